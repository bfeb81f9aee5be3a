"""The serving engine: requests, KV pool, scheduler, model runner, sampler."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from radixgen.engine.output import FinishReason, GenerationOutput, RequestOutput
from radixgen.engine.params import SamplingParams
from radixgen.engine.request import RequestStatus

if TYPE_CHECKING:
    from radixgen.engine.engine import Engine


def __getattr__(name: str) -> Any:
    # the engine module imports torch; requests and their outputs (all the server's HTTP process
    # needs) do not
    if name == "Engine":
        from radixgen.engine import engine

        return getattr(engine, name)
    raise AttributeError(f"module 'radixgen.engine' has no attribute {name!r}")


__all__ = ["Engine", "FinishReason", "GenerationOutput", "RequestOutput", "RequestStatus", "SamplingParams"]
