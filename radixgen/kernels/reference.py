"""Each fused op's definition in PyTorch code (``ops.py`` registers them as the ops' fallback):
the native and Triton kernels round where it rounds (in reduced precision each intermediate it
materialises is rounded to the model's dtype at the same place), and the tests hold each kernel
to it."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from radixgen.kernels import quant_layout


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, multiply_in_float: bool = False) -> torch.Tensor:
    """Normalise in float32 and round before the weight multiply, as transformers' LlamaRMSNorm
    does (``multiply_in_float``: multiply first, then round, as Gemma and OLMo 2 do)."""
    if x.dtype == torch.float32:
        return F.rms_norm(x, (x.shape[-1],), weight, eps)
    normed = F.rms_norm(x.float(), (x.shape[-1],), None, eps)
    if multiply_in_float:
        return (normed * weight.float()).to(x.dtype)
    return weight * normed.to(x.dtype)


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float,
                 multiply_in_float: bool = False) -> torch.Tensor:
    """residual += x (in place), then ``rms_norm`` of the sum."""
    residual.add_(x)
    return rms_norm(residual, weight, eps, multiply_in_float)


def rope_store_kv(qkv: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                  k_cache: torch.Tensor, v_cache: torch.Tensor, out_cache_loc: torch.Tensor,
                  num_heads: int) -> torch.Tensor:
    """qkv [T, (H + 2 KVH) * D] -> rotated q [T, H, D]; the rotated k and v go to the pool slots
    ``out_cache_loc`` of k_cache / v_cache [slots, KVH, D]. Rotary in the half-split layout of HF
    checkpoints: x * cos + rotate_half(x) * sin, the first product rounded, the sum once."""
    num_tokens = qkv.shape[0]
    num_kv_heads, head_dim = k_cache.shape[1], k_cache.shape[2]
    qk = qkv[:, : (num_heads + num_kv_heads) * head_dim].reshape(num_tokens, num_heads + num_kv_heads, head_dim)
    c, s = cos[positions].unsqueeze(1), sin[positions].unsqueeze(1)
    first, second = qk.chunk(2, dim=-1)
    rotated = torch.addcmul(qk * c, torch.cat([-second, first], dim=-1), s)
    v = qkv[:, (num_heads + num_kv_heads) * head_dim :].reshape(num_tokens, num_kv_heads, head_dim)
    k_cache.index_copy_(0, out_cache_loc, rotated[:, num_heads:])
    v_cache.index_copy_(0, out_cache_loc, v)
    return rotated[:, :num_heads].contiguous()


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """gate_up [T, 2I] -> silu(gate) * up [T, I]."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def small_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x @ W.T + b over the plain [out, in] weight (the CPU kernel: a matrix-vector product per row)."""
    return F.linear(x, weight, bias)


def quant_linear(x: torch.Tensor, packed: torch.Tensor, out_features: int, kind: int) -> torch.Tensor:
    """x @ dequant(W).T for a weight in records of any kind (``quant_layout``)."""
    return F.linear(x, quant_layout.dequantize_packed(packed, out_features, kind, x.dtype))


def argmax_rows(logits: torch.Tensor) -> torch.Tensor:
    """[B, V] float32 -> [B] int64: each row's first largest index (a NaN counts as largest)."""
    return logits.argmax(dim=-1)


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
    """Set disallowed logits to -inf in place: logits [B, V], bitmask [B, W] int32 (bit i of word
    j allows token 32*j + i, little-endian words; W*32 >= V). A byte lookup builds the additive
    mask in one gather (faster than unpacking bits with shifts)."""
    batch, vocab = logits.shape
    table = _byte_table(logits.device, logits.dtype)
    logits += table[bitmask.contiguous().view(torch.uint8).long()].view(batch, -1)[:, :vocab]


REFERENCE = {"rms_norm": rms_norm, "add_rms_norm": add_rms_norm, "rope_store_kv": rope_store_kv,
             "silu_mul": silu_mul, "small_linear": small_linear, "quant_linear": quant_linear,
             "argmax_rows": argmax_rows, "apply_bitmask": apply_bitmask}
