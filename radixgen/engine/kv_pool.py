"""Token-level KV pool: one K and one V slot per token, a free-list allocator, and the
``req_to_token`` table mapping (request row, position) -> slot.

Slot 0 is reserved as a harmless write target for padding and is never handed out, so a pool
of ``num_slots`` usable slots has ``num_slots + 1`` rows. Allocation and release are array
operations on a stack of free slot ids; there is no Python object per slot.
"""

from __future__ import annotations

import numpy as np
import torch

from radixgen.host_memory import huge_page_empty

PAD_SLOT = 0

UNWRITTEN_FILL: float | None = None
"""What a slot holds before its first write. Every slot is written before it is read (the pad
slot aside, zeroed), so by default the pool is left as allocated: zeroing it cost every start a
pass over the whole pool and made all of it resident at once. The test suite sets NaN, so that
a read of a slot never written shows in its outputs."""


class SlotAllocator:
    """A stack of free slot ids with O(n) alloc/free of n slots and a double-free guard."""

    def __init__(self, num_slots: int) -> None:
        self.num_slots = num_slots
        self._stack = np.arange(num_slots, 0, -1, dtype=np.int64)  # ids 1..num_slots
        self._top = num_slots
        self._is_free = np.ones(num_slots + 1, dtype=bool)
        self._is_free[PAD_SLOT] = False

    def available(self) -> int:
        return self._top

    def free_slots(self) -> np.ndarray:
        return self._stack[: self._top].copy()

    def alloc(self, n: int) -> np.ndarray | None:
        """n slot ids, or None (nothing taken) when fewer than n are free."""
        if n > self._top:
            return None
        self._top -= n
        slots = self._stack[self._top : self._top + n].copy()
        self._is_free[slots] = False
        return slots

    def free(self, slots: np.ndarray) -> None:
        n = len(slots)
        if n == 0:
            return
        assert not self._is_free[slots].any(), "double free of KV slots"
        assert (slots != PAD_SLOT).all(), "the reserved pad slot was never allocated; cannot free it"
        assert len(np.unique(slots)) == n, "duplicate slots in one free"
        self._is_free[slots] = True
        self._stack[self._top : self._top + n] = slots
        self._top += n


class RowAllocator:
    """Rows of req_to_token, one per request that holds KV."""

    def __init__(self, num_rows: int) -> None:
        self._free = list(range(num_rows - 1, -1, -1))

    def available(self) -> int:
        return len(self._free)

    def alloc(self) -> int:
        assert self._free, "no free req_to_token row; the scheduler caps running requests"
        return self._free.pop()

    def free(self, row: int) -> None:
        self._free.append(row)


def _unwritten_pool(shape: tuple[int, ...], dtype: torch.dtype, device: str | torch.device) -> torch.Tensor:
    fresh_mapping = torch.device(device).type == "cpu"
    if fresh_mapping:
        pool = huge_page_empty(shape, dtype)  # decode streams it like the weights: see host_memory
    else:
        pool = torch.empty(shape, dtype=dtype, device=device)
    if UNWRITTEN_FILL is not None:
        pool.fill_(UNWRITTEN_FILL)
    if UNWRITTEN_FILL is not None or not fresh_mapping:
        # padded rows read it; a fresh anonymous mapping already reads as zeros, and writing them
        # would fault in a huge page per layer at every start (96 MiB for a 24-layer model)
        pool[:, PAD_SLOT] = 0
    return pool


class KVPool:
    def __init__(
        self, *, num_slots: int, num_layers: int, num_kv_heads: int, head_dim: int,
        dtype: torch.dtype, device: str | torch.device, max_rows: int, max_context_len: int,
    ) -> None:
        self.num_slots = num_slots
        self.max_context_len = max_context_len
        self.max_rows = max_rows
        shape = (num_layers, num_slots + 1, num_kv_heads, head_dim)
        self.k = _unwritten_pool(shape, dtype, device)
        self.v = _unwritten_pool(shape, dtype, device)
        self.slots = SlotAllocator(num_slots)
        self.rows = RowAllocator(max_rows)
        # [rows, context]: slot of each position of each request (PAD_SLOT where unset). The
        # host array is the scheduler's source of truth; on CPU the device tensor shares its memory.
        self.req_to_token_host = np.zeros((max_rows, max_context_len), dtype=np.int64)
        self.req_to_token = torch.from_numpy(self.req_to_token_host).to(device)
        self._shares_host = self.req_to_token.device.type == "cpu"

    def write(self, rows: np.ndarray, positions: np.ndarray, slots: np.ndarray) -> None:
        """req_to_token[rows[i], positions[i]] = slots[i] (host and device)."""
        self.req_to_token_host[rows, positions] = slots
        if not self._shares_host:
            dev = self.req_to_token.device
            self.req_to_token[torch.from_numpy(rows).to(dev), torch.from_numpy(positions).to(dev)] = (
                torch.from_numpy(slots).to(dev)
            )

    def row_slots(self, row: int, length: int) -> np.ndarray:
        return self.req_to_token_host[row, :length]

    def available(self) -> int:
        return self.slots.available()

    def used(self) -> int:
        return self.num_slots - self.slots.available()

    @staticmethod
    def bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
        return 2 * num_layers * num_kv_heads * head_dim * torch.empty((), dtype=dtype).element_size()
