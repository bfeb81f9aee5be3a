"""What appending a step's token did to one request: the value the appender returns and the
applier acts on (engine/append.py, engine/apply.py), one per row of the step.

- ``GoOn``: the token (and what steering put in its place) is output; the request decodes on.
- ``ExtendForced``: jump-forward (or steering) appended several tokens at once: the request leaves
  the decode batch and one extend step computes their KV.
- ``Finish``: the request ends, for ``reason``.
- ``RollBack``: a validator rejected a value: the output goes back to the value's first token
  (``Rollback`` says where, what to ban and what to write instead).
"""

from __future__ import annotations

from dataclasses import dataclass

from radixgen.constraints.state import Rollback
from radixgen.engine.output import FinishReason


@dataclass(frozen=True)
class GoOn:
    pass


@dataclass(frozen=True)
class ExtendForced:
    pass


@dataclass(frozen=True)
class Finish:
    reason: FinishReason


@dataclass(frozen=True)
class RollBack:
    rollback: Rollback


RowOutcome = GoOn | ExtendForced | Finish | RollBack
Ended = Finish | RollBack
"""The outcomes that stop a run of appended tokens."""
GO_ON = GoOn()
EXTEND_FORCED = ExtendForced()
