"""The engine on a CUDA GPU (skipped without one; ``benchmarks/gpu_check.py`` runs them): the
model's logits against transformers on the same GPU, the Triton kernels against the reference
backend, greedy outputs equal to the CPU engine's, a constrained batch, an abort, and the KV
invariant after each (``make_engine`` checks it)."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import pytest
import torch

from radixgen import Engine, EngineConfig, SamplingParams
from radixgen.engine.output import FinishReason
from tests.conftest import FinalOutputs, make_tiny_hf_model

pytestmark = pytest.mark.cuda

PROMPTS = ["The capital of France is", "Once upon a time", "def fibonacci(n):", "1, 2, 3, 4,"]


def _greedy(n: int, **kw: Any) -> SamplingParams:
    return SamplingParams(max_new_tokens=n, temperature=0, ignore_eos=True, **kw)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_logits_match_transformers_on_the_gpu(dtype: torch.dtype, backend: str) -> None:
    from radixgen.models import ModelConfig, build_model
    from tests.models.harness import PoolHarness

    hf = make_tiny_hf_model("llama", seed=3).to("cuda", dtype)
    ours = build_model(ModelConfig.from_hf(hf.config), hf.state_dict(), dtype=dtype, device="cuda")
    ids = torch.randint(3, 49152, (60,), generator=torch.Generator().manual_seed(0)).tolist()
    with torch.no_grad():
        ref = hf(torch.tensor([ids], device="cuda")).logits[0].float().cpu()
    harness = PoolHarness(ours, attention=backend, device="cuda")
    (prefill,) = harness.extend([(0, ids[:50])])
    steps = [harness.extend([(0, [t])])[0] for t in ids[50:]]
    got = torch.cat([prefill, *steps])
    atol = 2e-4 if dtype == torch.float32 else 0.15
    torch.testing.assert_close(got, ref, atol=atol, rtol=0)


def test_triton_kernels_match_the_reference_on_the_gpu() -> None:
    from tests.models import test_attention_backends as cases

    for case in cases.CASES:
        for shape in cases.SHAPES:
            for layer in cases.LAYERS:
                for dtype in (torch.float32, torch.bfloat16):
                    cases.check_triton_against_reference(case, shape, layer, dtype, device="cuda")


def test_greedy_outputs_equal_the_cpu_engine(make_engine: Callable[..., Engine]) -> None:
    cpu = make_engine(dtype="float32")
    gpu = make_engine(device="cuda", dtype="float32")
    assert gpu.runner.attention.name == "triton"
    want = [o.token_ids for o in cpu.generate(PROMPTS, _greedy(24))]
    assert [o.token_ids for o in gpu.generate(PROMPTS, _greedy(24))] == want
    # one at a time too: batch composition must not change a row's result
    assert gpu.generate(PROMPTS[1], _greedy(24)).token_ids == want[1]


def test_defaults_on_the_gpu(make_engine: Callable[..., Engine]) -> None:
    engine = make_engine(device="cuda")
    assert engine.runner.pool.k.dtype == torch.bfloat16, "bfloat16 is CUDA's default dtype"
    assert engine.runner.pool.k.is_cuda and engine.runner.pool.req_to_token.is_cuda
    assert EngineConfig(device="cuda").model_dtype == "bfloat16"


def test_a_constrained_batch_on_the_gpu(make_engine: Callable[..., Engine]) -> None:
    engine = make_engine(device="cuda")
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                               "age": {"type": "integer"}}, "required": ["name", "age"]}
    outs = engine.generate(PROMPTS, [SamplingParams(max_new_tokens=64, temperature=0.8, seed=i, json_schema=schema)
                                     for i in range(len(PROMPTS))])
    for out in outs:
        value = json.loads(out.text)
        assert set(value) == {"name", "age"} and isinstance(value["age"], int)


def test_an_abort_on_the_gpu_frees_everything(make_engine: Callable[..., Engine]) -> None:
    engine = make_engine(device="cuda")
    outputs = FinalOutputs()
    started, finals = outputs.started, outputs.finals

    running = engine.add_request(PROMPTS[0], _greedy(900), on_output=outputs)
    assert started.wait(60)
    engine.abort(running.request_id)
    outputs.wait_for(1)
    assert finals[running.request_id].finish_reason is FinishReason.ABORT


@pytest.mark.parametrize("overlap", [False, True])
def test_greedy_outputs_equal_with_cuda_graphs_on_and_off(make_engine: Callable[..., Engine], overlap: bool) -> None:
    eager = make_engine(device="cuda", dtype="float32", cuda_graphs=False, overlap=overlap)
    graphed = make_engine(device="cuda", dtype="float32", cuda_graph_max_batch=16, overlap=overlap)
    assert eager.runner.decode_runner.name == "eager" and graphed.runner.decode_runner.name == "cuda_graphs"
    for batch in (1, 3, 8, 9):  # 9 pads to 16: past a bucket boundary
        prompts = [PROMPTS[i % len(PROMPTS)] + " " * (i // len(PROMPTS)) for i in range(batch)]
        lengths = [_greedy(12 + 3 * i) for i in range(batch)]  # rows leave the batch one by one
        want = [o.token_ids for o in eager.generate(prompts, lengths)]
        assert [o.token_ids for o in graphed.generate(prompts, lengths)] == want, batch


def test_a_constrained_batch_inside_cuda_graphs(make_engine: Callable[..., Engine]) -> None:
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                               "age": {"type": "integer"}}, "required": ["name", "age"]}
    params = [SamplingParams(max_new_tokens=64, temperature=0, json_schema=schema), _greedy(20, regex=r"[a-z]{3,9}-\d{2}"),
              _greedy(24)]
    eager = make_engine(device="cuda", dtype="float32", cuda_graphs=False)
    graphed = make_engine(device="cuda", dtype="float32")
    want = eager.generate(PROMPTS[:3], params)
    got = graphed.generate(PROMPTS[:3], params)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    assert set(json.loads(got[0].text)) == {"name", "age"}


def test_graphs_captured_again_and_over_another_pool_replay_the_same_outputs(
        make_engine: Callable[..., Engine]) -> None:
    engine = make_engine(device="cuda", dtype="float32", cuda_graph_max_batch=8)
    runner = engine.runner.decode_runner
    assert runner.name == "cuda_graphs" and runner.capture_s > 0 and runner.graph_bytes >= 0  # type: ignore[attr-defined]
    want = [o.token_ids for o in engine.generate(PROMPTS, _greedy(16))]
    engine.run_on_loop(runner.capture)  # type: ignore[attr-defined]
    assert [o.token_ids for o in engine.generate(PROMPTS, _greedy(16))] == want
    other = make_engine(device="cuda", dtype="float32", cuda_graph_max_batch=8, kv_cache_tokens=1024)
    assert other.runner.pool.num_slots != engine.runner.pool.num_slots
    assert [o.token_ids for o in other.generate(PROMPTS, _greedy(16))] == want
