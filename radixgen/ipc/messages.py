"""The messages between a server (the front) and its engine process, one class per kind.

Each travels pickled over a ZeroMQ socket (ipc/process.py). A front sends a ``FrontMessage``
and receives an ``EngineMessage``; a listening engine answers a ``Hello`` with ``Ready`` and
each ``Ping`` with ``Pong``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from radixgen.engine.output import DeltaBlock, RequestOutput
from radixgen.engine.params import SamplingParams

# ---- front -> engine ---------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class AddRequest:
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    stream: bool
    detokenize: bool
    """The engine makes the text (False: the front makes it from the token ids)."""


@dataclass(frozen=True, slots=True)
class Abort:
    request_id: str


@dataclass(frozen=True, slots=True)
class Hello:
    """A front attaches to a listening engine: what an earlier front left running is aborted."""


@dataclass(frozen=True, slots=True)
class Ping:
    """An attached front is alive (each second)."""


@dataclass(frozen=True, slots=True)
class StatsQuery:
    key: int
    """Echoed in the answering ``Stats``."""


@dataclass(frozen=True, slots=True)
class Shutdown:
    """The spawning server is done with the engine: stop and exit."""


FrontMessage = AddRequest | Abort | Hello | Ping | StatsQuery | Shutdown

# ---- engine -> front ---------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Ready:
    info: dict[str, Any]
    """``Engine.info()``: the model, its limits and capabilities."""


@dataclass(frozen=True, slots=True)
class Outputs:
    """One step's outputs, the whole batch in one message."""

    outputs: list[RequestOutput]
    """Finals and the deltas that are not plain one-token rows."""
    blocks: list[DeltaBlock] | None
    """The plain decode rows' one-token deltas, as columns (engine/output.py)."""


@dataclass(frozen=True, slots=True)
class Pong:
    pass


@dataclass(frozen=True, slots=True)
class Stats:
    key: int
    stats: dict[str, Any]


EngineMessage = Ready | Outputs | Pong | Stats
