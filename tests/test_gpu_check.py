"""benchmarks/gpu_check.py stays runnable where there is no GPU: its quick mode runs the same
measurements on tiny models on the CPU and writes its report."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_the_gpu_check_runs_its_measurements_on_tiny_models(tmp_path: Path) -> None:
    result = subprocess.run(
        [sys.executable, "benchmarks/gpu_check.py", "--device", "cpu", "--quick", "--out", str(tmp_path)],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
    )
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    report = json.loads((tmp_path / "gpu_check.json").read_text())
    assert [row["model"] for row in report["rows"]] == ["SmolLM2-135M", "Llama-3.2-1B"]
    for row in report["rows"]:
        for key in ("decode_b1", "decode_b4", "prefill", "json_b64", "plain_b64", "hf_b1", "hf_b4"):
            assert row[key] > 0, (key, row)
        assert row["json_valid"] == "4/4", row
    assert "decode_b1" in result.stdout and "vs_hf_b4" in result.stdout  # the table
    variants = report["variants"]
    assert [(v["model"], v["variant"]) for v in variants] == [
        (model, variant) for model in ("SmolLM2-135M", "Llama-3.2-1B")
        for variant in ("graphs+overlap", "graphs", "overlap", "eager")]
    assert all(v["decode_b1"] > 0 and v["decode_b4"] > 0 for v in variants), variants
    assert {v["decode_runner"] for v in variants} == {"eager"}, "no graphs on a CPU"
