"""Budget steering: a constrained output always finishes within its token budget.

Each constrained request keeps the cheapest completion from its automaton state
(``constraints.budget.Completer``) and the tokens it has left (``max_new_tokens`` and the
context end). After the model's token is accepted:

- **hard**: if the completion from the new state no longer fits in what is left, the token is
  taken back and the completion from the state before it is appended instead (it fits: that was
  checked one token earlier, and before generation for the start state). The request then ends.
- **soft**: within ``budget_margin_tokens`` of that point, a token that makes the completion
  longer (a new optional property, another array item, a longer anyOf branch), or one that
  starts a new word inside a string, is replaced by the first token of the completion: the
  string closes at a word boundary, the array or object closes, and the model goes on from
  there (it writes the next required value itself, not the minimum).

Every appended token is accepted by the matcher and seen by the validators like a sampled one.
Completions are recomputed only where they can change (a JSON token outside a string, every
token of a regex) and only near the end of the budget (``_FAR_TOKENS``), so the walk costs nothing on
most steps.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from radixgen.constraints.backend import Matcher
from radixgen.constraints.budget import (
    LONG_START_WALK_SCALE,
    START_WALK_SCALE,
    BudgetSnapshot,
    BudgetState,
    Completer,
    Completion,
    RegexCompletions,
)
from radixgen.constraints.spec import ConstraintSpec
from radixgen.constraints.state import ConstraintState
from radixgen.engine.request import Request

_FAR_TOKENS = 24
"""A completion is recomputed only when the tokens left are within max(_FAR_TOKENS, its last
cost) of it: one token (an optional property's key, an anyOf branch) does not make it that much
longer in the schemas we serve, and the walk (~0.2-2 ms) then runs only at the end of an output.
(With 64 / 2 x cost, steering took 3-8% of the run time at max_tokens 64-128.)"""


_OPENING_WINDOW = 4
"""A token that opens an object or array or starts another item or property has the completion
recomputed within this many times the usual window of the end: one such token took a completion
of 2 tokens to 66 (a new array item with required nested fields), and once written it cannot be
closed sooner. Only opening tokens pay for the wider window."""

_TOKENS_PER_WALK_SCALE = 512
"""A walk during generation may go one more time its usual bounds per this many tokens left."""

_SLACK_TOKENS = 1
_RETRY_AFTER_TOKENS = 4


@dataclass(frozen=True)
class Steer:
    """Tokens to append instead of the model's token, and whether they finish the output."""

    token_ids: list[int]
    finishes: bool


class BudgetSteering:
    def __init__(self, completer: Completer, tokenizer: Any, *, margin_tokens: int) -> None:
        self.completer = completer
        self.tokenizer = tokenizer
        self.margin = margin_tokens
        self._texts: dict[int, str] = {}

    def start(self, state: ConstraintState, spec: ConstraintSpec, shortest: Completion,
              dfa: RegexCompletions | None, strings: tuple[str, ...] = ()) -> None:
        state.budget = BudgetState(is_json=spec.kind in ("json_schema", "json_object"), completion=shortest, dfa=dfa,
                                 dfa_state=dfa.initial if dfa is not None else None, strings=strings)

    def shortest(self, matcher: Matcher, dfa: RegexCompletions | None, strings: tuple[str, ...] = ()
                 ) -> Completion | None:
        """The shortest complete output of a fresh request (cached per constraint by the caller,
        so its walk may go furthest)."""
        start = dfa.initial if dfa is not None else None
        completion = self._completion(matcher, dfa, start, scale=START_WALK_SCALE, strings=strings)
        if completion is None and dfa is None and self.completer.ran_out_of_room:
            completion = self._completion(matcher, dfa, start, scale=LONG_START_WALK_SCALE, strings=strings)
        return completion

    def _complete(self, state: BudgetState, matcher: Matcher, tokens_left: int = 0) -> Completion | None:
        # a completion that fits a large budget may be long: the walk's bounds grow with it
        return self._completion(matcher, state.dfa, state.dfa_state, scale=1 + tokens_left // _TOKENS_PER_WALK_SCALE,
                                strings=state.strings)

    def _completion(self, matcher: Matcher, dfa: RegexCompletions | None, dfa_state: int | None, *,
                    scale: int = 1, strings: tuple[str, ...] = ()) -> Completion | None:
        """From the DFA's exact table where there is one, else by walking the matcher."""
        if dfa is None:
            return self.completer.complete(matcher, scale=scale, strings=strings)
        text = dfa.completion(dfa_state)
        return Completion(text, self.completer.encode(text)) if text is not None else None

    def _still_completes(self, matcher: Matcher, completion: Completion) -> bool:
        """Whether ``completion``'s tokens are accepted from ``matcher``'s state and end the
        output there (the matcher is left as it was)."""
        if not matcher.accept_all(completion.token_ids):
            return False
        try:
            return matcher.is_completed()
        finally:
            if completion.token_ids:
                matcher.rollback(len(completion.token_ids))

    @staticmethod
    def _price_now(state: BudgetState, saved: BudgetSnapshot, before: Completion, tokens_left: int) -> bool:
        """Whether a token far from the end (outside the window where every structural token is
        priced) needs its completion found now, while it can still be taken back.

        - A new item or property can cost far more than the completion before it (an array item
          with required nested fields): priced within a wider window.
        - A completion left stale since far from the end is brought up to date in that window
          too, once per ``_FAR_TOKENS``.
        - An object or array opened at a nesting not opened before in this output, and the
          first comma that starts another item of an array, are priced at any distance: an
          optional object with 60 required properties, opened 400 tokens from the end, needs
          ~150 tokens to close, more than any window looks at. The same opening again (the next
          item of that array) is priced once the tokens left come within what the first one's
          completion cost: sp_306's items of ~40 required strings each cost ~200 tokens, and the
          one opened 120 tokens from the end was found too long only when nothing could close it."""
        opening = (state.containers if len(state.containers) > len(saved.containers)
                   else state.containers + "," if state.item_opened else None)
        if opening is not None:
            first_cost = state.priced_openings.get(opening)
            if first_cost is None or tokens_left - 1 <= first_cost + _FAR_TOKENS:
                state.pricing = opening
                return True
        if tokens_left - 1 > _OPENING_WINDOW * max(_FAR_TOKENS, before.cost):
            return False
        return state.opened or (state.stale and state.priced_at - tokens_left >= _FAR_TOKENS)

    def token_text(self, token_id: int) -> str:
        text = self._texts.get(token_id)
        if text is None:
            text = self._texts[token_id] = self.tokenizer.decode([token_id])
        return text

    def follow_forced(self, req: Request, token_ids: list[int]) -> None:
        """Jump-forward appended ``token_ids`` (the automaton forced them): follow their text."""
        assert req.constraint is not None
        state = req.constraint.budget
        assert state is not None
        for t in token_ids:
            state.scan(self.token_text(t))
        state.completion = None  # recomputed at the next token

    def after_accept(self, req: Request, token_id: int, tokens_left: int) -> Steer | None:
        """Called once the matcher has accepted the sampled ``token_id`` with ``tokens_left``
        counting its slot. Returns None to keep it; otherwise the matcher has been moved back
        before it and on through the returned tokens."""
        assert req.constraint is not None
        state, matcher = req.constraint.budget, req.constraint.matcher
        assert state is not None
        if state.disabled:
            return None
        before = state.completion
        saved = state.snapshot()
        text = self.token_text(token_id)
        in_string_before = state.in_string and not state.in_key
        touched = state.scan(text)
        if tokens_left > state.retry_below:
            state.stale = state.stale or touched
            return None
        room = tokens_left - 1
        near = before is None or room - before.cost <= max(_FAR_TOKENS, before.cost)
        if before is not None and not near and self._price_now(state, saved, before, tokens_left):
            near, state.stale = True, True
        if not near:
            state.stale = state.stale or touched
            return None  # far from the end: the completion from a few tokens back is good enough
        if before is not None and not (touched or state.stale) and not (
                state.in_string and not self._still_completes(matcher, before)):
            # inside a string the completion stays put, unless the string's own constraint (a
            # pattern, a length) needs other characters from here: "-20-2" closes with '0"'
            after: Completion | None = before
        elif before is not None and not state.stale and text and "\ufffd" not in text and before.text.startswith(text):
            # the model took the first steps of the cheapest completion: the rest still completes
            # (a token that is part of a character decodes to U+FFFD alone: its text tells nothing)
            rest = before.text[len(text):]
            after = Completion(rest, self.completer.encode(rest))
        else:
            after = self._complete(state, matcher, tokens_left)
            state.priced_at = tokens_left
            if state.pricing is not None and after is not None:
                state.priced_openings.setdefault(state.pricing, after.cost)
        state.pricing = None
        state.stale = False
        if after is None:  # the walk found no end from here: try again a few tokens on
            state.completion, state.retry_below = None, tokens_left - _RETRY_AFTER_TOKENS
            return None
        state.completion = after
        # one token of slack: the completion's tokens are counted on its text alone, and a
        # forced stretch appended by jump-forward may be tokenized one token longer
        if after.cost <= room - _SLACK_TOKENS:
            slack = room - _SLACK_TOKENS - after.cost
            grows = before is not None and after.cost > before.cost
            new_word = in_string_before and state.in_string and text[:1].isspace() and saved.string_chars > 0
            if slack >= self.margin or not (grows or new_word):
                return None
            finishes = False
        else:
            finishes = True
        # take the model's token back and follow the completion from the state before it
        matcher.rollback(1)
        state.restore(saved)
        fresh = self._complete(state, matcher, tokens_left)
        if fresh is not None and not fresh.token_ids:
            finishes = True  # complete already: stop here rather than let the output grow
        if fresh is None or (finishes and fresh.cost > tokens_left):
            matcher.accept(token_id)  # cannot do better than the model here
            state.scan(text)
            state.completion = after
            return None
        ids = list(fresh.token_ids) if finishes else list(fresh.token_ids[:1])
        if not matcher.accept_all(ids):  # the completion's tokenization is not the automaton's: give up
            matcher.accept(token_id)
            state.scan(text)
            state.disabled = True
            return None
        for t in ids:
            state.scan(self.token_text(t))
        state.completion = Completion("", ()) if finishes else None
        state.steered_tokens += len(ids)
        state.shortened = True
        return Steer(ids, finishes)
