"""Appending a request's tokens: stop checks, text deltas, jump-forward, budget steering, the
validators' rejections, output callbacks."""

from __future__ import annotations

import bisect
import logging
import time
from typing import Any

import numpy as np

from radixgen.constraints.backend import Matcher
from radixgen.constraints.events import Rejection
from radixgen.constraints.mask import allocate_bitmask, lone_token
from radixgen.constraints.report import REPORT_KINDS, ConstraintReport, ended_as
from radixgen.constraints.state import ConstraintState, Rollback
from radixgen.engine.constrained import automaton_failed, forced_token_ids
from radixgen.engine.detokenizer import IncrementalDetokenizer
from radixgen.engine.output import FinishReason, RequestOutput
from radixgen.engine.plan import StepPlan
from radixgen.engine.request import Request
from radixgen.engine.row_outcome import EXTEND_FORCED, GO_ON, Ended, Finish, RollBack, RowOutcome
from radixgen.engine.row_params import RowParams
from radixgen.engine.sampler import SampleResult
from radixgen.engine.steering import BudgetSteering

logger = logging.getLogger(__name__)

Logprobs = tuple[float, list[tuple[int, float]]]
"""A token's log-probability and the top alternatives' (id, log-probability)."""


class TokenAppender:
    def __init__(self, tokenizer: Any, eos_token_ids: tuple[int, ...], max_context_len: int,
                 jump_forward: bool = False, steering: BudgetSteering | None = None,
                 vocab_size: int | None = None) -> None:
        self.tokenizer = tokenizer
        self.jump_forward = jump_forward
        self.steering = steering
        self.replaced_samples: list[Request] = []
        """Requests whose sampled token was replaced this step (by steering, or by the model's
        own token found in jump-forward verification): the engine rebuilds their penalty counts."""
        self.eos_token_ids = frozenset(eos_token_ids)
        self.eos_array = np.array(sorted(self.eos_token_ids), dtype=np.int64)
        self.max_context_len = max_context_len
        self.detokenizers: dict[str, IncrementalDetokenizer] = {}
        self._lone_stop_mask = allocate_bitmask(1, vocab_size) if vocab_size else None
        """A mask row of its own for ``_lone_stop`` (the step's masks may be filled already)."""

    def add(self, req: Request) -> None:
        if self.tokenizer is None or not req.detokenize:
            return  # no text here: the trace simulator, or a consumer that makes its own
        self.detokenizers[req.request_id] = IncrementalDetokenizer(
            self.tokenizer, req.prompt_ids, skip_special_tokens=req.params.skip_special_tokens,
            stop=req.params.stop,
        )

    def remove(self, req: Request) -> None:
        self.detokenizers.pop(req.request_id, None)

    def append_token(
        self, req: Request, token: int, result: SampleResult, row: int, *, allow_jump: bool = True,
        sampled: Logprobs | None = None,
    ) -> RowOutcome:
        """Record a sampled token (and, with jump-forward, the tokens the constraint forces after
        it; with budget steering, the tokens that close the output instead of it) and say what
        follows for the request. ``sampled``: the token's log-probabilities where they are not
        the batch row's (a verified draft, the model's own token found by forced verification)."""
        if req.first_token_time is None:
            req.first_token_time = time.monotonic()
        state = req.constraint
        if state is None:  # the common, unconstrained case
            self._record_logprobs(req, result, row, sampled)
            return self._append_one(req, token) or GO_ON
        matcher = state.matcher
        if state.dead_end is not None:  # the caller's constraint cannot go on: say so, do not guess
            req.error, req.user_error = state.dead_end, True
            return Finish(FinishReason.ERROR)
        if not matcher.accept(token):
            return self._refused(req, state, token)
        if matcher.is_terminated():
            self._record_logprobs(req, result, row, sampled)
            req.output_ids.append(token)
            return self._complete(req)  # the automaton accepted its stop token
        steer = None
        if state.budget is not None and self.steering is not None:
            steer = self.steering.after_accept(req, token, req.tokens_left(self.max_context_len))
        if steer is not None:  # the sample and its log-probabilities are not kept
            self.replaced_samples.append(req)  # the sampler counted the replaced token for penalties
            tokens = steer.token_ids
            forced_from = 0
        else:
            self._record_logprobs(req, result, row, sampled)
            tokens = self._jump_forward(req, token) if self.jump_forward and allow_jump else [token]
            forced_from = 1
            if len(tokens) > 1 and state.budget is not None and self.steering is not None:
                self.steering.follow_forced(req, tokens[1:])
        for i, t in enumerate(tokens):
            if i >= forced_from:
                self._record_forced_logprobs(req, t)
            ended = self._append_one(req, t)
            if ended is not None:
                if i + 1 < len(tokens):
                    matcher.rollback(len(tokens) - 1 - i)  # forced tokens never appended
                state.cancel_forced()
                at_length = isinstance(ended, Finish) and ended.reason is FinishReason.LENGTH
                return self._complete(req) if at_length and self._stop_here(req) else ended
        if steer is not None and steer.finishes and self._stop_here(req):
            return self._complete(req)
        stop = self._lone_stop(req, matcher)
        if stop is not None:  # the step that would sample it is not run
            matcher.accept(stop)
            self._record_forced_logprobs(req, stop)
            req.output_ids.append(stop)
            return self._complete(req)
        return EXTEND_FORCED if len(tokens) > 1 else GO_ON

    def _lone_stop(self, req: Request, matcher: Matcher) -> int | None:
        """The stop token, where it is the one token the automaton allows next: a decode step
        would sample it whatever the logits (the end of a JSON document, of a choice). None
        where anything else may follow, or the output must not end yet."""
        if self._lone_stop_mask is None or len(req.output_ids) < req.params.min_new_tokens \
                or not matcher.is_completed():
            return None
        matcher.fill_bitmask(self._lone_stop_mask, 0)
        token = lone_token(self._lone_stop_mask[0])
        return token if token in matcher.stop_token_ids else None

    @staticmethod
    def gather_blocks(plan: StepPlan, rows: np.ndarray, tokens: np.ndarray, sinks: np.ndarray,
                      table: RowParams) -> None:
        """The one-token deltas of streamed plain rows (batch indices ``rows``, their ``tokens``
        already appended) whose text the consumer makes, into their ``StepDeltas``
        (``table.sink``): gathers over the row table, one block per sink."""
        pool_rows = plan.rows[rows]
        prompt = table.prompt_len[pool_rows]
        completion = plan.prefix_lens[rows] + 2 - prompt
        one_sink = bool((sinks == sinks[0]).all())  # an engine process has one
        for sink in [int(sinks[0])] if one_sink else np.unique(sinks).tolist():
            mine = slice(None) if one_sink else sinks == sink
            columns = (None, table.request_id[pool_rows[mine]].tolist(), prompt[mine].tolist(),
                       table.cached_tokens[pool_rows[mine]].tolist())
            table.sinks[sink].blocks.append((columns, tokens[mine].tolist(), None, completion[mine].tolist()))

    def append_plain(self, requests: list[Request], rows: list[int], token_ids: list[int],
                     outputs: list[RequestOutput]) -> list[tuple[Request, Exception]]:
        """Append each of ``rows``' token to a plain request that goes on (no constraint, stop
        string, stop token id or log-probabilities; not its last token: the caller checked),
        detokenize it and stream the delta into ``outputs``. Returns the requests whose
        callback raised, with what it raised."""
        failed: list[tuple[Request, Exception]] = []
        detokenizers = self.detokenizers
        for i in rows:
            req = requests[i]
            token = token_ids[i]
            output_ids = req.output_ids
            output_ids.append(token)
            text = ""
            detok = detokenizers.get(req.request_id)
            if detok is not None:
                if req.stream:
                    text = detok.stream_token(token)
                else:
                    detok.add_token(token)
            deltas = req.delta_sink
            if deltas is not None and req.stream and req.num_emitted == len(output_ids) - 1:
                req.num_emitted = upto = len(output_ids)
                deltas.request_ids.append(req.request_id)
                deltas.token_ids.append(token)
                deltas.texts.append(text)
                deltas.completion_tokens.append(upto)
                deltas.prompt_tokens.append(len(req.prompt_ids))
                deltas.cached_tokens.append(req.cached_tokens)
                continue
            callback = req.on_output
            if req.stream and callback is not None:
                since = req.num_emitted
                req.num_emitted = upto = len(output_ids)
                out = RequestOutput(request_id=req.request_id, new_token_ids=output_ids[since:upto], new_text=text,
                                    finished=False, error=req.error, user_error=req.user_error,
                                    prompt_tokens=req.prompt_len, completion_tokens=upto,
                                    cached_tokens=req.cached_tokens)
                try:
                    callback(out)
                except Exception as e:  # noqa: BLE001 - the caller's callback fails its own request alone
                    failed.append((req, e))
                outputs.append(out)
        return failed

    def _record_logprobs(self, req: Request, result: SampleResult, row: int, sampled: Logprobs | None) -> None:
        params = req.params
        if sampled is not None:
            if params.logprobs:
                req.output_logprobs.append(sampled[0])
            if params.top_logprobs:
                req.output_top_logprobs.append(sampled[1][: params.top_logprobs])
            return
        if result.logprobs is not None and params.logprobs:
            req.output_logprobs.append(float(result.logprobs[row]))
        if result.top_ids is not None and result.top_logprobs is not None and params.top_logprobs:
            n = params.top_logprobs
            req.output_top_logprobs.append(
                list(zip(result.top_ids[row, :n].tolist(), result.top_logprobs[row, :n].tolist(), strict=True))
            )

    def _stop_here(self, req: Request) -> bool:
        """At the end of the budget (or of steering), end the output if it is complete: the
        automaton takes its stop token without a step spent sampling the only allowed token."""
        assert req.constraint is not None
        return req.constraint.matcher.is_completed()

    @staticmethod
    def _refused(req: Request, state: ConstraintState, token: int) -> Ended:
        """The automaton refused a token its own mask allowed: the backend's mask and its parser
        disagreed, or its parser failed. A failed parser ends the request with its reason;
        otherwise the token is banned where it stood and that position is sampled again, as
        after a validator's rejection."""
        failure = state.matcher.error()
        if failure is not None:
            req.error, req.user_error = automaton_failed(failure), True
            return Finish(FinishReason.ERROR)
        logger.warning("%s: the constraint refused token %d that its mask allowed; sampling that position again "
                       "without it", req.request_id, token)
        here = len(req.output_ids)
        return RollBack(Rollback(here, here, f"the constraint refused token {token} that its mask allowed",
                                 token=token))

    def _complete(self, req: Request) -> Ended:
        """The automaton is terminated: a bare root value (a number) completes only here, so
        the validators see it now; a rejection rolls back like any other."""
        assert req.constraint is not None
        if req.constraint.validation is not None:
            rejection = req.constraint.validation.feed("", final=True)
            if rejection is not None:
                return self._reject(req, rejection)
        req.constraint.completed = True
        return Finish(FinishReason.STOP)

    def _jump_forward(self, req: Request, token: int) -> list[int]:
        """The sampled token plus the tokens of the text the automaton forces next, appended
        without a decode step each (they are computed together in one extend step). The last
        token of the forced text is left for the model (it may merge with what follows:
        '"' + 'John' -> '"John'). Greedy requests have the forced tokens verified against the
        model's own choices in that extend step, so their output is the one without jump-forward.
        Returns [token] when fewer than two tokens would be gained."""
        state = req.constraint
        assert state is not None
        matcher = state.matcher
        forced = matcher.forced_string()
        if not forced or self.tokenizer is None:
            return [token]
        room = req.tokens_left(self.max_context_len) - 1  # after the sampled token
        ids = forced_token_ids(self.tokenizer, forced)[:room]
        if len(ids) < 2:
            return [token]
        if not matcher.accept_all(ids):
            return [token]
        state.mark_forced(len(ids), verify=req.params.is_greedy)
        return [token, *ids]

    def _append_one(self, req: Request, token: int) -> Ended | None:
        """Append one token; what ends the run of tokens it is part of, or None to go on."""
        params = req.params
        req.output_ids.append(token)
        if (token in self.eos_token_ids and not params.ignore_eos) or token in params.stop_token_ids:
            return Finish(FinishReason.STOP)  # the stop token's text is not part of the output
        detok = self.detokenizers.get(req.request_id)
        if detok is not None:  # none in the trace simulator, or when the consumer makes the text
            new_text = detok.add_token(token)
            state = req.constraint
            if state is not None and state.validation is not None:
                state.token_text_ends.append(detok.length)
                rejection = state.validation.feed(new_text)
                if rejection is not None:
                    return self._reject(req, rejection)
            if detok.stopped:
                return Finish(FinishReason.STOP)
        if len(req.output_ids) >= params.max_new_tokens or req.seq_len >= self.max_context_len:
            return Finish(FinishReason.LENGTH)
        return None

    def _reject(self, req: Request, rejection: Rejection) -> Ended:
        if rejection.fatal:  # the caller's validator is broken: this request ends, nothing else
            req.error, req.user_error = rejection.reason, True
            return Finish(FinishReason.CONSTRAINT_VIOLATION)
        return RollBack(self._rollback_for(req, rejection))

    def _rollback_for(self, req: Request, rejection: Rejection) -> Rollback:
        # back to the value's first token; ban the token that chose its content (for a string,
        # the one after the opening quote, which the automaton forces anyway)
        state = req.constraint
        assert state is not None
        ban_char = rejection.start + (1 if rejection.is_string else 0)
        keep = self._token_at(state, rejection.start)
        replacement = None
        detok = self.detokenizers.get(req.request_id)
        if rejection.replacement is not None and detok is not None:
            # from the kept tokens' end: the value's first token may carry text before it (' 12');
            # and on through the character that ended the rejected value, so that the digits end
            text = detok.text
            start = state.token_text_ends[keep - 1] if keep else 0
            ending = text[rejection.end] if 0 <= rejection.end < len(text) else ""
            replacement = text[start : rejection.start] + rejection.replacement + ending
        fallback = None if rejection.fallback is None else self._rollback_for(req, rejection.fallback)
        return Rollback(keep, self._token_at(state, ban_char), rejection.reason, replacement,
                        ends_output=not rejection.path, fallback=fallback)

    def accepts_at(self, req: Request, keep: int, text: str) -> bool:
        """Whether the automaton takes ``text`` after the first ``keep`` output tokens; the
        matcher is left where it was."""
        state = req.constraint
        if self.tokenizer is None or state is None:
            return False
        matcher, tail = state.matcher, req.output_ids[keep:]
        ids = list(self.tokenizer.encode(text, add_special_tokens=False))
        matcher.rollback(len(tail))
        accepted = bool(ids) and matcher.accept_all(ids)
        if accepted:
            matcher.rollback(len(ids))
        restored = matcher.accept_all(tail)
        assert restored, "tokens the matcher had accepted were refused"
        return accepted

    def complete_written(self, req: Request) -> bool:
        """End the output where it stands (a searched root value just written), if the automaton
        may end it here. The value passed the same validators in the search, so the final check
        accepts it."""
        return self._stop_here(req) and self._complete(req) == Finish(FinishReason.STOP)

    def force_text(self, req: Request, text: str) -> bool:
        """Append the tokens of ``text`` as forced (probability 1) through the automaton, the
        validators and budget steering. False, with nothing appended, where the automaton
        refuses them, they do not fit the budget, or they end or fail the output."""
        state = req.constraint
        if self.tokenizer is None or state is None:
            return False
        matcher = state.matcher
        ids = list(self.tokenizer.encode(text, add_special_tokens=False))
        keep = len(req.output_ids)
        if not ids or len(ids) >= req.tokens_left(self.max_context_len):
            return False
        if not matcher.accept_all(ids):
            return False
        if state.budget is not None and self.steering is not None:
            self.steering.follow_forced(req, ids)
        for t in ids:
            self._record_forced_logprobs(req, t)
            if self._append_one(req, t) is not None:  # a rejection of it is dropped: the text is taken back whole
                matcher.rollback(len(ids))
                del req.output_ids[keep:], req.output_logprobs[keep:], req.output_top_logprobs[keep:]
                self.rewind(req, keep)
                return False
        return True

    @staticmethod
    def _record_forced_logprobs(req: Request, token: int) -> None:
        """A token forced by the constraint (or the budget, or a validator's search) has
        probability 1 under it."""
        if req.params.logprobs:
            req.output_logprobs.append(0.0)
        if req.params.top_logprobs:
            req.output_top_logprobs.append([(token, 0.0)])

    @staticmethod
    def _token_at(state: ConstraintState, char: int) -> int:
        """Index of the output token whose text holds character ``char``."""
        for i, end in enumerate(state.token_text_ends):
            if end > char:
                return i
        return len(state.token_text_ends) - 1

    def rewind(self, req: Request, keep: int) -> None:
        """Rebuild the text state for the first ``keep`` output tokens (after a rollback)."""
        old = self.detokenizers.get(req.request_id)
        if old is None:  # no text kept here
            return
        detok = IncrementalDetokenizer(self.tokenizer, req.prompt_ids, skip_special_tokens=old.skip_special_tokens,
                                       stop=old.stop)
        ends = []
        for t in req.output_ids[:keep]:
            detok.add_token(t)
            ends.append(detok.length)
        # what was streamed stays streamed: only text past it is sent again (a rollback reaches
        # back only into text that was held, never into text a client has seen)
        detok.resume_after(old.sent)
        self.detokenizers[req.request_id] = detok
        state = req.constraint
        if state is not None:
            state.token_text_ends = ends
            if state.validation is not None:
                state.validation.reset(detok.text)
            if state.budget is not None:
                state.budget.reset(detok.text)

    def emit(self, req: Request, *, final: bool) -> RequestOutput | None:
        """Hand a delta to the request's callback (the tokens appended since the last one);
        non-streaming requests only get the end. With validators only the text no rollback can
        reach is sent (a rollback must never take back text a client has seen): none of a JSON
        output before its end, a structural output's text and calls up to the part being checked."""
        if not final:
            if not req.stream or req.on_output is None:
                return None
            state = req.constraint
            if state is not None and state.validation is not None:
                tokens = bisect.bisect_right(state.token_text_ends, state.validation.settled)
                if tokens <= req.num_emitted:
                    return None
                return self._emit_delta(req, tokens, state.token_text_ends[tokens - 1])
            return self._emit_delta(req)
        detok = self.detokenizers.get(req.request_id)
        state = req.constraint
        out = RequestOutput(  # the final output
            request_id=req.request_id,
            new_text=detok.take_delta(True) if detok is not None else "",
            new_token_ids=req.output_ids[req.num_emitted:],
            finished=True,
            finish_reason=req.finish_reason,
            error=req.error,
            user_error=req.user_error,
            prompt_tokens=req.prompt_len,
            completion_tokens=len(req.output_ids),
            cached_tokens=req.cached_tokens,
            new_logprobs=req.output_logprobs[req.num_emitted:] if req.params.logprobs else None,
            new_top_logprobs=req.output_top_logprobs[req.num_emitted:] if req.params.top_logprobs else None,
            output_ids=list(req.output_ids),
            prompt_logprobs=req.prompt_logprobs.tolist() if req.prompt_logprobs is not None else None,
            text=detok.text if detok is not None else "",
            shortened=state is not None and state.budget is not None and state.budget.shortened,
            constraint_warnings=state.warnings if state is not None else None,
            constraint=constraint_report(req),
        )
        if req.on_output is not None:
            req.on_output(out)
        return out

    def _emit_delta(self, req: Request, tokens: int | None = None, chars: int | None = None) -> RequestOutput:
        """``emit`` of a streamed step's delta: the path every running request takes each step
        (up to output token ``tokens``, whose text ends at char ``chars``, when given)."""
        params = req.params
        since = req.num_emitted
        upto = req.num_emitted = len(req.output_ids) if tokens is None else tokens
        detok = self.detokenizers.get(req.request_id)
        out = RequestOutput(
            request_id=req.request_id, new_token_ids=req.output_ids[since:upto],
            new_text=detok.take_delta(False, chars) if detok is not None else "", finished=False,
            error=req.error, user_error=req.user_error, prompt_tokens=req.prompt_len,
            completion_tokens=len(req.output_ids), cached_tokens=req.cached_tokens,
            new_logprobs=req.output_logprobs[since:upto] if params.logprobs else None,
            new_top_logprobs=req.output_top_logprobs[since:upto] if params.top_logprobs else None,
        )
        assert req.on_output is not None
        req.on_output(out)
        return out


def constraint_report(req: Request) -> ConstraintReport | None:
    """What the constraint did to a finished request's output (None when it had none)."""
    spec = req.params.constraint
    if spec is None:
        return None
    state = req.constraint
    reason = req.finish_reason.value if req.finish_reason is not None else "error"
    shortened = state is not None and state.budget is not None and state.budget.shortened
    ended = ended_as(reason, completed=state is not None and state.completed, shortened=shortened,
                     attached=state is not None, user_error=req.user_error)
    speculation = req.speculation
    retries = state.num_rollbacks if state is not None else 0
    return ConstraintReport(
        kind=REPORT_KINDS.get(spec.kind, spec.kind), backend=state.backend if state is not None else "",
        valid=ended in ("complete", "budget_closed"), ended=ended,
        forced_tokens=(state.forced_tokens if state is not None else 0)
        + (speculation.accepted_forced if speculation is not None else 0),
        drafted_tokens=speculation.drafted if speculation is not None else 0,
        accepted_tokens=speculation.accepted if speculation is not None else 0,
        rollbacks=retries + (state.num_repairs + state.forced_drops if state is not None else 0),
        validator_retries=retries,
        steered_tokens=state.budget.steered_tokens if state is not None and state.budget is not None else 0,
        searched_values=state.searched_values if state is not None else 0)
