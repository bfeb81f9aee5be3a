"""The ``torch`` attention backend: request by request, PyTorch ops alone, on any device.

It is the reference the other backends are tested against, and the path for a device with no
kernel of ours. Each request gathers its own K/V from the pool and calls SDPA without an
additive mask: no prefix is plain causal attention, a cached prefix is causal aligned to the
bottom right (``causal_lower_right``: query i sees keys up to prefix + i), which SDPA's fused
kernels take, where an additive mask sends them to the math kernel. Layers with a sliding window
or soft-capping, which SDPA cannot express, compute the scores explicitly in float32.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from torch.nn.attention.bias import causal_lower_right

from radixgen.models.attention.base import (
    AttentionBackend,
    AttentionBatch,
    AttentionMetadata,
    LayerAttention,
    write_kv,
)


@dataclass
class RequestSpan:
    start: int
    """Index of the request's first new token in the step."""
    length: int
    """Its new tokens."""
    prefix: int
    """Its tokens in the pool before the step."""
    kv_slots: torch.Tensor
    """[prefix + length] pool slots of its sequence, on the device."""


@dataclass
class ReferenceMetadata(AttentionMetadata):
    out_cache_loc: torch.Tensor
    spans: list[RequestSpan]


class TorchAttention(AttentionBackend):
    name = "torch"

    def __init__(self, req_to_token: torch.Tensor) -> None:
        self.req_to_token = req_to_token
        self.device = req_to_token.device

    def host_arrays(self, batch: AttentionBatch) -> list[np.ndarray]:
        return [batch.out_cache_loc]

    def prepare_uploaded(self, batch: AttentionBatch, uploaded: list[torch.Tensor]) -> ReferenceMetadata:
        spans = []
        start = 0
        for row, prefix, length in zip(batch.rows.tolist(), batch.prefix_lens.tolist(), batch.extend_lens.tolist(),
                                       strict=True):
            spans.append(RequestSpan(start, length, prefix, self.req_to_token[row, : prefix + length]))
            start += length
        return ReferenceMetadata(uploaded[0], spans)

    def forward(
        self, q: torch.Tensor, k: torch.Tensor | None, v: torch.Tensor | None, k_cache: torch.Tensor,
        v_cache: torch.Tensor, layer: LayerAttention, metadata: AttentionMetadata,
    ) -> torch.Tensor:
        assert isinstance(metadata, ReferenceMetadata), "metadata from another backend"
        write_kv(k, v, k_cache, v_cache, metadata.out_cache_loc)
        num_tokens, num_heads, head_dim = q.shape
        parts = [_attend_request(q, k_cache, v_cache, span, layer) for span in metadata.spans]
        out = parts[0] if len(parts) == 1 else torch.cat(parts)
        return out.reshape(num_tokens, num_heads * head_dim)


def _attend_request(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, span: RequestSpan, layer: LayerAttention,
) -> torch.Tensor:
    """[length, heads, head_dim] for one request's queries."""
    queries = q[span.start : span.start + span.length].transpose(0, 1).unsqueeze(0)  # [1, H, E, D]
    keys = k_cache.index_select(0, span.kv_slots).transpose(0, 1).unsqueeze(0)  # [1, KVH, L, D]
    values = v_cache.index_select(0, span.kv_slots).transpose(0, 1).unsqueeze(0)
    if layer.window is None and layer.softcap is None:
        if span.length == 1:  # one query sees every key
            out = F.scaled_dot_product_attention(queries, keys, values, scale=layer.scale, enable_gqa=True)
        elif span.prefix == 0:
            out = F.scaled_dot_product_attention(queries, keys, values, is_causal=True, scale=layer.scale,
                                                 enable_gqa=True)
        else:
            bias = causal_lower_right(span.length, span.prefix + span.length)
            out = F.scaled_dot_product_attention(queries, keys, values, attn_mask=bias, scale=layer.scale,
                                                 enable_gqa=True)
    else:
        out = _explicit(queries, keys, values, span.prefix, layer)
    return out[0].transpose(0, 1)


def _explicit(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, prefix: int, layer: LayerAttention,
) -> torch.Tensor:
    """Scores in float32 with windows and soft-capping: q [1, H, E, D], k/v [1, KVH, L, D]."""
    group = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(group, dim=1).float()
    v = v.repeat_interleave(group, dim=1).float()
    scores = torch.matmul(q.float(), k.transpose(-1, -2)) * layer.scale  # [1, H, E, L]
    if layer.softcap is not None:
        scores = torch.tanh(scores / layer.softcap) * layer.softcap
    num_q, num_k = scores.shape[-2], scores.shape[-1]
    query_pos = prefix + torch.arange(num_q, device=q.device)[:, None]
    key_pos = torch.arange(num_k, device=q.device)[None, :]
    visible = key_pos <= query_pos
    if layer.window is not None:
        visible &= key_pos > query_pos - layer.window
    probs = torch.softmax(scores.masked_fill(~visible, float("-inf")), dim=-1)
    return torch.matmul(probs, v).to(q.dtype)
