"""`radixgen bench serving`: run a load preset against a URL (or a radixgen it starts)."""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict, fields
from pathlib import Path
from typing import Any

from radixgen.bench.serving import PRESETS, Workload, plot, run_preset

COLUMNS = ["target", "completed", "errors", "request_throughput", "output_tokens_per_s", "ttft_p50", "ttft_p95",
           "ttft_p99", "tpot_p50", "tpot_p95", "latency_p50", "latency_p95", "cache_hit_rate", "avg_batch_size"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--url", help="an OpenAI-compatible server (loopback); default: start radixgen serve")
    parser.add_argument("--preset", default="mixed-64", choices=sorted(PRESETS))
    parser.add_argument("--label", help="name of this target in the table and the file names")
    parser.add_argument("--model-name", default="default", help="the 'model' field sent with each request")
    for f in fields(Workload):
        kind = type(f.default)
        parse = (lambda v: v.lower() in ("1", "true", "yes")) if kind is bool else kind
        parser.add_argument("--" + f.name.replace("_", "-"), type=parse, default=None,
                            help=f"override the preset's {f.name}")
    parser.add_argument("--serve-args", default="", help="extra flags for the radixgen serve it starts")


def print_table(rows: list[dict[str, Any]]) -> None:
    def fmt(v: Any) -> str:
        return "-" if v is None else f"{v:.3f}" if isinstance(v, float) else str(v)

    widths = {c: max(len(c), *(len(fmt(r.get(c))) for r in rows)) for c in COLUMNS}
    print("  ".join(c.rjust(widths[c]) for c in COLUMNS))
    for row in rows:
        print("  ".join(fmt(row.get(c)).rjust(widths[c]) for c in COLUMNS))


def main(argv: list[str] | None = None, results_dir: Path = Path("benchmarks/results")) -> int:
    parser = argparse.ArgumentParser(prog="radixgen bench serving", description=__doc__)
    add_arguments(parser)
    return run(parser.parse_args(argv), results_dir)


def run(args: argparse.Namespace, results_dir: Path = Path("benchmarks/results")) -> int:
    overrides = {f.name: getattr(args, f.name) for f in fields(Workload)}
    server = None
    url = args.url
    if url is None:
        from radixgen.ipc.launch import launch_server

        server = launch_server(*args.serve_args.split())
        url = server.url
    try:
        report = run_preset(url, args.preset, label=args.label or ("radixgen" if server else url),
                            model=args.model_name, **overrides)
    finally:
        if server is not None:
            server.stop()
    summary = report.summary()
    print_table([summary])
    name = f"serving-{(args.label or args.preset).replace('/', '_')}"
    results_dir.mkdir(parents=True, exist_ok=True)
    (results_dir / f"{name}.json").write_text(json.dumps(
        {"summary": summary, "workload": report.workload, "records": [asdict(r) for r in report.records]}, indent=1))
    png = plot([report], results_dir / f"{name}.png")
    print(f"wrote {results_dir / (name + '.json')}" + (f" and {png}" if png else " (no matplotlib: no plot)"))
    return 0 if summary["errors"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
