"""Trace simulator: the real scheduler and radix tree, with a model that only costs modelled time.

A trace is a list of requests with arrival times, prompt token ids (given, or described as a
shared prefix plus a unique suffix) and output lengths. Time is virtual: each step advances the
clock by the cost model's estimate, so a run is deterministic and needs no model. This is how
scheduling changes are tested and measured.
"""

from __future__ import annotations

import json
import random
import time
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import torch

from radixgen.config import EngineConfig
from radixgen.engine.kv_pool import KVPool
from radixgen.engine.params import SamplingParams
from radixgen.engine.plan import StepPlan
from radixgen.engine.request import Request
from radixgen.engine.sampler import SampleResult
from radixgen.engine.scheduler import Scheduler

_VOCAB = 49152


@dataclass(frozen=True)
class TraceRequest:
    arrival: float
    prompt_ids: list[int]
    output_len: int


@dataclass(frozen=True)
class CostModel:
    """Step time = fixed + per new token + per context token read by attention + per request.
    Defaults are rough fits of SmolLM2-135M fp32 on 2 CPU cores."""

    step_s: float = 0.02
    per_token_s: float = 0.0015
    per_context_token_s: float = 2e-6
    per_request_s: float = 0.0005

    def step_time(self, plan: StepPlan) -> float:
        context = int(plan.seq_lens.sum())
        return (self.step_s + self.per_token_s * plan.num_tokens + self.per_context_token_s * context
                + self.per_request_s * plan.batch_size)


@dataclass
class SimulationReport:
    num_requests: int
    completed: int
    virtual_time_s: float
    cache_hit_rate: float
    output_tokens: int
    queue_delay_p50_s: float
    queue_delay_p95_s: float
    queue_delay_p99_s: float
    ttft_p50_s: float
    ttft_p95_s: float
    decode_batch_hist: dict[int, int]
    num_retractions: int
    num_repeat_retractions: int
    evicted_tokens: int
    scheduler_cpu_s: float
    steps: int

    def summary(self) -> str:
        lines = [
            f"requests         {self.completed}/{self.num_requests} completed in {self.virtual_time_s:.1f} s (virtual)",
            f"cache hit rate   {self.cache_hit_rate:.1%}",
            f"output tokens    {self.output_tokens} ({self.output_tokens / max(self.virtual_time_s, 1e-9):.1f} tok/s virtual)",
            f"queue delay      p50 {self.queue_delay_p50_s:.3f} s  p95 {self.queue_delay_p95_s:.3f} s  p99 {self.queue_delay_p99_s:.3f} s",
            f"TTFT             p50 {self.ttft_p50_s:.3f} s  p95 {self.ttft_p95_s:.3f} s",
            f"retractions      {self.num_retractions} ({self.num_repeat_retractions} of requests retracted before), "
            f"evicted tokens {self.evicted_tokens}",
            f"scheduler CPU    {self.scheduler_cpu_s * 1e6 / max(self.steps, 1):.1f} us/step over {self.steps} steps",
            "decode batch sizes " + ", ".join(f"{k}:{v}" for k, v in sorted(self.decode_batch_hist.items())),
        ]
        return "\n".join(lines)


def load_trace(path: str | Path) -> list[TraceRequest]:
    """JSON lines: {"arrival": s, "output_len": n, and either "prompt_ids": [...] or
    "prefix_group": name, "prefix_len": n, "suffix_len": m}."""
    out = []
    for i, line in enumerate(Path(path).read_text().splitlines()):
        if not line.strip():
            continue
        rec = json.loads(line)
        if "prompt_ids" in rec:
            ids = [int(t) for t in rec["prompt_ids"]]
        else:
            ids = trace_tokens(f"prefix:{rec['prefix_group']}", int(rec["prefix_len"])) + trace_tokens(f"suffix:{i}", int(rec["suffix_len"]))
        out.append(TraceRequest(float(rec["arrival"]), ids, int(rec["output_len"])))
    return sorted(out, key=lambda r: r.arrival)


def trace_tokens(key: str, n: int) -> list[int]:
    """n pseudo-random token ids, the same for the same key (shared prefixes in traces)."""
    rng = random.Random(key)
    return [rng.randrange(3, _VOCAB) for _ in range(n)]


def synthetic_trace(
    num_requests: int = 200, *, num_prefixes: int = 4, prefix_len: int = 400, suffix_len: tuple[int, int] = (10, 60),
    output_len: tuple[int, int] = (16, 128), rate: float = 8.0, multi_turn_share: float = 0.3, seed: int = 0,
) -> list[TraceRequest]:
    """Shared system prompts, unique questions, and multi-turn sessions that resend history."""
    rng = random.Random(seed)
    trace: list[TraceRequest] = []
    sessions: list[list[int]] = []
    clock = 0.0
    for i in range(num_requests):
        clock += rng.expovariate(rate)
        out_len = rng.randint(*output_len)
        if sessions and rng.random() < multi_turn_share:
            s = rng.randrange(len(sessions))
            # the previous answer (simulated outputs are deterministic) plus a new question
            prompt = sessions[s] + _sim_outputs(rng.randint(*output_len)) + trace_tokens(f"turn:{i}", rng.randint(*suffix_len))
            sessions[s] = prompt
        else:
            prompt = trace_tokens(f"prefix:{rng.randrange(num_prefixes)}", prefix_len) + trace_tokens(f"q:{i}", rng.randint(*suffix_len))
            sessions.append(prompt)
        trace.append(TraceRequest(clock, prompt, out_len))
    return trace


def _sim_outputs(n: int) -> list[int]:
    return [_sim_token(i) for i in range(n)]


def _sim_token(position: int) -> int:
    return 1000 + position % 997


class _NullTokenizer:
    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return ""


class ReplicaSim:
    """One engine replica in virtual time: the real scheduler and radix tree, a modelled forward."""

    def __init__(self, config: EngineConfig | None = None, cost: CostModel | None = None) -> None:
        config = config or EngineConfig()
        self.cost = cost or CostModel()
        num_slots = config.kv_cache_tokens or 65536
        max_context = config.max_context_len or 8192
        config = replace(config, kv_cache_tokens=num_slots, max_context_len=max_context)
        pool = KVPool(num_slots=num_slots, num_layers=1, num_kv_heads=1, head_dim=1, dtype=torch.float16,
                      device="cpu", max_rows=config.max_running_requests, max_context_len=max_context)
        self.sched = Scheduler(config, pool, None, eos_token_ids=())
        self.clock = 0.0
        self.scheduler_cpu_s = 0.0
        self.arrivals: dict[str, float] = {}
        self.admitted_at: dict[str, float] = {}
        self.first_token_at: dict[str, float] = {}
        self.completed = 0
        self.finish_reasons: dict[str, tuple[str, int]] = {}
        self.decode_batch_hist: dict[int, int] = {}

    @property
    def load(self) -> int:
        """Requests in flight (queued or running)."""
        return len(self.sched.requests)

    def has_work(self) -> bool:
        return self.sched.has_work()

    def add(self, request_id: str, request: TraceRequest) -> None:
        params = SamplingParams(max_new_tokens=request.output_len, temperature=0, ignore_eos=True)
        self.sched.add_request(Request(request_id, list(request.prompt_ids), params, rng_seed=0))
        self.arrivals[request_id] = request.arrival

    def step(self) -> bool:
        """Run one scheduler step, advancing the clock by its modelled cost (False: nothing to run)."""
        start = time.perf_counter()
        plan = self.sched.schedule()
        if plan is None:
            self.scheduler_cpu_s += time.perf_counter() - start
            return False
        tokens = np.fromiter((_sim_token(len(r.output_ids)) for r in plan.requests), dtype=np.int64,
                             count=plan.batch_size)
        step_s = self.cost.step_time(plan)
        self.clock += step_s
        if plan.kind.runs_as_extend:
            for r in plan.requests:
                self.admitted_at.setdefault(r.request_id, self.clock - step_s)
        else:
            self.decode_batch_hist[plan.batch_size] = self.decode_batch_hist.get(plan.batch_size, 0) + 1
        outs = self.sched.process_results(plan, SampleResult(tokens, None, None, None), forward_s=step_s)
        self.scheduler_cpu_s += time.perf_counter() - start
        for r in plan.requests:  # non-streaming requests report only their end: look at them
            if r.output_ids and r.request_id not in self.first_token_at:
                self.first_token_at[r.request_id] = self.clock
        for o in outs:
            if o.finished:
                self.completed += 1
                self.finish_reasons[o.request_id] = (o.finish_reason.value if o.finish_reason else "?", o.completion_tokens)
        return True

    def queue_delays(self) -> list[float]:
        return [self.admitted_at[r] - self.arrivals[r] for r in self.admitted_at]

    def ttfts(self) -> list[float]:
        return [self.first_token_at[r] - self.arrivals[r] for r in self.first_token_at]

    def close(self) -> None:
        self.sched.check_kv_invariant()
        self.sched.stats.close()


def simulate(
    trace: list[TraceRequest], config: EngineConfig | None = None, cost: CostModel | None = None,
) -> SimulationReport:
    replica = ReplicaSim(config, cost)
    next_arrival = 0
    while next_arrival < len(trace) or replica.has_work():
        while next_arrival < len(trace) and trace[next_arrival].arrival <= replica.clock:
            replica.add(f"sim-{next_arrival}", trace[next_arrival])
            next_arrival += 1
        if not replica.step():
            if next_arrival < len(trace):
                replica.clock = max(replica.clock, trace[next_arrival].arrival)
                continue
            break
    delays = np.array(replica.queue_delays() or [0.0])
    ttfts = np.array(replica.ttfts() or [0.0])
    stats = replica.sched.stats
    replica.close()
    return SimulationReport(
        num_requests=len(trace), completed=replica.completed, virtual_time_s=replica.clock,
        cache_hit_rate=stats.cache_hit_rate, output_tokens=stats.generated_tokens,
        queue_delay_p50_s=float(np.percentile(delays, 50)), queue_delay_p95_s=float(np.percentile(delays, 95)),
        queue_delay_p99_s=float(np.percentile(delays, 99)),
        ttft_p50_s=float(np.percentile(ttfts, 50)), ttft_p95_s=float(np.percentile(ttfts, 95)),
        decode_batch_hist=replica.decode_batch_hist, num_retractions=stats.num_retractions, num_repeat_retractions=stats.num_repeat_retractions,
        evicted_tokens=stats.evicted_tokens, scheduler_cpu_s=replica.scheduler_cpu_s, steps=stats.num_steps,
    )


def write_trace(trace: list[TraceRequest], path: str | Path) -> None:
    with open(path, "w") as f:
        for t in trace:
            f.write(json.dumps({"arrival": t.arrival, "prompt_ids": t.prompt_ids, "output_len": t.output_len}) + "\n")
