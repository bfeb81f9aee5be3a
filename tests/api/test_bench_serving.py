"""The serving load generator against the live tiny server: every request measured, the server's
own counters read back, the report and plot written."""

from __future__ import annotations

import json
from pathlib import Path

from radixgen.bench.cli import main
from radixgen.bench.serving import PRESETS, run_preset
from tests.api.conftest import LiveServer


def test_smoke_preset_measures_every_request(server: LiveServer) -> None:
    report = run_preset(server.url, "smoke", progress=False, model="tiny")
    summary = report.summary()
    workload = PRESETS["smoke"]
    assert summary["requests"] == workload.num_requests == summary["completed"] and summary["errors"] == 0
    forced = [r for r in report.records if not r.kind.startswith("json:")]
    assert forced and all(workload.min_output <= r.output_tokens <= workload.max_output for r in forced)
    assert {r.kind.split(":")[-1] for r in report.records} >= {"multi_turn"}
    for metric in ("ttft", "tpot", "latency"):
        assert 0 < summary[f"{metric}_p50"] <= summary[f"{metric}_p95"] <= summary[f"{metric}_p99"]
    assert summary["ttft_p50"] <= summary["latency_p50"]
    assert 0 <= summary["cache_hit_rate"] <= 1 and summary["avg_batch_size"] >= 1, "read from /metrics"


def test_cli_writes_json_and_plot(server: LiveServer, tmp_path: Path) -> None:
    code = main(["--url", server.url, "--preset", "smoke", "--label", "tiny", "--num-requests", "6",
                 "--model-name", "tiny"], results_dir=tmp_path)
    assert code == 0
    data = json.loads((tmp_path / "serving-tiny.json").read_text())
    assert data["summary"]["completed"] == 6 and len(data["records"]) == 6
    assert (tmp_path / "serving-tiny.png").stat().st_size > 10_000
