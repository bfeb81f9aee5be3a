"""What the engine did to a constrained answer, reported with it (``GenerationOutput.constraint``,
``choices[i].constraint`` at the server).

``ended`` says how the answer ended and ``valid`` whether the returned text satisfies the
constraint and its validators; both come from the request's own end (the automaton took its stop
token, the validators passed the whole value), never from a guess about the text:

- ``complete``: the automaton finished and the validators accepted the whole answer;
- ``budget_closed``: the same, after budget steering closed strings, arrays or objects early;
- ``max_tokens``: cut at the token budget (or the context's end), not valid;
- ``violation``: the validators kept rejecting a value after the retries (or the caller's
  validator raised), not valid;
- ``stopped``: a stop string or stop token of the caller ended it before the constraint did;
- ``refused``: the constraint was refused before generation (it cannot compile, or its
  shortest answer does not fit the budget);
- ``aborted`` / ``error``: the caller went away, or an internal fault ended the request.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any, Literal

ConstraintEnd = Literal["complete", "budget_closed", "max_tokens", "violation", "stopped", "refused", "aborted",
                        "error"]

REPORT_KINDS = {"json_schema": "json_schema", "json_object": "json_object", "regex": "regex", "choices": "choice",
                "structural": "tool_call"}
"""The spec's kind -> the kind a report names (``structural`` is text with tool calls in it)."""


@dataclass(frozen=True)
class ConstraintReport:
    kind: str
    """``json_schema``, ``json_object``, ``regex``, ``choice`` or ``tool_call``."""
    backend: str
    """The compiler whose automaton ran (``xgrammar``, ``llguidance``, ``outlines``); empty when
    the constraint was refused before one ran."""
    valid: bool
    ended: ConstraintEnd
    forced_tokens: int = 0
    """Tokens the automaton forced (jump-forward, or forced text drafted and verified)."""
    drafted_tokens: int = 0
    accepted_tokens: int = 0
    rollbacks: int = 0
    """Times the output was taken back: a validator's rejection, or forced tokens the model
    would not have written."""
    validator_retries: int = 0
    """Values the validators rejected and the model wrote again."""
    steered_tokens: int = 0
    """Tokens budget steering wrote instead of the model's choice to finish in time."""
    searched_values: int = 0
    """Values the validators wrote in place of rejected ones: a number or a listed literal the
    grammar cannot express, searched for, or a "]" that closed a list repeating itself."""

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def ended_as(finish_reason: str, *, completed: bool, shortened: bool, attached: bool, user_error: bool
             ) -> ConstraintEnd:
    """How a constrained request ended, from its finish reason and its constraint state:
    ``completed`` (the automaton finished and the validators passed), ``shortened`` (steering
    changed the output), ``attached`` (the constraint got as far as a matcher), ``user_error``
    (the error is the caller's: a refusal before generation, or, once attached, a dead end the
    validators' bans left the automaton in)."""
    if finish_reason == "stop":
        if completed:
            return "budget_closed" if shortened else "complete"
        return "stopped"
    if finish_reason == "length":
        return "max_tokens"
    if finish_reason == "constraint_violation":
        return "violation"
    if finish_reason == "abort":
        return "aborted"
    if user_error:
        return "violation" if attached else "refused"
    return "error"
