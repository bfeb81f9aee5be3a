"""Kernel choices by measurement (models/tuning.py): the selection logic with forced
capabilities and timings, the cache, and an engine running what was chosen."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import pytest
import torch

from radixgen import Engine, EngineConfig, SamplingParams
from radixgen.api.metrics import ServerMetrics
from radixgen.kernels import cpu_kernels
from radixgen.models import load_model, tuning
from radixgen.models.tuning import (
    CpuFeatures,
    Implementation,
    KernelChoices,
    OpChoice,
    choose,
    kernel_choices,
)

AVX2_ONLY = CpuFeatures("Test CPU", frozenset({"avx2", "fma"}))


def test_choose_never_times_what_cannot_run() -> None:
    timed: list[str] = []

    def time_ms(name: str) -> float:
        timed.append(name)
        return {"a": 2.0, "c": 1.0}[name]

    choice = choose("op", [Implementation("a"), Implementation("b", "needs AMX"), Implementation("c")], time_ms)
    assert choice.chosen == "c" and timed == ["a", "c"]
    assert choice.skipped == {"b": "needs AMX"} and choice.times_ms == {"a": 2.0, "c": 1.0}
    # the only runnable one is chosen without timing, even when listed after one that cannot run
    only = choose("op", [Implementation("fast", "needs AVX-512 BF16"), Implementation("slow")], time_ms)
    assert only.chosen == "slow" and only.times_ms == {} and timed == ["a", "c"]
    with pytest.raises(ValueError, match="no implementation of op runs here"):
        choose("op", [Implementation("x", "no")], time_ms)


def test_choose_keeps_the_rule_within_the_margin() -> None:
    near = {"rule": 1.0, "other": 1.0 - tuning.MARGIN / 2}
    assert choose("op", [Implementation("rule"), Implementation("other")], near.__getitem__).chosen == "rule"
    far = {"rule": 1.0, "other": 1.0 - 2 * tuning.MARGIN}
    assert choose("op", [Implementation("rule"), Implementation("other")], far.__getitem__).chosen == "other"


def test_small_linear_limit_is_the_largest_size_that_won_at_every_size_below() -> None:
    def choices(one: str, two: str) -> KernelChoices:
        return KernelChoices("cpu", [OpChoice("linear_1_token", one), OpChoice("linear_2_token", two)])

    assert choices("small_linear", "small_linear").small_linear_max_tokens(default=7) == 2
    assert choices("small_linear", "onednn").small_linear_max_tokens(default=7) == 1
    assert choices("onednn", "small_linear").small_linear_max_tokens(default=7) == 0
    assert KernelChoices("cpu", []).small_linear_max_tokens(default=7) == 7  # quantized: nothing timed


def test_cpu_features_label_names_the_flags_that_matter() -> None:
    features = CpuFeatures("Xeon", frozenset({"avx2", "amx_bf16", "amx_tile", "sse2"}))
    assert features.label() == "Xeon (avx2 amx_tile amx_bf16)"
    assert CpuFeatures("Old", frozenset({"sse2"})).label() == "Old (no AVX2)"
    detected = CpuFeatures.detect()
    if Path("/proc/cpuinfo").exists():
        assert detected.model_name != "unknown" and detected.flags


@pytest.fixture
def tuning_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("RADIXGEN_CACHE", str(tmp_path))
    return tmp_path / "tuning"


@pytest.fixture(scope="module")
def tiny_model(tiny_model_dir: Path) -> Any:
    return load_model(str(tiny_model_dir)).model


@pytest.mark.skipif(cpu_kernels() is None, reason="the native kernels do not build here")
def test_the_native_prefill_is_timed_where_it_runs_and_skipped_with_its_reason(tiny_model: Any) -> None:
    kernels = cpu_kernels()
    assert kernels is not None
    fp16 = tuning._choose_prefill(tiny_model, torch.float16, kernels)
    assert fp16.chosen == "sdpa" and "bfloat16 or float32" in fp16.skipped["native"]
    # a build without the float32 path (no AVX2): skipped with the reason, never timed or chosen
    without_avx2 = dataclasses.replace(kernels, prefill_attention_native=lambda dtype=None: dtype != torch.float32)
    fp32 = tuning._choose_prefill(tiny_model, torch.float32, without_avx2)
    assert fp32.chosen == "sdpa" and "AVX2" in fp32.skipped["native"] and fp32.times_ms == {}
    if kernels.prefill_attention_native(torch.float32):
        timed = tuning._choose_prefill(tiny_model, torch.float32, kernels)
        assert set(timed.times_ms) == {"native", "sdpa"} and not timed.skipped
    no_kernels = tuning._choose_decode(tiny_model, torch.float32, None)
    assert no_kernels.chosen == "sdpa" and "not built" in no_kernels.skipped["native"]


@pytest.mark.skipif(cpu_kernels() is None, reason="the native kernels do not build here")
def test_choices_are_measured_once_then_read_from_the_cache(tiny_model: Any, tuning_cache: Path) -> None:
    first = kernel_choices(tiny_model, torch.float32, cpu_kernels(), threads=1, features=AVX2_ONLY)
    assert first.measured and first.cpu == "Test CPU (avx2)"
    ops = [c.op for c in first.choices]
    assert ops == ["prefill_attention", "decode_attention", "linear_1_token", "linear_2_token"]
    decode = first.choices[1]
    assert set(decode.times_ms) == {"native", "sdpa"} and all(ms > 0 for ms in decode.times_ms.values())
    assert len(list(tuning_cache.glob("*.json"))) == 1
    again = kernel_choices(tiny_model, torch.float32, cpu_kernels(), threads=1, features=AVX2_ONLY)
    assert not again.measured and again.summary() == first.summary()
    # another machine (or thread count) is another entry, measured afresh
    other = kernel_choices(tiny_model, torch.float32, cpu_kernels(), threads=1,
                           features=CpuFeatures("Other CPU", frozenset({"avx2", "avx512f"})))
    assert other.measured and len(list(tuning_cache.glob("*.json"))) == 2
    rerun = kernel_choices(tiny_model, torch.float32, cpu_kernels(), threads=1, features=AVX2_ONLY, rerun=True)
    assert rerun.measured


@pytest.mark.skipif(cpu_kernels() is None, reason="the native kernels do not build here")
def test_kernels_built_or_dispatched_for_another_instruction_set_are_measured_afresh(
    tiny_model: Any, tuning_cache: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    from radixgen import kernels

    native_build = kernels._build_dir()
    kernel_choices(tiny_model, torch.float32, cpu_kernels(), threads=1, features=AVX2_ONLY)
    monkeypatch.setenv("RADIXGEN_KERNELS_MARCH", "x86-64-v3")
    assert "-march=x86-64-v3" in kernels._cflags() and kernels._build_dir() != native_build
    assert kernel_choices(tiny_model, torch.float32, cpu_kernels(), threads=1, features=AVX2_ONLY).measured
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX2")
    assert kernel_choices(tiny_model, torch.float32, cpu_kernels(), threads=1, features=AVX2_ONLY).measured
    assert len(list(tuning_cache.glob("*.json"))) == 3


@pytest.mark.skipif(cpu_kernels() is None, reason="the native kernels do not build here")
def test_an_engine_runs_what_was_chosen(
    tiny_model_dir: Path, tuning_cache: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("RADIXGEN_TUNE_KERNELS", "1")
    params = SamplingParams(max_new_tokens=6, temperature=0, ignore_eos=True)
    config = EngineConfig(model=str(tiny_model_dir), kv_cache_tokens=2048, max_context_len=256)
    with Engine(config) as engine:
        measured = engine.info()["kernels"]
        assert set(measured) == {"prefill_attention", "decode_attention", "linear_1_token", "linear_2_token"}
        reference = engine.generate([5, 6, 7, 8], params).token_ids
    # force the other decode path and no small linears through the cache the engine reads
    [entry] = tuning_cache.glob("*.json")
    data = json.loads(entry.read_text())
    for choice in data["choices"]:
        choice["chosen"] = {"decode_attention": "sdpa", "linear_1_token": "onednn",
                            "linear_2_token": "onednn"}.get(choice["op"], choice["chosen"])
    entry.write_text(json.dumps(data))
    with Engine(config) as engine:
        runner = engine.runner
        assert engine.info()["kernels"]["decode_attention"] == "sdpa"
        assert runner.attention.decode_kernel is None
        assert all(m.small_linear_max_tokens == 0 for m in runner.model.modules() if hasattr(m, "_packed"))
        out = engine.generate([5, 6, 7, 8], params).token_ids
    assert out == reference  # the same greedy tokens through the other implementations


def test_metrics_show_the_chosen_kernels() -> None:
    metrics = ServerMetrics()
    metrics.set_kernels({"prefill_attention": "sdpa", "decode_attention": "native"})
    body = metrics.render(None).decode()
    assert 'radixgen_kernel_info{implementation="sdpa",op="prefill_attention"} 1.0' in body
    assert 'radixgen_kernel_info{implementation="native",op="decode_attention"} 1.0' in body
    assert "radixgen_kernel_info" not in ServerMetrics().render(None).decode()
    metrics.set_weights("4-bit blocks (211 linears)")
    assert 'radixgen_weights_info{weights="4-bit blocks (211 linears)"} 1.0' in metrics.render(None).decode()


@pytest.mark.skipif(cpu_kernels() is None, reason="the native kernels do not build here")
def test_radixgen_tune_prints_and_caches_the_choices(
    tiny_model_dir: Path, tuning_cache: Path, capsys: pytest.CaptureFixture[str],
) -> None:
    from radixgen.cli import main

    assert main(["tune", "--model", str(tiny_model_dir), "--num-threads", "1"]) == 0
    out = capsys.readouterr().out
    assert "1 threads, float32" in out
    for op in ("prefill_attention", "decode_attention", "linear_1_token"):
        assert op in out
    prefill = next(line for line in out.splitlines() if line.startswith("prefill_attention"))
    kernels = cpu_kernels()
    if kernels is not None and kernels.prefill_attention_native(torch.float32):
        assert " ms" in prefill.split("native", 1)[1] and "sdpa " in prefill  # both timed
    else:
        assert "native skipped:" in prefill
    assert len(list(tuning_cache.glob("*.json"))) == 1


def test_large_steps_run_from_the_smallest_size_where_the_largest_sizes_winner_won_throughout() -> None:
    def choices(*chosen: str) -> KernelChoices:
        return KernelChoices("cpu", [OpChoice(f"quant_linear_{size}_tokens", name)
                                     for size, name in zip((32, 64, 128, 512)[:len(chosen)], chosen, strict=True)])

    assert choices("dense", "dense", "dense").quant_large_steps() == ("dense", 32)
    assert choices("blocks", "tiles_bfloat16", "tiles_bfloat16").quant_large_steps() == ("tiles_bfloat16", 64)
    assert choices("tiles_bfloat16", "dense", "tiles_bfloat16").quant_large_steps() == ("tiles_bfloat16", 128)
    assert choices("dense", "dense", "blocks").quant_large_steps() is None
    assert choices("blocks", "blocks", "blocks").quant_large_steps() is None
    assert KernelChoices("cpu", []).quant_large_steps() is None  # float weights: nothing timed
    # the prefill chunk (512, timed without the head) counts only where the blocks won the decode sizes
    assert choices("blocks", "blocks", "blocks", "tiles_float32").quant_large_steps() == ("tiles_float32", 512)
    assert choices("blocks", "tiles_bfloat16", "tiles_bfloat16", "tiles_float32").quant_large_steps() == \
        ("tiles_bfloat16", 64)
    assert choices("dense", "dense", "dense", "dense").quant_large_steps() == ("dense", 32)
    assert choices("blocks", "blocks", "blocks", "blocks").quant_large_steps() is None


def test_a_quantized_linear_runs_large_steps_on_its_dense_copy_and_small_ones_on_its_blocks(
        tiny_model_dir: Path) -> None:
    from radixgen.models.quantized import QuantizedLinear

    model = load_model(str(tiny_model_dir), weights="int4").model
    linear = next(m for m in model.modules() if isinstance(m, QuantizedLinear))
    generator = torch.Generator().manual_seed(0)
    small, large = (torch.randn(n, linear.in_features, generator=generator) for n in (3, 8))
    on_blocks = linear(small)
    held = linear.add_dense(torch.float32, min_tokens=8)
    assert held >= linear.out_features * linear.in_features * 4
    assert torch.equal(linear(small), on_blocks), "below the threshold the blocks still serve"
    dense = large @ linear.weight_q.dequantize(torch.float32).T
    if linear.bias is not None:
        dense = dense + linear.bias
    torch.testing.assert_close(linear(large), dense, rtol=1e-5, atol=1e-5)
    linear.drop_dense()
    assert linear.dense is None


@pytest.mark.skipif(cpu_kernels() is None, reason="the native kernels do not build here")
def test_quantized_weights_are_timed_against_a_dense_copy_and_the_engine_says_what_it_holds(
    tiny_model_dir: Path, tuning_cache: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    from radixgen.models.quantized import QuantizedLinear

    monkeypatch.setenv("RADIXGEN_TUNE_KERNELS", "1")
    config = EngineConfig(model=str(tiny_model_dir), weights="int4", kv_cache_tokens=2048, max_context_len=256)
    params = SamplingParams(max_new_tokens=4, temperature=0, ignore_eos=True)
    with Engine(config) as engine:
        kernels = engine.info()["kernels"]
        assert {"quant_linear_32_tokens", "quant_linear_128_tokens"} <= set(kernels)
        assert "linear_1_token" not in kernels, "no plain weights to time"
    [entry] = tuning_cache.glob("*.json")
    data = json.loads(entry.read_text())
    timed = [c for c in data["choices"] if c["op"].startswith("quant_linear_")]
    every = {"blocks", "tiles_bfloat16", "tiles_float32", "dense"}
    assert set(timed[0]["times_ms"]) == every, "the smallest size times them all"
    for c in timed[1:]:  # later ones leave out what lost hopelessly before
        assert set(c["times_ms"]) | set(c["skipped"]) == every
        assert all(" against " in why for why in c["skipped"].values())
    for choice in timed:  # as if the dense copy had won from 32 tokens on
        choice["chosen"] = "dense"
    entry.write_text(json.dumps(data))
    with Engine(config) as engine:
        quantized = [m for m in engine.runner.model.modules() if isinstance(m, QuantizedLinear)]
        assert quantized and all(m.dense is not None and m.dense_min_tokens == 32 for m in quantized)
        assert "steps of 32+ tokens on a dense float32 copy" in engine.info()["weights"]
        assert engine.generate(list(range(5, 45)), params).completion_tokens == 4  # a 40-token prefill, dense
    for choice in timed:  # as if float32 tiles had won from 64 tokens on
        choice["chosen"] = "blocks" if choice["op"] == "quant_linear_32_tokens" else "tiles_float32"
    entry.write_text(json.dumps(data))
    scored = SamplingParams(max_new_tokens=1, temperature=0, prompt_logprob_start=1)
    long_prompt = list(range(5, 85))  # an 80-token prefill: on the tiles
    with Engine(config) as engine:
        quantized = [m for m in engine.runner.model.modules() if isinstance(m, QuantizedLinear)]
        assert quantized and all(m.dense is None and m.tile_min_tokens == 64 for m in quantized)
        assert "steps of 64+ tokens on float32 tiles decoded per step" in engine.info()["weights"]
        on_tiles = engine.generate(long_prompt, scored).prompt_logprobs
        for m in quantized:
            m.set_tiles(0, torch.float32)
        on_blocks = engine.generate(long_prompt, scored).prompt_logprobs
    assert on_tiles is not None and on_blocks is not None and len(on_tiles) == len(on_blocks) == 79
    assert on_tiles != on_blocks, "the tiles ran (their products round apart from the blocks')"
    assert max(abs(a - b) for a, b in zip(on_tiles, on_blocks, strict=True)) < 1e-2


@pytest.mark.skipif(cpu_kernels() is None, reason="the native kernels do not build here")
def test_an_implementation_hopelessly_slower_at_a_small_step_is_not_timed_at_the_larger_ones(
    tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """bfloat16 tiles where the CPU has no bf16 products: ~130x the blocks at 32 tokens, minutes of
    timing at the larger sizes; a float32 tile twice the blocks' time is still timed."""
    from radixgen.models.quantized import QuantizedLinear

    model = load_model(str(tiny_model_dir), weights="int4").model
    linear = next(m for m in model.modules() if isinstance(m, QuantizedLinear))

    def fake_ms(run: Any, repeats: int = 3) -> float:
        if linear.tile_min_tokens:
            return 130.0 if linear.tile_dtype == torch.bfloat16 else 2.0
        return 200.0 if linear.dense is not None else 1.0

    monkeypatch.setattr(tuning, "_timed_ms", fake_ms)
    with_bf16 = CpuFeatures("Test CPU", frozenset({"avx2", "avx512f", "avx512_bf16"}))
    choices = {c.op: c for c in tuning.measure(model, torch.float32, cpu_kernels(), with_bf16).choices}
    first, *later = (choices[f"quant_linear_{n}_tokens"] for n in tuning.QUANT_STEP_SIZES)
    assert set(first.times_ms) == {"blocks", "tiles_bfloat16", "tiles_float32", "dense"}
    for choice in later:
        assert set(choice.times_ms) == {"blocks", "tiles_float32"}, choice
        assert "130 ms against 1 at quant_linear_32_tokens" in choice.skipped["tiles_bfloat16"]
        assert "dense" in choice.skipped
    # without bf16 products the bf16 tiles are not timed at all
    for choice in tuning.measure(model, torch.float32, cpu_kernels(), AVX2_ONLY).choices:
        if choice.op.startswith("quant_linear"):
            assert "no bf16 dot-product" in choice.skipped["tiles_bfloat16"]
