"""The batch's token bitmask: int32 words, bit i of word j allows token 32*j + i."""

from __future__ import annotations

import numpy as np

ALL_ALLOWED = -1  # every bit set


def allocate_bitmask(rows: int, vocab_size: int) -> np.ndarray:
    return np.full((rows, (vocab_size + 31) // 32), ALL_ALLOWED, dtype=np.int32)


def ban_tokens(row: np.ndarray, tokens: set[int]) -> None:
    """Clear the bits of ``tokens`` in one bitmask row, unless that would allow nothing at all
    (then the automaton's own choice stands and the retry bound ends the request)."""
    trial = row.copy()
    for t in tokens:
        trial[t // 32] &= np.int32(~(1 << (t % 32)) if t % 32 != 31 else 0x7FFFFFFF)
    if trial.any():
        row[:] = trial


def lone_token(row: np.ndarray) -> int | None:
    """The one token a bitmask row allows, or None where it allows none or several."""
    words = np.flatnonzero(row)
    if len(words) != 1:
        return None
    word = int(row[words[0]]) & 0xFFFFFFFF
    if word & (word - 1):  # more than one bit
        return None
    return int(words[0]) * 32 + word.bit_length() - 1


def allowed_tokens(row: np.ndarray) -> np.ndarray:
    """The tokens a bitmask row allows, ascending."""
    bits = np.unpackbits(np.ascontiguousarray(row).view(np.uint8), bitorder="little")
    return np.flatnonzero(bits)
