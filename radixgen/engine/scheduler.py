"""The scheduling loop's brain, split by concern:

- ``kv_cache.KVCacheManager``: the only code touching the KV pool and the radix tree (match,
  lock, alloc with eviction, release into the tree, the ownership invariant);
- ``planner.BatchPlanner``: the waiting queue and the running set, and each step's plan
  (prefill / mixed / decode, chunking, admission under the decode reserve, retraction);
- ``results.ResultProcessor``: a step's sampled tokens applied (outputs, stops, jump-forward,
  rollback, finishing).

``Scheduler`` is what the engine loop and the simulator hold: it admits and aborts requests and
runs the plan / apply cycle over the three.
"""

from __future__ import annotations

import time
from typing import Any

from radixgen.config import EngineConfig
from radixgen.engine.batch import StepPlan
from radixgen.engine.kv_cache import KVCacheManager
from radixgen.engine.kv_pool import KVPool
from radixgen.engine.outputs import OutputProcessor
from radixgen.engine.planner import BatchPlanner
from radixgen.engine.request import FinishReason, Request, RequestOutput
from radixgen.engine.results import ResultProcessor
from radixgen.engine.sampler import SampleResult
from radixgen.engine.speculative import Verdict
from radixgen.engine.stats import SchedulerStats, StepLog
from radixgen.engine.steering import BudgetSteering
from radixgen.radix import RadixTree


class Scheduler:
    def __init__(self, config: EngineConfig, pool: KVPool, tokenizer: Any, eos_token_ids: tuple[int, ...], *,
                 steering: BudgetSteering | None = None) -> None:
        self.config = config
        self.kv = KVCacheManager(pool, use_cache=not config.disable_radix_cache)
        self.requests: dict[str, Request] = {}
        self.outputs = OutputProcessor(tokenizer, eos_token_ids, pool.max_context_len, jump_forward=config.jump_forward,
                                       steering=steering)
        self.stats = SchedulerStats(event_log=config.event_log)
        self._log = StepLog()
        self.planner = BatchPlanner(config, self.kv, self.stats, self._log,
                                    finish_too_long=self._end_at_length)
        self.planner.drafter.tokenizer = tokenizer  # a constraint's forced text is drafted as its tokens
        self.results = ResultProcessor(config, self.kv, self.planner, self.outputs, self.stats, self._log,
                                       self.requests)

    @property
    def pool(self) -> KVPool:
        return self.kv.pool

    @property
    def tree(self) -> RadixTree:
        return self.kv.tree

    @property
    def chunked(self) -> Request | None:
        return self.planner.chunked

    def add_request(self, req: Request) -> None:
        assert req.request_id not in self.requests, f"duplicate request id {req.request_id}"
        self.requests[req.request_id] = req
        self.outputs.add(req)
        if req.params.speculative:
            self.planner.drafter.requested = True
        self.planner.waiting.append(req)

    def abort(self, request_id: str, reason: FinishReason = FinishReason.ABORT, error: str | None = None) -> bool:
        req = self.requests.get(request_id)
        if req is None:
            return False
        self.planner.discard(req)
        self.results.finish(req, reason, error=error)
        return True

    def _end_at_length(self, req: Request) -> None:
        self.abort(req.request_id, FinishReason.LENGTH)

    def has_work(self) -> bool:
        return self.planner.has_work()

    def schedule(self) -> StepPlan | None:
        start = time.perf_counter()
        self._log.begin()
        plan = self.planner.schedule()
        self._log.current.schedule_s = time.perf_counter() - start
        return plan

    def process_results(self, plan: StepPlan, result: SampleResult, forward_s: float = 0.0,
                        verdicts: dict[int, Verdict] | None = None) -> list[RequestOutput]:
        """Apply a step's sampled tokens (and a speculative step's verdicts); return the outputs
        handed to callbacks (finals always)."""
        return self.results.process_results(plan, result, forward_s, verdicts)

    def fail_step(self, plan: StepPlan, error: str) -> None:
        """An internal fault during the step: end its requests with an error, keep serving."""
        self.results.fail_step(plan, error)

    def held_by_requests(self) -> int:
        """KV slots owned by requests (their cached prefixes belong to the tree)."""
        return self.kv.held_by(self.requests.values())

    def check_kv_invariant(self) -> None:
        self.kv.check_invariant(self.requests.values())
