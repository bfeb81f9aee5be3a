from __future__ import annotations

import json
import random
from dataclasses import asdict
from pathlib import Path

import pytest

from radixgen import EngineConfig
from radixgen.cli import main as cli_main
from radixgen.engine.planner import DecodeReserve
from radixgen.engine.simulator import (
    ReplicaSim,
    TraceRequest,
    load_trace,
    simulate,
    synthetic_trace,
    trace_tokens,
    write_trace,
)


def _deterministic(report: object) -> dict[str, object]:
    d = asdict(report)  # type: ignore[call-overload]
    d.pop("scheduler_cpu_s")
    return d


def test_simulation_is_deterministic_and_completes_everything() -> None:
    trace = synthetic_trace(120, seed=3)
    a = simulate(trace, EngineConfig(kv_cache_tokens=12000))
    b = simulate(trace, EngineConfig(kv_cache_tokens=12000))
    assert _deterministic(a) == _deterministic(b)
    assert a.completed == a.num_requests == 120
    assert a.output_tokens == sum(t.output_len for t in trace)


def test_cache_raises_hit_rate_and_lowers_queueing() -> None:
    trace = synthetic_trace(150, seed=1)
    on = simulate(trace, EngineConfig(kv_cache_tokens=30000))
    off = simulate(trace, EngineConfig(kv_cache_tokens=30000, disable_radix_cache=True))
    assert on.cache_hit_rate > 0.6 and off.cache_hit_rate == 0.0
    assert on.queue_delay_p95_s < off.queue_delay_p95_s
    assert on.virtual_time_s < off.virtual_time_s


def test_tight_pool_retracts_but_finishes() -> None:
    report = simulate(synthetic_trace(80, seed=2), EngineConfig(kv_cache_tokens=2500))
    assert report.completed == 80
    assert report.num_retractions > 0 and report.evicted_tokens > 0


def test_trace_files_and_cli(tmp_path: Path, capsys: object) -> None:
    described = tmp_path / "described.jsonl"
    described.write_text("\n".join(json.dumps(r) for r in [
        {"arrival": 0.0, "prefix_group": "a", "prefix_len": 50, "suffix_len": 5, "output_len": 4},
        {"arrival": 0.5, "prefix_group": "a", "prefix_len": 50, "suffix_len": 7, "output_len": 4},
    ]))
    trace = load_trace(described)
    assert trace[0].prompt_ids[:50] == trace[1].prompt_ids[:50] and trace[0].prompt_ids != trace[1].prompt_ids
    explicit = tmp_path / "explicit.jsonl"
    write_trace(synthetic_trace(20, seed=5), explicit)
    assert load_trace(explicit) == synthetic_trace(20, seed=5)
    log = tmp_path / "events.jsonl"
    assert cli_main(["simulate", str(described), "--event-log", str(log)]) == 0
    out = capsys.readouterr().out  # type: ignore[attr-defined]
    assert "cache hit rate" in out and "2/2 completed" in out
    assert len(log.read_text().splitlines()) > 2


def _long_outputs(n: int, rate: float, seed: int = 0) -> list[TraceRequest]:
    rng = random.Random(seed)
    clock, trace = 0.0, []
    for i in range(n):
        clock += rng.expovariate(rate)
        trace.append(TraceRequest(clock, trace_tokens(f"long:{i}", rng.randint(50, 150)), rng.randint(600, 1000)))
    return trace


def test_long_outputs_do_not_cycle_between_admission_and_retraction(monkeypatch: pytest.MonkeyPatch) -> None:
    trace, config = _long_outputs(60, rate=0.5), EngineConfig(kv_cache_tokens=6000, max_context_len=4096)
    adaptive = simulate(trace, config)
    assert adaptive.completed == 60 and adaptive.num_retractions > 0
    assert adaptive.num_repeat_retractions == 0, "a retracted request was admitted again too soon"
    monkeypatch.setattr(DecodeReserve, "retracted", lambda self: None)  # the reserve of old: never adapts
    fixed = simulate(trace, config)
    assert fixed.num_repeat_retractions > 0 and fixed.num_retractions > 2 * adaptive.num_retractions


def test_a_half_prefilled_prompt_gives_way_to_the_running_request() -> None:
    """The running request grows while a long prompt is prefilled in small chunks, until the
    pool is full: the chunked prompt is retracted (its chunks go to the tree), the running
    request reaches its own length, and the prompt is finished afterwards."""
    sim = ReplicaSim(EngineConfig(kv_cache_tokens=800, max_context_len=2048, chunked_prefill_size=2))
    sim.add("running", TraceRequest(0.0, trace_tokens("a", 50), 700))
    sim.step()
    sim.add("chunked", TraceRequest(0.0, trace_tokens("b", 600), 20))
    while sim.step():
        pass
    assert sim.finish_reasons == {"running": ("length", 700), "chunked": ("length", 20)}
    assert sim.sched.stats.num_retractions >= 1
    sim.close()
