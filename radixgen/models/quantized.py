"""Weight-only quantized linears and embeddings (4-bit and 8-bit, groups of 32 along the input).

A weight is three arrays: ``qweight`` (uint8 nibble pairs for 4 bits, int8 for 8), ``scales``
and ``mins`` [out, in / 32] in float16 (as GGUF stores them: with float32 a 4-bit group took
a fifth more bytes), with w = q * scale + min (8-bit: no min). GGUF's Q4_1,
Q4_0 (min = -8 * scale) and Q8_0 blocks map onto this exactly, so a GGUF file is repacked, not
dequantized (``gguf_weights.py``); float checkpoints are quantized here (``quantize``).

On CPU, steps of up to ``FUSED_MAX_TOKENS`` tokens (decode batches) run the native
``quant_linear``: the activations rounded to 16-bit integers per group of 32, each group of
weights multiplied with up to 8 tokens by integer multiply-adds, so W is read at 0.625 (4-bit)
or 1.125 (8-bit) bytes per weight and no float copy is made. Longer steps (prefill) are
compute-bound and the float GEMM is faster there (gate_up at 128 / 512 tokens: 6.7 / 27.2 ms in
the kernel against 6.0 / 18.2 ms dequantized + GEMM, the dequantization included): the weight is
dequantized for that one call and freed.
Elsewhere (or without the native ops) the same in PyTorch ops.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from radixgen.kernels import CpuKernels

GROUP = 32
FUSED_MAX_TOKENS = 64


@dataclass
class QuantizedWeight:
    qweight: torch.Tensor
    scales: torch.Tensor
    mins: torch.Tensor
    """Empty for 8 bits."""
    bits: int

    def __post_init__(self) -> None:
        # float16 holds every GGUF scale exactly; caches written with float32 scales load too
        self.scales = self.scales.to(torch.float16)
        if self.mins.numel():
            self.mins = self.mins.to(torch.float16)

    @property
    def shape(self) -> tuple[int, int]:
        return self.qweight.shape[0], self.qweight.shape[1] * 8 // self.bits

    def rows(self, index: torch.Tensor) -> QuantizedWeight:
        """A weight of the selected output rows (concatenating or permuting rows is exact: the
        groups run along the input)."""
        return QuantizedWeight(
            self.qweight[index], self.scales[index], self.mins[index] if self.mins.numel() else self.mins, self.bits,
        )

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        out, in_features = self.shape
        groups = in_features // GROUP
        if self.bits == 4:
            packed = self.qweight.view(out, groups, GROUP // 2)
            q = torch.cat([packed & 0x0F, packed >> 4], dim=-1).float()
        else:
            q = self.qweight.view(out, groups, GROUP).float()
        w = q * self.scales.float()[..., None]
        if self.mins.numel():
            w = w + self.mins.float()[..., None]
        return w.view(out, in_features).to(dtype)

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.qweight, self.scales, self.mins))


def cat_rows(parts: list[QuantizedWeight]) -> QuantizedWeight:
    bits = parts[0].bits
    assert all(p.bits == bits for p in parts), "fused parts must share a bit width"
    has_mins = bool(parts[0].mins.numel())
    if any(bool(p.mins.numel()) != has_mins for p in parts):  # Q4_0 beside Q4_1: give Q4_0 its mins
        parts = [p if p.mins.numel() else QuantizedWeight(p.qweight, p.scales, torch.zeros_like(p.scales), bits)
                 for p in parts]
        has_mins = True
    return QuantizedWeight(
        torch.cat([p.qweight for p in parts]), torch.cat([p.scales for p in parts]),
        torch.cat([p.mins for p in parts]) if has_mins else parts[0].mins, bits,
    )


def quantize(weight: torch.Tensor, bits: int) -> QuantizedWeight:
    """Round a float [out, in] weight: 8 bits symmetric (Q8_0's rule), 4 bits with a minimum
    (Q4_1's rule: scale = (max - min) / 15)."""
    out, in_features = weight.shape
    if in_features % GROUP:
        raise ValueError(f"cannot quantize a weight of {in_features} inputs: not a multiple of {GROUP}")
    groups = weight.float().view(out, in_features // GROUP, GROUP)
    # the integers are rounded against the float16 scale and minimum that are stored
    if bits == 8:
        scales = (groups.abs().amax(-1) / 127).half().float()
        q = torch.round(groups / scales.clamp_min(1e-30)[..., None]).clamp(-127, 127).to(torch.int8)
        return QuantizedWeight(q.view(out, in_features), scales.contiguous(), torch.empty(0), 8)
    if bits != 4:
        raise ValueError(f"bits must be 4 or 8, got {bits}")
    low, high = groups.amin(-1).half().float(), groups.amax(-1)
    scales = ((high - low) / 15).half().float()
    q = torch.round((groups - low[..., None]) / scales.clamp_min(1e-30)[..., None]).clamp(0, 15).to(torch.uint8)
    packed = q[..., : GROUP // 2] | (q[..., GROUP // 2 :] << 4)
    return QuantizedWeight(packed.reshape(out, in_features // 2).contiguous(), scales.contiguous(),
                           low.contiguous(), 4)


class QuantizedLinear(nn.Module):
    """y = x @ dequant(W).T + b, with the ``Linear`` interface the decoder calls."""

    def __init__(self, weight: QuantizedWeight, bias: torch.Tensor | None) -> None:
        super().__init__()
        self.bits = weight.bits
        self.out_features, self.in_features = weight.shape
        self.qweight: torch.Tensor
        self.scales: torch.Tensor
        self.mins: torch.Tensor
        self.register_buffer("qweight", weight.qweight, persistent=False)
        self.register_buffer("scales", weight.scales, persistent=False)
        self.register_buffer("mins", weight.mins, persistent=False)
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)

    @property
    def weight_q(self) -> QuantizedWeight:
        return QuantizedWeight(self.qweight, self.scales, self.mins, self.bits)

    def forward(self, x: torch.Tensor, kernels: CpuKernels | None = None) -> torch.Tensor:
        if kernels is not None and x.shape[0] <= FUSED_MAX_TOKENS:
            y = kernels.quant_linear(x, self.qweight, self.scales, self.mins, self.bits)
        elif kernels is not None:
            weight = kernels.quant_dequantize(self.qweight, self.scales, self.mins, self.bits, x.dtype)
            y = nn.functional.linear(x, weight)
        else:
            y = nn.functional.linear(x, self.weight_q.dequantize(x.dtype))
        return y if self.bias is None else y + self.bias

    def pack(self, keep_plain: bool = True) -> None:
        """Quantized weights have no oneDNN layout (the decoder calls this on every linear)."""


class QuantizedEmbedding(nn.Module):
    """Embedding rows dequantized on lookup; the same buffers serve a tied LM head."""

    def __init__(self, weight: QuantizedWeight) -> None:
        super().__init__()
        self.head = QuantizedLinear(weight, None)

    def forward(self, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        return self.head.weight_q.rows(ids).dequantize(dtype)
