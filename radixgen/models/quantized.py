"""Weight-only quantized linears and embeddings (4-, 5-, 6- and 8-bit, groups of 32 along the input).

A weight quantized here (``quantize``, for float checkpoints) is three arrays: ``qweight`` (uint8
nibble pairs for 4 bits, int8 for 8), ``scales`` and ``mins`` [out, in / 32] in float16, with
w = q * scale + min (8-bit: no min). A GGUF file's blocks of every supported type are written
straight into the kernel's records instead (``PackedWeight``, ``gguf_weights.py``), not dequantized.

On CPU every step runs the native ``quant_linear`` on the weight as it is held, in the
kernel's layout (``interleave``: rows in blocks of 16, one record per block and group): the
activations rounded to 16-bit integers per group of 32 and multiplied with the weights by integer
multiply-adds, so W is read at 0.625 (4-bit) or 1.0625 (8-bit) bytes per weight, in one pass
for up to 12 tokens, and no float copy is made. One path at every step size keeps a token's
result independent of the step it runs in (decode, extend, prefill). Where kernel tuning
measured it faster for steps of many tokens, those steps decode the records into a float tile
(``set_tiles``: a scratch buffer of at most ``TILE_BYTES`` reused by every linear) and run one
matrix product on it: the decoding costs the same whatever the tokens, the product runs on
oneDNN (AMX tiles where the CPU has them), so no dense copy of the weights is kept.
Elsewhere (or without the native ops) ``torch.ops.radixgen.quant_linear`` dequantizes and runs
``F.linear`` (``kernels/ops.py``).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

import torch
from torch import nn

from radixgen.kernels import ops, quant_layout  # noqa: F401  # ops: defines torch.ops.radixgen.quant_linear
from radixgen.models.layers import Linear

GROUP = quant_layout.GROUP

TILE_BYTES = 32 << 20
"""The most a decoded tile holds; a larger weight is decoded and multiplied in runs of rows."""


class _TileScratch(threading.local):
    """Per thread, one buffer per dtype that every linear decodes its tiles into, grown on demand:
    a thread runs one linear at a time, and each product is done before the next decode (two
    engines in one process step on threads of their own)."""

    def __init__(self) -> None:
        self._buffers: dict[torch.dtype, torch.Tensor] = {}

    def tile(self, rows: int, cols: int, dtype: torch.dtype) -> torch.Tensor:
        buffer = self._buffers.get(dtype)
        if buffer is None or buffer.numel() < rows * cols:
            buffer = self._buffers[dtype] = torch.empty(rows * cols, dtype=dtype)
        return buffer[: rows * cols].view(rows, cols)


_scratch = _TileScratch()


@dataclass
class PackedWeight:
    """Rows of a weight already in the kernel's records [ceil(out / 16), in / 32, record bytes] of
    one kind (``quant_layout``)."""

    records: torch.Tensor
    kind: int
    out_features: int

    @property
    def in_features(self) -> int:
        return self.records.shape[1] * GROUP


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
        return quant_layout.dequantize(self.qweight, self.scales, self.mins, self.bits, dtype)

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


def interleave(weight: QuantizedWeight) -> torch.Tensor:
    """The weight in the native kernel's layout (``kernels/quant_layout.py``)."""
    return quant_layout.interleave(weight.qweight, weight.scales, weight.mins, weight.bits)


def deinterleave(records: torch.Tensor, bits: int, rows: torch.Tensor | None = None) -> QuantizedWeight:
    """``interleave`` undone for the blocks in ``records`` [B, groups, record bytes]: all 16 rows of
    each (rows None: 16 B rows, padding included), or row ``rows[i]`` of block i."""
    return QuantizedWeight(*quant_layout.deinterleave(records, bits, rows), bits)


def _as_packed(part: QuantizedWeight | PackedWeight) -> PackedWeight:
    if isinstance(part, PackedWeight):
        return part
    return PackedWeight(interleave(part), part.bits, part.shape[0])  # group records: the kind is the width


def _adjoined(first: torch.Tensor, second: torch.Tensor) -> torch.Tensor:
    """``torch.cat([first, second])`` of two record arrays: a view where ``second`` follows
    ``first`` in one storage (written so into the weights' arena), a copy elsewhere."""
    follows = (first.is_contiguous() and second.is_contiguous() and first.shape[1:] == second.shape[1:]
               and first.untyped_storage().data_ptr() == second.untyped_storage().data_ptr()
               and first.data_ptr() + first.nbytes == second.data_ptr())
    if not follows:
        return torch.cat([first, second])
    return first.new_empty(0).set_(first.untyped_storage(), first.storage_offset(),
                                   (first.shape[0] + second.shape[0], *first.shape[1:]), first.stride())


def _joined(parts: list[PackedWeight]) -> list[PackedWeight]:
    """Neighbours of one record kind as one weight where the rows before each seam fill whole blocks of 16."""
    out = [parts[0]]
    for part in parts[1:]:
        last = out[-1]
        if last.kind == part.kind and last.out_features % quant_layout.BLOCK_ROWS == 0:
            out[-1] = PackedWeight(_adjoined(last.records, part.records), part.kind,
                                   last.out_features + part.out_features)
        else:
            out.append(part)
    return out


class QuantizedLinear(nn.Module):
    """y = x @ dequant(W).T + b, with the ``Linear`` interface the decoder calls. The weight is
    held only in the kernel's records. A fused weight whose parts have records of different kinds
    (a GGUF's Q4_K query beside its Q6_K value) keeps one record array per kind and runs them one
    after another into one output."""

    def __init__(self, weight: QuantizedWeight | PackedWeight | list[QuantizedWeight | PackedWeight],
                 bias: torch.Tensor | None) -> None:
        super().__init__()
        parts = _joined([_as_packed(p) for p in (weight if isinstance(weight, list) else [weight])])
        self.kinds = tuple(p.kind for p in parts)
        self.segment_rows = tuple(p.out_features for p in parts)
        self.kind = parts[0].kind
        """The record kind of the first (usually only) record array."""
        self.out_features, self.in_features = sum(self.segment_rows), parts[0].in_features
        self.packed: torch.Tensor
        for i, part in enumerate(parts):
            self.register_buffer("packed" if i == 0 else f"packed_{i}", part.records, persistent=False)
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)
        self.dense: Linear | None = None
        """A dense copy of the weight for steps of at least ``dense_min_tokens`` tokens, where
        the machine measured a GEMM over it faster (``add_dense``); None: every step runs on the
        blocks."""
        self.dense_min_tokens = 0
        self.tile_min_tokens = 0
        """Steps of at least this many tokens run on decoded tiles (``set_tiles``); 0: never."""
        self.tile_dtype = torch.float32

    def set_tiles(self, min_tokens: int, dtype: torch.dtype) -> None:
        """Run steps of at least ``min_tokens`` tokens (0: none) as a product on tiles of the
        weight decoded into ``dtype`` (float32 or bfloat16; the activations are cast to it)."""
        if dtype not in (torch.float32, torch.bfloat16):
            raise ValueError(f"tiles are float32 or bfloat16, not {dtype}")
        self.tile_min_tokens, self.tile_dtype = min_tokens, dtype

    def segments(self) -> list[tuple[torch.Tensor, int, int]]:
        """(records, kind, rows) of each record array, in output order."""
        return [(getattr(self, "packed" if i == 0 else f"packed_{i}"), kind, rows)
                for i, (kind, rows) in enumerate(zip(self.kinds, self.segment_rows, strict=True))]

    def add_dense(self, dtype: torch.dtype, min_tokens: int) -> int:
        """Keep a dense ``dtype`` copy (in oneDNN's layout where it packs) for steps of at least
        ``min_tokens`` tokens; returns its bytes."""
        dense = Linear(self.in_features, self.out_features, self.bias is not None, dtype)
        dense.weight.data = self.dequantize(dtype)
        if self.bias is not None and dense.bias is not None:
            dense.bias.data = self.bias.data.to(dtype)
        dense.pack(keep_plain=False)
        self.dense, self.dense_min_tokens = dense, min_tokens
        held = dense._packed if dense._packed is not None else dense.weight
        return held.numel() * held.element_size()

    def drop_dense(self) -> None:
        self.dense, self.dense_min_tokens = None, 0

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The float [out, in] weight."""
        return torch.cat([quant_layout.dequantize_packed(records, rows, kind, dtype)
                          for records, kind, rows in self.segments()])

    @property
    def weight_q(self) -> QuantizedWeight:
        """The weight as ``QuantizedWeight`` arrays (a single 4- or 8-bit record array only)."""
        if len(self.kinds) != 1 or self.kind not in (4, 8):
            raise ValueError(f"a weight of records of kinds {self.kinds} has no QuantizedWeight form; use dequantize()")
        full = deinterleave(self.packed, self.kind)
        return full.rows(torch.arange(self.out_features)) if full.shape[0] != self.out_features else full

    def dequantize_rows(self, index: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """The float weight of the selected output rows [len(index), in] (embedding lookups):
        only those rows are decoded."""
        if len(self.kinds) != 1:
            return self.dequantize(dtype)[index]
        return quant_layout.dequantize_records(self.packed[index // quant_layout.BLOCK_ROWS], self.kind,
                                               index % quant_layout.BLOCK_ROWS, dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.dense is not None and x.shape[0] >= self.dense_min_tokens:
            return self.dense(x)
        if self.tile_min_tokens and x.shape[0] >= self.tile_min_tokens and x.device.type == "cpu":
            return self._on_tiles(x)
        if len(self.kinds) == 1:
            y = torch.ops.radixgen.quant_linear.default(x, self.packed, self.out_features, self.kind)
        else:
            y = torch.cat([torch.ops.radixgen.quant_linear.default(x, records, rows, kind)
                           for records, kind, rows in self.segments()], dim=-1)
        return y if self.bias is None else y + self.bias

    def _on_tiles(self, x: torch.Tensor) -> torch.Tensor:
        dtype, block_rows = self.tile_dtype, quant_layout.BLOCK_ROWS
        xt = x.to(dtype)
        blocks_per_tile = max(1, TILE_BYTES // (self.in_features * block_rows * dtype.itemsize))
        runs = [(records, kind, begin, min(records.shape[0], begin + blocks_per_tile), rows)
                for records, kind, rows in self.segments()
                for begin in range(0, records.shape[0], blocks_per_tile)]
        # one run: its product is the output; several: each product goes into its columns at once,
        # so at most one run's product is held beside the output
        y = None if len(runs) == 1 else torch.empty(x.shape[0], self.out_features, dtype=x.dtype)
        column = 0
        for records, kind, begin, end, rows in runs:
            tile = _scratch.tile(self.in_features, (end - begin) * block_rows, dtype)
            torch.ops.radixgen.dequantize_records.default(records, kind, begin, end, tile)
            valid = min(rows, end * block_rows) - begin * block_rows
            product = xt @ tile[:, :valid]
            if y is None:
                y = product.to(x.dtype)
            else:
                y[:, column : column + valid] = product
            column += valid
        assert y is not None
        return y if self.bias is None else y + self.bias

    def pack(self, keep_plain: bool = True) -> None:
        """Quantized weights have no oneDNN layout (the decoder calls this on every linear)."""


class QuantizedEmbedding(nn.Module):
    """Embedding rows dequantized on lookup; the same buffers serve a tied LM head."""

    def __init__(self, weight: QuantizedWeight | PackedWeight) -> None:
        super().__init__()
        self.head = QuantizedLinear(weight, None)

    def forward(self, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        flat = ids.reshape(-1)
        return self.head.dequantize_rows(flat, dtype).view(*ids.shape, self.head.in_features)
