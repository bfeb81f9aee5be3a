"""The batch's token bitmask: int32 words, bit i of word j allows token 32*j + i."""

from __future__ import annotations

import numpy as np
import torch

ALL_ALLOWED = -1  # every bit set


def allocate_bitmask(rows: int, vocab_size: int) -> np.ndarray:
    return np.full((rows, (vocab_size + 31) // 32), ALL_ALLOWED, dtype=np.int32)


_SHIFTS: dict[torch.device, torch.Tensor] = {}


def apply_bitmask(logits: torch.Tensor, bitmask: torch.Tensor) -> None:
    """Set disallowed logits to -inf in place: logits [B, V] float, bitmask [B, W] int32, on the
    logits' device. One unpack and one masked_fill for the whole batch."""
    shifts = _SHIFTS.get(logits.device)
    if shifts is None:
        shifts = _SHIFTS[logits.device] = torch.arange(32, dtype=torch.int32, device=logits.device)
    batch, vocab = logits.shape
    allowed = ((bitmask.unsqueeze(-1) >> shifts) & 1).view(batch, -1)[:, :vocab].bool()
    logits.masked_fill_(~allowed, float("-inf"))


def ban_tokens(row: np.ndarray, tokens: set[int]) -> None:
    """Clear the bits of ``tokens`` in one bitmask row, unless that would allow nothing at all
    (then the automaton's own choice stands and the retry bound ends the request)."""
    trial = row.copy()
    for t in tokens:
        trial[t // 32] &= np.int32(~(1 << (t % 32)) if t % 32 != 31 else 0x7FFFFFFF)
    if trial.any():
        row[:] = trial
