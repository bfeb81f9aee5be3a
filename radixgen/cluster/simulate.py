"""N replicas in virtual time behind a router: the cluster-wide cache hit rate and queueing
delay of a routing policy, at sizes this machine cannot run.

Each replica is the real scheduler and radix tree with a modelled forward
(``engine.simulator.ReplicaSim``); events are processed in time order: an arrival is routed with
the replicas' loads at that moment, and otherwise the replica whose clock is furthest behind
takes its next step.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

import numpy as np

from radixgen.cluster.routing import Router
from radixgen.config import EngineConfig
from radixgen.engine.simulator import (
    CostModel,
    ReplicaSim,
    TraceRequest,
    _sim_outputs,
    trace_tokens,
)


@dataclass
class ClusterReport:
    replicas: int
    routing: str
    requests: int
    completed: int
    cache_hit_rate: float
    """Cached prompt tokens / prompt tokens, over all replicas."""
    queue_delay_p50_s: float
    queue_delay_p95_s: float
    ttft_p50_s: float
    ttft_p95_s: float
    max_load_share: float
    """Largest share of requests any replica served (1/replicas is perfect balance)."""
    virtual_time_s: float


def simulate_cluster(
    trace: list[TraceRequest], num_replicas: int, router: Router, config: EngineConfig | None = None,
    cost: CostModel | None = None,
) -> ClusterReport:
    replicas = [ReplicaSim(config, cost) for _ in range(num_replicas)]
    served = [0] * num_replicas
    next_arrival = 0
    while True:
        busy = [r for r in replicas if r.has_work()]
        next_step = min((r.clock for r in busy), default=math.inf)
        if next_arrival < len(trace) and trace[next_arrival].arrival <= next_step:
            request = trace[next_arrival]
            target = router.choose(request.prompt_ids, [r.load for r in replicas])
            replica = replicas[target]
            if not replica.has_work():  # idle until now
                replica.clock = max(replica.clock, request.arrival)
            replica.add(f"sim-{next_arrival}", request)
            served[target] += 1
            next_arrival += 1
        elif busy:
            min(busy, key=lambda r: r.clock).step()
        else:
            break
    prompt = sum(r.sched.stats.prompt_tokens for r in replicas)
    cached = sum(r.sched.stats.cached_prompt_tokens for r in replicas)
    delays = np.array([d for r in replicas for d in r.queue_delays()] or [0.0])
    ttfts = np.array([t for r in replicas for t in r.ttfts()] or [0.0])
    for r in replicas:
        r.close()
    return ClusterReport(
        replicas=num_replicas, routing=router.name, requests=len(trace), completed=sum(r.completed for r in replicas),
        cache_hit_rate=cached / max(prompt, 1),
        queue_delay_p50_s=float(np.percentile(delays, 50)), queue_delay_p95_s=float(np.percentile(delays, 95)),
        ttft_p50_s=float(np.percentile(ttfts, 50)), ttft_p95_s=float(np.percentile(ttfts, 95)),
        max_load_share=max(served) / max(len(trace), 1), virtual_time_s=max(r.clock for r in replicas),
    )


def multi_tenant_trace(
    num_requests: int, *, num_tenants: int = 64, system_len: tuple[int, int] = (200, 800),
    question_len: tuple[int, int] = (10, 60), output_len: tuple[int, int] = (16, 128), rate: float = 8.0,
    follow_up_share: float = 0.5, zipf: float = 1.1, seed: int = 0,
) -> list[TraceRequest]:
    """Many tenants, each with its own system prompt (tenant popularity Zipf-distributed), and
    multi-turn sessions that resend their whole history with each follow-up."""
    rng = random.Random(seed)
    weights = [1.0 / (rank + 1) ** zipf for rank in range(num_tenants)]
    systems = [trace_tokens(f"tenant:{t}", rng.randint(*system_len)) for t in range(num_tenants)]
    sessions: list[list[int]] = []
    trace, clock = [], 0.0
    for i in range(num_requests):
        clock += rng.expovariate(rate)
        if sessions and rng.random() < follow_up_share:
            s = rng.randrange(len(sessions))
            prompt = sessions[s] + _sim_outputs(rng.randint(*output_len)) + trace_tokens(f"turn:{i}", rng.randint(*question_len))
            sessions[s] = prompt
        else:
            tenant = rng.choices(range(num_tenants), weights)[0]
            prompt = systems[tenant] + trace_tokens(f"q:{i}", rng.randint(*question_len))
            sessions.append(prompt)
        trace.append(TraceRequest(clock, prompt, rng.randint(*output_len)))
    return trace
