"""Speculative decoding without a draft model: n-gram drafts, verified in the decode step.

A request's next tokens are often a copy of tokens it has seen (extraction copies the
prompt's names and numbers, a repeated answer repeats itself). Before a decode step, such a
request looks up its last n tokens (the longest n that matches, up to ``speculative_ngram_max``)
in an index of its own prompt and output, and drafts the tokens that followed an earlier
occurrence; where no tokens match, the text of its last tokens is looked up in the prompt's
text and the text after it drafted (a copy that starts inside another token than the prompt's,
or a value whose first characters begin a word of the prompt); a constrained request's draft
is the text its automaton forces, then the first such guess the automaton takes, cut at the
first token it would reject, as long as guesses of its kind have lately run (``GuessLengths``).
The step then feeds the request's newest token and its k drafts as one extend (the planner's
speculative rows) and takes the logits after each of them. Verification keeps
the longest prefix of the draft that equals the model's own choice at each position (under the
constraint's mask) and adds the model's choice after it; the slots of rejected drafts are
freed at once. The model's choice is its argmax for a greedy request; for a sampled one it is
the token a decode step would sample there, from the same counter-based uniform (the seed and
the token's index in the output). So the output is the one without speculation for greedy and
seeded requests alike, as far as the logits are the same (where a sample sits on a boundary of
a nearly flat distribution, a last-bit difference can move it): for a draft that is one fixed
token this is speculative sampling, which accepts a draft with the probability the model gives
it, with the same acceptance rate and the target's distribution exactly.

Each position gets what the sampler does to a decode step's logits: the penalties (counting the
drafts before it as output), the logit bias, the mask; requested log-probabilities come from
it too. Validators see the accepted tokens one by one as they are appended, and a rejection
rolls them back like any others. A request whose drafts stop being accepted often enough to pay
for themselves stops drafting (``DraftCost``).
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from radixgen.config import EngineConfig
from radixgen.constraints.backend import Matcher
from radixgen.engine.constrained import mask_logits, walk_masks
from radixgen.engine.ngram import (
    INDEX_WINDOW,
    DraftState,
    NgramIndex,
    prompt_text_continuation,
    word_start_continuation,
)
from radixgen.engine.plan import StepPlan
from radixgen.engine.request import Request
from radixgen.engine.sampler import (
    PenaltyState,
    SamplingBatch,
    argmax_rows,
    logprob_parts,
    sample_rows,
)
from radixgen.staging import ReadBack

# After this many drafted tokens, a request whose drafts were accepted less often than they
# must be to pay (DraftCost.break_even; _GIVE_UP_BELOW until the engine has measured it) stops
# drafting: each drafted token costs a position of compute in the step.
_GIVE_UP_AFTER = 24
_GIVE_UP_BELOW = 0.2
_OWN_RECORD_AFTER = 8  # drafted tokens after which a request's own acceptance stands for it
# Measured back-off drafts where a request's acceptance beats the break-even by this factor: near
# break-even the gain is nothing and the fit's error decides, so drafting there loses as often
# as it wins (a batch of 16 on the bundled model drafted at 0.69 against 0.69, 0.96-0.98x of off).
_PAYS_BY = 1.1
_COST_WINDOW = 64  # the latest steps per batch-size bucket that the step-time fit reads
_REFIT_AFTER = 8  # new steps in a bucket after which its standing fit is computed again
_TAIL_TOKENS = 8  # a text copy looks up the text of the output's last few tokens
# GuessLengths: a guess's run counts lose this share per guess observed (they follow the last few
# hundred guesses); the hazard a position starts from before any guess reached it, and how many
# guesses' weight that prior has; every how many guesses one is drafted at the longest length.
_LENGTH_DECAY = 0.995
_PRIOR_HAZARD = 0.3
_PRIOR_WEIGHT = 2.0
_EXPLORE_EVERY = 8
# Continuations of the suffix's earlier occurrences tried against the grammar before a copy by
# the prompt's text: each costs an automaton walk of its tokens.
_CANDIDATES = 4


@dataclass
class Verdict:
    """What verification found for one speculative row."""

    accepted: list[int]
    """The leading draft tokens the model would have produced itself."""
    next_token: int
    """The model's choice after them."""
    logprobs: list[tuple[float, list[tuple[int, float]]]] | None = None
    """For a request that asks for log-probabilities: each of those tokens' log-probability and
    top alternatives under the model's distribution at its position, as a decode step gives."""


class DraftCost:
    """What a drafted position costs against what an accepted one saves, measured on this
    engine's own steps (each from its planning to the end of its applying: the host work a draft
    adds counts with the forward's), per batch size (rounded up to a power of two): a step of B rows and E
    drafted positions takes a + b*B + m*E, fitted by least squares over the bucket's recent
    steps (decode steps are E = 0). B is in the fit because the batch shrinks inside a bucket
    while the drafts shrink with it: fitted on E alone, m would take the rows' cost as the
    drafts'. A drafted token is accepted with probability p and then saves t(B)/B of decode time
    (t(B) = a + b*B), so drafting pays when p > m*B/t(B), the break-even acceptance. What that
    is depends on the machine and the model: where a step is bound by reading the weights,
    extra positions are nearly free; where it is bound by compute (a large batch on a few
    cores), each costs about a row's share."""

    def __init__(self) -> None:
        self._samples: dict[int, deque[tuple[int, float, float]]] = {}
        """Per bucket, its latest steps: (rows, drafted positions, seconds)."""
        self._fits: dict[int, tuple[float, float, float]] = {}
        """Per bucket, the last fit its steps supported: (a, b, m). It stands while drafting is
        off there (decode steps alone cannot separate the two again)."""
        self._unread: dict[int, int] = {}
        """Per bucket, steps observed since its fit was last computed: the fit is made when asked
        for, and once made, again only every ``_REFIT_AFTER`` steps (it moves slowly, and every
        step asks)."""

    @staticmethod
    def _bucket(rows: int) -> int:
        return 1 << max(rows - 1, 0).bit_length()

    def observe(self, plan: StepPlan, seconds: float) -> None:
        if plan.kind.has_prompt_rows:
            return  # prefill and mixed steps: their time is the prompts'
        drafted = float(plan.draft_lens.sum()) if plan.draft_lens is not None else 0.0
        self.observe_step(len(plan.requests), drafted, seconds)

    def observe_step(self, rows: int, drafted: float, seconds: float) -> None:
        bucket = self._bucket(rows)
        self._samples.setdefault(bucket, deque(maxlen=_COST_WINDOW)).append((rows, drafted, seconds))
        self._unread[bucket] = self._unread.get(bucket, 0) + 1

    def _fit(self, rows: int) -> tuple[float, float, float] | None:
        bucket = self._bucket(rows)
        unread = self._unread.get(bucket, 0)
        if unread and (bucket not in self._fits or unread >= _REFIT_AFTER):
            self._unread[bucket] = 0
            fit = _fit_step_time(np.array(self._samples[bucket], dtype=np.float64))
            if fit is not None:
                self._fits[bucket] = fit
        return self._fits.get(bucket)

    def measured(self, rows: int) -> bool:
        """Whether this batch size's cost has been measured (drafts have run at it)."""
        return self._fit(rows) is not None

    def break_even(self, rows: int) -> float:
        """The acceptance a request's drafts need to pay at this batch size (a default until
        measured)."""
        fit = self._fit(rows)
        if fit is None:
            return _GIVE_UP_BELOW
        a, b, m = fit
        step = a + b * rows
        if step <= 0:
            return _GIVE_UP_BELOW
        return min(max(m * rows / step, 0.05), 0.95)


class GuessLengths:
    """How long to guess, from how far guesses of this kind have run before the model left them.

    A guess of E tokens whose first j are right returns j + 1 tokens for a step that costs
    1 + c*E decode steps (c: a drafted position's cost, ``DraftCost.break_even``), so the best E
    maximises (1 + S(1) + ... + S(E)) / (1 + c*E), S(j) being the chance a guess's first j
    tokens are all right. S is estimated from the guesses verified so far, each a run of right
    tokens that ended at its first wrong one or was cut by its own length (a Kaplan-Meier
    estimate, counts decaying so it follows the traffic). Copies run long once begun (a name,
    a date) and stop where a value ends: S falls off slowly after its first steps, which a
    length that shrinks after every miss cannot follow. Every ``_EXPLORE_EVERY``-th guess is
    drafted at the longest length, or positions past the chosen length would never be seen."""

    def __init__(self, longest: int) -> None:
        self.longest = longest
        self.at_risk = np.zeros(longest + 1)
        """Per position j (1-based), guesses that reached it: drafted that far, all before it right."""
        self.ended = np.zeros(longest + 1)
        """Per position j, guesses whose first wrong token was at j."""
        self.guesses = 0

    def observe(self, drafted: int, accepted: int) -> None:
        if drafted <= 0:
            return
        self.at_risk *= _LENGTH_DECAY
        self.ended *= _LENGTH_DECAY
        reached = min(accepted + 1, drafted, self.longest)
        self.at_risk[1 : reached + 1] += 1
        if accepted < drafted and accepted < self.longest:
            self.ended[accepted + 1] += 1

    def survival(self) -> np.ndarray:
        """[longest] S(1..longest): each position's hazard from its own guesses, pulled toward
        the guesses' pooled hazard (all a position has before it is reached)."""
        pooled = (self.ended.sum() + _PRIOR_HAZARD) / (self.at_risk.sum() + 1.0)
        hazard = (self.ended[1:] + _PRIOR_WEIGHT * pooled) / (self.at_risk[1:] + _PRIOR_WEIGHT)
        return np.cumprod(1.0 - hazard)

    def choose(self, cost: float) -> int:
        """The guess length that returns the most tokens per step's cost; the longest now and then."""
        self.guesses += 1
        if self.guesses % _EXPLORE_EVERY == 0:
            return self.longest
        lengths = np.arange(1, self.longest + 1)
        value = (1.0 + np.cumsum(self.survival())) / (1.0 + cost * lengths)
        return int(lengths[int(np.argmax(value))])


def _fit_step_time(samples: np.ndarray) -> tuple[float, float, float] | None:
    """(a, b, m) of seconds = a + b*rows + m*drafted over [n, 3] samples; None while the drafted
    counts hardly vary apart from the rows (the fit would be noise)."""
    if len(samples) < 3:
        return None
    rows, drafted, seconds = samples.T
    varies = rows.var() > 1e-9
    base = np.column_stack([np.ones_like(rows), rows]) if varies else np.ones((len(rows), 1))
    residual = drafted - base @ np.linalg.lstsq(base, drafted, rcond=None)[0]
    if residual.var() <= 0.25:
        return None
    coef = np.linalg.lstsq(np.column_stack([base, drafted]), seconds, rcond=None)[0]
    a, b = (coef[0], coef[1]) if varies else (coef[0], 0.0)
    return float(a), float(b), max(float(coef[-1]), 0.0)


class NgramDrafter:
    def __init__(self, config: EngineConfig, max_context_len: int) -> None:
        self.by_default = config.speculative == "ngram"
        self.constrained_by_default = config.speculative == "auto"
        self.requested = False
        """A request that may draft has arrived (while not every request does)."""
        self.max_context_len = max_context_len
        self.max_draft = config.speculative_max_draft
        self.max_batch = config.speculative_max_batch
        self.step_budget = config.speculative_step_budget
        self.ngram_max = config.speculative_ngram_max
        self.drafted_tokens = 0
        self.accepted_tokens = 0
        self.accepted_by_source = {"forced": 0, "copied": 0, "ngram": 0}
        """Accepted draft tokens by where they came from: the constraint's forced text, a span
        of the prompt, or an earlier stretch of the output."""
        self.cost = DraftCost()
        self.guess_lengths = {"copied": GuessLengths(self.max_draft), "ngram": GuessLengths(self.max_draft)}
        """How long each kind of guess is drafted (copies of the prompt run longer than n-grams)."""
        self.max_step_tokens: int | None = None
        """Most tokens a step with drafts may feed (None: no bound): past it the model runs its
        linears in lower precision (``ModelRunner.full_precision_max_tokens``), and a draft
        verified there could be judged against other logits than a decode step's."""
        self._rows = 1  # the running batch at the last draft
        self.last_draft_s = 0.0
        """Host time the last ``draft`` took (walking each draft through its automaton is part of
        what a drafted position costs: ``DraftCost`` counts it with the step's)."""
        self.tokenizer: Any = None

    @property
    def active(self) -> bool:
        """Whether any request may draft (off by default and never asked for: no cost per step)."""
        return self.by_default or self.requested

    def wants(self, req: Request) -> bool:
        """Whether the request drafts: its own setting, else the engine's (auto: a JSON schema,
        regex, choice or grammar constraint; tool-call structures, whose free text the model
        writes, do not)."""
        p = req.params
        if p.speculative is not None:
            return p.speculative
        return self.by_default or (self.constrained_by_default and p.constraint is not None
                                   and p.constraint.kind != "structural")

    def drafting(self, req: Request, batch: int) -> bool:
        """Whether the request drafts in a step of ``batch`` running requests. Under auto, where
        its drafts pay at this batch size (``speculative_max_batch`` None: as measured, a batch
        size not yet measured drafting to measure it; a number: up to that many requests), unless
        the request asked for drafting itself."""
        state = req.speculation
        if not self.wants(req) or (state is not None and state.gave_up):
            return False
        if self.by_default or req.params.speculative is True:
            return True
        if self.max_batch is not None:
            return batch <= self.max_batch
        return not self.cost.measured(batch) or self.acceptance(req) > _PAYS_BY * self.cost.break_even(batch)

    def _measures_back_off(self, req: Request) -> bool:
        """Whether the request drafts only where the measured cost says it pays (auto, no cap,
        and the request left the choice to the engine)."""
        return self.constrained_by_default and self.max_batch is None and req.params.speculative is None

    def acceptance(self, req: Request) -> float:
        """How often the request's drafted tokens are accepted: its own record once it has one,
        before that the engine's (all drafts so far), before that as if every one were."""
        state = req.speculation
        if state is not None and state.drafted >= _OWN_RECORD_AFTER:
            return state.accepted / state.drafted
        if self.drafted_tokens >= _OWN_RECORD_AFTER:
            return self.accepted_tokens / self.drafted_tokens
        return 1.0

    def may_draft(self, reqs: list[Request]) -> bool:
        """Whether any of these requests may draft in its next step (overlapped scheduling plans a
        step ahead only where none does)."""
        if not self.active:
            return False
        return any(self.drafting(r, len(reqs)) for r in reqs)

    def note_request(self, req: Request) -> None:
        if self.wants(req):
            self.requested = True

    def draft(self, reqs: list[Request]) -> dict[Request, list[int]]:
        """Drafts for this step's running requests (those that have one), within the budget."""
        started = time.perf_counter()
        try:
            return self._draft(reqs)
        finally:
            self.last_draft_s = time.perf_counter() - started

    def _draft(self, reqs: list[Request]) -> dict[Request, list[int]]:
        budget = self.step_budget
        if self.max_step_tokens is not None:
            budget = min(budget, self.max_step_tokens - len(reqs))
        drafts: dict[Request, list[int]] = {}
        self._rows = len(reqs)
        for req in reqs:
            if budget <= 0:
                break
            state = req.speculation
            if state is None:
                state = req.speculation = DraftState(NgramIndex(self.ngram_max), gave_up=not self.wants(req))
            if len(req.output_ids) < req.params.min_new_tokens or not self.drafting(req, len(reqs)):
                continue
            # the newest token and the drafts must fit the request's budget and the context
            room = min(budget, req.tokens_left(self.max_context_len) - 1)
            if room <= 0:
                continue
            tokens = _current_tokens(req, state)
            state.index.update(tokens)
            constraint = req.constraint
            # forced text is drafted whole (the grammar writes nothing else there, so it is lost
            # only where the model splits it into other tokens); a guess, at the length its kind
            # of guess has run to lately
            forced = self._forced(constraint.matcher, min(room, self.max_draft)) if constraint is not None else []
            room_left = min(self.max_draft, room - len(forced))
            guesses = self._guesses(req, state, tokens + forced, room_left) if room_left > 0 else iter(())
            if constraint is not None:
                draft, found_at = _grammatical_draft(constraint.matcher, forced, guesses)
            else:
                proposed, found_at = next(guesses, ([], -1))
                draft = forced + proposed
            source = "copied" if found_at < req.prompt_len else "ngram"
            if found_at >= 0:
                length = self.guess_lengths[source].choose(self.cost.break_even(len(reqs)))
                draft = draft[: len(forced) + length]
            if draft:
                state.draft = draft
                state.draft_forced = min(len(forced), len(draft))
                state.draft_source = source
                drafts[req] = draft
                budget -= len(draft)
        return drafts

    def _guesses(self, req: Request, state: DraftState, tokens: list[int], k: int
                 ) -> Iterator[tuple[list[int], int]]:
        """Guesses of up to ``k`` tokens to follow ``tokens``, best first, each with where it
        starts in ``tokens`` (a copy of the prompt by its text: 0): continuations of the suffix's
        earlier occurrences (``ngram.NgramIndex``), else the prompt's text after the output's last
        characters (``ngram.prompt_text_continuation``: a copy begun inside another token than
        the prompt's, ``"INV`` against `` INV``), else after the output's last word where a word
        of the prompt starts so (``ngram.word_start_continuation``: a value's first characters)."""
        yield from state.index.candidates(tokens, k, limit=_CANDIDATES)
        if self.tokenizer is None:
            return
        if state.prompt_text is None:
            state.prompt_text = self.tokenizer.decode(req.prompt_ids[-INDEX_WINDOW:])
        tail = self.tokenizer.decode(tokens[max(req.prompt_len, len(tokens) - _TAIL_TOKENS) :])
        copied = prompt_text_continuation(state.prompt_text, tail, k, self._encode)
        if copied:
            yield copied, 0
            return
        output_text = self.tokenizer.decode(tokens[req.prompt_len :])
        copied = word_start_continuation(state.prompt_text, tail, output_text, k, self._encode)
        if copied:
            yield copied, 0

    def _encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def _forced(self, matcher: Matcher, room: int) -> list[int]:
        """The tokens of the text the request's automaton forces next (jump-forward's text, here
        verified in the step instead of appended before it). All of them: where the model would
        merge the last with what follows ('"' + 'John' -> '"John'), verification rejects it
        there, which jump-forward, appending unverified, must leave to the model."""
        text = matcher.forced_string() if self.tokenizer is not None else ""
        if not text:
            return []
        return self._encode(text)[:room]

    def record(self, req: Request, drafted: int, accepted: int) -> None:
        state = req.speculation
        assert state is not None
        state.draft = []
        state.drafted += drafted
        state.accepted += accepted
        forced = min(accepted, state.draft_forced)
        if accepted >= state.draft_forced:  # the guess was reached
            self.guess_lengths[state.draft_source].observe(drafted - state.draft_forced, accepted - forced)
        self.drafted_tokens += drafted
        self.accepted_tokens += accepted
        state.accepted_forced += forced
        self.accepted_by_source["forced"] += forced
        self.accepted_by_source[state.draft_source] += accepted - forced
        # measured back-off decides per step (a request that does not pay in a large batch may
        # pay once the batch has shrunk); otherwise a request that does not pay stops for good
        if not self._measures_back_off(req) and state.drafted >= _GIVE_UP_AFTER and \
                state.accepted < self.cost.break_even(self._rows) * state.drafted:
            state.gave_up = True


def _current_tokens(req: Request, state: DraftState) -> list[int]:
    tokens = state.tokens
    mirrored = len(tokens) - req.prompt_len  # output tokens already in the copy
    if mirrored < 0 or mirrored > len(req.output_ids) or (mirrored and tokens[-1] != req.output_ids[mirrored - 1]):
        tokens = state.tokens = req.all_ids()  # first use, or the output was cut back (a rollback)
    else:
        tokens.extend(req.output_ids[mirrored:])
    return tokens


def _grammatical_draft(matcher: Matcher, forced: list[int], guesses: Iterator[tuple[list[int], int]]
                       ) -> tuple[list[int], int]:
    """The forced tokens up to the first one the request's automaton rejects, and before a stop
    token that would end it (the end is the model's to choose; verifying past it would ask a
    finished automaton for a mask); then, where all were taken, the first guess whose first
    token the automaton takes after them, cut the same way; with where that guess starts (-1:
    none taken). The automaton's state unchanged."""
    taken, walked = _walk(matcher, forced)
    draft, found_at = forced[:taken], -1
    if taken == len(forced) and walked == taken:
        for proposed, start in guesses:
            more, more_walked = _walk(matcher, proposed)
            if more_walked:
                matcher.rollback(more_walked)
            if more:
                draft, found_at = forced + proposed[:more], start
                break
    if walked:
        matcher.rollback(walked)
    return draft, found_at


def _walk(matcher: Matcher, tokens: list[int]) -> tuple[int, int]:
    """Walk the automaton over ``tokens`` as far as it takes them, before a stop token that
    ends it: (tokens taken, tokens walked, which the caller rolls back)."""
    taken = walked = 0
    for token in tokens:
        if matcher.is_terminated() or not matcher.accept(token):
            break
        walked += 1
        if matcher.is_terminated():
            break
        taken += 1
    return taken, walked


def verify(plan: StepPlan, logits: torch.Tensor, batch: SamplingBatch, penalties: PenaltyState, bitmask: np.ndarray,
           dead_end: str) -> tuple[torch.Tensor, dict[int, Verdict]]:
    """Check each speculative row's drafts against the model's own choice at every position:
    its argmax for a greedy request, for a sampled one the token a decode step would sample
    there (``sampler.sample_rows`` with that position's counter), so either way the output is
    the one without speculation.

    ``logits`` holds the batch's last positions first, then for each speculative row the
    positions before each of its drafts (``ModelRunner.forward``). Returns the batch's rows and
    a verdict per speculative row. ``batch``: the step's sampling parameters, ``penalties``
    the sampler's token counts (a position's penalties count the drafts before it); ``bitmask``: a
    one-row host buffer (its width: the masks'); ``dead_end``: why a constrained row whose mask
    allows nothing cannot go on.

    Every position's choice (and log-probabilities, where asked for) is computed on the device
    first, constrained rows' masks filled on the host by walking their automaton over the draft;
    then one read brings them all back, and the verdicts are decided on the host."""
    assert plan.draft_lens is not None
    rows = plan.batch_size
    extra = logits[rows:]
    checks: list[_RowCheck] = []
    device_parts: list[torch.Tensor | None] = [argmax_rows(logits[:rows]), argmax_rows(extra)]
    row = 0
    for i, k in enumerate(plan.draft_lens.tolist()):
        if not k:
            continue
        req = plan.requests[i]
        state = req.speculation
        assert state is not None and len(state.draft) == k
        greedy = bool(batch.is_greedy[i])
        adjusted = req.params.has_penalties or bool(req.params.logit_bias)
        top = req.params.top_logprobs if (req.params.logprobs or req.params.top_logprobs) else None
        check = _RowCheck(i, row, k, state.draft, top)
        checks.append(check)
        row += k
        if greedy and req.constraint is None and not adjusted and top is None:
            continue  # the common case: the argmaxes of the whole step, no copy of this row's logits
        positions = torch.cat([extra[check.extra_start : check.extra_start + k], logits[i : i + 1]])
        # what the sampler does to a decode step's logits before it chooses
        if req.params.has_penalties:
            positions = penalties.apply_positions(positions, batch, i, state.draft)
        positions = batch.bias_positions(positions, i)
        if req.constraint is not None:
            masks, takes, dead_at = walk_masks(req.constraint, state.draft, bitmask.shape[1], len(req.output_ids))
            check.walk = _Walk(takes, dead_at)
            first = positions[:1]
            first_choice = first.argmax(dim=-1)
            check.first = len(device_parts)
            device_parts.append(first_choice)
            if top is not None:
                device_parts += logprob_parts(first, first_choice, top)
            n = len(masks)
            positions = mask_logits(positions[:n].clone(), masks) if n else positions[:0]
        check.choices = len(device_parts)
        if positions.shape[0]:
            choices = positions.argmax(dim=-1) if greedy else _sampled(positions, batch, i, 0)
        else:
            choices = positions.new_zeros(0, dtype=torch.int64)
        device_parts.append(choices)
        if top is not None:
            device_parts += logprob_parts(positions, choices, top)
    host = ReadBack(device_parts).wait()
    last_choice, extra_choice = host[0], host[1]
    assert last_choice is not None and extra_choice is not None
    verdicts = {}
    for check in checks:
        verdicts[check.index] = check.verdict(host, last_choice, extra_choice, plan.requests[check.index], dead_end)
    return logits[:rows], verdicts


@dataclass
class _Walk:
    """A constrained row's automaton walked over its draft on the host (and back again)."""

    takes: list[bool]
    """Whether the automaton took draft[j] after the draft tokens before it."""
    dead_at: int | None
    """The first position whose mask allows nothing (None: none)."""


@dataclass
class _RowCheck:
    """One speculative row: where its results sit in the step's read-back, and its verdict."""

    index: int
    extra_start: int
    """Its first drafted position among the step's extra logits rows."""
    k: int
    draft: list[int]
    top: int | None
    """Its top_logprobs when it asks for log-probabilities (None: it does not)."""
    walk: _Walk | None = None
    first: int | None = None
    """Index in the read-back of its unmasked first position's choice (constrained rows)."""
    choices: int | None = None
    """Index in the read-back of its positions' choices (None: the step's argmaxes serve)."""

    def verdict(self, host: list[np.ndarray | None], last_choice: np.ndarray, extra_choice: np.ndarray,
                req: Request, dead_end: str) -> Verdict:
        k, draft = self.k, self.draft
        if self.choices is None:
            choices = [*extra_choice[self.extra_start : self.extra_start + k].tolist(), int(last_choice[self.index])]
        else:
            found = host[self.choices]
            assert found is not None
            choices = found.tolist()
        if self.walk is None:
            accepted = 0
            while accepted < k and choices[accepted] == draft[accepted]:
                accepted += 1
            verdict = Verdict(draft[:accepted], choices[accepted])
            return self._with_logprobs(verdict, host, self.choices, accepted + 1)
        # a constrained row: the walk a decode step per position would have taken
        assert self.first is not None
        walked = 0
        choice = int(host[self.first][0])  # type: ignore[index]
        for j in range(k + 1):
            if self.walk.dead_at == j:
                if j == 0:
                    assert req.constraint is not None
                    req.constraint.mark_dead_end(dead_end)  # as a plain decode step would have found
                    return self._with_logprobs(Verdict([], choice), host, self.first, 1)
                # nothing may follow the last draft token: it is the model's choice, not a draft
                return self._with_logprobs(Verdict(draft[: j - 1], draft[j - 1]), host, self.choices, j)
            choice = choices[j]
            if j == k or choice != draft[j] or not self.walk.takes[j]:
                break
            walked += 1
        return self._with_logprobs(Verdict(draft[:walked], choice), host, self.choices, walked + 1)

    def _with_logprobs(self, verdict: Verdict, host: list[np.ndarray | None], at: int | None, count: int) -> Verdict:
        """``count`` positions' log-probabilities from the read-back parts after index ``at``."""
        if self.top is None:
            return verdict
        assert at is not None
        chosen, ids, values = host[at + 1], host[at + 2], host[at + 3]
        assert chosen is not None
        verdict.logprobs = [
            (float(chosen[p]), [] if ids is None or values is None else
             list(zip(ids[p].tolist(), values[p].tolist(), strict=True)))
            for p in range(count)
        ]
        return verdict


def _sampled(positions: torch.Tensor, batch: SamplingBatch, i: int, first: int) -> torch.Tensor:
    """Batch row ``i``'s samples at consecutive output positions, the first ``first`` tokens past
    the request's current output."""
    n = positions.shape[0]
    idx = torch.full((n,), i, dtype=torch.int64, device=positions.device)
    counters = batch.counters[idx] + torch.arange(first, first + n, device=positions.device)
    return sample_rows(positions, batch, idx, counters)
