"""The scheduling loop's brain: which requests run this step, and what their results mean.

Each step is either a prefill batch (waiting requests admitted under a token budget and the KV
room left after reserving for running requests' decode) or a decode batch (one token for every
running request), never both. Under KV pressure the most recently admitted running requests are
retracted to the front of the queue and later recomputed, instead of failing.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from radixgen.config import EngineConfig
from radixgen.engine.batch import StepKind, StepPlan
from radixgen.engine.detokenizer import IncrementalDetokenizer
from radixgen.engine.kv_pool import KVPool
from radixgen.engine.request import FinishReason, Request, RequestOutput, RequestStatus
from radixgen.engine.sampler import SampleResult

logger = logging.getLogger(__name__)

# Decode room reserved per running request when admitting new ones: a fraction of what it may
# still generate, clipped. Over-commit is safe (retraction), under-use wastes batch slots.
_RESERVE_CLIP = 256
_RESERVE_RATIO = 0.5


@dataclass
class SchedulerStats:
    num_steps: int = 0
    num_prefill_steps: int = 0
    num_decode_steps: int = 0
    num_retractions: int = 0
    prompt_tokens: int = 0
    computed_prompt_tokens: int = 0
    generated_tokens: int = 0
    batch_size_sum: int = 0
    schedule_time_s: float = 0.0
    extra: dict[str, float] = field(default_factory=dict)


class Scheduler:
    def __init__(self, config: EngineConfig, pool: KVPool, tokenizer: Any, eos_token_ids: tuple[int, ...]) -> None:
        self.config = config
        self.pool = pool
        self.tokenizer = tokenizer
        self.eos_token_ids = frozenset(eos_token_ids)
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self.detokenizers: dict[str, IncrementalDetokenizer] = {}
        self.stats = SchedulerStats()

    # ---- intake -------------------------------------------------------------------------

    def add_request(self, req: Request) -> None:
        assert req.request_id not in self.requests, f"duplicate request id {req.request_id}"
        self.requests[req.request_id] = req
        self.detokenizers[req.request_id] = IncrementalDetokenizer(
            self.tokenizer, req.prompt_ids, skip_special_tokens=req.params.skip_special_tokens,
            stop=req.params.stop,
        )
        self.stats.prompt_tokens += req.prompt_len
        self.waiting.append(req)

    def abort(self, request_id: str, reason: FinishReason = FinishReason.ABORT, error: str | None = None) -> bool:
        req = self.requests.get(request_id)
        if req is None:
            return False
        if req.status is RequestStatus.WAITING:
            self.waiting.remove(req)
        elif req in self.running:
            self.running.remove(req)
        self._finish(req, reason, error=error)
        return True

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    # ---- planning -----------------------------------------------------------------------

    def schedule(self) -> StepPlan | None:
        start = time.perf_counter()
        plan = None
        if self.waiting and len(self.running) < self.config.max_running_requests:
            plan = self._schedule_prefill()
        if plan is None and self.running:
            plan = self._schedule_decode()
        if plan is not None:
            self.stats.num_steps += 1
            self.stats.batch_size_sum += plan.batch_size
            if plan.kind is StepKind.PREFILL:
                self.stats.num_prefill_steps += 1
            else:
                self.stats.num_decode_steps += 1
        self.stats.schedule_time_s += time.perf_counter() - start
        return plan

    def _decode_reservation(self) -> int:
        remaining = sum(
            min(r.params.max_new_tokens - len(r.output_ids), _RESERVE_CLIP) for r in self.running
        )
        return int(remaining * _RESERVE_RATIO)

    def _schedule_prefill(self) -> StepPlan | None:
        budget = self.config.max_prefill_tokens
        room = self.pool.available() - self._decode_reservation()
        max_batch = self.config.max_running_requests - len(self.running)
        selected: list[Request] = []
        while self.waiting and len(selected) < max_batch:
            req = self.waiting[0]
            extend = req.seq_len
            if selected and extend > budget:
                break
            need = extend + int(min(req.params.max_new_tokens - len(req.output_ids), _RESERVE_CLIP) * _RESERVE_RATIO)
            if need > room and (selected or self.running):
                break  # wait for running requests to finish and free their KV
            slots = self.pool.slots.alloc(extend)
            if slots is None:
                break
            self.waiting.popleft()
            req.pool_row = self.pool.rows.alloc()
            self.pool.write(np.full(extend, req.pool_row), np.arange(extend), slots)
            req.status = RequestStatus.PREFILL
            selected.append(req)
            budget -= extend
            room -= need
        if not selected:
            return None
        extend_lens = np.array([r.seq_len for r in selected], dtype=np.int64)
        input_ids = np.fromiter(
            (t for r in selected for t in r.all_ids()), dtype=np.int64, count=int(extend_lens.sum())
        )
        positions = np.concatenate([np.arange(n) for n in extend_lens])
        rows = np.array([r.pool_row for r in selected], dtype=np.int64)
        out_cache_loc = self.pool.req_to_token_host[np.repeat(rows, extend_lens), positions]
        self.stats.computed_prompt_tokens += int(extend_lens.sum())
        return StepPlan(
            kind=StepKind.PREFILL, requests=selected, rows=rows,
            prefix_lens=np.zeros(len(selected), dtype=np.int64), extend_lens=extend_lens,
            input_ids=input_ids, positions=positions, out_cache_loc=out_cache_loc,
        )

    def _schedule_decode(self) -> StepPlan:
        while self.pool.available() < len(self.running) and len(self.running) > 1:
            self._retract(self.running[-1])
        if self.pool.available() < len(self.running):
            # One request alone has filled the whole pool: it cannot grow any further.
            self.abort(self.running[0].request_id, FinishReason.LENGTH)
            if not self.running:
                return None  # type: ignore[return-value]
        reqs = self.running
        batch = len(reqs)
        slots = self.pool.slots.alloc(batch)
        assert slots is not None, "decode slots were checked above"
        rows = np.fromiter((r.pool_row for r in reqs), dtype=np.int64, count=batch)
        positions = np.fromiter((r.seq_len - 1 for r in reqs), dtype=np.int64, count=batch)
        self.pool.write(rows, positions, slots)
        input_ids = np.fromiter((r.output_ids[-1] for r in reqs), dtype=np.int64, count=batch)
        return StepPlan(
            kind=StepKind.DECODE, requests=list(reqs), rows=rows, prefix_lens=positions,
            extend_lens=np.ones(batch, dtype=np.int64), input_ids=input_ids, positions=positions,
            out_cache_loc=slots,
        )

    def _retract(self, req: Request) -> None:
        """Give a running request's KV back; it re-enters the queue first and is recomputed."""
        self.running.remove(req)
        self._release_kv(req)
        req.status = RequestStatus.WAITING
        req.num_retractions += 1
        self.stats.num_retractions += 1
        self.waiting.appendleft(req)
        logger.debug("retracted %s (%d tokens)", req.request_id, req.seq_len)

    def _release_kv(self, req: Request) -> None:
        if req.pool_row < 0:
            return
        self.pool.slots.free(self.pool.row_slots(req.pool_row, req.num_computed).copy())
        self.pool.rows.free(req.pool_row)
        req.pool_row = -1
        req.num_computed = 0

    # ---- results ------------------------------------------------------------------------

    def process_results(self, plan: StepPlan, result: SampleResult) -> list[RequestOutput]:
        outputs = []
        now = time.monotonic()
        for i, req in enumerate(plan.requests):
            req.num_computed += int(plan.extend_lens[i])
            if req.is_finished:  # aborted while the step ran (cannot happen in-loop; defensive)
                continue
            if plan.kind is StepKind.PREFILL:
                req.status = RequestStatus.DECODE
                self.running.append(req)
            token = int(result.token_ids[i])
            req.output_ids.append(token)
            if req.first_token_time is None:
                req.first_token_time = now
            if result.logprobs is not None:
                req.output_logprobs.append(float(result.logprobs[i]))
            if result.top_ids is not None and result.top_logprobs is not None and req.params.top_logprobs:
                n = req.params.top_logprobs
                req.output_top_logprobs.append(
                    list(zip(result.top_ids[i, :n].tolist(), result.top_logprobs[i, :n].tolist(), strict=True))
                )
            outputs.append(self._after_token(req, token))
        self.stats.generated_tokens += len(plan.requests)
        return outputs

    def _after_token(self, req: Request, token: int) -> RequestOutput:
        params = req.params
        detok = self.detokenizers[req.request_id]
        reason: FinishReason | None = None
        if (token in self.eos_token_ids and not params.ignore_eos) or token in params.stop_token_ids:
            reason = FinishReason.STOP  # the stop token's text is not part of the output
        else:
            detok.add_token(token)
            if detok.stopped:
                reason = FinishReason.STOP
            elif len(req.output_ids) >= params.max_new_tokens or req.seq_len >= self.pool.max_context_len:
                reason = FinishReason.LENGTH
        if reason is None:
            return self._emit(req, final=False, has_new_token=True)
        self.running.remove(req)
        return self._finish(req, reason, has_new_token=True)

    def _emit(self, req: Request, *, final: bool, has_new_token: bool) -> RequestOutput:
        detok = self.detokenizers[req.request_id]
        out = RequestOutput(
            request_id=req.request_id,
            new_token_ids=req.output_ids[-1:] if has_new_token else [],
            new_text=detok.take_delta(final),
            finished=final,
            finish_reason=req.finish_reason,
            error=req.error,
            prompt_tokens=req.prompt_len,
            completion_tokens=len(req.output_ids),
            cached_tokens=req.cached_tokens,
            new_logprobs=req.output_logprobs[-1:] if has_new_token and req.params.logprobs else None,
            new_top_logprobs=(
                req.output_top_logprobs[-1:] if has_new_token and req.params.top_logprobs else None
            ),
        )
        if req.on_output is not None:
            req.on_output(out)
        return out

    def _finish(
        self, req: Request, reason: FinishReason, *, error: str | None = None, has_new_token: bool = False
    ) -> RequestOutput:
        self._release_kv(req)
        req.status = RequestStatus.ABORTED if reason in (FinishReason.ABORT, FinishReason.ERROR) else RequestStatus.FINISHED
        req.finish_reason = reason
        req.error = error
        out = self._emit(req, final=True, has_new_token=has_new_token)
        del self.requests[req.request_id]
        del self.detokenizers[req.request_id]
        return out

    def fail_step(self, plan: StepPlan, error: str) -> None:
        """An internal fault during the step: end its requests with an error, keep serving."""
        for i, req in enumerate(plan.requests):
            if req.is_finished:
                continue
            if req in self.running:
                self.running.remove(req)
            req.num_computed += int(plan.extend_lens[i])  # their slots were allocated for this step
            self._finish(req, FinishReason.ERROR, error=error)
