"""Engine memory against the number of distinct prompt lengths it has prefilled: oneDNN keeps a
primitive per distinct GEMM row count, so without row bucketing (``models/layers.padded_rows``)
every new prompt length grew RSS for good.

    python benchmarks/bench_prefill_memory.py [--lengths 250] [--exact-rows]

``--exact-rows`` turns the bucketing off (the behaviour before it) for a side-by-side run.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.common import print_table, write_json  # noqa: E402
from radixgen import Engine, EngineConfig, SamplingParams  # noqa: E402


def rss_mb() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lengths", type=int, default=250, help="distinct prompt lengths, from 60 tokens up")
    parser.add_argument("--exact-rows", action="store_true", help="no row bucketing (as before it)")
    args = parser.parse_args()
    if args.exact_rows:
        from radixgen.models import layers

        layers._EXACT_ROWS_UP_TO = 10**9
    engine = Engine(EngineConfig(disable_radix_cache=True))
    params = SamplingParams(max_new_tokens=1, temperature=0)
    engine.generate([100 + i for i in range(50)], params)  # the first step's one-off allocations
    rows = []
    start_mb = rss_mb()
    started = time.perf_counter()
    for i, n in enumerate(range(60, 60 + args.lengths), 1):
        engine.generate([100 + (j * 7) % 40000 for j in range(n)], params)
        if i % 50 == 0 or i == args.lengths:
            rss = rss_mb()
            rows.append({"distinct_lengths": i, "rss_mb": rss, "growth_mb": rss - start_mb})
    engine.shutdown()
    print_table(rows, ["distinct_lengths", "rss_mb", "growth_mb"])
    print(f"{time.perf_counter() - started:.0f} s; row bucketing {'off' if args.exact_rows else 'on'}")
    print(f"wrote {write_json('bench_prefill_memory' + ('_exact_rows' if args.exact_rows else ''), {'rows': rows, 'exact_rows': args.exact_rows})}")


if __name__ == "__main__":
    main()
