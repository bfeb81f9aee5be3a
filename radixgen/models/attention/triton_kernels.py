"""Triton kernels of the ``triton`` attention backend: decode and extend attention that read
K/V in place from the token pool through ``req_to_token`` (page size 1, the layout of SGLang's
Triton backend), with online softmax in float32.

- ``decode_attention``: one query per row. A program takes one row, one kv head and one split
  of its keys, and the query heads that share that kv head (GQA: each key is loaded once for
  the group); the splits' partial results are merged by a second kernel (flash-decoding), so a
  batch of one long sequence still fills the device.
- ``extend_attention``: any number of new tokens per request over its cached prefix and
  themselves (prefill, prefill after a cached prefix, mixed steps, speculative drafts). A
  program takes a block of one request's queries for one query head.

Both take a sliding window (keys a query sees, its own included; 0: none) and tanh
soft-capping (0: none). On a machine without a GPU they run under Triton's interpreter
(``TRITON_INTERPRET=1``, set before this module is imported), which is how the tests run them.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

# Masked scores: a large negative finite value rather than -inf, so a block whose keys are all
# masked for a query leaves its running maximum finite and its weights exactly zero.
_NEG = -1.0e30


@triton.jit
def _tanh(x):
    # tanh through exp, which every backend (the interpreter included) has
    e = tl.exp(-2.0 * tl.abs(x))
    t = (1.0 - e) / (1.0 + e)
    return tl.where(x < 0, -t, t)


@triton.jit
def _load_pool_rows(Cache, slots, stride_slot, head_offset, d, ok, d_ok, DOT_FP32: tl.constexpr):
    """[N, BLOCK_D] rows of one kv head at pool ``slots`` (zeros where not ``ok``)."""
    rows = tl.load(Cache + slots[:, None] * stride_slot + head_offset + d[None, :], mask=ok[:, None] & d_ok[None, :],
                   other=0.0)
    if DOT_FP32:
        rows = rows.to(tl.float32)
    return rows


@triton.jit
def _decode_split_kernel(
    Q, K, V, req_to_token, rows, seq_lens, PartialOut, PartialLse,
    stride_qt, stride_qh, stride_ks, stride_kh, stride_vs, stride_vh, stride_rt,
    stride_pt, stride_ph, stride_ps, stride_lt, stride_lh,
    scale, softcap, window, keys_per_split,
    GROUP: tl.constexpr, BLOCK_H: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr, HAS_SOFTCAP: tl.constexpr, PRECISION: tl.constexpr, DOT_FP32: tl.constexpr,
):
    t = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    row = tl.load(rows + t)
    seq_len = tl.load(seq_lens + t).to(tl.int32)
    first = tl.where(window > 0, tl.maximum(seq_len - window, 0), 0)
    begin = first + split * keys_per_split
    end = tl.minimum(begin + keys_per_split, seq_len)

    heads = kv_head * GROUP + tl.arange(0, BLOCK_H)
    head_ok = tl.arange(0, BLOCK_H) < GROUP
    d = tl.arange(0, BLOCK_D)
    d_ok = d < HEAD_DIM
    q = tl.load(Q + t * stride_qt + heads[:, None] * stride_qh + d[None, :], mask=head_ok[:, None] & d_ok[None, :],
                other=0.0)
    if DOT_FP32:
        q = q.to(tl.float32)

    m_i = tl.full([BLOCK_H], _NEG, tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_D], tl.float32)
    for start in range(begin, end, BLOCK_N):
        n = start + tl.arange(0, BLOCK_N)
        n_ok = n < end
        slots = tl.load(req_to_token + row * stride_rt + n, mask=n_ok, other=0).to(tl.int64)
        k = _load_pool_rows(K, slots, stride_ks, kv_head * stride_kh, d, n_ok, d_ok, DOT_FP32)
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale  # [BLOCK_H, BLOCK_N]
        if HAS_SOFTCAP:
            s = softcap * _tanh(s / softcap)
        s = tl.where(n_ok[None, :], s, _NEG)
        m_new = tl.maximum(m_i, tl.max(s, 1))
        p = tl.exp(s - m_new[:, None])
        p = tl.where(n_ok[None, :], p, 0.0)
        alpha = tl.exp(m_i - m_new)
        v = _load_pool_rows(V, slots, stride_vs, kv_head * stride_vh, d, n_ok, d_ok, DOT_FP32)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        l_i = l_i * alpha + tl.sum(p, 1)
        m_i = m_new

    has_keys = l_i > 0
    out = acc / tl.where(has_keys, l_i, 1.0)[:, None]
    lse = tl.where(has_keys, m_i + tl.log(tl.where(has_keys, l_i, 1.0)), _NEG)
    tl.store(PartialOut + t * stride_pt + heads[:, None] * stride_ph + split * stride_ps + d[None, :], out,
             mask=head_ok[:, None] & d_ok[None, :])
    tl.store(PartialLse + t * stride_lt + heads * stride_lh + split, lse, mask=head_ok)


@triton.jit
def _decode_merge_kernel(
    PartialOut, PartialLse, Out,
    stride_pt, stride_ph, stride_ps, stride_lt, stride_lh, stride_ot, stride_oh,
    NUM_SPLITS: tl.constexpr, BLOCK_S: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
):
    t = tl.program_id(0)
    h = tl.program_id(1)
    s = tl.arange(0, BLOCK_S)
    s_ok = s < NUM_SPLITS
    d = tl.arange(0, BLOCK_D)
    d_ok = d < HEAD_DIM
    lse = tl.load(PartialLse + t * stride_lt + h * stride_lh + s, mask=s_ok, other=_NEG)
    top = tl.max(lse, 0)
    w = tl.where(s_ok & (lse > _NEG), tl.exp(lse - top), 0.0)
    parts = tl.load(PartialOut + t * stride_pt + h * stride_ph + s[:, None] * stride_ps + d[None, :],
                    mask=s_ok[:, None] & d_ok[None, :], other=0.0)
    out = tl.sum(parts * w[:, None], 0) / tl.sum(w, 0)
    tl.store(Out + t * stride_ot + h * stride_oh + d, out.to(Out.dtype.element_ty), mask=d_ok)


@triton.jit
def _extend_kernel(
    Q, K, V, Out, req_to_token, rows, prefix_lens, extend_lens, q_starts,
    stride_qt, stride_qh, stride_ks, stride_kh, stride_vs, stride_vh, stride_ot, stride_oh, stride_rt,
    scale, softcap, window,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, HAS_SOFTCAP: tl.constexpr, PRECISION: tl.constexpr, DOT_FP32: tl.constexpr,
):
    b = tl.program_id(0)
    h = tl.program_id(1)
    block = tl.program_id(2)
    extend = tl.load(extend_lens + b).to(tl.int32)
    if block * BLOCK_M < extend:
        kv_head = h // GROUP
        row = tl.load(rows + b)
        prefix = tl.load(prefix_lens + b).to(tl.int32)
        q_start = tl.load(q_starts + b)
        m = block * BLOCK_M + tl.arange(0, BLOCK_M)
        m_ok = m < extend
        q_pos = prefix + m  # [BLOCK_M] positions of the queries in the sequence
        d = tl.arange(0, BLOCK_D)
        d_ok = d < HEAD_DIM
        q = tl.load(Q + (q_start + m)[:, None] * stride_qt + h * stride_qh + d[None, :],
                    mask=m_ok[:, None] & d_ok[None, :], other=0.0)
        if DOT_FP32:
            q = q.to(tl.float32)

        # keys this block of queries can see: up to its last query, from its first query's window
        last_pos = prefix + tl.minimum(block * BLOCK_M + BLOCK_M, extend) - 1
        first_key = tl.where(window > 0, tl.maximum(prefix + block * BLOCK_M - window + 1, 0), 0)
        first_key = (first_key // BLOCK_N) * BLOCK_N
        m_i = tl.full([BLOCK_M], _NEG, tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
        for start in range(first_key, last_pos + 1, BLOCK_N):
            n = start + tl.arange(0, BLOCK_N)
            n_ok = n <= last_pos
            slots = tl.load(req_to_token + row * stride_rt + n, mask=n_ok, other=0).to(tl.int64)
            k = _load_pool_rows(K, slots, stride_ks, kv_head * stride_kh, d, n_ok, d_ok, DOT_FP32)
            s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale  # [BLOCK_M, BLOCK_N]
            if HAS_SOFTCAP:
                s = softcap * _tanh(s / softcap)
            visible = (n[None, :] <= q_pos[:, None]) & n_ok[None, :]
            visible = visible & ((window <= 0) | (n[None, :] > q_pos[:, None] - window))
            s = tl.where(visible, s, _NEG)
            m_new = tl.maximum(m_i, tl.max(s, 1))
            p = tl.where(visible, tl.exp(s - m_new[:, None]), 0.0)
            alpha = tl.exp(m_i - m_new)
            v = _load_pool_rows(V, slots, stride_vs, kv_head * stride_vh, d, n_ok, d_ok, DOT_FP32)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
            l_i = l_i * alpha + tl.sum(p, 1)
            m_i = m_new
        out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
        tl.store(Out + (q_start + m)[:, None] * stride_ot + h * stride_oh + d[None, :], out.to(Out.dtype.element_ty),
                 mask=m_ok[:, None] & d_ok[None, :])


def _precision(dtype: torch.dtype) -> str:
    # float32 attention stays float32 (TF32 would change greedy outputs against the other backends)
    return "ieee" if dtype == torch.float32 or _INTERPRETED else "tf32"


# Triton's interpreter multiplies 16-bit float operands of tl.dot wrongly (it reads their bits as
# integers; checked against torch on triton 3.9), so interpreted runs take the products in
# float32. On a GPU bf16/fp16 operands go to the tensor cores as they are.
_INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"


def _block_d(head_dim: int) -> int:
    return max(16, triton.next_power_of_2(head_dim))


def decode_attention(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, req_to_token: torch.Tensor, rows: torch.Tensor,
    seq_lens: torch.Tensor, scale: float, window: int, softcap: float, num_splits: int, max_seq_len: int,
) -> torch.Tensor:
    """q [T, H, D] (one query per entry of ``rows``/``seq_lens``: the query at position
    seq_len - 1) -> [T, H, D]. ``num_splits`` key ranges per row, each of
    ceil(``max_seq_len`` / num_splits) keys (a host-side bound: no length is read back)."""
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[1]
    group = num_heads // num_kv_heads
    block_d = _block_d(head_dim)
    keys_per_split = max(1, -(-min(max_seq_len, window or max_seq_len) // num_splits))
    partial = torch.empty(num_tokens, num_heads, num_splits, head_dim, dtype=torch.float32, device=q.device)
    lse = torch.empty(num_tokens, num_heads, num_splits, dtype=torch.float32, device=q.device)
    _decode_split_kernel[(num_tokens, num_kv_heads, num_splits)](
        q, k_cache, v_cache, req_to_token, rows, seq_lens, partial, lse,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), v_cache.stride(0), v_cache.stride(1),
        req_to_token.stride(0), partial.stride(0), partial.stride(1), partial.stride(2), lse.stride(0), lse.stride(1),
        scale, softcap, window, keys_per_split,
        GROUP=group, BLOCK_H=max(16, triton.next_power_of_2(group)), HEAD_DIM=head_dim, BLOCK_D=block_d, BLOCK_N=32,
        HAS_SOFTCAP=softcap > 0, PRECISION=_precision(q.dtype), DOT_FP32=_INTERPRETED,
    )
    out = torch.empty_like(q)
    _decode_merge_kernel[(num_tokens, num_heads)](
        partial, lse, out, partial.stride(0), partial.stride(1), partial.stride(2), lse.stride(0), lse.stride(1),
        out.stride(0), out.stride(1),
        NUM_SPLITS=num_splits, BLOCK_S=triton.next_power_of_2(num_splits), HEAD_DIM=head_dim, BLOCK_D=block_d,
    )
    return out


def extend_attention(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, req_to_token: torch.Tensor, rows: torch.Tensor,
    prefix_lens: torch.Tensor, extend_lens: torch.Tensor, q_starts: torch.Tensor, max_extend: int, scale: float,
    window: int, softcap: float,
) -> torch.Tensor:
    """q [T, H, D], the requests' new tokens in order (request b's from ``q_starts[b]``) ->
    [T, H, D]; K/V of every token, new ones included, already in the pool. ``max_extend``: a
    host-side bound on ``extend_lens`` (sizes the grid)."""
    num_tokens, num_heads, head_dim = q.shape
    group = num_heads // k_cache.shape[1]
    block_m = 32 if max_extend > 16 else 16
    out = torch.empty_like(q)
    grid = (rows.shape[0], num_heads, triton.cdiv(max_extend, block_m))
    _extend_kernel[grid](
        q, k_cache, v_cache, out, req_to_token, rows, prefix_lens, extend_lens, q_starts,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), v_cache.stride(0), v_cache.stride(1),
        out.stride(0), out.stride(1), req_to_token.stride(0),
        scale, softcap, window,
        GROUP=group, HEAD_DIM=head_dim, BLOCK_D=_block_d(head_dim), BLOCK_M=block_m, BLOCK_N=32,
        HAS_SOFTCAP=softcap > 0, PRECISION=_precision(q.dtype), DOT_FP32=_INTERPRETED,
    )
    return out
