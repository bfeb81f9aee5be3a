"""CUDA implementations of the fused layer ops (``ops.py`` defines them) as Triton kernels: one
program per token row, arithmetic in float32, rounding where the PyTorch definition rounds.
The tests run them on CPU tensors in Triton's interpreter against that definition."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from radixgen.kernels import reference


@triton.jit
def _rms_norm_kernel(X, Residual, W, Out, stride_x, stride_r, stride_o, dim, eps,
                     HAS_RESIDUAL: tl.constexpr, MULTIPLY_IN_FLOAT: tl.constexpr, IS_FP32: tl.constexpr,
                     BLOCK: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    ok = cols < dim
    x = tl.load(X + row * stride_x + cols, mask=ok, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(Residual + row * stride_r + cols, mask=ok, other=0.0)
        x = (r.to(tl.float32) + x.to(tl.float32)).to(r.dtype)  # the sum is rounded like the stored residual
        tl.store(Residual + row * stride_r + cols, x, mask=ok)
    xf = x.to(tl.float32)
    inv_rms = 1.0 / tl.sqrt(tl.sum(xf * xf, 0) / dim + eps)
    w = tl.load(W + cols, mask=ok, other=0.0).to(tl.float32)
    if IS_FP32 or MULTIPLY_IN_FLOAT:
        out = xf * inv_rms * w
    else:  # round the normalised value, then multiply by the weight and round again
        normed = (xf * inv_rms).to(x.dtype).to(tl.float32)
        out = normed * w
    tl.store(Out + row * stride_o + cols, out.to(Out.dtype.element_ty), mask=ok)


def _norm(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float,
          multiply_in_float: bool) -> torch.Tensor:
    rows, dim = x.shape
    out = torch.empty_like(x, memory_format=torch.contiguous_format)
    if rows:
        _rms_norm_kernel[(rows,)](
            x, residual if residual is not None else x, weight, out, x.stride(0),
            residual.stride(0) if residual is not None else 0, out.stride(0), dim, eps,
            HAS_RESIDUAL=residual is not None, MULTIPLY_IN_FLOAT=multiply_in_float, IS_FP32=x.dtype == torch.float32,
            BLOCK=triton.next_power_of_2(dim),
        )
    return out


def _rows(x: torch.Tensor) -> torch.Tensor:
    return x if x.stride(-1) == 1 else x.contiguous()


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, multiply_in_float: bool = False) -> torch.Tensor:
    return _norm(_rows(x), None, weight.contiguous(), eps, multiply_in_float)


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float,
                 multiply_in_float: bool = False) -> torch.Tensor:
    assert residual.stride(-1) == 1, "the residual is updated in place: its rows must be contiguous"
    return _norm(_rows(x), residual, weight.contiguous(), eps, multiply_in_float)


@triton.jit
def _silu_mul_kernel(GateUp, Out, stride_in, stride_out, inter, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    start = tl.program_id(1) * BLOCK
    cols = start + tl.arange(0, BLOCK)
    ok = cols < inter
    gate = tl.load(GateUp + row * stride_in + cols, mask=ok, other=0.0)
    up = tl.load(GateUp + row * stride_in + inter + cols, mask=ok, other=0.0)
    g = gate.to(tl.float32)
    silu = (g / (1.0 + tl.exp(-g))).to(gate.dtype)
    tl.store(Out + row * stride_out + cols, (silu.to(tl.float32) * up.to(tl.float32)).to(Out.dtype.element_ty),
             mask=ok)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    gate_up = _rows(gate_up)
    rows, width = gate_up.shape
    inter = width // 2
    out = torch.empty(rows, inter, dtype=gate_up.dtype, device=gate_up.device)
    block = min(1024, triton.next_power_of_2(inter))
    if rows:
        _silu_mul_kernel[(rows, triton.cdiv(inter, block))](gate_up, out, gate_up.stride(0), out.stride(0), inter,
                                                            BLOCK=block)
    return out


@triton.jit
def _rope_store_kernel(QKV, Positions, Cos, Sin, KCache, VCache, Slots, Q,
                       stride_qkv, stride_cos, stride_kc, stride_vc, stride_q,
                       NUM_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
                       HALF: tl.constexpr, BLOCK_H: tl.constexpr):
    t = tl.program_id(0)
    pos = tl.load(Positions + t)
    slot = tl.load(Slots + t)
    heads = tl.arange(0, BLOCK_H)
    half = tl.arange(0, HALF)
    row = QKV + t * stride_qkv
    cos_lo = tl.load(Cos + pos * stride_cos + half).to(tl.float32)
    cos_hi = tl.load(Cos + pos * stride_cos + HALF + half).to(tl.float32)
    sin_lo = tl.load(Sin + pos * stride_cos + half).to(tl.float32)
    sin_hi = tl.load(Sin + pos * stride_cos + HALF + half).to(tl.float32)
    is_head = heads < NUM_HEADS + NUM_KV_HEADS
    offsets = heads[:, None] * HEAD_DIM + half[None, :]
    lo = tl.load(row + offsets, mask=is_head[:, None], other=0.0)
    hi = tl.load(row + offsets + HALF, mask=is_head[:, None], other=0.0)
    lof, hif = lo.to(tl.float32), hi.to(tl.float32)
    # x * cos rounded, then + rotate_half(x) * sin in float, rounded once
    out_lo = ((lof * cos_lo[None, :]).to(lo.dtype).to(tl.float32) - hif * sin_lo[None, :]).to(lo.dtype)
    out_hi = ((hif * cos_hi[None, :]).to(lo.dtype).to(tl.float32) + lof * sin_hi[None, :]).to(lo.dtype)
    is_q = heads < NUM_HEADS
    q_off = t * stride_q + heads[:, None] * HEAD_DIM + half[None, :]
    tl.store(Q + q_off, out_lo, mask=is_q[:, None])
    tl.store(Q + q_off + HALF, out_hi, mask=is_q[:, None])
    is_k = (heads >= NUM_HEADS) & is_head
    k_off = slot * stride_kc + (heads[:, None] - NUM_HEADS) * HEAD_DIM + half[None, :]
    tl.store(KCache + k_off, out_lo, mask=is_k[:, None])
    tl.store(KCache + k_off + HALF, out_hi, mask=is_k[:, None])
    # v: copied as it is
    kv_heads = tl.arange(0, BLOCK_H)
    dims = tl.arange(0, 2 * HALF)
    is_v = kv_heads < NUM_KV_HEADS
    v = tl.load(row + (NUM_HEADS + NUM_KV_HEADS) * HEAD_DIM + kv_heads[:, None] * HEAD_DIM + dims[None, :],
                mask=is_v[:, None], other=0.0)
    tl.store(VCache + slot * stride_vc + kv_heads[:, None] * HEAD_DIM + dims[None, :], v, mask=is_v[:, None])


def rope_store_kv(qkv: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                  k_cache: torch.Tensor, v_cache: torch.Tensor, out_cache_loc: torch.Tensor,
                  num_heads: int) -> torch.Tensor:
    num_kv_heads, head_dim = k_cache.shape[1], k_cache.shape[2]
    if head_dim & (head_dim - 1):  # the kernel's halves are aranges: other head sizes take the PyTorch op
        return reference.rope_store_kv(qkv, positions, cos, sin, k_cache, v_cache, out_cache_loc, num_heads)
    qkv = _rows(qkv)
    num_tokens = qkv.shape[0]
    assert k_cache.is_contiguous() and v_cache.is_contiguous() and cos.is_contiguous() and sin.is_contiguous()
    q = torch.empty(num_tokens, num_heads, head_dim, dtype=qkv.dtype, device=qkv.device)
    if num_tokens:
        _rope_store_kernel[(num_tokens,)](
            qkv, positions, cos, sin, k_cache, v_cache, out_cache_loc, q,
            qkv.stride(0), cos.stride(0), k_cache.stride(0), v_cache.stride(0), q.stride(0),
            NUM_HEADS=num_heads, NUM_KV_HEADS=num_kv_heads, HEAD_DIM=head_dim, HALF=head_dim // 2,
            BLOCK_H=triton.next_power_of_2(num_heads + num_kv_heads),
        )
    return q
