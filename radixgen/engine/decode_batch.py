"""What a decode batch keeps while it stands, in one place: the planner's ``decode_batch``.

A batch is the planner's running requests at one ``running_version``; while no request joins or
leaves, its decode steps reuse what was gathered for it. Each part is made by the code that uses
it and carries the version it was made for (``Keyed``):

- ``arrays``: the requests, their pool rows and the positions of their newest tokens (the
  planner: the next decode step's positions are these + 1);
- ``next_inputs``: the tokens the last decode step appended, each its request's own sample (the
  applier's batched lanes): the next plan's inputs, read once;
- ``sampling``: the sampler's per-row parameter tensors (``sampler.SamplingBatchCache``);
- ``steady``: the constants of the applier's steady lane (``apply._SteadyBatch``).

``forget`` drops every part: a batch changed under a plan (a lookahead step's rows dropped).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Generic, NamedTuple, TypeVar

import numpy as np

from radixgen.engine.request import Request

T = TypeVar("T")


@dataclass(frozen=True)
class Keyed(Generic[T]):
    version: int
    value: T


def current(part: Keyed[T] | None, version: int | None) -> T | None:
    """``part``'s value if it was made for the batch ``version`` (None: a step of no batch)."""
    return part.value if part is not None and version is not None and part.version == version else None


class DecodeArrays(NamedTuple):
    requests: list[Request]
    rows: np.ndarray
    positions: np.ndarray


@dataclass
class DecodeBatchCache:
    arrays: Keyed[DecodeArrays] | None = None
    next_inputs: Keyed[np.ndarray] | None = None
    sampling: Keyed[Any] | None = None
    """A ``sampler.SamplingBatch`` (typed loosely: the planner's side imports no torch)."""
    steady: Keyed[Any] | None = None
    """An ``apply._SteadyBatch``."""

    def forget(self) -> None:
        self.arrays = self.next_inputs = self.sampling = self.steady = None
