"""The scheduling loop's brain, split by concern:

- ``kv_cache.KVCacheManager``: the only code touching the KV pool and the radix tree (match,
  lock, alloc with eviction, release into the tree, the ownership invariant);
- ``planner.BatchPlanner``: the waiting queue and the running set, and each step's plan
  (prefill / mixed / decode, chunking, admission under the decode reserve, retraction);
- ``apply.StepApplier``: a step's sampled tokens applied to its requests (fast lanes,
  verdicts, rollback, finishing), each request's tokens appended by ``append.TokenAppender``.

``Scheduler`` is what the engine loop and the simulator hold: it admits and aborts requests and
runs the plan / apply cycle over the three.
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np

from radixgen.config import EngineConfig
from radixgen.engine.append import TokenAppender
from radixgen.engine.apply import StepApplier
from radixgen.engine.kv_cache import KVCacheManager
from radixgen.engine.kv_pool import KVPool
from radixgen.engine.output import FinishReason, RequestOutput
from radixgen.engine.plan import StepPlan
from radixgen.engine.planner import BatchPlanner
from radixgen.engine.request import Request
from radixgen.engine.sampler import SampleResult
from radixgen.engine.speculative import Verdict
from radixgen.engine.stats import SchedulerStats, StepLog
from radixgen.engine.steering import BudgetSteering
from radixgen.radix import RadixTree


class Scheduler:
    def __init__(self, config: EngineConfig, pool: KVPool, tokenizer: Any, eos_token_ids: tuple[int, ...], *,
                 steering: BudgetSteering | None = None, vocab_size: int | None = None) -> None:
        self.config = config
        self.kv = KVCacheManager(pool, use_cache=not config.disable_radix_cache)
        self.requests: dict[str, Request] = {}
        self.appender = TokenAppender(tokenizer, eos_token_ids, pool.max_context_len, jump_forward=config.jump_forward,
                                       steering=steering, vocab_size=vocab_size)
        self.stats = SchedulerStats(event_log=config.event_log)
        self._log = StepLog()
        self.planner = BatchPlanner(config, self.kv, self.stats, self._log,
                                    finish_too_long=self._end_at_length)
        self.planner.drafter.tokenizer = tokenizer  # a constraint's forced text is drafted as its tokens
        self.applier = StepApplier(config, self.kv, self.planner, self.appender, self.stats, self._log,
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
        self.appender.add(req)
        self.planner.drafter.note_request(req)
        self.planner.waiting.append(req)

    def abort(self, request_id: str, reason: FinishReason = FinishReason.ABORT, error: str | None = None) -> bool:
        req = self.requests.get(request_id)
        if req is None:
            return False
        self.planner.discard(req)
        self.applier.finish(req, reason, error=error)
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
        if plan is not None:
            plan.record = self._log.current
        return plan

    def lookahead(self, plan: StepPlan, result: SampleResult) -> StepPlan | None:
        """The decode step after ``plan``, planned before its results are applied (overlapped
        scheduling; ``planner.lookahead_decode``); None when the next step must wait for them."""
        start = time.perf_counter()
        applying = self._log.current
        self._log.begin()
        nxt = self.planner.lookahead_decode(plan, result.token_ids)
        record, self._log.current = self._log.current, applying
        if nxt is not None:
            record.schedule_s = time.perf_counter() - start
            nxt.record = record
        return nxt

    def landed_rows(self, plan: StepPlan) -> np.ndarray:
        """[B] bool: a lookahead plan's rows whose request continued as the plan assumed (it is
        still running in the same row, with exactly the plan's input as its newest token and
        everything before it computed): their results are the ones a step planned now would give."""
        keep = np.zeros(plan.batch_size, dtype=bool)
        running = self.planner.running
        rows, positions, inputs = plan.rows.tolist(), plan.positions.tolist(), plan.input_ids.tolist()
        for i, req in enumerate(plan.requests):
            keep[i] = (req in running and req.pool_row == rows[i] and req.num_computed == positions[i]
                       and req.seq_len - 1 == positions[i] and req.output_ids[-1] == inputs[i])
        return keep

    def drop_rows(self, plan: StepPlan, keep: np.ndarray) -> None:
        """Give back the KV slots of a plan's rows that will not be applied (``keep`` False): no
        request holds them, and the step that wrote them has ended."""
        dropped = plan.out_cache_loc[~keep]
        if len(dropped):
            self.kv.pool.slots.free(dropped.copy())
        if not keep.all():  # a batch changed under the plan: its per-batch arrays are stale
            self.planner.forget_decode_batch()

    def process_results(self, plan: StepPlan, result: SampleResult, forward_s: float = 0.0,
                        verdicts: dict[int, Verdict] | None = None) -> list[RequestOutput]:
        """Apply a step's sampled tokens (and a speculative step's verdicts); return the outputs
        handed to callbacks (finals always)."""
        if plan.record is not None:
            self._log.current = plan.record
        return self.applier.process_results(plan, result, forward_s, verdicts)

    def fail_step(self, plan: StepPlan, error: str) -> None:
        """An internal fault during the step: end its requests with an error, keep serving."""
        self.applier.fail_step(plan, error)

    def held_by_requests(self) -> int:
        """KV slots owned by requests (their cached prefixes belong to the tree)."""
        return self.kv.held_by(self.requests.values())

    def check_kv_invariant(self) -> None:
        self.kv.check_invariant(self.requests.values())
