"""Overlapped scheduling (``EngineConfig.overlap``): the next decode step starts before this
one's results are applied, and every output is the one the sequential loop gives — free,
seeded, constrained, rolled back by validators, speculative, under retraction — with nothing
leaked when requests end, are aborted or disconnect while a step is in flight (make_engine
checks the pool after each test)."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from radixgen import Engine, FinishReason, SamplingParams
from radixgen.engine.step import OverlapPipeline, StepPipeline
from tests.conftest import FinalOutputs

PROMPTS = ["The capital of France is", "Once upon a time", "def fibonacci(n):", "1, 2, 3, 4,"]


def greedy(n: int, **kw: Any) -> SamplingParams:
    return SamplingParams(max_new_tokens=n, temperature=0, **kw)


def _pair(make_engine: Callable[..., Engine], **kw: Any) -> tuple[Engine, Engine]:
    sequential, overlapped = make_engine(overlap=False, **kw), make_engine(overlap=True, **kw)
    assert type(sequential.pipeline) is StepPipeline and isinstance(overlapped.pipeline, OverlapPipeline)
    return sequential, overlapped


def _lookaheads(engine: Engine) -> int:
    pipeline = engine.pipeline
    assert isinstance(pipeline, OverlapPipeline)
    return pipeline.num_lookahead_steps


def test_overlap_is_off_on_a_cpu_unless_asked_for() -> None:
    from radixgen import EngineConfig

    assert not EngineConfig().use_overlap and EngineConfig(overlap=True).use_overlap
    assert EngineConfig(device="cuda").use_overlap and not EngineConfig(device="cuda", overlap=False).use_overlap


def test_greedy_and_seeded_outputs_equal_the_sequential_loop(make_engine: Callable[..., Engine]) -> None:
    sequential, overlapped = _pair(make_engine)
    # different lengths, so rows end (and are dropped from the step in flight) at different steps
    params = [greedy(10 + 9 * i) for i in range(4)] + [
        SamplingParams(max_new_tokens=30, temperature=0.9, top_p=0.9, seed=s, ignore_eos=True) for s in (1, 2)]
    prompts = PROMPTS + PROMPTS[:2]
    want = sequential.generate(prompts, params)
    got = overlapped.generate(prompts, params)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    assert [o.finish_reason for o in got] == [o.finish_reason for o in want]
    assert _lookaheads(overlapped) > 20, "the decode steps were meant to overlap"
    pipeline = overlapped.pipeline
    assert isinstance(pipeline, OverlapPipeline) and pipeline.num_dropped_rows > 0, "rows ended mid-flight"


def test_stop_strings_penalties_and_logprobs_equal_the_sequential_loop(make_engine: Callable[..., Engine]) -> None:
    sequential, overlapped = _pair(make_engine)
    text = sequential.generate(PROMPTS[3], greedy(40)).text
    params = [greedy(40, stop=[text[12:16]]), greedy(30, repetition_penalty=1.3, frequency_penalty=0.5),
              greedy(25, logprobs=True, top_logprobs=3),
              SamplingParams(max_new_tokens=30, temperature=1.0, seed=7, presence_penalty=0.8)]
    prompts = [PROMPTS[3], *PROMPTS[:3]]
    want = sequential.generate(prompts, params)
    got = overlapped.generate(prompts, params)
    assert [(o.text, o.token_ids) for o in got] == [(o.text, o.token_ids) for o in want]
    # the same tokens' logprobs; the rows beside a request in a step may differ between the loops,
    # and a float linear's sums with them (1e-7 relative was seen)
    assert got[2].logprobs == pytest.approx(want[2].logprobs, rel=1e-5, abs=1e-6)
    assert got[0].finish_reason is FinishReason.STOP


def test_constrained_outputs_and_validator_rollbacks_equal_the_sequential_loop(
        make_engine: Callable[..., Engine]) -> None:
    # drafting off: a constrained request that may draft is planned after its results, never ahead
    sequential, overlapped = _pair(make_engine, speculative="off")
    schema = {"type": "object", "properties": {"items": {"type": "array", "items": {"type": "string", "maxLength": 6},
                                                         "minItems": 3, "maxItems": 5}}, "required": ["items"]}
    plain_schema = {"type": "object", "properties": {"a": {"type": "string", "maxLength": 12},
                                                     "b": {"type": "array", "items": {"type": "integer"}, "maxItems": 4}},
                    "required": ["a", "b"]}

    def run(engine: Engine) -> tuple[list[list[int]], int]:
        seen: list[str] = []

        def new_items_only(item: str) -> bool:
            ok = item not in seen
            seen.append(item)
            return ok

        params = [greedy(120, json_schema=schema, validators={"$.items[*]": new_items_only}, max_validation_retries=30),
                  greedy(80, json_schema=plain_schema), greedy(40, regex=r"(ab|cd){3,8}x"),
                  SamplingParams(max_new_tokens=60, temperature=0.8, seed=3, json_schema=plain_schema)]
        outs = engine.generate(["List:", "Give a record:", "Pattern:", "Another record:"], params)
        assert [o.finish_reason.value for o in outs[1:]] == ["stop"] * 3, outs
        json.loads(outs[1].text)
        return [o.token_ids for o in outs], engine.scheduler.stats.num_rollbacks

    want, rollbacks = run(sequential)
    got, overlapped_rollbacks = run(overlapped)
    assert got == want and overlapped_rollbacks == rollbacks > 0
    assert _lookaheads(overlapped) > 0


def test_speculative_steps_equal_the_sequential_loop(make_engine: Callable[..., Engine]) -> None:
    sequential, overlapped = _pair(make_engine, speculative="ngram")
    params = [greedy(60), greedy(40, regex=r"[a-c]{5,20}"), greedy(50)]
    prompts = ["1, 2, 3, 1, 2, 3, 1, 2,", "Letters:", PROMPTS[0]]
    assert [o.token_ids for o in overlapped.generate(prompts, params)] == [
        o.token_ids for o in sequential.generate(prompts, params)]
    assert overlapped.scheduler.stats.drafted_tokens > 0


def test_retraction_under_a_small_pool_works_with_overlap(make_engine: Callable[..., Engine]) -> None:
    prompts = [p + " and more" * i for i, p in enumerate(PROMPTS * 2)]
    roomy = make_engine()
    expected = [o.token_ids for o in roomy.generate(prompts, greedy(60))]
    tight = make_engine(kv_cache_tokens=320, overlap=True)
    assert [o.token_ids for o in tight.generate(prompts, greedy(60))] == expected
    assert tight.scheduler.stats.num_retractions > 0, "the pool was meant to be too small"
    assert _lookaheads(tight) > 0


def test_aborts_during_overlapped_steps_free_everything(make_engine: Callable[..., Engine]) -> None:
    engine = make_engine(overlap=True)
    outputs = FinalOutputs()
    started, finals = outputs.started, outputs.finals

    handles = [engine.add_request(p, greedy(900, ignore_eos=True), on_output=outputs) for p in PROMPTS]
    assert started.wait(30)
    time.sleep(0.2)  # let the decode steps chain up
    assert _lookaheads(engine) > 0
    for h in handles[:2]:
        engine.abort(h.request_id)
    time.sleep(0.1)
    for h in handles[2:]:
        engine.abort(h.request_id)
    outputs.wait_for(4)
    assert {f.finish_reason for f in finals.values()} == {FinishReason.ABORT}
    assert all(0 < f.completion_tokens < 900 for f in finals.values())
    # a request after the aborts is served from a balanced pool
    assert engine.generate(PROMPTS[0], greedy(8)).completion_tokens == 8


def test_a_stream_closed_mid_flight_aborts_its_request(make_engine: Callable[..., Engine]) -> None:
    import asyncio

    engine = make_engine(overlap=True)
    other = engine.add_request(PROMPTS[1], greedy(200, ignore_eos=True))

    async def read_some() -> int:
        seen = 0
        async for out in engine.generate_stream(PROMPTS[0], greedy(500, ignore_eos=True)):
            seen += len(out.new_token_ids)
            if seen >= 10:
                break  # the client goes away
        return seen

    assert asyncio.run(read_some()) >= 10
    deadline = time.monotonic() + 30
    while engine.num_active > 1 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert engine.num_active == 1, "the closed stream's request must be aborted"
    engine.abort(other.request_id)


def test_calls_on_the_loop_see_a_step_boundary(make_engine: Callable[..., Engine]) -> None:
    """``run_on_loop`` (the server's accounting, the invariant check) runs between steps, not
    while one is in flight: the pool balances at every such call during overlapped decoding."""
    engine = make_engine(overlap=True)
    handle = engine.add_request(PROMPTS[0], greedy(300, ignore_eos=True))
    checks = 0
    while engine.num_active and checks < 20:
        engine.run_on_loop(engine.scheduler.check_kv_invariant)
        checks += 1
    assert checks >= 5
    engine.abort(handle.request_id)


def test_the_event_log_stays_ordered_with_overlap(make_engine: Callable[..., Engine], tmp_path: Path) -> None:
    log = tmp_path / "events.jsonl"
    engine = make_engine(event_log=str(log), overlap=True)
    engine.generate(["one prompt", "another prompt"], [greedy(12, ignore_eos=True), greedy(20, ignore_eos=True)])
    engine.run_on_loop(lambda: None)
    records = [json.loads(line) for line in log.read_text().splitlines()]
    assert [r["step"] for r in records] == list(range(1, len(records) + 1))
    decode = [r for r in records if r["kind"] == "decode"]
    assert decode and all(r["new_tokens"] == r["batch_size"] + r["dropped_rows"] for r in decode)
    # the step after the shorter request's last was planned with its row: computed, dropped
    assert sum(r["dropped_rows"] for r in records) == 1
    assert [r["batch_size"] for r in decode][-8:] == [1] * 8


@pytest.mark.parametrize("overlap", [False, True])
def test_an_internal_fault_in_an_overlapped_step_fails_its_requests_alone(
        make_engine: Callable[..., Engine], overlap: bool) -> None:
    # every prefill mixed: a request admitted a step late would otherwise prefill alone, and the
    # injected fault could fall on its step only (each request fails with its own step)
    engine = make_engine(overlap=overlap, prefill_alone_below_tokens=0)
    real = engine.pipeline.execute
    calls = {"n": 0}

    def flaky(plan: Any, *args: Any) -> Any:
        calls["n"] += 1
        if calls["n"] == 6:
            raise RuntimeError("injected")
        return real(plan, *args)

    engine.pipeline.execute = flaky  # type: ignore[method-assign]
    outs = engine.generate(PROMPTS[:2], greedy(30, ignore_eos=True))
    assert {o.finish_reason for o in outs} == {FinishReason.ERROR}
    assert all("injected" in (o.error or "") for o in outs)
    engine.pipeline.execute = real  # type: ignore[method-assign]
    assert engine.generate(PROMPTS[2], greedy(5)).completion_tokens == 5
