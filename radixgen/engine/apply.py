"""Applying a step: what its sampled tokens mean for each of its requests.

A token is appended (with the constraint's forced text after it, jump-forward), a finished
request gives its KV to the tree and its final output to the callback, a prefill's chunk is
cached as soon as it is computed, jump-forward's extends and a validator's rollbacks send the
request back to the queue, and a fault in one request ends that request alone.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import numpy as np

from radixgen.config import EngineConfig
from radixgen.constraints.state import ForcedMismatch, Rollback
from radixgen.engine.append import TokenAppender
from radixgen.engine.decode_batch import Keyed, current
from radixgen.engine.kv_cache import KVCacheManager
from radixgen.engine.output import Columns, FinishReason, RequestOutput, StepDeltas
from radixgen.engine.plan import StepKind, StepPlan
from radixgen.engine.planner import BatchPlanner
from radixgen.engine.request import Request, RequestStatus
from radixgen.engine.row_outcome import GO_ON, ExtendForced, Finish, RollBack, RowOutcome
from radixgen.engine.row_params import RowParams
from radixgen.engine.sampler import SampleResult
from radixgen.engine.speculative import Verdict
from radixgen.engine.stats import SchedulerStats, StepLog

logger = logging.getLogger(__name__)

_REPAIRS_PER_RETRY = 4
"""Values the validators may write in one output per retry it is allowed (max_validation_retries)."""


@dataclass
class _SteadyBatch:
    """A decode batch's constants for ``StepApplier._steady_step`` (``sink`` None: the
    batch is not one whose every row streams plain deltas into one sink)."""

    version: int
    sink: StepDeltas | None
    end_at: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))
    """[B] the sequence length at which each row ends (its max tokens, or the context)."""
    stops_at_eos: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=bool))
    prompt_len: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))
    columns: Columns = (None, [], [], [])
    """The deltas' request ids, prompt and cached lengths, keyed by the batch's version: sent
    once per batch (engine/output.py)."""

    @classmethod
    def of(cls, plan: StepPlan, table: RowParams, max_context_len: int) -> _SteadyBatch:
        assert plan.batch_version is not None
        rows = plan.rows
        sinks = table.sink[rows]
        if not len(rows) or not table.fast_lane[rows].all() or sinks[0] < 0 or not (sinks == sinks[0]).all():
            return cls(plan.batch_version, None)
        prompt_len = table.prompt_len[rows]
        return cls(plan.batch_version, table.sinks[int(sinks[0])],
                   end_at=table.end_at(rows, max_context_len),
                   stops_at_eos=~table.ignore_eos[rows], prompt_len=prompt_len,
                   columns=(plan.batch_version, table.request_id[rows].tolist(), prompt_len.tolist(),
                            table.cached_tokens[rows].tolist()))


def _ending(tokens: np.ndarray, seq_len: np.ndarray, end_at: np.ndarray, stops_at_eos: np.ndarray,
            eos_ids: np.ndarray) -> np.ndarray:
    """[B] bool: the decode rows their token ends: the sequence reaches its end (max tokens or the
    context; ``seq_len`` counts the token), or it is an EOS id and the row stops at EOS. (A
    request's stop ids and stop strings are checked on the per-request path, ``append``.)"""
    ends = seq_len >= end_at
    for token in eos_ids.tolist():  # one to three ids: cheaper than np.isin's sort
        ends |= (tokens == token) & stops_at_eos
    return ends


class StepApplier:
    def __init__(self, config: EngineConfig, kv: KVCacheManager, planner: BatchPlanner, appender: TokenAppender,
                 stats: SchedulerStats, log: StepLog, requests: dict[str, Request]) -> None:
        self.config = config
        self.kv = kv
        self.planner = planner
        self.appender = appender
        self.stats = stats
        self.log = log
        self.requests = requests
        """Every request the scheduler holds (shared with it); a finished one leaves it here."""

    def process_results(self, plan: StepPlan, result: SampleResult, forward_s: float = 0.0,
                        verdicts: dict[int, Verdict] | None = None) -> list[RequestOutput]:
        """Apply a step's sampled tokens (and a speculative step's verdicts); return the outputs
        handed to callbacks (finals always)."""
        outputs: list[RequestOutput] = []
        drafter = self.planner.drafter
        num_prefill = plan.num_prefill if plan.kind.runs_as_extend else 0
        rest: list[int] = []  # the rows left to the per-request path
        token_ids: list[int] = []
        if verdicts is None and self._steady_step(plan, result):
            pass
        else:
            token_ids = result.token_ids.tolist()
            plain = self._plain_decode_rows(plan, result, verdicts)
            if plain is not None:
                self._apply_plain(plan, plain, result, token_ids, outputs)
                if plan.batch_version is not None and plain.all():  # each row appended exactly its sample
                    self.planner.decode_batch.next_inputs = Keyed(plan.batch_version, result.token_ids.copy())
            rest = list(range(len(plan.requests))) if plain is None else np.flatnonzero(~plain).tolist()
        # the batch the next step decodes: this step's finished prompts join it as it is applied
        running = len(self.planner.running) + _joining(plan, num_prefill)
        # jump-forward's extend reuses the cached sequence; without the radix cache it would
        # compute the whole sequence again, so the forced tokens are decoded (or drafted) instead
        allow_jump = self.kv.use_cache and running <= self.config.jump_forward_max_batch
        extend_lens = plan.extend_lens.tolist() if rest else []
        for i in rest:
            req = plan.requests[i]
            req.num_computed += extend_lens[i]
            # a greedy drafting request drafts the forced text with what follows it, in the decode
            # step, instead of a jump-forward extend of its own (the output is the same: both are
            # verified against the model's argmax); a sampled one keeps jump-forward, which appends
            # the forced text's own tokens where drafting would sample them
            jump = allow_jump and not (req.params.is_greedy and drafter.active and drafter.drafting(req, running))
            try:
                if verdicts is not None and i in verdicts:
                    out = self._apply_verdict(req, plan, i, result, verdicts[i], jump)
                else:
                    out = self._apply_result(req, plan, i, token_ids, result, num_prefill, jump)
            except Exception as e:  # noqa: BLE001 - one request's fault (user code, a bug) ends it alone
                logger.exception("applying the step's result to %s failed", req.request_id)
                out = self._fail_request(req, f"internal error: {type(e).__name__}: {e}")
            if out is not None:
                outputs.append(out)
        sampled = plan.sample_mask
        self.stats.generated_tokens += len(plan.requests) if sampled is None else int(sampled.sum())
        step = self.log.current
        step.kind = plan.kind.value
        step.batch_size = plan.batch_size
        step.decode_rows = plan.batch_size - num_prefill
        if plan.kind is StepKind.SPECULATIVE:  # logged as a decode step whose rows carried drafts
            assert plan.draft_lens is not None
            step.kind, step.decode_rows = "decode", plan.batch_size
            step.drafted_tokens = int(plan.draft_lens.sum())
            step.accepted_tokens = sum(len(v.accepted) for v in (verdicts or {}).values())
            step.verified_drafts = int((plan.draft_lens > 0).sum())
        step.forward_s = forward_s
        self.stats.record(step, queue_depth=len(self.planner.waiting), running=len(self.planner.running),
                          kv_used=self.kv.used(), cached=self.kv.cached_tokens())
        return outputs

    def _steady_step(self, plan: StepPlan, result: SampleResult) -> bool:
        """The serving steady state, whole: a decode step of an unchanged batch whose every row
        is a plain stream with its text made by the consumer and its deltas in one sink, and
        none of them ends here. What does not change between such steps (where each row ends,
        the deltas' ids, prompt and cached lengths) is gathered once per batch (``_SteadyBatch``);
        a step only appends, checks ends and adds one block. False (nothing done) otherwise."""
        version = plan.batch_version
        if version is None:
            return False
        cache = self.planner.decode_batch
        steady = current(cache.steady, version)
        if steady is None:
            steady = _SteadyBatch.of(plan, self.kv.row_params, self.appender.max_context_len)
            cache.steady = Keyed(version, steady)
        if steady.sink is None:
            return False
        tokens = result.token_ids
        seq_len = plan.prefix_lens + 2  # with the token this step appends
        if _ending(tokens, seq_len, steady.end_at, steady.stops_at_eos, self.appender.eos_array).any():
            return False
        token_list = tokens.tolist()
        for req, token in zip(plan.requests, token_list, strict=True):
            req.num_computed += 1
            output_ids = req.output_ids
            output_ids.append(token)
            req.num_emitted = len(output_ids)  # the block below streams it
        steady.sink.blocks.append((steady.columns, token_list, None, (seq_len - steady.prompt_len).tolist()))
        cache.next_inputs = Keyed(version, tokens.copy())
        return True

    def _plain_decode_rows(self, plan: StepPlan, result: SampleResult,
                           verdicts: dict[int, Verdict] | None) -> np.ndarray | None:
        """[B] bool: the decode rows whose token only appends, detokenizes and streams (a plain
        request that does not end with it), found with gathers over the row table; None when
        the step has none."""
        if verdicts is not None or plan.kind is StepKind.SPECULATIVE:
            return None
        start = plan.num_prefill if plan.kind.runs_as_extend else 0
        if start >= len(plan.requests):
            return None
        rows, tokens = plan.rows[start:], result.token_ids[start:]
        table = self.kv.row_params
        seq_len = plan.prefix_lens[start:] + 2  # with the token this step appends
        ends = _ending(tokens, seq_len, table.end_at(rows, self.appender.max_context_len), ~table.ignore_eos[rows],
                       self.appender.eos_array)
        plain = np.zeros(len(plan.requests), dtype=bool)
        plain[start:] = table.fast_lane[rows] & ~ends
        return plain

    def _apply_plain(self, plan: StepPlan, plain: np.ndarray, result: SampleResult, token_ids: list[int],
                     outputs: list[RequestOutput]) -> None:
        """The batched lane of ``process_results``; a request whose stream callback raised ends
        alone, as on the per-request path."""
        indices = np.flatnonzero(plain)
        table = self.kv.row_params
        sinks = table.sink[plan.rows[indices]]
        in_blocks = sinks >= 0
        requests = plan.requests
        if in_blocks.any():  # streams whose text the consumer makes: deltas gathered as blocks
            block = indices[in_blocks]
            tokens = result.token_ids[block]
            everyone = len(block) == len(requests)
            for req, token in zip(requests if everyone else [requests[i] for i in block.tolist()], tokens.tolist(),
                                  strict=True):
                req.num_computed += 1
                output_ids = req.output_ids
                output_ids.append(token)
                req.num_emitted = len(output_ids)  # the block below streams it
            self.appender.gather_blocks(plan, block, tokens, sinks[in_blocks], table)
            indices = indices[~in_blocks]
        rows = indices.tolist()
        for i in rows:
            requests[i].num_computed += 1
        failed = self.appender.append_plain(requests, rows, token_ids, outputs)
        for req, e in failed:
            logger.error("streaming %s's output failed: %s: %s", req.request_id, type(e).__name__, e)
            out = self._fail_request(req, f"internal error: {type(e).__name__}: {e}")
            if out is not None:
                outputs.append(out)

    def _apply_result(self, req: Request, plan: StepPlan, i: int, token_ids: list[int], result: SampleResult,
                      num_prefill: int, allow_jump: bool) -> RequestOutput | None:
        token, sampled = token_ids[i], None
        if i < num_prefill:
            mismatch = self._take_forced_mismatch(req)
            if mismatch is not None:  # the model's own token follows the forced tokens it kept
                token, sampled = mismatch.token, (mismatch.logprob, mismatch.top_logprobs)
            if not self._after_prefill(req, plan, i):
                return None  # a non-final chunk: nothing to sample yet
        outcome = self.appender.append_token(req, token, result, i, allow_jump=allow_jump, sampled=sampled)
        return self._after_append(req, outcome)

    def _after_append(self, req: Request, outcome: RowOutcome) -> RequestOutput | None:
        """What the step's new tokens lead to: a rollback, the end, a jump-forward extend, or a delta."""
        if isinstance(outcome, RollBack):
            return self._rollback(req, outcome.rollback)
        if isinstance(outcome, Finish):
            self.planner.remove_running(req)
            return self.finish(req, outcome.reason)
        if isinstance(outcome, ExtendForced):
            self._requeue_for_extend(req)
            return None
        return self.appender.emit(req, final=False)

    def _apply_verdict(self, req: Request, plan: StepPlan, i: int, result: SampleResult, verdict: Verdict,
                       allow_jump: bool) -> RequestOutput | None:
        """A speculative row: its accepted drafts and the model's token after them are appended
        one by one, the ordinary way (the automaton, stops, steering and text see each); the
        slots of drafts that did not become output are freed."""
        state = req.speculation
        assert state is not None
        fed = state.draft
        newest_position = int(plan.prefix_lens[i])  # where the request's newest token stood
        start = len(req.output_ids)
        tokens = [*verdict.accepted, verdict.next_token]
        outcome: RowOutcome = GO_ON
        for j, token in enumerate(tokens):
            last = j == len(tokens) - 1
            # the batch's row holds only the last position's log-probabilities
            sampled = verdict.logprobs[j] if verdict.logprobs is not None else None
            outcome = self.appender.append_token(req, token, result, i, allow_jump=allow_jump and last,
                                                 sampled=sampled)
            if isinstance(outcome, (Finish, RollBack)):
                break
            if not last and (len(req.output_ids) != start + j + 1 or req.output_ids[-1] != token):
                break  # steering put other tokens in its place: the rest of the draft no longer follows
        if req.params.has_penalties:  # the sampler counted its own sample of the row, not these tokens
            self.appender.replaced_samples.append(req)
        self.planner.drafter.record(req, len(fed), len(verdict.accepted))
        appended = req.output_ids[start:]
        valid = 0  # drafts whose K/V this step computed and that are now output
        while valid < min(len(appended), len(fed)) and appended[valid] == fed[valid]:
            valid += 1
        self.kv.truncate(req, min(newest_position + 1 + valid, req.seq_len - 1))
        self.stats.generated_tokens += len(appended)  # sample_mask counts none of a drafting row's tokens
        return self._after_append(req, outcome)

    def _fail_request(self, req: Request, error: str) -> RequestOutput | None:
        if req.is_finished or req.request_id not in self.requests:
            return None
        self.planner.discard(req)
        return self.finish(req, FinishReason.ERROR, error=error)

    def _take_forced_mismatch(self, req: Request) -> ForcedMismatch | None:
        """The verification of a prefill's forced tokens (jump-forward): where the model would not
        have written them from some token on, they are dropped from there, and the mismatch
        (the model's own token there) is returned."""
        mismatch = req.constraint.take_mismatch() if req.constraint is not None else None
        if mismatch is not None:
            self.appender.replaced_samples.append(req)  # the sampler counted the discarded sample
            self._drop_forced_tail(req, mismatch.keep)
        return mismatch

    def _after_prefill(self, req: Request, plan: StepPlan, i: int) -> bool:
        """Prefill-only bookkeeping: prefix caching, joining the decode group. False for a
        non-final chunk (nothing is sampled for it)."""
        if self.kv.use_cache:
            self.kv.cache_computed_prefix(req)
        if plan.sample_mask is not None and not plan.sample_mask[i]:
            return False
        req.status = RequestStatus.DECODE
        self.planner.add_running(req)
        return True

    def _drop_forced_tail(self, req: Request, keep: int) -> None:
        """Forget the forced tokens from output index ``keep`` on (their KV included); the
        model's own token for that index is appended next, as if sampled in this step."""
        removed = len(req.output_ids) - keep
        self.kv.truncate(req, req.num_computed - removed)  # keeps the positions before the first dropped token
        self._truncate_output(req, keep)
        state = req.constraint
        if state is not None:  # the report counts the forced tokens that stayed
            state.forced_tokens -= removed
            state.forced_drops += 1

    def _truncate_output(self, req: Request, keep: int) -> None:
        """Keep the first ``keep`` output tokens (their logprobs and text state with them)."""
        del req.output_ids[keep:]
        del req.output_logprobs[keep:]
        del req.output_top_logprobs[keep:]
        req.num_emitted = min(req.num_emitted, keep)
        self.appender.rewind(req, keep)

    def _requeue_for_extend(self, req: Request) -> None:
        """Jump-forward added several tokens at once: their KV is computed by one prefill (extend)
        on top of the cached sequence instead of one decode step each."""
        self.planner.remove_running(req)
        self.kv.release(req, cache=True)
        self.planner.requeue(req)
        self.log.current.jump_forwards += 1

    def _rollback(self, req: Request, rollback: Rollback) -> RequestOutput | None:
        """A validator rejected a value: take the output back to the value's first token, ban that
        token there, and requeue the request (its kept prefix is served from the cache). Past
        the retry bound the request ends with ``constraint_violation``."""
        state = req.constraint
        assert state is not None
        if rollback.fallback is not None and not (
                rollback.replacement is not None and self.appender.accepts_at(req, rollback.keep, rollback.replacement)):
            rollback = rollback.fallback
        keep, ban_at, why = rollback.keep, rollback.ban_at, rollback.reason
        # a value the validators write themselves (a closer after repeats, a searched value) holds
        # by construction: it is no retry of the model's, but it is bounded all the same
        if rollback.replacement is not None:
            state.num_repairs += 1
        else:
            state.num_rollbacks += 1
        self.planner.remove_running(req)
        retries = req.params.max_validation_retries
        if state.num_rollbacks > retries or state.num_repairs > _REPAIRS_PER_RETRY * retries:
            return self.finish(req, FinishReason.CONSTRAINT_VIOLATION,
                                error=f"the output kept failing validation; last reason: {why}")
        removed = len(req.output_ids) - keep
        state.matcher.rollback(removed)
        state.bans = {pos: toks for pos, toks in state.bans.items() if pos <= keep or pos == ban_at}
        state.bans.setdefault(ban_at, set()).add(req.output_ids[ban_at] if rollback.token is None else rollback.token)
        self._truncate_output(req, keep)
        # KV stays valid for the kept tokens but the last one (it is fed again to resample)
        kept_computed = req.prompt_len + keep - 1
        if kept_computed >= req.prefix_len:
            self.kv.truncate(req, kept_computed)
            self.kv.release(req, cache=True)
        else:  # the cached prefix reaches past the rollback point: keep the tree's copy, drop ours
            self.kv.release(req, cache=False)
        self.log.current.rollbacks += 1
        replacement = rollback.replacement
        if replacement is not None and self.appender.force_text(req, replacement):
            logger.info("%s: wrote %r in place of a value its validators rejected %s", req.request_id, replacement, why)
            self.stats.num_searched_values += 1
            state.searched_values += 1
            if rollback.ends_output and self.appender.complete_written(req):
                return self.finish(req, FinishReason.STOP)  # its row and slots were given back above
        # the requeued prefill computes the written tokens' KV and samples what follows
        self.planner.requeue(req)
        logger.debug("rolled back %s to output token %d: %s", req.request_id, keep, why)
        return None

    def finish(
        self, req: Request, reason: FinishReason, *, error: str | None = None
    ) -> RequestOutput:
        # A failed step may have left garbage in its slots: do not cache them then.
        self.kv.release(req, cache=reason is not FinishReason.ERROR)
        req.status = RequestStatus.ABORTED if reason in (FinishReason.ABORT, FinishReason.ERROR) else RequestStatus.FINISHED
        req.finish_reason = reason
        req.error = error or req.error
        out = self.appender.emit(req, final=True)
        assert out is not None, "a final output is always emitted"
        self.stats.num_shortened += out.shortened
        self.stats.num_constraint_violations += reason is FinishReason.CONSTRAINT_VIOLATION
        self.appender.remove(req)
        del self.requests[req.request_id]
        return out

    def fail_step(self, plan: StepPlan, error: str) -> None:
        """An internal fault during the step: end its requests with an error, keep serving."""
        for i, req in enumerate(plan.requests):
            if not req.is_finished:
                req.num_computed += int(plan.extend_lens[i])  # their slots were allocated for this step
                self._fail_request(req, error)


def _joining(plan: StepPlan, num_prefill: int) -> int:
    """How many of the step's prompt rows finish their prompt here (and join the running batch)."""
    if num_prefill == 0:
        return 0
    if plan.sample_mask is None:
        return num_prefill
    return int(plan.sample_mask[:num_prefill].sum())
