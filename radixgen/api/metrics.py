"""Prometheus metrics of one server (own registry: no module-level state)."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from radixgen.engine.output import RequestOutput

if TYPE_CHECKING:
    from radixgen.api.jobs import ChoiceResult

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)


class ServerMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("radixgen_requests", "Finished HTTP requests", ["endpoint", "status"], registry=r)
        self.prompt_tokens = Counter("radixgen_prompt_tokens", "Prompt tokens of finished requests", registry=r)
        self.generation_tokens = Counter("radixgen_generation_tokens", "Generated tokens", registry=r)
        self.cached_tokens = Counter("radixgen_cached_prompt_tokens", "Prompt tokens served from the prefix cache", registry=r)
        self.ttft = Histogram("radixgen_time_to_first_token_seconds", "Time to first token", buckets=_LATENCY_BUCKETS, registry=r)
        self.itl = Histogram("radixgen_inter_token_latency_seconds", "Time between streamed tokens",
                             buckets=_LATENCY_BUCKETS, registry=r)
        self.e2e = Histogram("radixgen_request_latency_seconds", "End-to-end request latency", buckets=_LATENCY_BUCKETS, registry=r)
        self.in_flight = Gauge("radixgen_requests_in_flight", "Requests being served", registry=r)
        self._replica: dict[str, Gauge] | None = None  # created when a cluster reports replicas
        self._engine: dict[str, Gauge] = {
            name: Gauge(f"radixgen_{name}", doc, registry=r)
            for name, doc in {
                "queue_depth": "Requests waiting in the engine",
                "running_requests": "Requests decoding in the engine",
                "kv_usage_ratio": "Share of KV slots in use (requests and cache)",
                "kv_free_slots": "Free KV slots",
                "kv_request_slots": "KV slots held by running requests",
                "kv_cached_slots": "KV slots held by the prefix cache",
                "cache_hit_rate": "Share of prompt tokens served from the prefix cache",
                "avg_batch_size": "Average requests per engine step",
                "avg_decode_batch_size": "Average requests per decode step",
                "scheduler_seconds_per_step": "Scheduler CPU time per step",
                "forward_seconds_per_step": "Model time per step",
                "engine_steps": "Engine steps so far",
                "retractions": "Requests retracted under KV pressure so far",
                "shortened_requests": "Constrained requests steered to close early to finish within max_tokens",
                "constraint_refusals": "Constrained requests refused up front (no grammar, or no output fits the budget)",
                "constraint_violations": "Requests that ended constraint_violation (validators kept rejecting)",
                "searched_values": "Rejected numbers replaced by a valid value the validators accept, found by search",
                "spec_drafted_tokens": "Tokens speculative decoding drafted so far",
                "spec_accepted_tokens": "Drafted tokens that became output so far",
                "spec_acceptance_rate": "Share of drafted tokens that became output",
            }.items()
        }

    def set_kernels(self, kernels: dict[str, str]) -> None:
        """Which implementation of each CPU op the engine measured fastest and runs
        (``radixgen_kernel_info{op, implementation} 1``; none when it did not tune)."""
        if not kernels:
            return
        info = Gauge("radixgen_kernel_info", "The implementation of each op the engine chose by timing it on this machine",
                     ["op", "implementation"], registry=self.registry)
        for op, implementation in kernels.items():
            info.labels(op=op, implementation=implementation).set(1)

    def set_weights(self, weights: str | None) -> None:
        """What holds the model's weights (``radixgen_weights_info{weights} 1``): with
        ``weights=auto``, what the engine picked for this machine."""
        if weights:
            Gauge("radixgen_weights_info", "What holds the model's weights", ["weights"],
                  registry=self.registry).labels(weights=weights).set(1)

    def render(self, engine_stats: dict[str, Any] | None) -> bytes:
        if engine_stats and "replicas" in engine_stats:
            self._render_replicas(engine_stats["replicas"])
        if engine_stats:
            s = engine_stats
            steps = max(s.get("num_steps", 0), 1)
            values = {
                "queue_depth": s.get("queue_depth", 0), "running_requests": s.get("running", 0),
                "kv_usage_ratio": 1 - s["free"] / s["pool_size"] if s.get("pool_size") else 0,
                "kv_free_slots": s.get("free", 0), "kv_request_slots": s.get("held_by_requests", 0),
                "kv_cached_slots": s.get("held_by_tree", 0), "cache_hit_rate": s.get("cache_hit_rate", 0),
                "avg_batch_size": s.get("avg_batch_size", 0), "avg_decode_batch_size": s.get("avg_decode_batch_size", 0),
                "scheduler_seconds_per_step": s.get("schedule_time_s", 0) / steps,
                "forward_seconds_per_step": s.get("forward_time_s", 0) / steps,
                "engine_steps": s.get("num_steps", 0), "retractions": s.get("num_retractions", 0),
                "shortened_requests": s.get("num_shortened", 0),
                "constraint_refusals": s.get("num_constraint_refusals", 0),
                "constraint_violations": s.get("num_constraint_violations", 0),
                "searched_values": s.get("num_searched_values", 0),
                "spec_drafted_tokens": s.get("drafted_tokens", 0), "spec_accepted_tokens": s.get("accepted_tokens", 0),
                "spec_acceptance_rate": s.get("accepted_tokens", 0) / s["drafted_tokens"] if s.get("drafted_tokens") else 0,
            }
            for name, value in values.items():
                self._engine[name].set(value)
        return generate_latest(self.registry)

    _REPLICA_GAUGES = {
        "queue_depth": "Requests waiting in the replica's engine",
        "running": "Requests decoding in the replica's engine",
        "free": "Free KV slots of the replica",
        "cache_hit_rate": "Share of the replica's prompt tokens served from its prefix cache",
        "prompt_tokens": "Prompt tokens the replica has served",
        "cached_prompt_tokens": "Prompt tokens the replica served from its cache",
        "generated_tokens": "Tokens the replica has generated",
        "routed_requests": "Requests the front has routed to the replica",
        "num_steps": "Engine steps of the replica",
    }

    def _render_replicas(self, replicas: list[dict[str, Any]]) -> None:
        """Per-replica counters with a ``replica`` label (scale-out on Ray); created on first use
        so a single-engine server's output is unchanged."""
        if self._replica is None:
            self._replica = {name: Gauge(f"radixgen_replica_{name}", doc, ["replica"], registry=self.registry)
                             for name, doc in self._REPLICA_GAUGES.items()}
        gauges = self._replica
        for stats in replicas:
            label = str(stats.get("replica"))
            for name, gauge in gauges.items():
                gauge.labels(replica=label).set(stats.get(name, 0))

    def observe_latency(self, last: list[float | None], i: int, out: RequestOutput, started: float) -> None:
        """Time to first token or between tokens for choice ``i`` (``last``: each choice's last token time)."""
        if not out.new_token_ids:
            return
        now = time.perf_counter()
        previous = last[i]
        if previous is None:
            self.ttft.observe(now - started)
        else:
            self.itl.observe(now - previous)
        last[i] = now

    def record(self, endpoint: str, status: int, results: list[ChoiceResult], started: float) -> None:
        """A finished HTTP request: its status, and for a success its tokens and latency."""
        self.requests.labels(endpoint=endpoint, status=str(status)).inc()
        if results and status == 200:
            self.prompt_tokens.inc(results[0].prompt_tokens)
            self.cached_tokens.inc(results[0].cached_tokens)
            self.generation_tokens.inc(sum(len(r.token_ids) for r in results))
            self.e2e.observe(time.perf_counter() - started)
