"""The decode runner behind every decode step (engine/graph_runner.py): buckets, padding to them
and cutting the pad rows off, on a CPU. The eager runner given buckets pads exactly as the CUDA
graphs do; the graph runner's static buffers and fixed-split metadata run here without
capturing (the Triton kernels in Triton's interpreter). Capture and replay are in test_cuda.py."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

from radixgen import Engine, SamplingParams
from radixgen.engine.graph_runner import (
    CudaGraphDecode,
    DecodeRunner,
    EagerDecode,
    decode_buckets,
    pad_decode,
)
from radixgen.engine.kv_pool import PAD_SLOT
from radixgen.engine.plan import StepKind, StepPlan

PROMPTS = ["The capital of France is", "Once upon a time", "def fibonacci(n):", "1, 2, 3, 4,", "Hello", "Dear"]


def _greedy(n: int, **kw: Any) -> SamplingParams:
    return SamplingParams(max_new_tokens=n, temperature=0, ignore_eos=True, **kw)


def _decode_plan(batch: int) -> StepPlan:
    rows = np.arange(3, 3 + batch, dtype=np.int64)
    positions = np.arange(10, 10 + batch, dtype=np.int64)
    return StepPlan(kind=StepKind.DECODE, requests=[object()] * batch, rows=rows,  # type: ignore[list-item]
                    prefix_lens=positions, extend_lens=np.ones(batch, dtype=np.int64),
                    input_ids=np.arange(100, 100 + batch, dtype=np.int64), positions=positions,
                    out_cache_loc=np.arange(50, 50 + batch, dtype=np.int64), batch_version=1)


def test_buckets_are_powers_of_two_then_steps_of_eight_up_to_the_cap() -> None:
    assert decode_buckets(32) == (1, 2, 4, 8, 16, 24, 32)
    assert decode_buckets(20) == (1, 2, 4, 8, 16, 20)
    assert decode_buckets(5) == (1, 2, 4, 5)
    assert decode_buckets(1) == (1,)


def test_padding_appends_rows_that_write_the_pad_slot_and_read_one_key() -> None:
    plan = _decode_plan(3)
    inputs = pad_decode(plan, 8)
    assert inputs.size == 8
    assert inputs.input_ids.tolist() == [100, 101, 102] + [0] * 5
    assert inputs.positions.tolist() == [10, 11, 12] + [0] * 5
    assert inputs.logits_index.tolist() == list(range(8))
    batch = inputs.batch
    assert batch.is_decode and batch.batch_size == 8
    assert batch.out_cache_loc.tolist() == [50, 51, 52] + [PAD_SLOT] * 5
    assert batch.rows.tolist() == [3, 4, 5] + [3] * 5
    assert batch.seq_lens.tolist() == [11, 12, 13] + [1] * 5
    # a full bucket is the plan's own arrays
    assert pad_decode(plan, 3).input_ids is plan.input_ids


def test_a_runner_takes_plain_decode_steps_up_to_its_largest_bucket() -> None:
    runner: DecodeRunner = EagerDecode(None, None, None, decode_buckets(16))  # type: ignore[arg-type]
    assert [runner.padded_size(_decode_plan(b)) for b in (1, 3, 8, 9, 16)] == [1, 4, 8, 16, 16]
    assert runner.padded_size(_decode_plan(17)) is None
    prefill = _decode_plan(2)
    prefill.kind = StepKind.PREFILL
    assert runner.padded_size(prefill) is None
    speculative = _decode_plan(2)
    speculative.kind, speculative.draft_lens = StepKind.SPECULATIVE, np.zeros(2, dtype=np.int64)
    assert runner.padded_size(speculative) is None
    assert EagerDecode(None, None, None).padded_size(_decode_plan(2)) is None, "no buckets: unpadded"  # type: ignore[arg-type]


def _use_runner(engine: Engine, make: Callable[[Engine], DecodeRunner]) -> list[int]:
    """Swap the engine's decode runner and record the row count of every forward it makes."""
    sizes: list[int] = []
    runner = engine.runner
    new = make(engine)
    real_run = new.run

    def run(inputs: Any, uploaded: Any) -> Any:
        sizes.append(inputs.size)
        return real_run(inputs, uploaded)

    new.run = run  # type: ignore[method-assign]

    def swap() -> None:
        runner.decode_runner = new

    engine.run_on_loop(swap)
    return sizes


def _outputs(engine: Engine) -> list[list[int]]:
    batch3 = engine.generate(PROMPTS[:3], [_greedy(12), _greedy(9), _greedy(6)])
    batch5 = engine.generate(PROMPTS[1:], _greedy(7, regex=r"[a-z ]{4,30}"))
    return [o.token_ids for o in [*batch3, *batch5]]


def test_padded_decode_steps_give_the_unpadded_outputs(make_engine: Callable[..., Engine]) -> None:
    want = _outputs(make_engine())
    engine = make_engine()
    sizes = _use_runner(engine, lambda e: EagerDecode(e.runner.model, e.runner.attention, e.runner.pool,
                                                      decode_buckets(8)))
    assert _outputs(engine) == want
    # batches of 3, 2 and 1 ran at 4, 2 and 1; of 5, at 8
    assert {4, 2, 1, 8} <= set(sizes) and set(sizes) <= {1, 2, 4, 8}


def test_the_graph_runners_static_buffers_give_the_same_outputs(make_engine: Callable[..., Engine]) -> None:
    """What a replay computes, run eagerly: the step copied into the static buffers, decode
    attention split by the context rather than the step's longest row."""
    want = make_engine(attention_backend="triton").generate(PROMPTS[:3], [_greedy(8), _greedy(5), _greedy(3)])
    engine = make_engine(attention_backend="triton")
    sizes = _use_runner(engine, lambda e: CudaGraphDecode(e.runner.model, e.runner.attention, e.runner.pool,
                                                          decode_buckets(4), replay=False))
    got = engine.generate(PROMPTS[:3], [_greedy(8), _greedy(5), _greedy(3)])
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    assert set(sizes) == {4, 2, 1}


def test_backends_that_cannot_be_captured_say_so(make_engine: Callable[..., Engine]) -> None:
    engine = make_engine()
    assert engine.runner.decode_runner.name == "eager"
    assert not engine.runner.attention.supports_decode_graphs
    with pytest.raises(NotImplementedError, match="cannot run inside CUDA graphs"):
        engine.runner.attention.decode_graph_state(4, 128)


def test_a_negative_graph_batch_cap_is_refused() -> None:
    from radixgen import EngineConfig

    with pytest.raises(ValueError, match="cuda_graph_max_batch must be 0"):
        EngineConfig(cuda_graph_max_batch=-1)
    assert EngineConfig(cuda_graph_max_batch=0).cuda_graph_max_batch == 0
