"""Batch planning: which requests run in the next step, and in what shape.

Each step is a prefill batch or a decode batch; with ``mixed_steps`` a prefill batch also
carries every running request's next token (its rows last), under a smaller prefill budget,
unless it admits new requests only and computes fewer than ``prefill_alone_below_tokens`` tokens
(then it runs alone and the running requests decode in the next step). A
prefill batch admits waiting requests (by policy) under a token budget, the running cap and the
KV room left after reserving part of what running requests may still generate; each admitted
request first takes its longest cached prefix from the radix tree (locked while it runs) and
computes only the rest. Prompts longer than ``chunked_prefill_size`` are computed a chunk per
step, the running requests decoding in between (inside those steps when they are mixed). Under
KV pressure, unlocked tree leaves are evicted first; if that is not enough a half-prefilled
prompt and then the most recently admitted running requests are retracted (their computed
tokens go into the tree, so they resume cheaply).
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator

import numpy as np

from radixgen.config import EngineConfig
from radixgen.engine.decode_batch import DecodeArrays, DecodeBatchCache, Keyed, current
from radixgen.engine.kv_cache import KVCacheManager
from radixgen.engine.plan import PromptScoring, StepKind, StepPlan
from radixgen.engine.request import Request, RequestStatus
from radixgen.engine.speculative import NgramDrafter
from radixgen.engine.stats import SchedulerStats, StepLog

logger = logging.getLogger(__name__)

# Decode room reserved per running request when admitting new ones: half of what it may still
# generate, up to a horizon. Over-commit is safe (retraction) but costs the retracted requests'
# recompute; under-use wastes batch slots. The horizon doubles on each retraction (long outputs
# would otherwise be admitted, retracted and admitted again) and decays back to its base while
# steps pass without one, as SGLang's new-token ratio does.
_RESERVE_RATIO = 0.5
_RESERVE_HORIZON_BASE = 128
_RESERVE_HORIZON_DECAY = 1 / 512  # per step that decodes: the excess halves in ~350 steps
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


def _forced_pending(req: Request) -> int:
    """Jump-forward's forced tokens at the end of the output awaiting verification."""
    return req.constraint.forced_pending if req.constraint is not None else 0


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


class RequestQueue:
    """The waiting requests, front first: O(1) at both ends and O(1) removal of any of them (a
    deque's ``remove`` scanned the whole queue for each aborted request: a disconnect storm over
    a long queue was quadratic)."""

    def __init__(self, requests: Iterable[Request] = ()) -> None:
        self._order: OrderedDict[Request, None] = OrderedDict.fromkeys(requests)

    def append(self, req: Request) -> None:
        self._order[req] = None

    def appendleft(self, req: Request) -> None:
        self._order[req] = None
        self._order.move_to_end(req, last=False)

    def popleft(self) -> Request:
        return self._order.popitem(last=False)[0]

    def front(self) -> Request:
        return next(iter(self._order))

    def remove(self, req: Request) -> None:
        self._order.pop(req, None)

    def __contains__(self, req: object) -> bool:
        return req in self._order

    def __len__(self) -> int:
        return len(self._order)

    def __iter__(self) -> Iterator[Request]:
        return iter(self._order)


class BatchPlanner:
    """Owns the waiting queue, the running set and the request part-way through chunked
    prefill; plans each step over them through the KV cache manager."""

    def __init__(self, config: EngineConfig, kv: KVCacheManager, stats: SchedulerStats, log: StepLog,
                 finish_too_long: Callable[[Request], None]) -> None:
        self.config = config
        self.kv = kv
        self.stats = stats
        self.log = log
        self.finish_too_long = finish_too_long
        """Ends a request that alone fills the whole pool (finish_reason length)."""
        self.waiting = RequestQueue()
        self.running: dict[Request, None] = {}
        """Running requests in admission order (a dict: O(1) removal, the newest last)."""
        self.running_version = 0
        """Bumped whenever ``running`` changes; per-batch arrays are reused while it stands."""
        self.decode_batch = DecodeBatchCache()
        """What the running batch's decode steps reuse while it stands (engine/decode_batch.py)."""
        self.chunked: Request | None = None
        """The request whose prompt is part-way through chunked prefill (holds KV, not running)."""
        self.reserve = DecodeReserve(kv.pool.max_context_len)
        self._decode_turn = False
        self.drafter = NgramDrafter(config, kv.pool.max_context_len)  # requests may ask for it when off

    # ---- the sets -----------------------------------------------------------------------

    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self.chunked)

    def add_running(self, req: Request) -> None:
        self.running[req] = None
        self.running_version += 1

    def remove_running(self, req: Request) -> None:
        del self.running[req]
        self.running_version += 1

    def requeue(self, req: Request) -> None:
        """Back to the front of the queue (its KV already given back)."""
        req.status = RequestStatus.WAITING
        self.waiting.appendleft(req)

    def forget_decode_batch(self) -> None:
        """The next decode step gathers its rows, inputs and sampling parameters afresh."""
        self.decode_batch.forget()

    def discard(self, req: Request) -> None:
        """Take ``req`` out of whichever set holds it (it is ending)."""
        if req.status is RequestStatus.WAITING:
            self.waiting.remove(req)
        elif req in self.running:
            self.remove_running(req)
        elif req is self.chunked:
            self.chunked = None

    # ---- planning -----------------------------------------------------------------------

    def schedule(self) -> StepPlan | None:
        plan = None
        batch = self.decode_batch
        known_inputs, batch.next_inputs = batch.next_inputs, None  # good for this plan only
        decode_first = self._decode_turn and self.running
        self._decode_turn = False
        if not decode_first and (self.chunked or self.waiting):
            plan = self._schedule_prefill()
            if plan is not None and self.running and self.config.mixed_steps:
                if self._prefills_alone(plan):
                    self._decode_turn = True  # a short prefill alone, then the running requests decode
                else:
                    plan = self._with_decode_rows(plan)
        if plan is None and self.running:
            plan = self._schedule_decode(known_inputs)
        if plan is not None and plan.kind.decodes_running:
            self.reserve.decode_step()  # the running requests decode in this step, mixed or not
        return plan

    def _prefills_alone(self, plan: StepPlan) -> bool:
        """A prefill of new requests only, shorter than ``prefill_alone_below_tokens``: its step
        runs without the running requests' decode rows. A request that has output already (its
        forced tokens requeued by jump-forward, or resumed after a retraction) stays mixed, or
        each of its few tokens would cost the decode batch a forward of its own."""
        if int(plan.extend_lens.sum()) >= self.config.prefill_alone_below_tokens:
            return False
        return not any(r.output_ids for r in plan.requests)

    def _schedule_prefill(self) -> StepPlan | None:
        budget = self.config.max_prefill_tokens
        if self.running and self.config.mixed_steps:
            budget = min(budget, self.config.max_mixed_prefill_tokens)
        chunk_cap = self.config.chunked_prefill_size or None
        room = self.kv.room() - self.reserve.total(self.running)
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
                req = self.waiting.front()  # admitted in queue order
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
            self.kv.place(req, slots)
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
        if self.config.schedule_policy != "lpm" or not self.kv.use_cache or len(self.waiting) > _LPM_MAX_QUEUE:
            return
        if len(self.waiting) > 1:
            ranked = sorted(self.waiting, key=lambda r: -self.kv.peek_prefix_len(r.all_ids()))
            self.waiting = RequestQueue(ranked)

    def _admit(self, req: Request, room: int, others_present: bool) -> bool:
        """Give ``req`` a req_to_token row and its cached prefix (locked); False if it must wait."""
        tokens = req.all_ids()
        start = req.params.prompt_logprob_start
        # a scored prompt position must be computed, so the cache serves only what precedes it
        reusable = len(tokens) - 1 if start is None else min(len(tokens) - 1, start - 1)
        forced = _forced_pending(req)
        if forced:
            # jump-forward's forced tokens are verified against the logits before each of them,
            # so those positions are computed even when the cache holds them
            reusable = min(reusable, len(tokens) - forced - 1)
        match = self.kv.match(tokens[:reusable])
        prefix = match.length if match is not None else 0
        need = len(tokens) - prefix + self.reserve.of(req)
        if others_present and need > room:
            return False
        if not self.kv.has_free_row():
            return False
        self.kv.take_row(req, match)
        if not req.admitted:
            req.admitted = True
            req.cached_tokens = prefix
            self.kv.row_params.cached_tokens[req.pool_row] = prefix
            self.stats.prompt_tokens += req.prompt_len
            self.stats.cached_prompt_tokens += min(prefix, req.prompt_len)
        self.log.current.cached_tokens += prefix
        return True

    def _unadmit(self, req: Request) -> None:
        """Undo ``_admit`` for a request that did not make it into the batch after all."""
        if req is self.chunked:
            return  # keeps its row and its computed chunks
        self.kv.release(req, cache=False)
        self.waiting.appendleft(req)  # it was the queue's front

    def _prefill_plan(self, reqs: list[Request], extends: list[int], is_last: list[bool]) -> StepPlan:
        extend_lens = np.array(extends, dtype=np.int64)
        prefix_lens = np.array([r.num_computed for r in reqs], dtype=np.int64)
        input_ids = np.concatenate(
            [np.asarray(r.all_ids()[p : p + n], dtype=np.int64) for r, p, n in zip(reqs, prefix_lens, extends, strict=True)]
        )
        positions = np.concatenate([np.arange(p, p + n) for p, n in zip(prefix_lens, extends, strict=True)])
        rows = np.array([r.pool_row for r in reqs], dtype=np.int64)
        out_cache_loc = self.kv.slots_at(np.repeat(rows, extend_lens), positions)
        self.log.current.new_tokens = int(extend_lens.sum())
        # forced tokens are verified only when the whole run is in this step's extend
        forced = [_forced_pending(r) for r in reqs]
        verify = np.array([f if last and f < n else 0 for f, n, last in zip(forced, extends, is_last, strict=True)],
                          dtype=np.int64)
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
        self.kv.write(rows, positions, slots)
        self.decode_batch.arrays = None  # the next decode step's positions are not the last ones + 1
        self._decode_turn = False  # the running requests decode in this step
        ones = np.ones(len(reqs), dtype=np.int64)
        self.log.current.new_tokens += len(reqs)
        return StepPlan(
            kind=StepKind.MIXED, requests=plan.requests + reqs, rows=np.concatenate([plan.rows, rows]),
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

    def _schedule_decode(self, known_inputs: Keyed[np.ndarray] | None = None) -> StepPlan | None:
        if self.chunked is not None and self.kv.short_of(len(self.running)):
            # a half-prefilled prompt holds KV that no running request can use: it goes first
            self._retract_chunked()
        while self.kv.short_of(len(self.running)) and len(self.running) > 1:
            self._retract(next(reversed(self.running)))
        need = len(self.running)
        if self.drafter.active:
            plan = self._schedule_speculative()
            if plan is not None:
                return plan
        slots = self._alloc_slots(need)
        if slots is None:
            # One request alone has filled the whole pool: it cannot grow any further.
            self.finish_too_long(next(iter(self.running)))
            return None
        version = self.running_version
        cached = current(self.decode_batch.arrays, version)
        if cached is not None:  # same batch as the last decode step: every sequence grew by exactly one token
            reqs, rows, positions = cached.requests, cached.rows, cached.positions + 1
        else:
            reqs = list(self.running)
            rows, positions = _rows_and_positions(reqs)
        batch = len(reqs)
        self.decode_batch.arrays = Keyed(version, DecodeArrays(reqs, rows, positions))
        self.kv.write(rows, positions, slots)
        known = current(known_inputs, version)
        input_ids = known if known is not None else _last_tokens(reqs)
        self.log.current.new_tokens = batch
        return StepPlan(
            kind=StepKind.DECODE, requests=reqs, rows=rows, prefix_lens=positions,
            extend_lens=np.ones(batch, dtype=np.int64), input_ids=input_ids, positions=positions,
            out_cache_loc=slots, batch_version=self.running_version,
        )

    def lookahead_decode(self, plan: StepPlan, tokens: np.ndarray) -> StepPlan | None:
        """The decode step after ``plan``, planned before ``plan``'s results are applied
        (overlapped scheduling): the same rows one position on, fed the tokens ``plan`` sampled.
        None wherever the next step might be anything else (requests that could be admitted, a
        chunked prompt, drafts to verify, a batch changed since, no room without retracting),
        and the caller plans after applying the results instead."""
        if (plan.kind is not StepKind.DECODE
                or plan.batch_version is None or plan.batch_version != self.running_version
                or self.chunked is not None or self.drafter.may_draft(plan.requests)
                or (self.waiting and len(self.running) < self.config.max_running_requests)):
            return None
        positions = plan.positions + 1
        if int(positions.max()) >= self.kv.pool.max_context_len or self.kv.short_of(len(positions)):
            return None
        slots = self._alloc_slots(len(positions))
        if slots is None:
            return None
        self._decode_turn = False  # what schedule() does on its way to a decode step
        self.kv.write(plan.rows, positions, slots)
        cached = current(self.decode_batch.arrays, plan.batch_version)
        if cached is not None:
            self.decode_batch.arrays = Keyed(plan.batch_version, cached._replace(positions=positions))
        self.reserve.decode_step()
        self.log.current.new_tokens = len(positions)
        return StepPlan(
            kind=StepKind.DECODE, requests=plan.requests, rows=plan.rows, prefix_lens=positions,
            extend_lens=plan.extend_lens, input_ids=tokens.astype(np.int64, copy=True), positions=positions,
            out_cache_loc=slots, batch_version=plan.batch_version, lookahead=True,
        )

    def _schedule_speculative(self) -> StepPlan | None:
        """A decode step in which the requests that drafted tokens feed them after their newest
        token, as extends (their rows first, the others decoding one token after them); None
        when no request drafted or the pool has no room for the drafts."""
        reqs = list(self.running)
        drafts = self.drafter.draft(reqs)
        if not drafts:
            return None
        extra = sum(len(d) for d in drafts.values())
        if self.kv.short_of(len(reqs) + extra):
            for req in drafts:
                self.drafter.record(req, 0, 0)
            return None
        spec = [r for r in reqs if r in drafts]
        plain = [r for r in reqs if r not in drafts]
        ordered = spec + plain
        draft_lens = np.array([len(drafts[r]) for r in spec] + [0] * len(plain), dtype=np.int64)
        extend_lens = draft_lens + 1
        prefix_lens = np.fromiter((r.seq_len - 1 for r in ordered), dtype=np.int64, count=len(ordered))
        input_ids = np.fromiter((t for r in ordered for t in (r.output_ids[-1], *drafts.get(r, ()))), dtype=np.int64,
                                count=int(extend_lens.sum()))
        positions = np.concatenate([np.arange(p, p + n) for p, n in zip(prefix_lens, extend_lens, strict=True)])
        rows = np.fromiter((r.pool_row for r in ordered), dtype=np.int64, count=len(ordered))
        slots = self._alloc_slots(len(input_ids))
        assert slots is not None, "room was checked"
        self.kv.write(np.repeat(rows, extend_lens), positions, slots)
        self.decode_batch.arrays = None  # positions moved by more than one
        self.log.current.new_tokens = len(input_ids)
        return StepPlan(
            kind=StepKind.SPECULATIVE, requests=ordered, rows=rows, prefix_lens=prefix_lens, extend_lens=extend_lens,
            input_ids=input_ids, positions=positions, out_cache_loc=slots,
            sample_mask=draft_lens == 0, verify_counts=draft_lens, draft_lens=draft_lens, num_decode=len(plain),
        )

    def _alloc_slots(self, n: int) -> np.ndarray | None:
        slots, evicted = self.kv.alloc(n)
        self.log.current.evicted_tokens += evicted
        return slots

    def _retract(self, req: Request) -> None:
        """Give a running request's KV back (into the tree); it re-enters the queue first."""
        self.remove_running(req)
        self._requeue_retracted(req)

    def _retract_chunked(self) -> None:
        req = self.chunked
        assert req is not None
        self.chunked = None
        self._requeue_retracted(req)

    def _requeue_retracted(self, req: Request) -> None:
        self.kv.release(req, cache=True)
        req.num_retractions += 1
        self.log.current.retracted += 1
        self.log.current.retracted_again += req.num_retractions > 1
        self.reserve.retracted()
        self.requeue(req)
        logger.debug("retracted %s (%d tokens)", req.request_id, req.seq_len)
