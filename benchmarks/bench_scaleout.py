"""Routing across replicas, simulated: cluster-wide cache hit rate and queueing delay of
round-robin vs prefix-affinity at 2, 8 and 32 replicas on a multi-tenant trace.

Each replica is the real scheduler and radix tree with a modelled forward (the trace simulator's
cost model, fitted to SmolLM2-135M on 2 CPU cores), so the numbers compare policies, not
hardware. The load grows with the cluster (requests and arrival rate per replica are fixed).

    python benchmarks/bench_scaleout.py [--replicas 2 8 32] [--requests-per-replica 150]
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import asdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.common import print_table, write_json  # noqa: E402
from radixgen import EngineConfig  # noqa: E402
from radixgen.cluster.routing import make_router  # noqa: E402
from radixgen.cluster.simulate import multi_tenant_trace, simulate_cluster  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--replicas", type=int, nargs="+", default=[2, 8, 32])
    parser.add_argument("--requests-per-replica", type=int, default=150)
    parser.add_argument("--rate-per-replica", type=float, default=1.0, help="arrivals per second per replica")
    parser.add_argument("--tenants-per-replica", type=int, default=8)
    parser.add_argument("--kv-cache-tokens", type=int, default=16384, help="KV pool of each replica")
    args = parser.parse_args()
    rows = []
    for n in args.replicas:
        trace = multi_tenant_trace(args.requests_per_replica * n, num_tenants=args.tenants_per_replica * n,
                                   rate=args.rate_per_replica * n, seed=n)
        for routing in ("round-robin", "prefix-affinity"):
            start = time.perf_counter()
            report = simulate_cluster(trace, n, make_router(routing), EngineConfig(kv_cache_tokens=args.kv_cache_tokens))
            rows.append({**asdict(report), "wall_s": time.perf_counter() - start})
    columns = ["replicas", "routing", "requests", "cache_hit_rate", "queue_delay_p50_s", "queue_delay_p95_s",
               "ttft_p50_s", "ttft_p95_s", "max_load_share", "wall_s"]
    print_table(rows, columns)
    print(f"wrote {write_json('bench_scaleout', {'args': vars(args), 'rows': rows})}")


if __name__ == "__main__":
    main()
