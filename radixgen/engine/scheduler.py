"""The scheduling loop's brain: which requests run this step, and what their results mean.

Each step is a prefill batch or a decode batch; with ``mixed_steps`` a prefill batch also
carries every running request's next token (its rows last), under a smaller prefill budget. A
prefill batch admits waiting requests (by policy) under a token budget, the running cap and the
KV room left after reserving part of what running requests may still generate; each admitted
request first takes its longest cached prefix from the radix tree (locked while it runs) and
computes only the rest. Prompts longer than ``chunked_prefill_size`` are computed a chunk per
step, the running requests decoding in between (inside those steps when they are mixed). Under KV pressure, unlocked tree leaves are evicted first; if that is not enough the most
recently admitted running requests are retracted (their computed tokens go into the tree, so
they resume cheaply). When a request ends, its sequence is inserted into the tree.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Iterable
from typing import Any

import numpy as np

from radixgen.config import EngineConfig
from radixgen.engine.batch import PromptScoring, StepKind, StepPlan
from radixgen.engine.kv_pool import KVPool
from radixgen.engine.outputs import OutputProcessor
from radixgen.engine.request import FinishReason, Request, RequestOutput, RequestStatus
from radixgen.engine.sampler import SampleResult
from radixgen.engine.stats import SchedulerStats, StepRecord
from radixgen.engine.steering import BudgetSteering
from radixgen.radix import RadixTree

logger = logging.getLogger(__name__)

# Decode room reserved per running request when admitting new ones: half of what it may still
# generate, up to a horizon. Over-commit is safe (retraction) but costs the retracted requests'
# recompute; under-use wastes batch slots. The horizon doubles on each retraction (long outputs
# would otherwise be admitted, retracted and admitted again) and decays back to its base while
# steps pass without one, as SGLang's new-token ratio does.
_RESERVE_RATIO = 0.5
_RESERVE_HORIZON_BASE = 128
_RESERVE_HORIZON_DECAY = 1 / 512  # per decode step: the excess halves in ~350 steps
# Past this queue length, lpm falls back to fcfs (matching every waiting prompt costs time).
_LPM_MAX_QUEUE = 128


class DecodeReserve:
    """How much KV room admission keeps for each running request's next tokens."""

    def __init__(self, max_horizon: int) -> None:
        self.horizon = float(_RESERVE_HORIZON_BASE)
        self.max_horizon = max(max_horizon, _RESERVE_HORIZON_BASE)

    def of(self, req: Request) -> int:
        remaining = req.params.max_new_tokens - len(req.output_ids)
        return int(min(remaining * _RESERVE_RATIO, self.horizon))

    def total(self, reqs: Iterable[Request]) -> int:
        return sum(self.of(r) for r in reqs)

    def retracted(self) -> None:
        self.horizon = min(self.horizon * 2, self.max_horizon)

    def decode_step(self) -> None:
        if self.horizon > _RESERVE_HORIZON_BASE:
            self.horizon -= (self.horizon - _RESERVE_HORIZON_BASE) * _RESERVE_HORIZON_DECAY


def _rows_and_positions(reqs: list[Request]) -> tuple[np.ndarray, np.ndarray]:
    """req_to_token row and position of each running request's next decode token."""
    rows = np.fromiter((r.pool_row for r in reqs), dtype=np.int64, count=len(reqs))
    positions = np.fromiter((r.seq_len - 1 for r in reqs), dtype=np.int64, count=len(reqs))
    return rows, positions


def _last_tokens(reqs: list[Request]) -> np.ndarray:
    """Each running request's newest token: the input of its next decode step."""
    return np.fromiter((r.output_ids[-1] for r in reqs), dtype=np.int64, count=len(reqs))


def _prompt_scoring(reqs: list[Request], prefix_lens: np.ndarray, extend_lens: np.ndarray) -> PromptScoring | None:
    """The positions of this prefill whose next prompt token a request wants scored."""
    parts: list[tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]] = []
    token_start = 0
    for i, req in enumerate(reqs):
        prefix, extend = int(prefix_lens[i]), int(extend_lens[i])
        start = req.params.prompt_logprob_start
        if start is not None:
            # position p predicts prompt token p + 1; scored tokens begin at ``start``
            lo, hi = max(start - 1, prefix), min(prefix + extend, req.prompt_len - 1)
            if lo < hi:
                positions = np.arange(lo, hi)
                parts.append((token_start + positions - prefix, np.asarray(req.prompt_ids[lo + 1 : hi + 1]),
                              np.full(hi - lo, i), positions + 1 - start))
        token_start += extend
    if not parts:
        return None
    index, targets, owners, offsets = (np.concatenate(column).astype(np.int64) for column in zip(*parts, strict=True))
    return PromptScoring(index, targets, owners, offsets)


class Scheduler:
    def __init__(self, config: EngineConfig, pool: KVPool, tokenizer: Any, eos_token_ids: tuple[int, ...], *,
                 steering: BudgetSteering | None = None) -> None:
        self.config = config
        self.pool = pool
        self.tree = RadixTree()
        self.use_cache = not config.disable_radix_cache
        self.waiting: deque[Request] = deque()
        self.running: dict[Request, None] = {}
        """Running requests in admission order (a dict: O(1) removal, the newest last)."""
        self.running_version = 0
        """Bumped whenever ``running`` changes; per-batch arrays are reused while it stands."""
        self._decode_arrays: tuple[int, list[Request], np.ndarray, np.ndarray] | None = None
        self.chunked: Request | None = None
        """The request whose prompt is part-way through chunked prefill (holds KV, not running)."""
        self.requests: dict[str, Request] = {}
        self.outputs = OutputProcessor(tokenizer, eos_token_ids, pool.max_context_len, jump_forward=config.jump_forward,
                                       steering=steering)
        self.stats = SchedulerStats(event_log=config.event_log)
        self.reserve = DecodeReserve(pool.max_context_len)
        self._decode_turn = False
        self._step = StepRecord()

    # ---- intake -------------------------------------------------------------------------

    def add_request(self, req: Request) -> None:
        assert req.request_id not in self.requests, f"duplicate request id {req.request_id}"
        self.requests[req.request_id] = req
        self.outputs.add(req)
        self.waiting.append(req)

    def abort(self, request_id: str, reason: FinishReason = FinishReason.ABORT, error: str | None = None) -> bool:
        req = self.requests.get(request_id)
        if req is None:
            return False
        if req.status is RequestStatus.WAITING:
            self.waiting.remove(req)
        elif req in self.running:
            self._remove_running(req)
        elif req is self.chunked:
            self.chunked = None
        self._finish(req, reason, error=error)
        return True

    def _remove_running(self, req: Request) -> None:
        del self.running[req]
        self.running_version += 1

    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self.chunked)

    def held_by_requests(self) -> int:
        """KV slots owned by requests (their cached prefixes belong to the tree)."""
        return sum(r.num_computed - r.prefix_len for r in self.requests.values() if r.pool_row >= 0)

    def check_kv_invariant(self) -> None:
        """free + owned by requests + owned by the tree == pool, with no slot in two places."""
        owned = [self.pool.row_slots(r.pool_row, r.num_computed)[r.prefix_len :]
                 for r in self.requests.values() if r.pool_row >= 0]
        tree_slots = self.tree.all_slots()
        free = self.pool.slots.free_slots()
        everything = np.concatenate([free, tree_slots, *owned])
        assert len(everything) == self.pool.num_slots, (
            f"free {len(free)} + tree {len(tree_slots)} + requests {sum(map(len, owned))} != pool {self.pool.num_slots}"
        )
        assert len(np.unique(everything)) == len(everything), "a KV slot is owned twice"

    # ---- planning -----------------------------------------------------------------------

    def schedule(self) -> StepPlan | None:
        start = time.perf_counter()
        self._step = StepRecord()
        plan = None
        decode_first = self._decode_turn and self.running
        self._decode_turn = False
        if not decode_first and (self.chunked or self.waiting):
            plan = self._schedule_prefill()
            if plan is not None and self.running and self.config.mixed_steps:
                plan = self._with_decode_rows(plan)
        if plan is None and self.running:
            plan = self._schedule_decode()
        self._step.schedule_s = time.perf_counter() - start
        return plan

    def _schedule_prefill(self) -> StepPlan | None:
        budget = self.config.max_prefill_tokens
        if self.running and self.config.mixed_steps:
            budget = min(budget, self.config.max_mixed_prefill_tokens)
        chunk_cap = self.config.chunked_prefill_size or None
        room = self.pool.available() + self.tree.evictable_tokens() - self.reserve.total(self.running)
        free_batch = self.config.max_running_requests - len(self.running)
        selected: list[Request] = []
        extends: list[int] = []
        is_last_chunk: list[bool] = []
        if self.chunked is not None:
            candidates: list[Request] = [self.chunked]
        else:
            self._order_waiting()
            candidates = []
        while budget > 0 and len(selected) < free_batch:
            if candidates:
                req = candidates.pop()
            else:
                if not self.waiting:
                    break
                req = self.waiting[0]  # admitted in queue order: the next one is the front
                if not self._admit(req, room, bool(selected or self.running)):
                    break
                self.waiting.popleft()
            remaining = req.seq_len - req.num_computed
            limit = budget if chunk_cap is None else min(budget, chunk_cap)
            if remaining <= limit or chunk_cap is None and not selected:
                extend = remaining  # all of it (with chunking off, even past the budget, alone)
            elif selected:
                self._unadmit(req)  # a chunk starts a step of its own: take it next step
                break
            else:
                extend = limit
            slots = self._alloc_slots(extend)
            if slots is None:
                self._unadmit(req)
                break
            start = req.num_computed
            self.pool.write(np.full(extend, req.pool_row), np.arange(start, start + extend), slots)
            req.status = RequestStatus.PREFILL
            selected.append(req)
            extends.append(extend)
            is_last_chunk.append(extend == remaining)
            budget -= extend
            room -= extend + self.reserve.of(req)
            if extend < remaining:
                self.chunked = req
                self._decode_turn = True  # let running requests decode before the next chunk
                break
            if req is self.chunked:
                self.chunked = None
        if not selected:
            return None
        return self._prefill_plan(selected, extends, is_last_chunk)

    def _order_waiting(self) -> None:
        if self.config.schedule_policy != "lpm" or not self.use_cache or len(self.waiting) > _LPM_MAX_QUEUE:
            return
        if len(self.waiting) > 1:
            ranked = sorted(self.waiting, key=lambda r: -self.tree.peek_prefix_len(r.all_ids()))
            self.waiting = deque(ranked)

    def _admit(self, req: Request, room: int, others_present: bool) -> bool:
        """Give ``req`` a req_to_token row and its cached prefix (locked); False if it must wait."""
        tokens = req.all_ids()
        start = req.params.prompt_logprob_start
        # a scored prompt position must be computed, so the cache serves only what precedes it
        reusable = len(tokens) - 1 if start is None else min(len(tokens) - 1, start - 1)
        if req.forced_pending:
            # jump-forward's forced tokens are verified against the logits before each of them,
            # so those positions are computed even when the cache holds them
            reusable = min(reusable, len(tokens) - req.forced_pending - 1)
        match = self.tree.match_prefix(tokens[:reusable]) if self.use_cache else None
        prefix = match.length if match is not None else 0
        need = len(tokens) - prefix + self.reserve.of(req)
        if others_present and need > room:
            return False
        if self.pool.rows.available() == 0:
            return False
        req.pool_row = self.pool.rows.alloc()
        if match is not None and prefix:
            self.tree.lock(match.node)
            req.last_node = match.node
            self.pool.write(np.full(prefix, req.pool_row), np.arange(prefix), match.slots)
        req.prefix_len = req.num_computed = prefix
        if not req.admitted:
            req.admitted = True
            req.cached_tokens = prefix
            self.stats.prompt_tokens += req.prompt_len
            self.stats.cached_prompt_tokens += min(prefix, req.prompt_len)
        self._step.cached_tokens += prefix
        return True

    def _unadmit(self, req: Request) -> None:
        """Undo ``_admit`` for a request that did not make it into the batch after all."""
        if req is self.chunked:
            return  # keeps its row and its computed chunks
        self._release_kv(req, cache=False)
        self.waiting.appendleft(req)  # it was the queue's front

    def _prefill_plan(self, reqs: list[Request], extends: list[int], is_last: list[bool]) -> StepPlan:
        extend_lens = np.array(extends, dtype=np.int64)
        prefix_lens = np.array([r.num_computed for r in reqs], dtype=np.int64)
        input_ids = np.concatenate(
            [np.asarray(r.all_ids()[p : p + n], dtype=np.int64) for r, p, n in zip(reqs, prefix_lens, extends, strict=True)]
        )
        positions = np.concatenate([np.arange(p, p + n) for p, n in zip(prefix_lens, extends, strict=True)])
        rows = np.array([r.pool_row for r in reqs], dtype=np.int64)
        out_cache_loc = self.pool.req_to_token_host[np.repeat(rows, extend_lens), positions]
        self._step.new_tokens = int(extend_lens.sum())
        # forced tokens are verified only when the whole run is in this step's extend
        verify = np.array([r.forced_pending if last and r.forced_pending < n else 0
                           for r, n, last in zip(reqs, extends, is_last, strict=True)], dtype=np.int64)
        return StepPlan(
            kind=StepKind.PREFILL, requests=reqs, rows=rows, prefix_lens=prefix_lens, extend_lens=extend_lens,
            input_ids=input_ids, positions=positions, out_cache_loc=out_cache_loc,
            sample_mask=np.array(is_last, dtype=bool), verify_counts=verify if verify.any() else None,
            prompt_scoring=_prompt_scoring(reqs, prefix_lens, extend_lens),
        )

    def _with_decode_rows(self, plan: StepPlan) -> StepPlan:
        """Append every running request's next token to a prefill plan (a mixed step). Their
        slots were reserved when the prefill was sized; if the pool is short anyway, the plan
        stays prefill-only and the next step is a decode step, which may retract."""
        reqs = list(self.running)
        slots = self._alloc_slots(len(reqs))
        if slots is None:
            self._decode_turn = True
            return plan
        rows, positions = _rows_and_positions(reqs)
        self.pool.write(rows, positions, slots)
        self._decode_arrays = None  # the next decode step's positions are not the last ones + 1
        self._decode_turn = False  # the running requests decode in this step
        ones = np.ones(len(reqs), dtype=np.int64)
        self._step.new_tokens += len(reqs)
        return StepPlan(
            kind=StepKind.PREFILL, requests=plan.requests + reqs, rows=np.concatenate([plan.rows, rows]),
            prefix_lens=np.concatenate([plan.prefix_lens, positions]),
            extend_lens=np.concatenate([plan.extend_lens, ones]),
            input_ids=np.concatenate([plan.input_ids, _last_tokens(reqs)]),
            positions=np.concatenate([plan.positions, positions]),
            out_cache_loc=np.concatenate([plan.out_cache_loc, slots]),
            sample_mask=np.concatenate([plan.sample_mask, ones.astype(bool)]) if plan.sample_mask is not None else None,
            verify_counts=np.concatenate([plan.verify_counts, np.zeros_like(ones)]) if plan.verify_counts is not None else None,
            prompt_scoring=plan.prompt_scoring,  # indexes the prefill rows, which keep their places
            num_decode=len(reqs),
        )

    def _schedule_decode(self) -> StepPlan | None:
        self.reserve.decode_step()
        if self.chunked is not None and self._short_of(len(self.running)):
            # a half-prefilled prompt holds KV that no running request can use: it goes first
            self._retract_chunked()
        while self._short_of(len(self.running)) and len(self.running) > 1:
            self._retract(next(reversed(self.running)))
        need = len(self.running)
        slots = self._alloc_slots(need)
        if slots is None:
            # One request alone has filled the whole pool: it cannot grow any further.
            self.abort(next(iter(self.running)).request_id, FinishReason.LENGTH)
            return None
        cached = self._decode_arrays
        if cached is not None and cached[0] == self.running_version:
            # same batch as the last decode step: every sequence grew by exactly one token
            reqs, rows, positions = cached[1], cached[2], cached[3] + 1
        else:
            reqs = list(self.running)
            rows, positions = _rows_and_positions(reqs)
        batch = len(reqs)
        self._decode_arrays = (self.running_version, reqs, rows, positions)
        self.pool.write(rows, positions, slots)
        input_ids = _last_tokens(reqs)
        self._step.new_tokens = batch
        return StepPlan(
            kind=StepKind.DECODE, requests=reqs, rows=rows, prefix_lens=positions,
            extend_lens=np.ones(batch, dtype=np.int64), input_ids=input_ids, positions=positions,
            out_cache_loc=slots, batch_version=self.running_version,
        )

    # ---- KV ownership -------------------------------------------------------------------

    def _alloc_slots(self, n: int) -> np.ndarray | None:
        short = n - self.pool.available()
        if short > 0 and self.use_cache:
            freed = self.tree.evict(short)
            self.pool.slots.free(freed)
            self._step.evicted_tokens += len(freed)
        return self.pool.slots.alloc(n)

    def _short_of(self, need: int) -> bool:
        return self.pool.available() + self.tree.evictable_tokens() < need

    def _retract(self, req: Request) -> None:
        """Give a running request's KV back (into the tree); it re-enters the queue first."""
        self._remove_running(req)
        self._requeue_retracted(req)

    def _retract_chunked(self) -> None:
        req = self.chunked
        assert req is not None
        self.chunked = None
        self._requeue_retracted(req)

    def _requeue_retracted(self, req: Request) -> None:
        self._release_kv(req, cache=True)
        req.status = RequestStatus.WAITING
        req.num_retractions += 1
        self._step.retracted += 1
        self._step.retracted_again += req.num_retractions > 1
        self.reserve.retracted()
        self.waiting.appendleft(req)
        logger.debug("retracted %s (%d tokens)", req.request_id, req.seq_len)

    def _cache_computed_prefix(self, req: Request) -> None:
        """Insert a request's freshly prefilled tokens into the tree now, not at its end, so
        requests arriving while it still runs share its prompt. The request then holds the tree's
        slots for that prefix (locked), and frees any it computed twice."""
        n = req.num_computed
        tokens = req.all_ids()[:n]
        slots = self.pool.row_slots(req.pool_row, n).copy()
        existing = self.tree.insert(tokens, slots)
        match = self.tree.match_prefix(tokens)
        assert match.length == n, "a just-inserted sequence must match in full"
        if existing > req.prefix_len:
            self.pool.slots.free(slots[req.prefix_len : existing])
            self.pool.write(np.full(existing, req.pool_row), np.arange(existing), match.slots[:existing])
        self.tree.lock(match.node)
        self.tree.unlock(req.last_node)
        req.last_node, req.prefix_len = match.node, n

    def _release_kv(self, req: Request, cache: bool) -> None:
        if req.pool_row < 0:
            return
        n = req.num_computed
        slots = self.pool.row_slots(req.pool_row, n).copy()
        owned_from = req.prefix_len  # slots before this belong to the tree
        if cache and self.use_cache and n > 0:
            # The tree takes what it lacks; what it already had we computed twice: free ours.
            existing = self.tree.insert(req.all_ids()[:n], slots)
            assert existing >= req.prefix_len, "a locked prefix vanished from the tree"
            owned_from, n = req.prefix_len, existing
        self.pool.slots.free(slots[owned_from:n])
        self.tree.unlock(req.last_node)
        self.pool.rows.free(req.pool_row)
        req.pool_row = -1
        req.num_computed = req.prefix_len = req.last_node = 0

    # ---- results ------------------------------------------------------------------------

    def process_results(self, plan: StepPlan, result: SampleResult, forward_s: float = 0.0) -> list[RequestOutput]:
        """Apply a step's sampled tokens; return the outputs handed to callbacks (finals always)."""
        outputs: list[RequestOutput] = []
        token_ids = result.token_ids.tolist()
        allow_jump = len(self.running) <= self.config.jump_forward_max_batch
        num_prefill = plan.num_prefill if plan.kind is StepKind.PREFILL else 0
        extend_lens = plan.extend_lens.tolist()
        for i, req in enumerate(plan.requests):
            req.num_computed += extend_lens[i]
            try:
                out = self._apply_result(req, plan, i, token_ids, result, num_prefill, allow_jump)
            except Exception as e:  # noqa: BLE001 - one request's fault (user code, a bug) ends it alone
                logger.exception("applying the step's result to %s failed", req.request_id)
                out = self._fail_request(req, f"internal error: {type(e).__name__}: {e}")
            if out is not None:
                outputs.append(out)
        sampled = plan.sample_mask
        self.stats.generated_tokens += len(plan.requests) if sampled is None else int(sampled.sum())
        self._step.kind = "mixed" if plan.num_decode else plan.kind.value
        self._step.batch_size = plan.batch_size
        self._step.decode_rows = plan.batch_size - num_prefill
        self._step.forward_s = forward_s
        self.stats.record(self._step, queue_depth=len(self.waiting), running=len(self.running),
                          kv_used=self.pool.used(), cached=self.tree.cached_tokens())
        return outputs

    def _apply_result(self, req: Request, plan: StepPlan, i: int, token_ids: list[int], result: SampleResult,
                      num_prefill: int, allow_jump: bool) -> RequestOutput | None:
        if i < num_prefill and not self._after_prefill(req, plan, i, token_ids):
            return None  # a non-final chunk: nothing to sample yet
        reason = self.outputs.append_token(req, token_ids[i], result, i, allow_jump=allow_jump)
        if req.pending_rollback is not None:
            return self._rollback(req)
        if reason is not None:
            self._remove_running(req)
            return self._finish(req, reason, has_new_token=True)
        if req.pending_extend:
            self._requeue_for_extend(req)
            return None
        return self.outputs.emit(req, final=False, has_new_token=True)

    def _fail_request(self, req: Request, error: str) -> RequestOutput | None:
        if req.is_finished or req.request_id not in self.requests:
            return None
        if req in self.running:
            self._remove_running(req)
        if req in self.waiting:
            self.waiting.remove(req)
        if req is self.chunked:
            self.chunked = None
        return self._finish(req, FinishReason.ERROR, error=error)

    def _after_prefill(self, req: Request, plan: StepPlan, i: int, token_ids: list[int]) -> bool:
        """Prefill-only bookkeeping: jump-forward verification outcome, prefix caching, joining the
        decode group. False for a non-final chunk (nothing is sampled for it)."""
        req.forced_pending = 0
        mismatch, req.forced_mismatch = req.forced_mismatch, None
        if mismatch is not None:  # the model would not have produced the forced tokens from here
            keep, token_ids[i], req.sample_override = mismatch
            self.outputs.replaced_samples.append(req)  # the sampler counted the discarded sample
            self._drop_forced_tail(req, keep)
        if self.use_cache:
            self._cache_computed_prefix(req)
        if plan.sample_mask is not None and not plan.sample_mask[i]:
            return False
        req.status = RequestStatus.DECODE
        self.running[req] = None
        self.running_version += 1
        return True

    def _drop_forced_tail(self, req: Request, keep: int) -> None:
        """Forget the forced tokens from output index ``keep`` on (their KV included); the
        model's own token for that index is appended next, as if sampled in this step."""
        removed = len(req.output_ids) - keep
        valid = req.num_computed - removed  # KV of positions before the first dropped token
        self.pool.slots.free(self.pool.row_slots(req.pool_row, req.num_computed)[max(valid, req.prefix_len):].copy())
        req.num_computed = max(valid, req.prefix_len)
        del req.output_ids[keep:]
        del req.output_logprobs[keep:]
        del req.output_top_logprobs[keep:]
        self.outputs.rewind(req, keep)

    def _requeue_for_extend(self, req: Request) -> None:
        """Jump-forward added several tokens at once: their KV is computed by one prefill (extend)
        on top of the cached sequence instead of one decode step each."""
        req.pending_extend = False
        self._remove_running(req)
        self._release_kv(req, cache=True)
        req.status = RequestStatus.WAITING
        self.waiting.appendleft(req)
        self._step.jump_forwards += 1

    def _rollback(self, req: Request) -> RequestOutput | None:
        """A validator rejected a value: take the output back to the value's first token, ban that
        token there, and requeue the request (its kept prefix is served from the cache). Past
        the retry bound the request ends with ``constraint_violation``."""
        assert req.pending_rollback is not None and req.matcher is not None
        keep, ban_at, why = req.pending_rollback
        req.pending_rollback = None
        req.num_rollbacks += 1
        self._remove_running(req)
        if req.num_rollbacks > req.params.max_validation_retries:
            return self._finish(req, FinishReason.CONSTRAINT_VIOLATION,
                                error=f"the output kept failing validation; last reason: {why}")
        removed = len(req.output_ids) - keep
        req.matcher.rollback(removed)
        req.bans = {pos: toks for pos, toks in req.bans.items() if pos <= keep or pos == ban_at}
        req.bans.setdefault(ban_at, set()).add(req.output_ids[ban_at])
        del req.output_ids[keep:]
        del req.output_logprobs[keep:]
        del req.output_top_logprobs[keep:]
        self.outputs.rewind(req, keep)
        # KV stays valid for the kept tokens but the last one (it is fed again to resample)
        kept_computed = req.prompt_len + keep - 1
        if kept_computed >= req.prefix_len:
            tail = self.pool.row_slots(req.pool_row, req.num_computed)[kept_computed:].copy()
            self.pool.slots.free(tail)
            req.num_computed = kept_computed
            self._release_kv(req, cache=True)
        else:  # the cached prefix reaches past the rollback point: keep the tree's copy, drop ours
            self._release_kv(req, cache=False)
        req.status = RequestStatus.WAITING
        self.waiting.appendleft(req)
        self._step.rollbacks += 1
        logger.debug("rolled back %s to output token %d: %s", req.request_id, keep, why)
        return None

    def _finish(
        self, req: Request, reason: FinishReason, *, error: str | None = None, has_new_token: bool = False
    ) -> RequestOutput:
        # A failed step may have left garbage in its slots: do not cache them then.
        self._release_kv(req, cache=reason is not FinishReason.ERROR)
        req.status = RequestStatus.ABORTED if reason in (FinishReason.ABORT, FinishReason.ERROR) else RequestStatus.FINISHED
        req.finish_reason = reason
        req.error = error or req.error
        out = self.outputs.emit(req, final=True, has_new_token=has_new_token)
        assert out is not None, "a final output is always emitted"
        self.stats.num_shortened += out.shortened
        self.outputs.remove(req)
        del self.requests[req.request_id]
        return out

    def fail_step(self, plan: StepPlan, error: str) -> None:
        """An internal fault during the step: end its requests with an error, keep serving."""
        for i, req in enumerate(plan.requests):
            if not req.is_finished:
                req.num_computed += int(plan.extend_lens[i])  # their slots were allocated for this step
                self._fail_request(req, error)
