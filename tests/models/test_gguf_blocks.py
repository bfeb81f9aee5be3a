"""GGUF block types run as they are: each supported type's blocks, written into the kernel's
records by ``gguf_repack``, hold exactly the values the gguf package's own dequantizer gives, and ``quant_linear`` over them agrees with a float linear over those values. Random bytes
make the blocks (only their float16 fields are set to plausible scales), so every bit pattern of
the quantized values is covered, not only what a quantizer writes."""

from __future__ import annotations

import struct
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from radixgen.kernels import quant_layout
from radixgen.models.gguf_file import GGUFFile
from radixgen.models.gguf_weights import RECORD_KINDS
from radixgen.models.quantized import PackedWeight, QuantizedLinear

# byte offsets of each type's float16 fields inside a block
_HALVES = {"Q4_0": (0,), "Q4_1": (0, 2), "Q5_0": (0,), "Q5_1": (0, 2), "Q8_0": (0,), "Q4_K": (0, 2),
           "Q5_K": (0, 2), "Q6_K": (208,)}


def random_blocks(kind: str, rows: int, cols: int, seed: int) -> tuple[np.ndarray, torch.Tensor]:
    """Random raw blocks [rows, row bytes] of ``kind`` and their values by the gguf package."""
    import gguf

    qtype = gguf.GGMLQuantizationType[kind]
    block, block_bytes = gguf.GGML_QUANT_SIZES[qtype]
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, size=(rows, cols // block, block_bytes), dtype=np.uint8)
    for offset in _HALVES[kind]:
        halves = rng.uniform(0.002, 0.03, size=raw.shape[:2]).astype(np.float16)
        raw[..., offset : offset + 2] = halves.view(np.uint8).reshape(*raw.shape[:2], 2)
    raw = raw.reshape(rows, -1)
    values = gguf.quants.dequantize(raw, qtype).reshape(rows, cols).astype(np.float32)
    return raw, torch.from_numpy(values)


def _records(kernels: Any, kind: str, raw: np.ndarray, cols: int) -> PackedWeight:
    import gguf

    records = kernels.gguf_repack(torch.from_numpy(raw), int(gguf.GGMLQuantizationType[kind]), cols)
    return PackedWeight(records, RECORD_KINDS[kind], raw.shape[0])


@pytest.mark.parametrize("kind", list(RECORD_KINDS))
def test_repacked_blocks_hold_the_gguf_packages_values(kernels: Any, kind: str) -> None:
    raw, expected = random_blocks(kind, 37, 512, seed=len(kind))  # 37 rows: a padded last block of 16
    weight = _records(kernels, kind, raw, 512)
    assert weight.records.shape == (3, 16, quant_layout.record_bytes(weight.kind))
    got = quant_layout.dequantize_records(weight.records, weight.kind)
    assert not got[37:].any(), "padding rows are zero weights"
    got = got[:37]
    assert torch.equal(got, expected)
    linear = QuantizedLinear(weight, None)
    index = torch.tensor([36, 0, 17, 17, 5])
    assert torch.equal(linear.dequantize_rows(index, torch.float32), got[index])


@pytest.mark.parametrize("kind", list(RECORD_KINDS))
@pytest.mark.parametrize("tokens", [1, 2, 5, 40])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_kernel_over_each_block_type_equals_the_dequantized_linear(
    kernels: Any, kind: str, tokens: int, dtype: torch.dtype,
) -> None:
    raw, expected = random_blocks(kind, 70, 768, seed=tokens)
    linear = QuantizedLinear(_records(kernels, kind, raw, 768), None)
    x = torch.randn(tokens, 768, generator=torch.Generator().manual_seed(tokens)).to(dtype)
    reference = x.float() @ expected.T
    scale = reference.abs().amax() + 1
    # the activations' 16-bit rounding; bf16: the output's
    tolerance = 3e-4 if dtype == torch.float32 else 2e-2
    got = linear(x)
    assert got.dtype == dtype and ((got.float() - reference).abs() / scale).max() < tolerance
    alone = torch.cat([linear(x[i : i + 1]) for i in range(tokens)])
    assert torch.equal(got, alone), "a token's result does not depend on the tokens beside it"


def test_a_fused_weight_of_mixed_widths_runs_each_part_in_its_own_records(kernels: Any) -> None:
    """Q4_K queries beside Q4_0 / Q4_1 keys, a Q6_K value and a Q8_0 gate (the mixes Q4_K_M files
    hold): one output, in order, equal to the float linear over the concatenated values."""
    layout = [("Q4_K", 32), ("Q4_K", 8), ("Q4_0", 16), ("Q4_0", 8), ("Q4_1", 8), ("Q6_K", 8), ("Q8_0", 5)]
    parts = [(kind, *random_blocks(kind, rows, 512, seed=i)) for i, (kind, rows) in enumerate(layout)]
    linear = QuantizedLinear([_records(kernels, kind, raw, 512) for kind, raw, _ in parts], None)
    assert linear.kinds == (quant_layout.K4, quant_layout.OFFSET4, 4, quant_layout.K6, 8), \
        "neighbours of one record kind share records"
    assert linear.segment_rows == (40, 24, 8, 8, 5)
    expected = torch.cat([values for _, _, values in parts])
    x = torch.randn(3, 512)
    reference = x @ expected.T
    assert ((linear(x) - reference).abs().max() / (reference.abs().amax() + 1)) < 1.5e-3
    assert torch.equal(linear.dequantize(), expected)


def test_parts_written_one_after_another_into_an_arena_are_joined_without_a_copy(kernels: Any) -> None:
    """A query, key and value repacked one after another into the weights' arena are one record
    array by view; the same parts repacked apart are joined by a copy, with the same values."""
    import gguf

    from radixgen.host_memory import WeightArena

    k4 = quant_layout.K4
    layout = [("Q4_K", 32, 0), ("Q4_K", 16, 1), ("Q4_K", 16, 2)]
    raws = [random_blocks(kind, rows, 512, seed=seed)[0] for kind, rows, seed in layout]
    apart = QuantizedLinear([_records(kernels, kind, raw, 512) for (kind, _, _), raw in zip(layout, raws, strict=True)], None)
    arena = WeightArena(sum(rows // 16 * (512 // 32) * quant_layout.record_bytes(k4) for _, rows, _ in layout))
    parts = []
    for (type_name, rows, _), raw in zip(layout, raws, strict=True):
        records = arena.take((rows // 16, 16, quant_layout.record_bytes(k4)))
        assert records is not None
        kernels.gguf_repack_into(torch.from_numpy(raw), int(gguf.GGMLQuantizationType[type_name]), 512, records)
        parts.append(PackedWeight(records, k4, rows))
    joined = QuantizedLinear(parts, None)
    assert joined.kinds == (k4,) and arena.holds(joined.packed) and joined.packed.data_ptr() == arena.bytes.data_ptr()
    assert not arena.holds(apart.packed)
    assert torch.equal(joined.packed, apart.packed)


def _write_minimal_gguf(path: Path, tensors: list[tuple[str, list[int], int, bytes]]) -> None:
    """A GGUF v3 file: one metadata key, the given tensors (name, GGUF-order dims, type id, bytes)."""
    def string(text: str) -> bytes:
        data = text.encode()
        return struct.pack("<Q", len(data)) + data

    header = b"GGUF" + struct.pack("<IQQ", 3, len(tensors), 1)
    header += string("general.architecture") + struct.pack("<I", 8) + string("llama")
    offset, infos, blobs = 0, b"", b""
    for name, dims, type_id, data in tensors:
        infos += string(name) + struct.pack("<I", len(dims)) + b"".join(struct.pack("<Q", d) for d in dims)
        infos += struct.pack("<IQ", type_id, offset)
        padded = data + b"\0" * (-len(data) % 32)
        blobs += padded
        offset += len(padded)
    head = header + infos
    path.write_bytes(head + b"\0" * (-len(head) % 32) + blobs)


def test_the_file_reader_finds_each_tensor_and_refuses_a_cut_file(tmp_path: Path, kernels: Any) -> None:
    raw, expected = random_blocks("Q6_K", 4, 256, seed=3)
    norm = np.arange(256, dtype=np.float32)
    path = tmp_path / "two.gguf"
    _write_minimal_gguf(path, [("blk.0.ffn_down.weight", [256, 4], 14, raw.tobytes()),
                               ("blk.0.attn_norm.weight", [256], 0, norm.tobytes())])
    file = GGUFFile(path)
    assert file.architecture == "llama"
    info = file.tensors["blk.0.ffn_down.weight"]
    assert (info.shape, info.type_name) == ((4, 256), "Q6_K")
    assert torch.equal(file.raw(info.name), torch.from_numpy(raw))
    again = GGUFFile(path, file.to_index())  # a later start: the header is not walked again
    assert again.tensors == file.tensors and again.metadata == file.metadata

    cut = tmp_path / "cut.gguf"
    cut.write_bytes(path.read_bytes()[:-600])
    with pytest.raises(ValueError, match="cut short.*blk.0"):
        GGUFFile(cut)
    with pytest.raises(ValueError, match="cut short"):  # an index taken of the whole file is not trusted
        GGUFFile(cut, file.to_index())
    (tmp_path / "short.gguf").write_bytes(path.read_bytes()[:40])
    with pytest.raises(ValueError, match="corrupt or cut short"):
        GGUFFile(tmp_path / "short.gguf")
    (tmp_path / "other.gguf").write_bytes(b"PK\x03\x04" + bytes(100))
    with pytest.raises(ValueError, match="not a GGUF file"):
        GGUFFile(tmp_path / "other.gguf")


def test_a_block_type_without_a_kernel_is_held_as_8_bits_with_a_warning_and_an_unreadable_one_refused(
    tmp_path: Path, kernels: Any, caplog: pytest.LogCaptureFixture,
) -> None:
    """Q3_K (a Q3_K_M file's linears): dequantized by the gguf package and held as 8-bit blocks, with a
    warning naming the tensor and its cost; Q8_K (which the gguf package cannot read either): refused
    naming the tensor and the supported types."""
    import gguf

    from radixgen.models.gguf_weights import GGUFTensor
    from radixgen.models.quantized import QuantizedWeight

    q3 = np.random.default_rng(0).integers(0, 256, size=(4, 110), dtype=np.uint8)
    q3[:, 108:110] = np.frombuffer(np.full(4, 0.01, dtype=np.float16).tobytes(), dtype=np.uint8).reshape(4, 2)
    expected = gguf.quants.dequantize(q3, gguf.GGMLQuantizationType.Q3_K).reshape(4, 256)
    path = tmp_path / "odd.gguf"
    _write_minimal_gguf(path, [("blk.0.ffn_up.weight", [256, 4], int(gguf.GGMLQuantizationType.Q3_K), q3.tobytes()),
                               ("blk.0.ffn_gate.weight", [256, 4], int(gguf.GGMLQuantizationType.Q8_K),
                                bytes(4 * 292))])
    file = GGUFFile(path)
    with caplog.at_level("WARNING"):
        held = GGUFTensor(file, file.tensors["blk.0.ffn_up.weight"]).quantized(4)
    assert isinstance(held, QuantizedWeight) and held.bits == 8
    assert "blk.0.ffn_up.weight" in caplog.text and "Q3_K" in caplog.text and "MiB" in caplog.text
    step = np.abs(expected).max(axis=1, keepdims=True) / 127
    assert (np.abs(held.dequantize().numpy() - expected) <= step).all()
    with pytest.raises(ValueError, match=r"blk.0.ffn_gate.weight.*Q8_K.*supported: Q4_0"):
        GGUFTensor(file, file.tensors["blk.0.ffn_gate.weight"]).quantized(4)


@pytest.mark.parametrize("kind", list(RECORD_KINDS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_records_decode_into_a_transposed_tile_of_exactly_their_values(kernels: Any, kind: str, dtype: torch.dtype) -> None:
    """Blocks 1..2 of a 37-row weight (the second one padded) into a wider tile: the tile's columns
    are the rows' values (rounded to the tile's dtype as a cast rounds), and nothing past them is written."""
    raw, _ = random_blocks(kind, 37, 512, seed=3)
    weight = _records(kernels, kind, raw, 512)
    values = quant_layout.dequantize_records(weight.records, weight.kind)  # [48, 512], padding rows zero
    tile = torch.full((512, 40), 7.0, dtype=dtype)
    kernels.dequantize_records(weight.records, weight.kind, 1, 3, tile)
    assert torch.equal(tile[:, :32], values[16:48].T.to(dtype))
    assert (tile[:, 32:] == 7).all()
    with pytest.raises(RuntimeError, match="block range"):
        kernels.dequantize_records(weight.records, weight.kind, 2, 4, tile)


def test_a_linear_on_decoded_tiles_equals_the_dequantized_linear_and_splits_a_large_weight(
    kernels: Any, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Mixed widths, a bias, and tiles smaller than the weight (runs of rows): float32 tiles agree
    with the float linear to float32 rounding, bfloat16 ones to bfloat16's; small steps stay on the blocks."""
    from radixgen.models import quantized

    layout = [("Q4_K", 40), ("Q6_K", 24), ("Q8_0", 5)]
    parts = [random_blocks(kind, rows, 512, seed=i) for i, (kind, rows) in enumerate(layout)]
    bias = torch.randn(69)
    linear = QuantizedLinear([_records(kernels, kind, raw, 512) for (kind, _), (raw, _) in zip(layout, parts, strict=True)],
                             bias)
    expected = linear.dequantize()
    x = torch.randn(20, 512, generator=torch.Generator().manual_seed(0))
    reference = x @ expected.T + bias
    small = x[:3]
    on_blocks = linear(small)
    monkeypatch.setattr(quantized, "TILE_BYTES", 512 * 16 * 4)  # one block of 16 rows per tile
    for dtype, tolerance in ((torch.float32, 1e-5), (torch.bfloat16, 2e-2)):
        linear.set_tiles(8, dtype)
        got = linear(x)
        assert got.dtype == torch.float32 and got.shape == (20, 69)
        assert ((got - reference).abs().max() / reference.abs().max()) < tolerance
        assert torch.equal(linear(small), on_blocks), "a step below the threshold runs on the blocks"
    with pytest.raises(ValueError, match="float32 or bfloat16"):
        linear.set_tiles(8, torch.float16)


def test_each_thread_decodes_into_a_tile_buffer_of_its_own() -> None:
    """Two engines in one process step on two threads: their tiles must not share memory."""
    import threading

    from radixgen.models import quantized

    tiles: list[torch.Tensor] = []  # held, so no buffer is freed and its address reused
    threads = [threading.Thread(target=lambda: tiles.append(quantized._scratch.tile(64, 32, torch.float32)))
               for _ in range(2)]
    for t in threads:
        t.start()
        t.join()
    tiles.append(quantized._scratch.tile(64, 32, torch.float32))
    assert len({tile.data_ptr() for tile in tiles}) == 3
