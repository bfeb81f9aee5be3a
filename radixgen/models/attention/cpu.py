"""The ``cpu`` attention backend: radixgen's native kernels where they are built, PyTorch's
SDPA around them.

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

import numpy as np
import torch
import torch.nn.functional as F

from radixgen.kernels import CpuKernels
from radixgen.models.attention.base import (
    AttentionBackend,
    AttentionBatch,
    AttentionMetadata,
    LayerAttention,
    write_kv,
)


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
class AttentionPlan(AttentionMetadata):
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


def build_attention_plan(
    plan: AttentionBatch, req_to_token: torch.Tensor, device: torch.device, dtype: torch.dtype,
    decode_kernel: Callable[..., torch.Tensor] | None = None, per_request_prefill: bool | None = None,
    prefill_kernel: Callable[..., torch.Tensor] | None = None,
    shared_prefix_kernel: Callable[..., tuple[torch.Tensor, torch.Tensor, torch.Tensor]] | None = None,
) -> AttentionPlan:
    """Device tensors for attention, built once per step and shared by every layer.
    ``decode_kernel``: the pool-reading decode kernel, used for decode steps when given.
    ``prefill_kernel``: the pool-reading prefill kernel, used for prefill (parts of) steps when given.
    ``shared_prefix_kernel``: with ``decode_kernel``, attends a prefix several decode rows share
    once for all of them (see ``shared_prefixes``).
    ``per_request_prefill``: attend prefill requests one by one (default: on CPU) rather than
    padded to the longest under one mask (elsewhere one masked call beats a launch per request)."""
    if per_request_prefill is None:
        per_request_prefill = device.type == "cpu"
    if plan.is_draft and decode_kernel is not None:
        # every token of a speculative step is a query at its own position over K/V already in
        # the pool: the decode kernel reads them in place, with a decode step's arithmetic
        return AttentionPlan(
            torch.from_numpy(plan.out_cache_loc).to(device), None, None, None, None, is_decode=True,
            decode_kernel=decode_kernel, req_to_token=req_to_token,
            rows=torch.from_numpy(np.repeat(plan.rows, plan.extend_lens)).to(device),
            seq_lens=torch.from_numpy(plan.positions + 1).to(device),
        )
    if plan.num_decode and plan.num_prefill:
        head, tail = plan.split_mixed()
        attn = build_attention_plan(
            head, req_to_token, device, dtype, decode_kernel, per_request_prefill, prefill_kernel)
        attn.decode_tail = build_attention_plan(
            tail, req_to_token, device, dtype, decode_kernel, shared_prefix_kernel=shared_prefix_kernel)
        attn.num_prefill_tokens = head.num_tokens
        attn.out_cache_loc = torch.from_numpy(plan.out_cache_loc).to(device)
        return attn
    out_cache_loc = torch.from_numpy(plan.out_cache_loc).to(device)
    batch = plan.batch_size
    if not plan.is_decode and prefill_kernel is not None:
        return AttentionPlan(
            out_cache_loc, None, None, None, None, is_decode=False, prefill_kernel=prefill_kernel,
            req_to_token=req_to_token, rows=torch.from_numpy(plan.rows).to(device),
            prefix_lens=torch.from_numpy(plan.prefix_lens).to(device),
            extend_lens=torch.from_numpy(plan.extend_lens).to(device),
        )
    if not plan.is_decode and (per_request_prefill or (batch == 1 and plan.prefix_lens[0] == 0)):
        spans = _prefill_spans(plan, req_to_token, device, dtype)
        return AttentionPlan(out_cache_loc, None, None, None, None, is_decode=False, spans=spans)

    if plan.is_decode and decode_kernel is not None:
        attn = AttentionPlan(
            out_cache_loc, None, None, None, None, is_decode=True, decode_kernel=decode_kernel,
            req_to_token=req_to_token, rows=torch.from_numpy(plan.rows).to(device),
            seq_lens=torch.from_numpy(plan.seq_lens).to(device),
        )
        sharing = shared_prefixes(req_to_token, plan.rows, plan.seq_lens) if shared_prefix_kernel is not None else None
        if sharing is not None:
            attn.shared_prefix_kernel = shared_prefix_kernel
            attn.shared_prefix, attn.group_leader = (torch.from_numpy(a).to(device) for a in sharing)
        return attn

    return _masked_plan(plan, req_to_token, device, dtype, out_cache_loc)


def _masked_plan(plan: AttentionBatch, req_to_token: torch.Tensor, device: torch.device, dtype: torch.dtype,
                 out_cache_loc: torch.Tensor) -> AttentionPlan:
    """The reference path: every row's K/V gathered and padded to the longest, one additive mask."""
    batch = plan.batch_size
    prefix = torch.from_numpy(plan.prefix_lens).to(device)
    extend = torch.from_numpy(plan.extend_lens).to(device)
    seq_lens = prefix + extend
    max_len = int(plan.seq_lens.max())
    rows = torch.from_numpy(plan.rows).to(device)
    kv_indices = req_to_token[rows, :max_len]  # [B, L]
    key_pos = torch.arange(max_len, device=device)

    if plan.is_decode:
        visible = (key_pos[None, :] < seq_lens[:, None]).view(batch, 1, 1, max_len)
        return AttentionPlan(
            out_cache_loc, kv_indices, additive_mask(visible, dtype), None, None, is_decode=True,
            query_positions=(seq_lens - 1)[:, None],
        )

    max_q = int(plan.extend_lens.max())
    q_pos = torch.arange(max_q, device=device)
    # key j is visible to new token i of request b iff j <= prefix_b + i (causal) and j < seq_b
    visible = (key_pos[None, None, :] <= (prefix[:, None, None] + q_pos[None, :, None])) & (
        key_pos[None, None, :] < seq_lens[:, None, None]
    )
    starts = torch.cumsum(extend, 0) - extend
    query_index = starts[:, None] + torch.minimum(q_pos[None, :], extend[:, None] - 1)  # [B, Q]
    is_real = q_pos[None, :] < extend[:, None]
    flat = torch.arange(batch * max_q, device=device).view(batch, max_q)
    query_unpad = flat[is_real]  # row-major == the flat token order
    return AttentionPlan(
        out_cache_loc, kv_indices, additive_mask(visible.unsqueeze(1), dtype), query_index, query_unpad,
        is_decode=False, query_positions=prefix[:, None] + q_pos[None, :],
    )


MIN_SHARED_PREFIX = 64
"""Keys decode rows must share for their prefix to be attended once for the group."""


def shared_prefixes(
    req_to_token: torch.Tensor, rows: np.ndarray, seq_lens: np.ndarray,
) -> tuple[np.ndarray, np.ndarray] | None:
    """Decode rows whose sequences begin with the same pool slots (a prompt prefix the radix
    tree shares): (keys each row shares with its group, 0 for none; the batch index of its
    group's first row), or None when no two rows share ``MIN_SHARED_PREFIX`` keys. Rows are
    grouped by the slot at key ``MIN_SHARED_PREFIX - 1`` (a slot belongs to one tree path, so
    rows holding it share everything before it), and a group shares the common run of its rows,
    short of each row's newest key."""
    if len(rows) < 2:
        return None
    table = req_to_token.numpy()
    eligible = np.flatnonzero(seq_lens > MIN_SHARED_PREFIX)
    if len(eligible) < 2:
        return None
    marks = table[rows[eligible], MIN_SHARED_PREFIX - 1]
    order = np.argsort(marks, kind="stable")
    starts = np.concatenate(([0], np.flatnonzero(np.diff(marks[order])) + 1))
    ends = np.append(starts[1:], len(order))
    shared = np.zeros(len(rows), dtype=np.int64)
    leader = np.arange(len(rows), dtype=np.int64)
    groups = ends - starts >= 2  # a row alone shares nothing; no Python per such row
    for start, end in zip(starts[groups].tolist(), ends[groups].tolist(), strict=True):
        members = eligible[order[start:end]]
        limit = int(seq_lens[members].min()) - 1
        block = table[rows[members], :limit]
        same = (block == block[0]).all(axis=0)
        length = limit if same.all() else int(np.argmin(same))
        if length >= MIN_SHARED_PREFIX:
            members = np.sort(members)
            shared[members] = length
            leader[members] = members[0]
    return (shared, leader) if shared.any() else None


def _prefill_spans(
    plan: AttentionBatch, req_to_token: torch.Tensor, device: torch.device, dtype: torch.dtype,
) -> list[PrefillSpan]:
    spans = []
    start = 0
    for row, prefix, extend in zip(plan.rows.tolist(), plan.prefix_lens.tolist(), plan.extend_lens.tolist(), strict=True):
        span = PrefillSpan(start, extend, prefix=prefix)
        if prefix:
            seq_len = prefix + extend
            span.kv_slots = req_to_token[row, :seq_len]
            # new token i sees keys 0 .. prefix + i
            key_pos = torch.arange(seq_len, device=device)
            visible = key_pos[None, :] <= prefix + torch.arange(extend, device=device)[:, None]
            span.mask = additive_mask(visible.view(1, 1, extend, seq_len), dtype)
        spans.append(span)
        start += extend
    return spans


class CpuAttention(AttentionBackend):
    """The native decode, prefill and shared-prefix kernels where ``kernels`` has them (the
    prefill kernel only where it is native for the pool's dtype), per-request SDPA prefill and
    gather + SDPA decode where not. ``padded_prefill``: prefill padded to the longest request
    under one mask (what one launch on an accelerator would prefer; kept for tests)."""

    name = "cpu"

    def __init__(
        self, req_to_token: torch.Tensor, dtype: torch.dtype, head_dim: int, kernels: CpuKernels | None,
        *, padded_prefill: bool = False, choices: dict[str, str] | None = None,
    ) -> None:
        self.req_to_token = req_to_token
        self.device = req_to_token.device
        self.dtype = dtype
        self.padded_prefill = padded_prefill
        self.decode_kernel = kernels.decode_attention if kernels else None
        self.prefill_kernel = kernels.prefill_attention_for(dtype) if kernels else None
        self.shared_prefix_kernel = kernels.shared_prefix_attention_for(dtype, head_dim) if kernels else None
        # the implementations measured fastest on this machine (models/tuning.py) over the rules above
        choices = choices or {}
        native_runs = dtype == torch.bfloat16 or (dtype == torch.float32 and kernels is not None
                                                  and kernels.prefill_attention_native(dtype))
        if kernels is not None and choices.get("prefill_attention") == "native" and native_runs:
            self.prefill_kernel = kernels.prefill_attention
        elif choices.get("prefill_attention") == "sdpa":
            self.prefill_kernel = None
        if choices.get("decode_attention") == "sdpa":
            self.decode_kernel = self.shared_prefix_kernel = None

    def prepare_uploaded(self, batch: AttentionBatch, uploaded: list[torch.Tensor]) -> AttentionPlan:
        # CPU only: the plan's tensors share the host arrays' memory, nothing is copied
        return build_attention_plan(
            batch, self.req_to_token, self.device, self.dtype, self.decode_kernel,
            per_request_prefill=not self.padded_prefill, prefill_kernel=self.prefill_kernel,
            shared_prefix_kernel=self.shared_prefix_kernel,
        )

    def forward(
        self, q: torch.Tensor, k: torch.Tensor | None, v: torch.Tensor | None, k_cache: torch.Tensor,
        v_cache: torch.Tensor, layer: LayerAttention, metadata: AttentionMetadata,
    ) -> torch.Tensor:
        assert isinstance(metadata, AttentionPlan), "metadata from another backend"
        write_kv(k, v, k_cache, v_cache, metadata.out_cache_loc)
        return attend_pool(q, k_cache, v_cache, metadata, layer, k, v)
