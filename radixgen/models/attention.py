"""Attention over a token-level KV pool.

Every layer receives the same ``AttentionPlan`` for the step: which pool slots the new tokens'
K/V go to, and for each request which slots hold its whole sequence. K/V are gathered through
those slot indices into a padded block and attended with SDPA under a mask that is causal
within the new tokens and open over the cached prefix. Prefill, prefill-after-cached-prefix
("extend") and decode are the same code with different lengths.

Prefill on CPU goes request by request instead (``PrefillSpan``): a request without a cached
prefix is plain causal SDPA over its own K/V (no mask, so the flash kernel's causal skipping
applies), one with a prefix gets a mask of its own size. Padding every request to the longest
under one mask built float intermediates of ~75 MB per layer at 8 prompts of 64-512 tokens; a
bf16 step took 1.2-3.8 s that way, with the allocator's state, against ~1.05 s.

Decode on CPU has a second path: a native kernel (``radixgen/kernels``) that reads each
request's K/V rows straight from the pool through ``req_to_token``, with no gather, padding or
mask. Decode attention is memory-bound, and the gather path moved every K/V byte three times.
Prefill in bfloat16 on a CPU with AVX-512 BF16 has one too: a flash-style kernel over the pool
in bf16 dot products. PyTorch's CPU flash kernel computes bf16 attention in float32 GEMMs,
at about a fifth of the machine's bf16 rate.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F


@dataclass(frozen=True)
class LayerAttention:
    """What differs between the attention of layers and families: the q.k scale, a sliding
    window (keys a query sees, its own included) and tanh soft-capping of the scores."""

    scale: float
    window: int | None = None
    softcap: float | None = None


@dataclass
class PrefillSpan:
    """One request's part of a prefill step, attended on its own."""

    start: int
    """Index of its first new token in the step's token stream."""
    length: int
    """Its new tokens."""
    kv_slots: torch.Tensor | None = None
    """[L] pool slots of its whole sequence (cached prefix + new tokens); None without a cached
    prefix, when its keys are exactly its new tokens."""
    mask: torch.Tensor | None = None
    """[1, 1, length, L] additive mask (causal over the new tokens, open over the prefix);
    None without a cached prefix (plain causal attention)."""
    prefix: int = 0
    window_masks: dict[int | None, torch.Tensor] = field(default_factory=dict)
    """Masks built on first use by layers with a window or soft-capping, shared by every such layer."""

    def mask_for(self, window: int | None, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """The additive mask of this span under ``window`` (None: plain causal)."""
        if window not in self.window_masks:
            seq_len = self.prefix + self.length
            key_pos = torch.arange(seq_len, device=device)[None, :]
            query_pos = self.prefix + torch.arange(self.length, device=device)[:, None]
            visible = key_pos <= query_pos
            if window is not None:
                visible &= key_pos > query_pos - window
            self.window_masks[window] = additive_mask(visible.view(1, 1, self.length, seq_len), dtype)
        return self.window_masks[window]


@dataclass
class AttentionPlan:
    """Per-step attention inputs shared by all layers (built once per step).

    B requests, T new tokens in total, Q = the longest new-token run, L = the longest sequence.
    """

    out_cache_loc: torch.Tensor
    """[T] int64: pool slot that receives each new token's K/V."""
    kv_indices: torch.Tensor | None
    """[B, L] int64: pool slots of each request's sequence, padded (padding is masked)."""
    attn_mask: torch.Tensor | None
    """[B, 1, Q, L] additive, in the model's dtype: 0 where a query may attend a key, else -inf."""
    query_index: torch.Tensor | None
    """[B, Q] int64 into the T new tokens (padding repeats a valid index); None for decode."""
    query_unpad: torch.Tensor | None
    """[T] int64 into the flattened [B*Q] padded queries; None for decode."""
    is_decode: bool
    """Every request has exactly one new token: no query padding needed."""
    spans: list[PrefillSpan] | None = None
    """Prefill attended request by request (CPU, or a single request); the padded fields are
    then None."""
    decode_kernel: Callable[..., torch.Tensor] | None = None
    """Decode only: the pool-reading kernel, called as (q [B,H,D], k_cache, v_cache,
    req_to_token, rows, seq_lens, scale); when set, kv_indices and attn_mask are None."""
    shared_prefix_kernel: Callable[..., tuple[torch.Tensor, torch.Tensor, torch.Tensor]] | None = None
    """Decode only, with ``decode_kernel``: attends the prefix a group of rows shares for all of
    them at once (called as (q, k_cache, v_cache, req_to_token, rows, shared_prefix,
    group_leader, scale, softcap) -> the rows' unnormalised output, max and sum), which the
    decode kernel then extends over each row's own keys. Layers with a window skip it."""
    shared_prefix: torch.Tensor | None = None
    """[B] int64 keys at the start of each row shared with its group (0: none)."""
    group_leader: torch.Tensor | None = None
    """[B] int64 batch index of the row whose req_to_token row holds its group's prefix."""
    prefill_kernel: Callable[..., torch.Tensor] | None = None
    """Prefill only: the pool-reading kernel, called as (q [T,H,D], k_cache, v_cache,
    req_to_token, rows, prefix_lens, extend_lens, scale, window, softcap); when set, the padded
    fields and spans are None."""
    req_to_token: torch.Tensor | None = None
    rows: torch.Tensor | None = None
    """[B] int64 req_to_token row of each request (the kernels only)."""
    seq_lens: torch.Tensor | None = None
    """[B] int64 keys each request attends, its new token included (decode kernel only)."""
    prefix_lens: torch.Tensor | None = None
    """[B] int64 tokens of each request already in the pool before this step (prefill kernel only)."""
    extend_lens: torch.Tensor | None = None
    """[B] int64 new tokens of each request, in the step's token order (prefill kernel only)."""
    decode_tail: AttentionPlan | None = None
    """A mixed step: the plan of the decode rows whose tokens follow the first
    ``num_prefill_tokens`` (this plan's own fields describe the prefill rows only, except
    ``out_cache_loc``, which covers every token)."""
    num_prefill_tokens: int = 0
    query_positions: torch.Tensor | None = None
    """[B, Q] position of each padded query (the gather paths: sliding windows need it)."""
    window_masks: dict[int, torch.Tensor] = field(default_factory=dict)
    """``attn_mask`` narrowed to a window, built on first use and shared by the window's layers."""

    def mask_for(self, window: int | None) -> torch.Tensor:
        assert self.attn_mask is not None and self.query_positions is not None
        if window is None:
            return self.attn_mask
        if window not in self.window_masks:
            key_pos = torch.arange(self.attn_mask.shape[-1], device=self.attn_mask.device)
            outside = key_pos[None, None, :] <= self.query_positions[:, :, None] - window  # [B, Q, L]
            self.window_masks[window] = self.attn_mask.masked_fill(outside.unsqueeze(1), float("-inf"))
        return self.window_masks[window]


def additive_mask(visible: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Bool mask -> 0 / -inf in the model's dtype, once per step: SDPA would otherwise convert
    a bool mask again in every layer."""
    return torch.zeros(visible.shape, dtype=dtype, device=visible.device).masked_fill_(~visible, float("-inf"))


def paged_attention(
    q: torch.Tensor,  # [T, heads, head_dim]
    k: torch.Tensor,  # [T, kv_heads, head_dim]
    v: torch.Tensor,  # [T, kv_heads, head_dim]
    k_cache: torch.Tensor,  # [slots, kv_heads, head_dim] of this layer
    v_cache: torch.Tensor,
    plan: AttentionPlan,
    layer: LayerAttention,
) -> torch.Tensor:
    """Write the new K/V into the pool, attend, and return [T, heads * head_dim]."""
    k_cache[plan.out_cache_loc] = k
    v_cache[plan.out_cache_loc] = v
    return attend_pool(q, k_cache, v_cache, plan, layer, k, v)


def attend_pool(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, plan: AttentionPlan, layer: LayerAttention,
    k: torch.Tensor | None = None, v: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention of q over the pool, whose K/V already include this step's tokens (``k``/``v``:
    the new tokens' K/V when the caller still has them; else read back from the pool where a
    path needs them). Returns [T, heads * head_dim]."""
    if plan.decode_tail is None:
        return _attend_written(q, k, v, k_cache, v_cache, plan, layer)
    # Decode rows would be padded to the prefill's query length in one SDPA call; each part
    # takes its own path instead.
    n = plan.num_prefill_tokens
    return torch.cat([
        _attend_written(q[:n], None if k is None else k[:n], None if v is None else v[:n], k_cache, v_cache, plan,
                        layer),
        _attend_written(q[n:], None, None, k_cache, v_cache, plan.decode_tail, layer),
    ])


def _attend_written(
    q: torch.Tensor, k: torch.Tensor | None, v: torch.Tensor | None, k_cache: torch.Tensor,
    v_cache: torch.Tensor, plan: AttentionPlan, layer: LayerAttention,
) -> torch.Tensor:
    num_tokens, num_heads, head_dim = q.shape
    if plan.decode_kernel is not None:
        if plan.shared_prefix_kernel is not None and layer.window is None:
            prior = plan.shared_prefix_kernel(
                q, k_cache, v_cache, plan.req_to_token, plan.rows, plan.shared_prefix, plan.group_leader,
                layer.scale, layer.softcap or 0.0,
            )
            out = plan.decode_kernel(
                q, k_cache, v_cache, plan.req_to_token, plan.rows, plan.seq_lens, layer.scale, 0,
                layer.softcap or 0.0, plan.shared_prefix, *prior,
            )
        else:
            out = plan.decode_kernel(
                q, k_cache, v_cache, plan.req_to_token, plan.rows, plan.seq_lens, layer.scale, layer.window or 0,
                layer.softcap or 0.0,
            )
        return out.view(num_tokens, num_heads * head_dim)
    if plan.prefill_kernel is not None:
        out = plan.prefill_kernel(
            q, k_cache, v_cache, plan.req_to_token, plan.rows, plan.prefix_lens, plan.extend_lens, layer.scale,
            layer.window or 0, layer.softcap or 0.0,
        )
        return out.view(num_tokens, num_heads * head_dim)
    if plan.spans is not None:
        parts = [_attend_span(q, k, v, k_cache, v_cache, plan.out_cache_loc, span, layer) for span in plan.spans]
        return parts[0] if len(parts) == 1 else torch.cat(parts)

    assert plan.kv_indices is not None and plan.attn_mask is not None, "plan lacks gather indices"
    batch, max_len = plan.kv_indices.shape
    flat_idx = plan.kv_indices.view(-1)
    # index_select copies whole rows: ~10x faster than advanced indexing (aten::index) here.
    keys = k_cache.index_select(0, flat_idx).view(batch, max_len, -1, head_dim).transpose(1, 2)  # [B, kvh, L, D]
    values = v_cache.index_select(0, flat_idx).view(batch, max_len, -1, head_dim).transpose(1, 2)

    if plan.is_decode:
        queries = q.unsqueeze(2)  # [B, heads, 1, D]
    else:
        assert plan.query_index is not None and plan.query_unpad is not None
        queries = q[plan.query_index].transpose(1, 2)  # [B, heads, Q, D]
    out = _attend(queries, keys, values, plan.mask_for(layer.window), layer)  # [B, heads, Q, D]
    out = out.transpose(1, 2).reshape(-1, num_heads * head_dim)  # [B*Q, heads*D]
    if plan.is_decode:
        return out
    return out[plan.query_unpad]


def _attend_span(
    q: torch.Tensor, k: torch.Tensor | None, v: torch.Tensor | None, k_cache: torch.Tensor,
    v_cache: torch.Tensor, out_cache_loc: torch.Tensor, span: PrefillSpan, layer: LayerAttention,
) -> torch.Tensor:
    """One request's prefill attention: [length, heads * head_dim]."""
    first, end = span.start, span.start + span.length
    num_heads, head_dim = q.shape[1], q.shape[2]
    queries = q[first:end].transpose(0, 1).unsqueeze(0)  # [1, heads, Q, D]
    plain_causal = layer.softcap is None and (layer.window is None or layer.window >= span.length)
    if span.kv_slots is None:
        if k is None or v is None:  # the fused path wrote them to the pool only
            slots = out_cache_loc[first:end]
            keys, values = k_cache.index_select(0, slots), v_cache.index_select(0, slots)
        else:
            keys, values = k[first:end], v[first:end]
        keys, values = keys.transpose(0, 1).unsqueeze(0), values.transpose(0, 1).unsqueeze(0)
        if plain_causal:  # no mask: the flash kernel skips the masked half
            out = F.scaled_dot_product_attention(
                queries, keys, values, is_causal=True, enable_gqa=True, scale=layer.scale,
            )
        else:
            out = _attend(queries, keys, values, span.mask_for(layer.window, q.dtype, q.device), layer)
    else:
        keys = k_cache.index_select(0, span.kv_slots).transpose(0, 1).unsqueeze(0)  # [1, kvh, L, D]
        values = v_cache.index_select(0, span.kv_slots).transpose(0, 1).unsqueeze(0)
        mask = span.mask if layer.window is None and span.mask is not None else span.mask_for(
            layer.window, q.dtype, q.device)
        out = _attend(queries, keys, values, mask, layer)
    return out[0].transpose(0, 1).reshape(span.length, num_heads * head_dim)


def _attend(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, layer: LayerAttention,
) -> torch.Tensor:
    """Masked GQA attention: q [B, H, Q, D], k/v [B, KVH, L, D], additive mask [B, 1, Q, L]
    -> [B, H, Q, D].

    SDPA everywhere but reduced precision on CPU, where its flash kernel with a mask was ~13x
    slower than two grouped matmuls (bf16 decode, 32 x 300 keys: 7.5 ms vs 0.6 ms per layer),
    and soft-capped layers, which SDPA cannot express.
    """
    if layer.softcap is None and (q.device.type != "cpu" or q.dtype == torch.float32):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True, scale=layer.scale)
    batch, num_heads, num_q, head_dim = q.shape
    num_kv = k.shape[1]
    group = num_heads // num_kv
    # head h reads kv head h // group (transformers' repeat_kv order)
    qg = q.reshape(batch, num_kv, group * num_q, head_dim)
    scores = torch.matmul(qg, k.transpose(2, 3)).float() * layer.scale  # [B, KVH, G*Q, L]
    if layer.softcap is not None:
        scores = torch.tanh(scores / layer.softcap) * layer.softcap
    scores = scores.view(batch, num_kv, group, num_q, -1) + mask.unsqueeze(1)
    probs = torch.softmax(scores, dim=-1).to(q.dtype).view(batch, num_kv, group * num_q, -1)
    return torch.matmul(probs, v).view(batch, num_heads, num_q, head_dim)
