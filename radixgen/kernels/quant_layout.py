"""The layout ``quant_linear.cpp`` reads a 4- or 8-bit weight in, and the weight's values from it.

A weight arrives as three arrays (``qweight``: uint8 nibble pairs for 4 bits, int8 for 8;
``scales`` and, 4-bit, ``mins`` [out, in / 32] in float16; w = q * scale + min), as GGUF's
blocks map onto them. The kernel holds it as output rows in blocks of 16 (zero rows pad the last
one) and, per block and group of 32 inputs, one record of the 16 rows' quantized bytes, then
their float16 scales and (4-bit) minimums, so a step reads W front to back as one sequence:
uint8 [ceil(out / 16), in / 32, record bytes] (4-bit 320, 8-bit 544).
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


def dequantize_packed(packed: torch.Tensor, out_features: int, bits: int, dtype: torch.dtype) -> torch.Tensor:
    """The float [out_features, in] weight of a weight held in the kernel's layout."""
    return dequantize(*deinterleave(packed, bits), bits, dtype)[:out_features]
