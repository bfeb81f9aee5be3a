"""A GGUF file's header read directly, and its tensors' bytes as views of one read-only mmap.

The gguf package's reader builds an array for every metadata value (a 150k-token vocabulary is
150k small arrays: seconds per start); a start needs only the architecture and where each tensor
lies, so this reader walks the metadata without keeping the vocabulary. A file that is cut short
or does not parse is a ``ValueError`` that names the file and what is wrong, never a crash.
"""

from __future__ import annotations

import mmap
import struct
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

_MAGIC = b"GGUF"
_STRING, _ARRAY = 8, 9
_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_DEFAULT_ALIGNMENT = 32
_PAGE = mmap.PAGESIZE


@dataclass(frozen=True)
class TensorInfo:
    name: str
    shape: tuple[int, ...]
    """Slowest dimension first, as torch orders it (GGUF lists the fastest first)."""
    ggml_type: int
    type_name: str
    offset: int
    """From the start of the file."""
    nbytes: int


class GGUFFile:
    """The scalar and string metadata (``metadata``), the tensors (``tensors``, by GGUF name)
    and their bytes (``raw``). ``index``: what ``to_index`` returned for this file earlier; the
    header is then not walked again (its vocabulary took about a second)."""

    def __init__(self, path: Path, index: dict[str, Any] | None = None) -> None:
        self.path = Path(path)
        self.metadata: dict[str, Any] = {}
        self.tensors: dict[str, TensorInfo] = {}
        with open(self.path, "rb") as f:
            self._map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        self._pos = 0
        if index is not None and index.get("size") == len(self._map):
            self.metadata = dict(index["metadata"])
            self.tensors = {t[0]: TensorInfo(t[0], tuple(t[1]), *t[2:]) for t in index["tensors"]}
            return
        try:
            self._parse()
        except (struct.error, UnicodeDecodeError, IndexError, OverflowError) as exc:
            raise ValueError(f"{self.path}: not a readable GGUF file ({exc}); the file is corrupt or cut short") from None

    def to_index(self) -> dict[str, Any]:
        """The parsed header as JSON-able data, for ``GGUFFile(path, index)``."""
        return {"size": len(self._map), "metadata": self.metadata,
                "tensors": [[t.name, list(t.shape), t.ggml_type, t.type_name, t.offset, t.nbytes]
                            for t in self.tensors.values()]}

    def close(self) -> None:
        """Unmap the file (views taken by ``raw`` must be gone)."""
        self._map.close()

    @property
    def architecture(self) -> str:
        return str(self.metadata.get("general.architecture", ""))

    def raw(self, name: str) -> torch.Tensor:
        """The tensor's bytes as uint8 [rows, row bytes], a view of the file (no copy)."""
        info = self.tensors[name]
        rows = int(np.prod(info.shape[:-1])) if len(info.shape) > 1 else 1
        view = np.frombuffer(self._map, dtype=np.uint8, count=info.nbytes, offset=info.offset)
        with warnings.catch_warnings():  # the map is read-only; nothing writes through this view
            warnings.simplefilter("ignore", UserWarning)
            return torch.from_numpy(view).view(rows, info.nbytes // rows)

    def release(self, name: str) -> None:
        """Let the kernel drop the tensor's pages from this process (they stay in the page cache):
        a start holds what it repacked, not the file beside it."""
        info = self.tensors[name]
        start = info.offset - info.offset % _PAGE
        end = info.offset + info.nbytes
        self._map.madvise(mmap.MADV_DONTNEED, start, end - start)

    # -- parsing -----------------------------------------------------------------------------

    def _read(self, fmt: str) -> Any:
        (value,) = struct.unpack_from(fmt, self._map, self._pos)
        self._pos += struct.calcsize(fmt)
        return value

    def _string(self) -> str:
        length = self._read("<Q")
        if self._pos + length > len(self._map):
            raise IndexError(f"a string of {length} bytes at byte {self._pos} runs past the end")
        text = self._map[self._pos : self._pos + length].decode("utf-8")
        self._pos += length
        return text

    def _value(self, kind: int, keep: bool) -> Any:
        if kind in _SCALARS:
            return self._read(_SCALARS[kind])
        if kind == _STRING:
            return self._string()
        if kind != _ARRAY:
            raise IndexError(f"unknown metadata value type {kind} at byte {self._pos}")
        item, count = self._read("<I"), self._read("<Q")
        if item in _SCALARS:  # skipped or read in one step
            size = struct.calcsize(_SCALARS[item])
            if self._pos + size * count > len(self._map):
                raise IndexError(f"an array of {count} values at byte {self._pos} runs past the end")
            values = np.frombuffer(self._map, dtype=np.dtype(_SCALARS[item]), count=count, offset=self._pos) if keep else None
            self._pos += size * count
            return None if values is None else values.tolist()
        if item == _STRING and not keep:  # the vocabulary: walk past it
            for _ in range(count):
                length = self._read("<Q")  # read before the position is taken: it moves it
                self._pos += length
            if self._pos > len(self._map):
                raise IndexError(f"an array of {count} strings runs past the end")
            return None
        return [self._value(item, keep) for _ in range(count)]

    def _parse(self) -> None:
        import gguf

        if self._map[:4] != _MAGIC:
            raise ValueError(f"{self.path}: not a GGUF file (it starts with {bytes(self._map[:4])!r}, not b'GGUF')")
        self._pos = 4
        version = self._read("<I")
        if version not in (2, 3):
            raise ValueError(f"{self.path}: GGUF version {version} is not supported (2 and 3 are)")
        tensor_count, kv_count = self._read("<Q"), self._read("<Q")
        for _ in range(kv_count):
            key = self._string()
            kind = self._read("<I")
            # small arrays (merges and scores aside) are kept; the tokenizer's are not needed here
            value = self._value(kind, keep=not key.startswith("tokenizer."))
            if value is not None:
                self.metadata[key] = value
        infos = []
        for _ in range(tensor_count):
            name = self._string()
            dims = [self._read("<Q") for _ in range(self._read("<I"))]
            infos.append((name, tuple(reversed(dims)), self._read("<I"), self._read("<Q")))
        alignment = int(self.metadata.get("general.alignment", _DEFAULT_ALIGNMENT))
        data_start = -(-self._pos // alignment) * alignment
        size = len(self._map)
        for name, shape, ggml_type, offset in infos:
            try:
                kind = gguf.GGMLQuantizationType(ggml_type)
            except ValueError:
                raise ValueError(f"{self.path}: tensor {name!r} has unknown ggml type id {ggml_type}") from None
            block, block_bytes = gguf.GGML_QUANT_SIZES[kind]
            count = int(np.prod(shape)) if shape else 1
            if shape and shape[-1] % block:
                raise ValueError(f"{self.path}: tensor {name!r} ({kind.name}) has rows of {shape[-1]} values, "
                                 f"not whole blocks of {block}")
            nbytes = count // block * block_bytes
            start = data_start + offset
            if start + nbytes > size:
                raise ValueError(f"{self.path} is cut short: tensor {name!r} needs bytes {start}..{start + nbytes} "
                                 f"but the file has {size}; download it again")
            self.tensors[name] = TensorInfo(name, shape, ggml_type, kind.name, start, nbytes)
