"""Overlapped scheduling against the sequential loop on this machine, side by side in one
process: the bundled model decoding free text at batch 1 and 16 and JSON-schema objects at
batch 16 (greedy), each engine in turn, ``--rounds`` times. tok/s is generated tokens over wall
time; the table gives each mode's median and the ratio, with the overlapped engine's lookahead
steps and the rows it computed and dropped (requests that ended while their next step was in
flight).

On a CPU the forward already runs on every core, so the worker thread and the loop thread share
them; the mode is off there by default. The GPU figures are benchmarks/gpu_check.py's.

    python benchmarks/bench_overlap.py [--rounds 3] [--dtype float32] [--weights float]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.common import machine, print_table, write_json  # noqa: E402
from radixgen import Engine, EngineConfig, SamplingParams  # noqa: E402
from radixgen.engine.step import OverlapPipeline  # noqa: E402

SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 24}, "age": {"type": "integer", "minimum": 0, "maximum": 150},
    "tags": {"type": "array", "items": {"type": "string", "maxLength": 12}, "maxItems": 4},
}, "required": ["name", "age", "tags"]}


def workloads() -> dict[str, tuple[list[str], list[SamplingParams]]]:
    people = [f"Describe person number {i} as JSON:" for i in range(16)]
    return {
        "free b1": (["Once upon a time"], [SamplingParams(max_new_tokens=96, temperature=0, ignore_eos=True)]),
        "free b16": ([f"Story {i}: once upon a time" for i in range(16)],
                     [SamplingParams(max_new_tokens=64 + 4 * i, temperature=0, ignore_eos=True) for i in range(16)]),
        "json b16": (people, [SamplingParams(max_new_tokens=160, temperature=0, json_schema=SCHEMA)] * 16),
    }


def rate(engine: Engine, prompts: list[str], params: list[SamplingParams]) -> float:
    start = time.perf_counter()
    outs = engine.generate(prompts, params)
    return sum(len(o.token_ids) for o in outs) / (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--weights", default="float")
    args = parser.parse_args()
    engines = {mode: Engine(EngineConfig(dtype=args.dtype, weights=args.weights, overlap=mode == "overlap",
                                         kv_cache_tokens=16384, max_context_len=1024))
               for mode in ("sequential", "overlap")}
    work = workloads()
    rates: dict[tuple[str, str], list[float]] = {}
    try:
        for engine in engines.values():  # compile the grammar, warm every shape
            for prompts, params in work.values():
                engine.generate(prompts[:2], params[:2])
        for _ in range(args.rounds):
            for name, (prompts, params) in work.items():
                for mode, engine in engines.items():
                    rates.setdefault((name, mode), []).append(rate(engine, prompts, params))
        pipeline = engines["overlap"].pipeline
        assert isinstance(pipeline, OverlapPipeline)
        counts = {"lookahead_steps": pipeline.num_lookahead_steps, "dropped_rows": pipeline.num_dropped_rows,
                  "steps": engines["overlap"].scheduler.stats.num_steps}
    finally:
        for engine in engines.values():
            engine.shutdown()
    rows: list[dict[str, Any]] = []
    for name in work:
        seq, ovl = statistics.median(rates[(name, "sequential")]), statistics.median(rates[(name, "overlap")])
        rows.append({"workload": name, "sequential tok/s": seq, "overlap tok/s": ovl, "ratio": ovl / seq,
                     "rounds": " ".join(f"{a:.1f}/{b:.1f}" for a, b in
                                        zip(rates[(name, "sequential")], rates[(name, "overlap")], strict=True))})
    info = machine()
    print(f"{info['cpu']}, {info['threads']} threads; {args.dtype}, weights {args.weights}; overlapped engine: {counts}")
    print_table(rows, list(rows[0]))
    write_json("bench_overlap", {"machine": info, "dtype": args.dtype, "weights": args.weights, "rows": rows,
                                 "overlap_counts": counts})


if __name__ == "__main__":
    main()
