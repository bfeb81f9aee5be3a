from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path

from radixgen import EngineConfig
from radixgen.api.cli import main as cli_main
from radixgen.engine.simulator import load_trace, simulate, synthetic_trace, write_trace


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
