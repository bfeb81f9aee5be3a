"""Shared decoder building blocks: linear layers, RMSNorm, rotary embeddings, the gated MLP.

On CPU, linear weights are handed to oneDNN once in its own blocked layout and applied with
``mkldnn._linear_pointwise``. Measured here on 30 layers of 576x3072 weights (2 threads):
fp32 batch 1 / 8 / 64 took 9.8 / 11.1 / 49 ms packed against 12 / 30 / 72-85 ms for the best
of ``x @ W.t()`` layouts through MKL, whose small-batch fp32 GEMMs are slow; bf16 6.4 / 7.6 /
21.5 ms against 10 / 11 / 26 ms. Elsewhere (CUDA, or a torch without oneDNN) ``F.linear``.

Norms, rotary with the K/V write and SiLU*up are one ``torch.ops.radixgen`` op each
(``radixgen/kernels/ops.py``: the C++ kernel on CPU, Triton on CUDA, PyTorch elsewhere). Steps of
at most ``Linear.small_linear_max_tokens`` tokens run the linears as matrix-vector products over
the plain weight, which is kept beside the packed one for that (``small_linear.cpp``).
"""

from __future__ import annotations

import torch
from torch import nn

from radixgen.kernels import ops  # noqa: F401  # defines torch.ops.radixgen's fused ops
from radixgen.models.config import RopeSpec

# The batch size oneDNN is told to expect when reordering; 64 was the best all-rounder for
# batch 1..256 here (packing for batch 1 made batch 64 ~45% slower).
_PACK_BATCH_HINT = 64
# oneDNN builds (and keeps, even past its cache capacity) a primitive of ~0.6 MB per distinct
# row count: prefills of every length grew the engine's memory without bound (+482 MB over 200
# lengths on four weights). Row counts above this are padded up to one of 16 steps per octave
# (at most 6.25% more rows); the decode batches below it are at most max_running_requests shapes.
_EXACT_ROWS_UP_TO = 64
_ROW_STEPS_PER_OCTAVE_LOG2 = 4


def padded_rows(rows: int) -> int:
    """The row count a packed linear runs ``rows`` rows at."""
    if rows <= _EXACT_ROWS_UP_TO:
        return rows
    step = 1 << (rows.bit_length() - 1 - _ROW_STEPS_PER_OCTAVE_LOG2)
    return -(-rows // step) * step


def _can_pack(weight: torch.Tensor) -> bool:
    # oneDNN's bf16 reorder needs AVX-512 (BW/VL/DQ) or AVX-NE-CONVERT: on an AVX2-only CPU it
    # raises, and bf16 weights stay plain (F.linear)
    return (
        weight.device.type == "cpu"
        and torch.backends.mkldnn.is_available()
        and (weight.dtype == torch.float32
             or (weight.dtype == torch.bfloat16 and torch.ops.mkldnn._is_mkldnn_bf16_supported()))
        and hasattr(torch.ops.mkldnn, "_linear_pointwise")
    )


class Linear(nn.Module):
    """y = x @ W.T + b, W [out, in] in HF layout; ``pack()`` adds oneDNN's layout of it."""

    def __init__(self, in_features: int, out_features: int, bias: bool, dtype: torch.dtype) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=dtype), requires_grad=False)
        self.bias = nn.Parameter(torch.zeros(out_features, dtype=dtype), requires_grad=False) if bias else None
        self._packed: torch.Tensor | None = None
        self.small_linear_max_tokens = 0
        """Steps of at most this many tokens run ``small_linear`` over the plain weight (the
        model runner sets it on CPU; 0: never)."""

    def pack(self, keep_plain: bool = True) -> None:
        """Reorder the weight for oneDNN (CPU only). The plain copy stays for ``small_linear``
        unless ``keep_plain`` is False (then its memory is freed, for good)."""
        if self._packed is None and _can_pack(self.weight):
            self._packed = torch.ops.mkldnn._reorder_linear_weight(self.weight.data, _PACK_BATCH_HINT)
        if not keep_plain and self._packed is not None:
            self.weight = nn.Parameter(torch.empty(0, dtype=self.weight.dtype), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[0] <= self.small_linear_max_tokens and self.weight.numel():
            return torch.ops.radixgen.small_linear.default(x, self.weight, self.bias)
        if self._packed is not None:
            rows = x.shape[0]
            padded = padded_rows(rows) if x.dim() == 2 else rows
            if padded != rows:
                # the extra rows are never read back, so they are left unset (half F.pad's copy)
                grown = x.new_empty(padded, x.shape[1])
                grown[:rows] = x
                return torch.ops.mkldnn._linear_pointwise(grown, self._packed, self.bias, "none", [], "")[:rows]
            return torch.ops.mkldnn._linear_pointwise(x, self._packed, self.bias, "none", [], "")
        return nn.functional.linear(x, self.weight, self.bias)


class RMSNorm(nn.Module):
    """``multiply_in_float``: scale by the weight before rounding to the model's dtype (Gemma,
    OLMo 2) rather than after (Llama); the same in float32."""

    def __init__(self, dim: int, eps: float, dtype: torch.dtype, multiply_in_float: bool = False) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim, dtype=dtype), requires_grad=False)
        self.eps = eps
        self.multiply_in_float = multiply_in_float

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.radixgen.rms_norm.default(x, self.weight, self.eps, self.multiply_in_float)

    def add_and_norm(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(norm(residual + x), residual + x): ``residual`` is updated in place."""
        return torch.ops.radixgen.add_rms_norm.default(x, residual, self.weight, self.eps, self.multiply_in_float), residual


class RotaryEmbedding(nn.Module):
    """Rotary position embedding in the half-split layout of HF checkpoints.

    ``rotate_half`` is a fixed signed permutation, applied as one small matmul by ``rotation``
    (exact: one +-1 term per output), so rotating q and k together costs three ops instead of
    slicing and concatenating per tensor; the arithmetic order matches transformers'. With
    partial rotary the permutation covers the rotary dims only and cos/sin are 1/0 past them,
    so the remaining dims pass through unchanged.
    """

    def __init__(self, head_dim: int, max_positions: int, spec: RopeSpec, dtype: torch.dtype) -> None:
        super().__init__()
        self.cos: torch.Tensor
        self.sin: torch.Tensor
        self.rotation: torch.Tensor
        rotary = spec.rotary_dim
        self.partial = rotary < head_dim
        positions = torch.arange(max_positions, dtype=torch.float32)
        freqs = torch.outer(positions, torch.tensor(spec.inv_freq, dtype=torch.float32))
        if spec.long_inv_freq is not None and max_positions > spec.long_from:
            # longrope: positions past the original context use the long factors (HF switches the
            # whole forward once its length passes that point; a cached key keeps its rotation)
            long = torch.outer(positions, torch.tensor(spec.long_inv_freq, dtype=torch.float32))
            freqs[spec.long_from :] = long[spec.long_from :]
        emb = torch.cat((freqs, freqs), dim=-1)  # [max_positions, rotary]
        cos, sin = emb.cos() * spec.attention_factor, emb.sin() * spec.attention_factor
        if self.partial:
            cos = torch.cat([cos, torch.ones(max_positions, head_dim - rotary)], dim=-1)
            sin = torch.cat([sin, torch.zeros(max_positions, head_dim - rotary)], dim=-1)
        # computed in float32 then cast, as transformers does
        self.register_buffer("cos", cos.to(dtype), persistent=False)
        self.register_buffer("sin", sin.to(dtype), persistent=False)
        half = rotary // 2
        rotation = torch.zeros(head_dim, head_dim, dtype=dtype)
        rotation[torch.arange(half) + half, torch.arange(half)] = -1.0  # out[:half] = -x[half:rotary]
        rotation[torch.arange(half), torch.arange(half) + half] = 1.0  # out[half:rotary] = x[:half]
        self.register_buffer("rotation", rotation, persistent=False)

    def tables(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """[T] -> two [T, 1, head_dim] tables that broadcast over heads (once per step)."""
        return self.cos[positions].unsqueeze(1), self.sin[positions].unsqueeze(1)

    def rotate(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x [T, heads, head_dim] -> x * cos + rotate_half(x) * sin."""
        return torch.addcmul(x * cos, x @ self.rotation, sin)


class GatedMLP(nn.Module):
    """down(act(gate(x)) * up(x)) with gate and up fused into one matmul; act is SiLU (SwiGLU)
    or tanh-approximated GELU (Gemma's GeGLU)."""

    def __init__(self, hidden: int, intermediate: int, bias: bool, dtype: torch.dtype, act: str = "silu") -> None:
        super().__init__()
        self.intermediate = intermediate
        self.act = act
        self.gate_up = Linear(hidden, 2 * intermediate, bias, dtype)
        self.down = Linear(intermediate, hidden, bias, dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up(x)  # [T, 2I]
        if self.act == "silu":
            return self.down(torch.ops.radixgen.silu_mul.default(gate_up))
        gate, up = gate_up.split(self.intermediate, dim=-1)  # 2 x [T, I]
        return self.down(nn.functional.gelu(gate, approximate="tanh") * up)
