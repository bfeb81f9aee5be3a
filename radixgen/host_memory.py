"""How the CPU engine's memory is laid out: glibc's malloc kept from handing memory back, and the
weights and KV pool placed in transparent huge pages.

A decode step streams every weight from DRAM once. In 4 KiB pages that is one TLB entry per
4 KiB, and where the allocator happened to put each weight changed the step's speed between
runs of the same code by more than the changes being measured (benchmarks/README.md, "huge
pages"). One 2 MiB-aligned mapping advised ``MADV_HUGEPAGE`` holds them all instead; the kernel
backs it with huge pages where it has them (``/sys/kernel/mm/transparent_hugepage/enabled`` set
to ``madvise`` or ``always``) and with small pages otherwise, so nothing fails without them.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import logging
import math
import mmap
import threading
from collections.abc import Iterable
from typing import Any

import torch

logger = logging.getLogger(__name__)

HUGE_PAGE = 2 << 20
_ALIGN = 64  # a cache line: every tensor placed in an arena starts on one

# glibc mallopt parameters
_M_TRIM_THRESHOLD, _M_TOP_PAD, _M_MMAP_THRESHOLD = -1, -2, -3
_MMAP_THRESHOLD_MAX = 32 << 20  # glibc's DEFAULT_MMAP_THRESHOLD_MAX on 64-bit
_TOP_PAD = 256 << 20
_TRIM_EVERY = 64 << 20
_MADV_DONTNEED = 4
_MADV_POPULATE_WRITE = 23  # Linux 5.14: fault a range in, writable, without changing what it holds
# A populate holds the process's mmap lock, which every mmap and munmap of the other threads (the
# Python allocator's arenas) waits for: it goes a piece at a time.
# (2 MiB pieces cost more in handing the GIL back and forth than they saved).
_POPULATE_CHUNK = 32 << 20


def keep_freed_memory_for_reuse() -> bool:
    """Tell glibc's malloc to keep freed memory for the next allocation rather than hand it back.

    A forward's intermediates (a prefill chunk's activations, 10-30 MB each) are allocated and
    freed every layer. Above glibc's mmap threshold each one was fresh pages from the kernel,
    faulted in on first touch, at about the cost of the copy or fill that touched them (see
    benchmarks/README.md). Raising the threshold to glibc's maximum and not trimming the heap
    top keeps those pages mapped; the price is that the process holds its peak heap (vLLM's
    CPU backend preloads tcmalloc for the same reason). Returns whether glibc took the settings
    (elsewhere nothing changes)."""
    mallopt = getattr(_libc(), "mallopt", None)
    if mallopt is None:
        return False
    ok = all(mallopt(param, value) == 1 for param, value in (
        (_M_MMAP_THRESHOLD, _MMAP_THRESHOLD_MAX), (_M_TRIM_THRESHOLD, 2**31 - 1), (_M_TOP_PAD, _TOP_PAD)))
    if not ok:
        logger.debug("mallopt refused a setting; the allocator keeps its defaults for it")
    return ok


def release_freed_memory() -> None:
    """Hand the memory malloc holds free back to the kernel once (``malloc_trim``): after
    ``move_into_huge_pages`` the weights' old heap pages would otherwise stay resident for good
    (``keep_freed_memory_for_reuse`` turns trimming off)."""
    malloc_trim = getattr(_libc(), "malloc_trim", None)
    if malloc_trim is not None:
        malloc_trim(0)


def huge_page_bytes(nbytes: int) -> torch.Tensor:
    """A uint8 CPU tensor of ``nbytes``, 2 MiB-aligned, in an anonymous mapping advised
    ``MADV_HUGEPAGE``. Pages are faulted in on first touch, as with ``torch.empty``; the
    mapping lives as long as a tensor viewing it."""
    mapping = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    advice = getattr(mmap, "MADV_HUGEPAGE", None)
    if advice is not None:
        try:
            mapping.madvise(advice)
        except OSError:  # a kernel without transparent huge pages: small pages, same memory
            logger.debug("madvise(MADV_HUGEPAGE) refused; the mapping keeps small pages")
    whole = torch.frombuffer(mapping, dtype=torch.uint8)
    start = -whole.data_ptr() % HUGE_PAGE
    return whole[start : start + nbytes]


def huge_page_empty(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """``torch.empty(shape, dtype=dtype)`` on the CPU, in huge pages (``huge_page_bytes``)."""
    return huge_page_bytes(math.prod(shape) * dtype.itemsize).view(dtype).view(shape)


class WeightArena:
    """One huge-page mapping that weights are written into as they are made (a GGUF's records, by
    the repack), so they need no move into huge pages after: ``take`` hands out its bytes in order,
    each tensor on a cache line. Faulting a huge page in costs the kernel a zeroing and, where
    free memory is fragmented, a compaction, which can cost more than the writes themselves
    (benchmarks/README.md); ``populate_in_background`` has that done by a thread of its own while
    the start does other work."""

    def __init__(self, nbytes: int) -> None:
        self.bytes = huge_page_bytes(nbytes)
        self.used = 0
        self._populating: threading.Thread | None = None
        self._stop_populating = threading.Event()

    @staticmethod
    def bytes_for(sizes: Iterable[int]) -> int:
        """The arena that holds tensors of these byte sizes, taken in this order."""
        return sum(_round_up(size, _ALIGN) for size in sizes)

    def take(self, shape: tuple[int, ...], dtype: torch.dtype = torch.uint8) -> torch.Tensor | None:
        """An uninitialised contiguous tensor in the arena, or None when it does not fit."""
        start = _round_up(self.used, _ALIGN)
        nbytes = math.prod(shape) * dtype.itemsize
        if start + nbytes > self.bytes.numel():
            return None
        self.used = start + nbytes
        return self.bytes[start : start + nbytes].view(dtype).view(shape)

    @property
    def storage_ptr(self) -> int:
        """Where the mapping's storage starts: every tensor taken from the arena shares it."""
        return self.bytes.untyped_storage().data_ptr()

    def holds(self, tensor: torch.Tensor) -> bool:
        return tensor.untyped_storage().data_ptr() == self.storage_ptr

    def populate_in_background(self) -> None:
        """Fault the whole arena in on a thread, without the GIL (what is written meanwhile stays:
        a populate leaves pages already there alone). A kernel without ``MADV_POPULATE_WRITE``
        leaves each page to its first write."""
        madvise = _madvise()
        if madvise is None or self._populating is not None:
            return

        def populate(arena: torch.Tensor) -> None:  # holds the mapping until done
            for start in range(0, arena.numel(), _POPULATE_CHUNK):  # the arena starts on a page
                if self._stop_populating.is_set():
                    return
                length = min(_POPULATE_CHUNK, arena.numel() - start)
                if madvise(arena.data_ptr() + start, length, _MADV_POPULATE_WRITE) != 0:
                    logger.debug("MADV_POPULATE_WRITE refused (errno %d): pages fault in as written",
                                 ctypes.get_errno())
                    return

        self._populating = threading.Thread(target=populate, args=(self.bytes,), name="radixgen-arena", daemon=True)
        self._populating.start()

    def wait_populated(self) -> None:
        if self._populating is not None:
            self._populating.join()

    def release_unused(self) -> int:
        """Stop populating and hand back the whole huge pages past what was taken (tensors sized
        for that were not taken: the loader skipped them). Returns the bytes handed back."""
        self._stop_populating.set()
        self.wait_populated()
        tail = _round_up(self.used, HUGE_PAGE)  # the arena starts on a huge page
        madvise = _madvise()
        if tail >= self.bytes.numel() or madvise is None:
            return 0
        if madvise(self.bytes.data_ptr() + tail, self.bytes.numel() - tail, _MADV_DONTNEED) != 0:
            return 0
        return self.bytes.numel() - tail


@functools.cache
def _libc() -> ctypes.CDLL | None:
    """The C library (its functions called without the GIL), loaded once; None where there is none
    to load."""
    name = ctypes.util.find_library("c")
    if not name:
        return None
    try:
        return ctypes.CDLL(name, use_errno=True)
    except OSError:
        return None


@functools.cache
def _madvise() -> Any:
    """libc's madvise, or None."""
    madvise = getattr(_libc(), "madvise", None)
    if madvise is not None:
        madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    return madvise


def _round_up(n: int, to: int) -> int:
    return -(-n // to) * to


def move_into_huge_pages(tensors: Iterable[torch.Tensor], placed: WeightArena | None = None) -> int:
    """Move the storages behind ``tensors`` (CPU, strided; those in ``placed`` stay) into one
    huge-page arena, in place:
    each tensor keeps its identity, shape, strides and sharing (tied weights stay tied, views
    stay views of the same storage; a tensor listed twice is moved once). Returns the bytes
    moved. The memory they leave is handed back as the move goes (every ``_TRIM_EVERY`` bytes),
    so the process never holds the weights twice over (a 0.5B model's start peaked at 2x them)."""
    storages: dict[int, torch.UntypedStorage] = {}
    users: dict[int, list[torch.Tensor]] = {}
    for tensor in tensors:
        if tensor.device.type != "cpu" or tensor.layout != torch.strided or tensor.is_sparse:
            continue
        try:
            storage = tensor.untyped_storage()
        except (NotImplementedError, RuntimeError):  # opaque (oneDNN-packed) tensors
            continue
        if storage.nbytes() == 0 or (placed is not None and storage.data_ptr() == placed.storage_ptr):
            continue
        key = storage.data_ptr()
        storages.setdefault(key, storage)
        users.setdefault(key, [])
        if not any(user is tensor for user in users[key]):
            users[key].append(tensor)
    if not storages:
        return 0
    offsets: dict[int, int] = {}
    total = 0
    for key, storage in storages.items():
        offsets[key] = total
        total = _round_up(total + storage.nbytes(), _ALIGN)
    arena = huge_page_bytes(total)
    arena_storage = arena.untyped_storage()
    base = arena.data_ptr() - arena_storage.data_ptr()  # the arena's byte offset in its mapping
    unreleased = 0
    with torch.no_grad():
        for key in list(storages):
            storage = storages.pop(key)  # this function's reference goes with the move
            start, nbytes = offsets[key], storage.nbytes()
            arena[start : start + nbytes].copy_(_bytes_of(storage))
            del storage
            for tensor in users.pop(key):
                itemsize = tensor.element_size()
                moved = torch.empty(0, dtype=tensor.dtype).set_(
                    arena_storage, (base + start) // itemsize + tensor.storage_offset(), tensor.shape, tensor.stride(),
                )
                tensor.data = moved
            unreleased += nbytes
            if unreleased >= _TRIM_EVERY:
                release_freed_memory()
                unreleased = 0
    return total


def _bytes_of(storage: torch.UntypedStorage) -> torch.Tensor:
    return torch.empty(0, dtype=torch.uint8).set_(storage, 0, (storage.nbytes(),), (1,))

