"""The records ``quant_linear.cpp`` reads a quantized weight from, and the weight's values from them.

A weight quantized here arrives as three arrays (``qweight``: uint8 nibble pairs for 4 bits, int8
for 8; ``scales`` and, 4-bit, ``mins`` [out, in / 32] in float16; w = q * scale + min);
``interleave`` writes them as the kernel holds them: output rows in blocks of 16 (zero rows pad
the last one) and, per block and group of 32 inputs, one record of the 16 rows' quantized bytes,
then their float16 scales and (4-bit) minimums, so a step reads W front to back as one sequence:
uint8 [ceil(out / 16), in / 32, record bytes] (4-bit 320, 8-bit 544).

A GGUF's blocks are written by ``gguf_repack.cpp`` into records of the kind of their type (its
header and ``quant_records.h`` give the bytes): the same group records for Q4_1, Q5_1 (a plane of
high bits after the nibbles) and Q8_0, group records without minimums for Q4_0 and Q5_0, and
super-block records for the K-quants. ``dequantize_records`` reads every kind.
"""

from __future__ import annotations

import torch

GROUP = 32
BLOCK_ROWS = 16


def _chunks(bits: int) -> int:
    """32-byte chunks per group record: 4 bits, 8 (each byte two nibbles); 8 bits, 16."""
    return 8 if bits == 4 else 16


def interleave(qweight: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor, bits: int) -> torch.Tensor:
    out = qweight.shape[0]
    in_features = qweight.shape[1] * 8 // bits
    groups, chunks = in_features // GROUP, _chunks(bits)
    blocks = -(-out // BLOCK_ROWS)
    pad = blocks * BLOCK_ROWS - out

    def rows_padded(t: torch.Tensor) -> torch.Tensor:
        return torch.cat([t, t.new_zeros(pad, *t.shape[1:])]) if pad else t

    # 4 bits: byte 2c + j of a group holds elements 2c + j (low nibble) and 2c + j + 16 (high);
    # 8 bits: byte 2p + j is element 2p + j. Either way the record's chunk c takes byte pair c of
    # all 16 rows.
    q = rows_padded(qweight.view(torch.uint8)).view(blocks, BLOCK_ROWS, groups, chunks, 2)
    parts = [q.permute(0, 2, 3, 1, 4).reshape(blocks, groups, chunks * 2 * BLOCK_ROWS)]
    per_group = [scales]
    if bits == 4:
        per_group.append(mins if mins.numel() else torch.zeros_like(scales))
    for values in per_group:
        halves = rows_padded(values.to(torch.float16)).view(blocks, BLOCK_ROWS, groups).transpose(1, 2).contiguous()
        parts.append(halves.view(torch.uint8))
    return torch.cat(parts, dim=-1).contiguous()


def deinterleave(
    records: torch.Tensor, bits: int, rows: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(qweight, scales, mins) of the blocks in ``records`` [B, groups, record bytes]: all 16 rows
    of each (rows None: 16 B rows, padding included), or row ``rows[i]`` of block i."""
    blocks, groups, _ = records.shape
    chunks = _chunks(bits)
    qbytes = chunks * 2 * BLOCK_ROWS
    q = records[..., :qbytes].view(blocks, groups, chunks, BLOCK_ROWS, 2)
    per_group = [records[..., qbytes + i * 2 * BLOCK_ROWS : qbytes + (i + 1) * 2 * BLOCK_ROWS].contiguous()
                 .view(torch.float16) for i in range(2 if bits == 4 else 1)]  # [B, groups, 16] each
    if rows is None:
        q = q.permute(0, 3, 1, 2, 4).reshape(blocks * BLOCK_ROWS, groups * chunks * 2)
        per_group = [v.transpose(1, 2).reshape(blocks * BLOCK_ROWS, groups) for v in per_group]
    else:
        picked = torch.arange(blocks, device=records.device)
        q = q[picked, :, :, rows].reshape(blocks, groups * chunks * 2)
        per_group = [v[picked, :, rows] for v in per_group]
    qweight = q.contiguous() if bits == 4 else q.contiguous().view(torch.int8)
    mins = per_group[1] if bits == 4 else torch.empty(0, device=records.device)
    return qweight, per_group[0].contiguous(), mins.contiguous()


def dequantize(qweight: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor, bits: int,
               dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The float [out, in] weight: w = q * scale + min."""
    out = qweight.shape[0]
    in_features = qweight.shape[1] * 8 // bits
    groups = in_features // GROUP
    if bits == 4:
        nibbles = qweight.view(out, groups, GROUP // 2)
        q = torch.cat([nibbles & 0x0F, nibbles >> 4], dim=-1).float()
    else:
        q = qweight.view(out, groups, GROUP).float()
    w = q * scales.float()[..., None]
    if mins.numel():
        w = w + mins.float()[..., None]
    return w.view(out, in_features).to(dtype)


SUPER, OFFSET = 100, 200
"""Record kinds (quant_records.h): 4, 5 and 8 are group records of that many bits; OFFSET + bits
group records whose minimum is the scale times -2^(bits - 1), not stored (Q4_0, Q5_0); SUPER + bits
super-block records (the K-quants)."""
SUPER_GROUPS = 8
K4, K5, K6 = SUPER + 4, SUPER + 5, SUPER + 6
"""The record kinds of Q4_K, Q5_K and Q6_K."""
OFFSET4, OFFSET5 = OFFSET + 4, OFFSET + 5
"""The record kinds of Q4_0 and Q5_0."""


def is_super(kind: int) -> bool:
    return kind // 100 == SUPER // 100


def is_offset(kind: int) -> bool:
    return kind // 100 == OFFSET // 100


def value_bits(kind: int) -> int:
    return kind % 100


def record_bytes(kind: int) -> int:
    """Bytes per block of 16 rows and group of 32 inputs: the records' last dimension (super-block
    records: an eighth of one)."""
    if is_super(kind):
        return super_bytes(kind) // SUPER_GROUPS
    return quant_bytes(kind) + (1 if kind == 8 or is_offset(kind) else 2) * 2 * BLOCK_ROWS


def quant_bytes(kind: int) -> int:
    """Bytes of one group's integers for 16 rows."""
    bits = value_bits(kind)
    return 512 if bits == 8 else 256 + 64 * (bits - 4)


def super_scale_bytes(kind: int) -> int:
    return 32 if value_bits(kind) == 6 else 24


def super_bytes(kind: int) -> int:
    head = 2 * BLOCK_ROWS * (1 if value_bits(kind) == 6 else 2)
    return SUPER_GROUPS * (quant_bytes(kind) + super_scale_bytes(kind)) + head


def _lanes(part: torch.Tensor, rows: torch.Tensor | None) -> torch.Tensor:
    """A record part of 32-byte chunks [B, G, chunks * 32] as [B, G, chunks, R, 2]: every row's byte
    pair (R = 16), or row ``rows[i]`` of block i (R = 1)."""
    blocks, groups, size = part.shape
    lanes = part.reshape(blocks, groups, size // 32, BLOCK_ROWS, 2)
    if rows is None:
        return lanes
    return lanes[torch.arange(blocks, device=part.device), :, :, rows].unsqueeze(3)


def _halves(part: torch.Tensor) -> torch.Tensor:
    """A record's float16 vector [B, G, 32 bytes] as float32 [B, G, 16]."""
    return part.contiguous().view(torch.float16).float()


_DECODE_BLOCKS = 64
"""Blocks decoded at a time: the integer and float temporaries of a whole LM head were several
times its float size."""


def dequantize_records(records: torch.Tensor, kind: int, rows: torch.Tensor | None = None,
                       dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The float weight rows of ``records`` [B, groups, record bytes] of any kind: all 16 rows of
    each block ([B * 16, in], padding included), or row ``rows[i]`` of block i ([B, in])."""
    blocks, groups, _ = records.shape
    if blocks <= _DECODE_BLOCKS:
        return _decode(records, kind, rows, dtype)
    per_block = 1 if rows is not None else BLOCK_ROWS
    out = torch.empty(blocks * per_block, groups * GROUP, dtype=dtype, device=records.device)
    for start in range(0, blocks, _DECODE_BLOCKS):
        end = min(start + _DECODE_BLOCKS, blocks)
        out[start * per_block : end * per_block] = _decode(
            records[start:end], kind, None if rows is None else rows[start:end], dtype)
    return out


def _decode(records: torch.Tensor, kind: int, rows: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
    blocks, groups, _ = records.shape
    bits, qbytes = value_bits(kind), quant_bytes(kind)
    if is_super(kind):  # 8 groups' values, their scale parts, the rows' float16 factors
        scale_bytes = super_scale_bytes(kind)
        whole = records.reshape(blocks, groups // SUPER_GROUPS, super_bytes(kind))
        values = whole[..., : SUPER_GROUPS * qbytes].reshape(blocks, groups, qbytes)
        parts = whole[..., SUPER_GROUPS * qbytes : SUPER_GROUPS * (qbytes + scale_bytes)]
        first, second = _super_factors(parts.reshape(blocks, -1, SUPER_GROUPS, scale_bytes),
                                       whole[..., SUPER_GROUPS * (qbytes + scale_bytes) :], bits)
    else:
        values = records[..., :qbytes]
        first = _halves(records[..., qbytes : qbytes + 32])
        if is_offset(kind):
            second = first * -float(2 ** (bits - 1))
        else:
            second = _halves(records[..., qbytes + 32 : qbytes + 64]) if bits != 8 else torch.zeros_like(first)
    if rows is not None:
        picked = torch.arange(blocks, device=records.device)
        first, second = first[picked, :, rows].unsqueeze(-1), second[picked, :, rows].unsqueeze(-1)
    if bits == 8:  # chunk p holds elements 2p, 2p + 1
        q = _lanes(values, rows).view(torch.int8).permute(0, 1, 3, 2, 4)
        q = q.reshape(blocks, groups, q.shape[2], GROUP).float()
    else:  # chunk c: low nibbles are elements 2c + j, high nibbles 2c + j + 16
        nibbles = _lanes(values[..., :256], rows).to(torch.int32)
        low, high = nibbles & 0x0F, nibbles >> 4
        if bits != 4:
            extra, shared = bits - 4, (2 if bits == 5 else 4)
            chunk = torch.arange(8, device=records.device)
            upper = _lanes(values[..., 256:qbytes], rows).to(torch.int32)[:, :, chunk % shared]
            upper = upper >> ((chunk // shared) * 2 * extra).view(1, 1, 8, 1, 1)
            mask = (1 << extra) - 1
            low = low | ((upper & mask) << 4)
            high = high | (((upper >> extra) & mask) << 4)
        halves = [v.permute(0, 1, 3, 2, 4).reshape(blocks, groups, v.shape[3], GROUP // 2) for v in (low, high)]
        q = torch.cat(halves, dim=-1).float()
        if bits == 6:
            q = q - 32
    scale = first[..., None]
    if bits == 6:  # elements 16..31 have a scale of their own
        scale = torch.cat([scale.expand(-1, -1, -1, GROUP // 2), second[..., None].expand(-1, -1, -1, GROUP // 2)],
                          dim=-1)
    w = q * scale
    if bits in (4, 5):
        w = w + second[..., None]
    return w.permute(0, 2, 1, 3).reshape(-1, groups * GROUP).to(dtype)


def _super_factors(parts: torch.Tensor, head: torch.Tensor, bits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A super-block record's group factors (quant_records.h's ``group_factors``), float32 [B, G, 16]
    each, from its scale parts [B, S, 8, part bytes] and float16 factors [B, S, head bytes]."""
    blocks, supers = parts.shape[:2]
    factors = head.contiguous().view(torch.float16).float()[:, :, None, :]  # [B, S, 1, 16 or 32]
    if bits == 6:
        codes = parts.contiguous().view(torch.int8).float()
        first, second = factors * codes[..., :BLOCK_ROWS], factors * codes[..., BLOCK_ROWS:]
    else:
        row = torch.arange(BLOCK_ROWS, device=parts.device)
        p = parts.to(torch.int32)
        low, upper = p[..., :BLOCK_ROWS], p[..., BLOCK_ROWS + row % 8] >> (4 * (row // 8))

        def code(field: int) -> torch.Tensor:  # quant_records.h's super_code
            return ((low >> (4 * field)) & 0xF) | ((upper >> (2 * field)) & 3) << 4

        first = factors[..., :BLOCK_ROWS] * code(0).float()
        second = factors[..., BLOCK_ROWS:] * (-code(1)).float()
    return first.reshape(blocks, supers * SUPER_GROUPS, BLOCK_ROWS), \
        second.reshape(blocks, supers * SUPER_GROUPS, BLOCK_ROWS)


def dequantize_packed(packed: torch.Tensor, out_features: int, kind: int, dtype: torch.dtype) -> torch.Tensor:
    """The float [out_features, in] weight of a weight held in records of ``kind``."""
    return dequantize_records(packed, kind, dtype=dtype)[:out_features]
