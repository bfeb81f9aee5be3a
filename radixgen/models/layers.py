"""Shared Llama-family building blocks: RMSNorm, rotary embeddings, the SwiGLU MLP.

Linear weights are stored transposed (``[in, out]``, contiguous) and applied as ``x @ w``:
on CPU this form reads the weight at about twice the bandwidth of ``F.linear`` for the skinny
matmuls of decode (see DESIGN.md, measured facts).
"""

from __future__ import annotations

import math

import torch
from torch import nn

from radixgen.models.config import RopeScaling


def linear(x: torch.Tensor, weight_t: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    if bias is None:
        return x @ weight_t
    return torch.addmm(bias, x, weight_t)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float, dtype: torch.dtype) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim, dtype=dtype), requires_grad=False)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Same order of operations as transformers' LlamaRMSNorm, so bf16 rounds the same way.
        dtype = x.dtype
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(dtype)


def rope_inv_freq(head_dim: int, theta: float, scaling: RopeScaling) -> torch.Tensor:
    """Inverse frequencies [head_dim/2] with linear or llama3 scaling applied."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if scaling.kind == "linear":
        return inv_freq / scaling.factor
    if scaling.kind == "llama3":
        # Llama 3.1: long wavelengths are slowed by `factor`, short ones kept, a smooth ramp between.
        old_len = scaling.original_max_position_embeddings
        low_wavelen = old_len / scaling.low_freq_factor
        high_wavelen = old_len / scaling.high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / scaling.factor, inv_freq)
        smooth = (old_len / wavelen - scaling.low_freq_factor) / (
            scaling.high_freq_factor - scaling.low_freq_factor
        )
        smoothed = (1 - smooth) * scaled / scaling.factor + smooth * scaled
        is_medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        return torch.where(is_medium, smoothed, scaled)
    return inv_freq


class RotaryEmbedding(nn.Module):
    """cos/sin tables for every position up to ``max_positions``, looked up per token."""

    def __init__(
        self, head_dim: int, max_positions: int, theta: float, scaling: RopeScaling,
        dtype: torch.dtype,
    ) -> None:
        super().__init__()
        inv_freq = rope_inv_freq(head_dim, theta, scaling)
        freqs = torch.outer(torch.arange(max_positions, dtype=torch.float32), inv_freq)
        # [max_positions, head_dim/2]; computed in float32 then cast like transformers does.
        self.register_buffer("cos", freqs.cos().to(dtype), persistent=False)
        self.register_buffer("sin", freqs.sin().to(dtype), persistent=False)

    def forward(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # [T] -> two [T, 1, head_dim/2] tables that broadcast over heads
        return self.cos[positions].unsqueeze(1), self.sin[positions].unsqueeze(1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate [T, heads, head_dim] in the half-split layout of HF Llama checkpoints."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


class SwiGLU(nn.Module):
    """down(silu(gate(x)) * up(x)) with gate and up fused into one matmul."""

    def __init__(self, hidden: int, intermediate: int, bias: bool, dtype: torch.dtype) -> None:
        super().__init__()
        self.intermediate = intermediate
        self.gate_up_t = nn.Parameter(torch.empty(hidden, 2 * intermediate, dtype=dtype), requires_grad=False)
        self.down_t = nn.Parameter(torch.empty(intermediate, hidden, dtype=dtype), requires_grad=False)
        self.gate_up_bias = (
            nn.Parameter(torch.zeros(2 * intermediate, dtype=dtype), requires_grad=False) if bias else None
        )
        self.down_bias = nn.Parameter(torch.zeros(hidden, dtype=dtype), requires_grad=False) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = linear(x, self.gate_up_t, self.gate_up_bias)  # [T, 2I]
        gate, up = gate_up.split(self.intermediate, dim=-1)
        return linear(nn.functional.silu(gate) * up, self.down_t, self.down_bias)
