"""Weight-only quantized linears: the native kernel against a float reference built from the same
dequantized weights (exact values; the kernel rounds the activations to 16 bits per group of 32,
so float32 agrees within 3e-4 of the outputs' magnitude, the PyTorch path within 1e-4), the GGUF
block layouts, and whole models run quantized."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from radixgen.kernels import cpu_kernels, quant_layout
from radixgen.kernels import reference as fused_ops_reference
from radixgen.models.gguf_file import GGUFFile
from radixgen.models.gguf_weights import RECORD_KINDS
from radixgen.models.quantized import (
    QuantizedLinear,
    QuantizedWeight,
    deinterleave,
    interleave,
    quantize,
)


def _random_weight(bits: int, out: int, inp: int, seed: int) -> QuantizedWeight:
    return quantize(torch.randn(out, inp, generator=torch.Generator().manual_seed(seed)), bits)


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize(("out", "inp"), [(1, 32), (37, 96), (300, 576), (130, 1536)])
@pytest.mark.parametrize("tokens", [1, 2, 8, 64, 200])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernel_matches_the_dequantized_float_linear(kernels: Any, bits: int, out: int, inp: int, tokens: int,
                                                     dtype: torch.dtype) -> None:
    weight = _random_weight(bits, out, inp, seed=out + inp)
    bias = torch.randn(out).to(dtype)
    linear = QuantizedLinear(weight, bias)
    x = torch.randn(tokens, inp).to(dtype)
    reference = (x.float() @ weight.dequantize().T + bias.float())
    got = linear(x)
    assert got.dtype == dtype and got.shape == (tokens, out)
    scale = reference.abs().amax() + 1
    # float32: each activation is within 2^-16 of its group's largest (measured up to 1.3e-4 here,
    # a float GEMM 5e-7); bf16: the output's rounding
    tolerance = 3e-4 if dtype == torch.float32 else 2e-2
    assert ((got.float() - reference).abs() / scale).max() < tolerance
    # the op's PyTorch definition (other devices) agrees, to accumulation order
    torch_tolerance = 1e-4 if dtype == torch.float32 else tolerance
    defined = fused_ops_reference.quant_linear(x, linear.packed, out, bits) + bias
    torch.testing.assert_close(defined.float(), reference, atol=float(scale) * torch_tolerance, rtol=0)


@pytest.mark.parametrize("bits", [4, 8])
def test_a_tokens_result_does_not_depend_on_the_tokens_beside_it(kernels: Any, bits: int) -> None:
    """Bit for bit: greedy outputs must not change with the batch, and a speculative step's
    extend must give the logits the decode step would have."""
    linear = QuantizedLinear(_random_weight(bits, 300, 576, seed=bits), None)
    x = torch.randn(29, 576, generator=torch.Generator().manual_seed(1))
    alone = torch.cat([linear(x[i : i + 1]) for i in range(29)])
    for tokens in (2, 3, 5, 11, 12, 13, 29):  # passes of up to 12 tokens: one, one full, several
        assert torch.equal(linear(x[:tokens]), alone[:tokens]), tokens


@pytest.mark.parametrize("bits", [4, 8])
def test_the_kernel_layout_holds_the_weight_and_selects_rows(bits: int) -> None:
    """interleave / deinterleave round-trip with a padded last block (37 rows: 16 + 16 + 5), and the
    rows an embedding lookup selects are the weight's rows."""
    w = _random_weight(bits, 37, 96, seed=bits)
    packed = interleave(w)
    assert packed.shape == (3, 3, 320 if bits == 4 else 544) and packed.dtype == torch.uint8
    back = deinterleave(packed, bits)
    assert torch.equal(back.dequantize()[:37], w.dequantize())
    assert not back.dequantize()[37:].any(), "padding rows are zero weights"
    linear = QuantizedLinear(w, None)
    assert torch.equal(linear.weight_q.dequantize(), w.dequantize())
    index = torch.tensor([36, 0, 17, 17, 5])
    assert torch.equal(linear.dequantize_rows(index, torch.float32), w.rows(index).dequantize())


def test_quantization_error_is_within_a_step(kernels: Any) -> None:
    w = torch.randn(64, 256)
    for bits, steps in ((8, 127), (4, 15)):
        q = quantize(w, bits)
        groups = w.view(64, -1, 32)
        step = (groups.amax(-1) - groups.amin(-1)) / steps if bits == 4 else groups.abs().amax(-1) / steps
        # the stored scale is the step rounded to float16 (4 bits: measured from the minimum
        # rounded to float16), and the integers are rounded against it
        stored = q.scales.float()
        assert q.scales.dtype == torch.float16 and ((stored - step).abs() <= step * 2**-9).all()
        assert ((q.dequantize().view(64, -1, 32) - groups).abs() <= stored[..., None] * 0.5 + 1e-6).all()


def _gguf_blocks(kind: str, rows: int, cols: int, seed: int) -> tuple[np.ndarray, torch.Tensor]:
    """Random blocks of a GGUF type and their float values by the gguf package's own dequantizer."""
    import gguf

    floats = np.random.default_rng(seed).standard_normal((rows, cols)).astype(np.float32)
    qtype = gguf.GGMLQuantizationType[kind]
    blocks = gguf.quants.quantize(floats, qtype)
    return blocks, torch.from_numpy(gguf.quants.dequantize(blocks, qtype).reshape(rows, cols).astype(np.float32))


def _repacked(kernels: Any, kind: str, blocks: np.ndarray, rows: int) -> torch.Tensor:
    import gguf

    raw = torch.from_numpy(np.ascontiguousarray(blocks).view(np.uint8).reshape(rows, -1))
    cols = raw.shape[1] // gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[kind]][1] * 32
    records = kernels.gguf_repack(raw, int(gguf.GGMLQuantizationType[kind]), cols)
    return quant_layout.dequantize_packed(records, rows, RECORD_KINDS[kind], torch.float32)


@pytest.mark.parametrize("kind", ["Q4_0", "Q8_0"])
def test_gguf_blocks_repack_to_the_gguf_packages_values(kernels: Any, kind: str) -> None:
    blocks, expected = _gguf_blocks(kind, 12, 96, seed=1)
    assert torch.equal(_repacked(kernels, kind, blocks, 12), expected)


def test_q4_1_blocks_repack_to_the_bundled_files_values(kernels: Any, default_model_dir: Path) -> None:
    """Q4_1 (the bundled file's linears; the gguf package writes no Q4_1): the repacked weight
    equals the gguf package's dequantization of the same blocks."""
    import gguf

    from radixgen.models.loader import default_gguf_path

    tensor = next(t for t in gguf.GGUFReader(default_gguf_path()).tensors if t.name == "blk.3.ffn_down.weight")
    assert tensor.tensor_type.name == "Q4_1"
    rows, cols = int(tensor.shape[1]), int(tensor.shape[0])
    expected = gguf.quants.dequantize(np.asarray(tensor.data), tensor.tensor_type).reshape(rows, cols)
    assert torch.equal(_repacked(kernels, "Q4_1", np.asarray(tensor.data), rows), torch.from_numpy(expected))
    ours = GGUFFile(default_gguf_path())  # the file's own reader sees the same bytes
    assert torch.equal(ours.raw(tensor.name), torch.from_numpy(np.asarray(tensor.data).view(np.uint8).reshape(rows, -1)))


@pytest.mark.parametrize("kind", ["Q4_0"])  # Q8_0 blocks: the bundled file's embedding, tested below
def test_a_quantized_gguf_runs_quantized_and_equals_its_dequantized_float_copy(
    kind: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A tiny random Gemma 2 written as a Q4_0 GGUF: ``auto`` runs its blocks as they are (4 bits,
    embedding included; Gemma's stored 1 + w norms), ``float`` runs transformers' dequantization
    of the same file; the logits agree to the kernel's 16-bit rounding of the activations (within
    1e-3; logits reach the final cap of 30, and the float paths agree to ~1e-5). (A 2,048-token cut of the bundled
    vocabulary: transformers' reader takes seconds per read of the whole one.) Fields the reader does not read back take its
    defaults, which are the released models' values (caps 50 / 30, query scalar 256)."""
    from radixgen.models import load_model
    from radixgen.models.loader import default_gguf_path
    from tests.models.families import make_family_model
    from tests.models.gguf_writer import write_gguf
    from tests.models.harness import PoolHarness

    kernels = cpu_kernels()  # built (or found) in the real cache, not compiled again in the test's own
    monkeypatch.setenv("RADIXGEN_CACHE", str(tmp_path / "cache"))
    hf = make_family_model("gemma2", seed=9, vocab_size=2048, attn_logit_softcapping=50.0, final_logit_softcapping=30.0,
                           query_pre_attn_scalar=256)
    path = write_gguf(hf, tmp_path / f"tiny-{kind}.gguf", default_gguf_path(), linear_type=kind)
    quantized = load_model(path)
    assert isinstance(quantized.model.decoder_layers()[0].mlp.gate_up, QuantizedLinear)
    # every record array written straight into one arena sized for them (fused parts joined by view)
    arena = quantized.model.weight_arena
    assert arena is not None and arena.used == arena.bytes.numel()
    packed = [b for name, b in quantized.model.named_buffers() if name.rsplit(".", 1)[-1].startswith("packed")]
    assert packed and all(arena.holds(b) for b in packed)
    assert quantized.model.decoder_layers()[0].mlp.gate_up.kind == RECORD_KINDS[kind]
    dequantized = load_model(path, weights="float").model
    ids = list(range(7, 67))
    outs = [PoolHarness(m, attention_kernels=kernels).extend(
        [(0, ids)])[0] for m in (quantized.model, dequantized)]
    torch.testing.assert_close(outs[0], outs[1], atol=1e-3, rtol=0)
    # the converted folder stays a checkpoint other tools load: vLLM takes every top-level *.safetensors;
    # the blocks are read from the file at each start, never copied into the cache
    (folder,) = {p.parent for p in (tmp_path / "cache").rglob("config.json")}
    assert [f.name for f in folder.rglob("*.safetensors")] == ["model.safetensors"]
    (folder / "radixgen-gguf").mkdir()  # the copies earlier releases left: removed at the next start
    (folder / "radixgen-gguf" / "blocks.safetensors").write_bytes(b"")
    (folder / "gguf-blocks.safetensors").write_bytes(b"")
    again = load_model(path)
    assert not list(folder.rglob("*blocks.safetensors")), "the earlier releases' copies are cleaned up"
    assert torch.equal(again.model.lm_head.packed, quantized.model.lm_head.packed)



PROMPTS = ["Name three uses of a radix tree.", "Write a haiku about the sea.", "What is 17 times 3?",
           "Give me a packing list for a weekend hike.", "Explain what a KV cache is in one sentence."]


@pytest.mark.real_model
def test_the_bundled_model_runs_as_int4_close_to_its_dequantized_float_copy(tokenizer: Any) -> None:
    """The bundled Q4_1 file under ``weights=auto`` (its linears at 4 bits, the Q8_0 embedding
    and tied head at 8): logits within 5e-2 of the dequantized float32 model on chat prompts
    (measured ~1.6e-2: the kernel's 16-bit activations, where llama.cpp rounds them to 8 bits; a
    float kernel agreed to 1.5e-4; logits reach ~40), greedy tokens equal for the first 24 tokens of 5 chat
    prompts, JSON-schema output valid, and resident weights within 1.3x the file's size."""
    import json

    import jsonschema

    from radixgen import Engine, EngineConfig, SamplingParams
    from radixgen.models import load_model
    from radixgen.models.loader import default_gguf_path
    from tests.models.harness import PoolHarness

    quantized, dequantized = load_model(None), load_model(None, weights="float")
    layer = quantized.model.decoder_layers()[0]
    assert isinstance(layer.attn.qkv, QuantizedLinear) and layer.attn.qkv.kind == 4
    assert quantized.model.lm_head.kind == 8 and quantized.model.embed.numel() == 0  # no float copy
    assert quantized.model.weight_bytes() <= 1.3 * default_gguf_path().stat().st_size
    kernels = cpu_kernels()
    for prompt in PROMPTS[:2]:
        text = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                             tokenize=False)
        ids = tokenizer.encode(text, add_special_tokens=False)
        got, want = (PoolHarness(m.model, attention_kernels=kernels)
                     .extend([(0, ids)])[0] for m in (quantized, dequantized))
        torch.testing.assert_close(got, want, atol=5e-2, rtol=0)
    del dequantized
    engines = [Engine(EngineConfig(kv_cache_tokens=4096, max_context_len=1024, weights=w)) for w in ("auto", "float")]
    try:
        params = SamplingParams(max_new_tokens=24, temperature=0, ignore_eos=True)
        chats = [[{"role": "user", "content": p}] for p in PROMPTS]
        int4, fp32 = ([o.token_ids for o in e.generate([e.apply_chat_template(c) for c in chats], params)]
                      for e in engines)
        assert int4 == fp32
        schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}},
                  "required": ["city"], "additionalProperties": False}
        out = engines[0].generate(["The capital of France, as JSON:"],
                                  SamplingParams(max_new_tokens=32, temperature=0, json_schema=schema))[0]
        jsonschema.validate(json.loads(out.text), schema)
        stats = engines[0].kv_accounting()
        assert stats["held_by_requests"] == 0 and stats["free"] + stats["held_by_tree"] == stats["pool_size"]
    finally:
        for engine in engines:
            engine.shutdown()
