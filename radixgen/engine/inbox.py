"""What other threads hand the engine's loop thread (``Engine._inbox``), one class per kind.

The loop drains them all between steps (``Engine._drain_inbox``), in the order they came.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from radixgen.constraints.backend import Grammar
from radixgen.engine.request import Request


@dataclass(frozen=True, slots=True)
class Admit:
    """A request without a constraint, ready to schedule."""

    request: Request


@dataclass(frozen=True, slots=True)
class AdmitCompiled:
    """A constrained request whose grammar compile ended (``grammar`` or ``error``)."""

    request: Request
    grammar: Grammar | None
    error: Exception | None


@dataclass(frozen=True, slots=True)
class AbortRequest:
    request_id: str


@dataclass(frozen=True, slots=True)
class RunOnLoop:
    """A call made between steps (``Engine.run_on_loop``)."""

    call: Callable[[], None]


@dataclass(frozen=True, slots=True)
class Wake:
    """Nothing to do: wakes a loop blocked on an empty inbox (at shutdown)."""


InboxItem = Admit | AdmitCompiled | AbortRequest | RunOnLoop | Wake
