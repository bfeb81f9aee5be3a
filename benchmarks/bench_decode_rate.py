"""Decode rate of the bundled model at a few batch sizes, with nothing but decode counted:
(80 more tokens) / (time of a 96-token run - time of a 16-token run), best of ``--reps``.

``--before REV`` measures that revision too (a temporary worktree), the two trees alternating
``--rounds`` times in fresh processes; the table gives each tree's median: the quick check
that a change did not slow a step.

    python benchmarks/bench_decode_rate.py [--before REV] [--rounds 3] [--batch-sizes 1,16] [--weights float]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.common import print_table, trees_to_measure, write_json  # noqa: E402


def worker(args: argparse.Namespace) -> None:
    """One tree's rates, printed as JSON (run in that tree's own process, from its folder)."""
    sys.path.insert(0, str(Path.cwd()))  # that tree's radixgen, not this script's
    from radixgen import Engine, EngineConfig, SamplingParams

    engine = Engine(EngineConfig(weights=args.weights, dtype=args.dtype, kv_cache_tokens=16384,
                                 max_context_len=1024, disable_radix_cache=True))
    prompt = list(range(1000, 1100))
    rates = {}
    try:
        for batch in (int(b) for b in args.batch_sizes.split(",")):
            def run(n: int, batch: int = batch) -> float:
                start = time.perf_counter()
                engine.generate([prompt] * batch, SamplingParams(max_new_tokens=n, temperature=0, ignore_eos=True))
                return time.perf_counter() - start

            run(4)
            rates[str(batch)] = max(batch * 80 / (run(96) - run(16)) for _ in range(args.reps))
    finally:
        engine.shutdown()
    print(json.dumps(rates))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--before", help="a git revision to measure beside this tree")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--batch-sizes", default="1,16")
    parser.add_argument("--weights", default="float")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--reps", type=int, default=4)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return
    flags = ["--batch-sizes", args.batch_sizes, "--weights", args.weights, "--dtype", args.dtype,
             "--reps", str(args.reps), "--worker"]
    with trees_to_measure(args.before) as trees:
        samples: dict[str, list[dict[str, float]]] = {label: [] for _, label in trees}
        for _ in range(args.rounds):
            for tree, label in trees:
                out = subprocess.run([sys.executable, str(Path(__file__).resolve()), *flags],
                                     cwd=tree, capture_output=True, text=True, check=True, timeout=1200)
                samples[label].append(json.loads(out.stdout.strip().splitlines()[-1]))
    batches = args.batch_sizes.split(",")
    rows = [{"tree": label, **{f"b{b}_tok_s": statistics.median(s[b] for s in runs) for b in batches}}
            for label, runs in samples.items()]
    print(f"weights {args.weights}, dtype {args.dtype}; median of {args.rounds} alternating rounds, "
          f"each the best of {args.reps}")
    print_table(rows, ["tree", *[f"b{b}_tok_s" for b in batches]])
    print("wrote", write_json("bench_decode_rate", {"weights": args.weights, "dtype": args.dtype,
                                                    "rows": rows, "samples": samples}))


if __name__ == "__main__":
    main()
