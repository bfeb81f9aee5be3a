"""A step's traffic between host and device: one upload in, one read-back out.

``upload`` packs a step's host arrays (any dtypes) into one byte buffer, pinned on CUDA, and
copies it with one ``non_blocking`` copy; the arrays come back as typed views of the device
buffer. ``ReadBack`` copies device results into pinned host memory behind an event and waits
once, when the host needs them. Between the two a step reads nothing from the device. On CPU
both are free: the views are the arrays' own memory.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

_ALIGN = 8  # every view starts on a boundary of the widest element


def upload(arrays: Sequence[np.ndarray], device: torch.device) -> list[torch.Tensor]:
    """The arrays as tensors on ``device``, in one host-to-device copy (none on CPU)."""
    if device.type == "cpu":
        return [torch.from_numpy(np.ascontiguousarray(a)) for a in arrays]
    offsets, total = [], 0
    for a in arrays:
        offsets.append(total)
        total += -(-a.nbytes // _ALIGN) * _ALIGN
    host = torch.empty(max(total, _ALIGN), dtype=torch.uint8, pin_memory=True)
    buffer = host.numpy()
    for a, start in zip(arrays, offsets, strict=True):
        buffer[start : start + a.nbytes] = np.ascontiguousarray(a).view(np.uint8).reshape(-1)
    on_device = host.to(device, non_blocking=True)
    views = []
    for a, start in zip(arrays, offsets, strict=True):
        dtype = torch.from_numpy(np.empty(0, dtype=a.dtype)).dtype
        views.append(on_device[start : start + a.nbytes].view(dtype).view(a.shape))
    return views


class ReadBack:
    """Device tensors copied to the host without blocking; ``wait`` gives them as numpy arrays."""

    def __init__(self, tensors: Sequence[torch.Tensor | None]) -> None:
        self._host: list[torch.Tensor | None] = []
        self._event: torch.cuda.Event | None = None
        for t in tensors:
            if t is None or t.device.type == "cpu":
                self._host.append(t)
                continue
            host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
            host.copy_(t, non_blocking=True)
            self._host.append(host)
            if self._event is None:
                self._event = torch.cuda.Event()
        if self._event is not None:
            self._event.record()

    def wait(self) -> list[np.ndarray | None]:
        if self._event is not None:
            self._event.synchronize()
        return [None if t is None else t.numpy() for t in self._host]
