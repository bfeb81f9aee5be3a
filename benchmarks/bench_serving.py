"""Serving benchmark against any OpenAI-compatible URL (the load generator is radixgen.bench.serving).

    python benchmarks/bench_serving.py                          # start radixgen (bundled model), mixed-64
    python benchmarks/bench_serving.py --url http://127.0.0.1:30000 --preset smoke
    radixgen bench serving --url ... --preset mixed-64           # the same, from the CLI

Prints the P50/P95/P99 table, writes benchmarks/results/serving-<label>.json and a PNG with the
latency CDFs and the throughput bar.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from radixgen.bench.cli import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:], results_dir=Path(__file__).resolve().parent / "results"))
