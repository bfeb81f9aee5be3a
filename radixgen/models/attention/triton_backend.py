"""The ``triton`` attention backend: decode and extend kernels over the pool
(``triton_kernels.py``), one host-to-device copy of the step's index arrays."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from radixgen.models.attention.base import (
    AttentionBackend,
    AttentionBatch,
    AttentionMetadata,
    DecodeGraphState,
    LayerAttention,
    write_kv,
)

# Keys per split of a decode row: rows with longer sequences are attended in several programs
# whose partial results are merged (flash-decoding), up to MAX_DECODE_SPLITS.
DECODE_KEYS_PER_SPLIT = 256
MAX_DECODE_SPLITS = 16


@dataclass
class TritonMetadata(AttentionMetadata):
    out_cache_loc: torch.Tensor
    rows: torch.Tensor
    """[B] (decode: [T], one entry per query) req_to_token row."""
    is_decode: bool
    """Decode kernel: every query is the newest key of its entry (``seq_lens``)."""
    seq_lens: torch.Tensor | None = None
    num_splits: int = 1
    max_seq_len: int = 0
    prefix_lens: torch.Tensor | None = None
    extend_lens: torch.Tensor | None = None
    q_starts: torch.Tensor | None = None
    max_extend: int = 0


def decode_splits(max_seq_len: int, num_entries: int) -> int:
    """Key ranges per decode row: enough programs to fill the device when the batch alone does not."""
    splits = min(MAX_DECODE_SPLITS, max(1, -(-max_seq_len // DECODE_KEYS_PER_SPLIT)))
    return max(1, min(splits, MAX_DECODE_SPLITS * 8 // max(1, num_entries)))


class _DecodeGraphState(DecodeGraphState):
    """Decode metadata in static buffers. A graph cannot size its grid by the step's longest
    sequence, so every bucket splits ``max_seq_len`` (the context) evenly: a row's programs past
    its own length return at once."""

    def __init__(self, device: torch.device, max_batch: int, max_seq_len: int) -> None:
        self.out_cache_loc = torch.zeros(max_batch, dtype=torch.int64, device=device)
        self.rows = torch.zeros(max_batch, dtype=torch.int64, device=device)
        self.seq_lens = torch.ones(max_batch, dtype=torch.int64, device=device)
        self.max_seq_len = max_seq_len
        self._by_size: dict[int, TritonMetadata] = {}

    def metadata(self, size: int) -> TritonMetadata:
        if size not in self._by_size:
            self._by_size[size] = TritonMetadata(
                self.out_cache_loc[:size], self.rows[:size], True, seq_lens=self.seq_lens[:size],
                max_seq_len=self.max_seq_len, num_splits=decode_splits(self.max_seq_len, size))
        return self._by_size[size]

    def load(self, size: int, uploaded: list[torch.Tensor]) -> None:
        out_cache_loc, rows, seq_lens = uploaded
        self.out_cache_loc[:size].copy_(out_cache_loc, non_blocking=True)
        self.rows[:size].copy_(rows, non_blocking=True)
        self.seq_lens[:size].copy_(seq_lens, non_blocking=True)

    def reset(self) -> None:
        self.out_cache_loc.zero_()  # the pool's pad slot
        self.rows.zero_()
        self.seq_lens.fill_(1)


class TritonAttention(AttentionBackend):
    name = "triton"
    supports_decode_graphs = True

    def __init__(self, req_to_token: torch.Tensor) -> None:
        from radixgen.models.attention import triton_kernels

        self.kernels = triton_kernels
        self.req_to_token = req_to_token
        self.device = req_to_token.device

    def decode_graph_state(self, max_batch: int, max_seq_len: int) -> DecodeGraphState:
        return _DecodeGraphState(self.device, max_batch, max_seq_len)

    def _decode_entries(self, batch: AttentionBatch) -> tuple[np.ndarray, np.ndarray]:
        """(req_to_token row, keys) of each decode query: one per row, or one per drafted token
        (a draft token is a decode query at its own position over keys already in the pool)."""
        if batch.is_decode:
            return batch.rows, batch.seq_lens
        return np.repeat(batch.rows, batch.extend_lens), batch.positions + 1

    def host_arrays(self, batch: AttentionBatch) -> list[np.ndarray]:
        if batch.is_decode or batch.is_draft:
            return [batch.out_cache_loc, *self._decode_entries(batch)]
        q_starts = np.cumsum(batch.extend_lens) - batch.extend_lens
        return [batch.out_cache_loc, batch.rows, batch.prefix_lens, batch.extend_lens, q_starts]

    def prepare_uploaded(self, batch: AttentionBatch, uploaded: list[torch.Tensor]) -> TritonMetadata:
        if batch.is_decode or batch.is_draft:
            rows, seq_lens = self._decode_entries(batch)
            max_seq_len = int(seq_lens.max())  # host arrays: grid sizes never come from the device
            out_cache_loc, rows_d, seq_lens_d = uploaded
            return TritonMetadata(out_cache_loc, rows_d, True, seq_lens=seq_lens_d, max_seq_len=max_seq_len,
                                  num_splits=decode_splits(max_seq_len, len(rows)))
        out_cache_loc, rows_d, prefix_d, extend_d, starts_d = uploaded
        return TritonMetadata(out_cache_loc, rows_d, False, prefix_lens=prefix_d, extend_lens=extend_d,
                              q_starts=starts_d, max_extend=int(batch.extend_lens.max()))

    def forward(
        self, q: torch.Tensor, k: torch.Tensor | None, v: torch.Tensor | None, k_cache: torch.Tensor,
        v_cache: torch.Tensor, layer: LayerAttention, metadata: AttentionMetadata,
    ) -> torch.Tensor:
        assert isinstance(metadata, TritonMetadata), "metadata from another backend"
        write_kv(k, v, k_cache, v_cache, metadata.out_cache_loc)
        num_tokens, num_heads, head_dim = q.shape
        q = q.contiguous()
        window, softcap = layer.window or 0, layer.softcap or 0.0
        if metadata.is_decode:
            assert metadata.seq_lens is not None
            out = self.kernels.decode_attention(
                q, k_cache, v_cache, self.req_to_token, metadata.rows, metadata.seq_lens, layer.scale, window,
                softcap, metadata.num_splits, metadata.max_seq_len,
            )
        else:
            assert metadata.prefix_lens is not None and metadata.extend_lens is not None and metadata.q_starts is not None
            out = self.kernels.extend_attention(
                q, k_cache, v_cache, self.req_to_token, metadata.rows, metadata.prefix_lens, metadata.extend_lens,
                metadata.q_starts, metadata.max_extend, layer.scale, window, softcap,
            )
        return out.view(num_tokens, num_heads * head_dim)
