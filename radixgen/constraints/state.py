"""A constrained request's state in the engine, owned by constrained decoding: its automaton, its
validators and the bans they set, budget steering's view of it, and jump-forward's
forced tokens awaiting verification. ``Request.constraint`` holds it (None: unconstrained).

What a token does within its step (go on, finish, roll back, extend) is the appender's return
value to the applier (engine/row_outcome.py); a validator's rejection travels there as a
``Rollback``. What carries from one step to the next changes only through the state's methods:

- jump-forward: ``mark_forced`` (the appender, with the forced tokens appended; the applier then
  requeues the request: one prefill computes the forced tokens)
  -> for greedy output the planner verifies them (``forced_pending``) -> ``record_mismatch``
  (constrained decoding, where the model would have chosen otherwise) -> ``take_mismatch``
  (the applier drops the forced tail and keeps the model's token); ``cancel_forced`` where the
  output ended or rolled back before the verification;
- ``mark_dead_end``: the mask allowed nothing, so the request ends with the reason.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from radixgen.constraints.backend import Matcher
from radixgen.constraints.budget import BudgetState
from radixgen.constraints.call_validation import StructuralValidation
from radixgen.constraints.events import Validation


@dataclass(frozen=True)
class Rollback:
    """A validator's rejection, applied by the applier: the output goes back to ``keep`` tokens
    and the token at ``ban_at`` is banned there when the model resamples."""

    keep: int
    ban_at: int
    reason: str
    replacement: str | None = None
    """Written in place of the rolled-back value, from the kept tokens' end: a valid value the
    validators' search found (``Validation.search_number``)."""
    ends_output: bool = False
    """The replaced value is the whole output (a bare root number): once written, the output
    ends there instead of letting the model add digits to it."""
    token: int | None = None
    """The token to ban at ``ban_at`` where it is not in the output (one the automaton refused
    before it was appended); None: the output's own token there."""
    fallback: Rollback | None = None
    """Applied instead where the automaton refuses ``replacement`` after ``keep`` tokens."""


@dataclass(frozen=True)
class ForcedMismatch:
    """Verification found the model would not have produced a forced token: the output keeps
    ``keep`` tokens and the model's own ``token`` follows, with its log-probabilities."""

    keep: int
    token: int
    logprob: float
    top_logprobs: list[tuple[int, float]]


@dataclass(eq=False)
class ConstraintState:
    matcher: Matcher
    """The constraint automaton's state for this request."""
    validation: Validation | StructuralValidation | None = None
    """Validators over the JSON output (None when there are none)."""
    budget: BudgetState | None = None
    """Budget steering's view (engine/steering.py); None when not steered."""
    warnings: list[str] | None = None
    """What the compiled grammar leaves to the validators (``Grammar.not_enforced``)."""
    token_text_ends: list[int] = field(default_factory=list)
    """Output text length after each output token (maps a rejected value's start to a token)."""
    bans: dict[int, set[int]] = field(default_factory=dict)
    """Output position -> tokens a validator rejected there (masked out when resampling)."""
    num_rollbacks: int = 0
    """Rejected values the model wrote again (bounded by max_validation_retries)."""
    num_repairs: int = 0
    """Rejected values the validators replaced themselves (a closer, a searched value)."""
    dead_end: str | None = None
    """Why the automaton (with the validators' bans) allowed no token at this step, if it did not."""
    forced_pending: int = 0
    """Forced tokens at the end of the output not yet checked against the model's greedy choice."""
    forced_mismatch: ForcedMismatch | None = None
    backend: str = ""
    """The compiler whose automaton this is (for the answer's report)."""
    completed: bool = False
    """The automaton finished and the validators accepted the whole output."""
    forced_tokens: int = 0
    """Tokens jump-forward appended as the automaton's forced text."""
    forced_drops: int = 0
    """Times forced tokens were taken back because the model would not have written them."""
    searched_values: int = 0
    """Values the validators' search wrote in place of rejected ones."""

    def mark_forced(self, count: int, *, verify: bool) -> None:
        """Jump-forward appended ``count`` forced tokens; ``verify``: check them against the
        model's greedy choices in the step that computes them."""
        self.forced_tokens += count
        if verify:
            self.forced_pending = count

    def cancel_forced(self) -> None:
        """The output ended or rolled back before its forced tokens were verified."""
        self.forced_pending = 0

    def record_mismatch(self, mismatch: ForcedMismatch) -> None:
        self.forced_mismatch = mismatch

    def take_mismatch(self) -> ForcedMismatch | None:
        """The verification's outcome, once the forced tokens' step is applied: None when the
        model would have written them all."""
        mismatch, self.forced_mismatch, self.forced_pending = self.forced_mismatch, None, 0
        return mismatch

    def mark_dead_end(self, reason: str) -> None:
        self.dead_end = reason
