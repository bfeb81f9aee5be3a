"""The serving engine: requests, KV pool, scheduler, model runner, sampler."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from radixgen.engine.request import FinishReason, RequestOutput, RequestStatus, SamplingParams

if TYPE_CHECKING:
    from radixgen.engine.engine import Engine, GenerationOutput


def __getattr__(name: str) -> Any:
    # the engine module imports torch; requests and their outputs (all the server's HTTP process
    # needs) do not
    if name in ("Engine", "GenerationOutput"):
        from radixgen.engine import engine

        return getattr(engine, name)
    raise AttributeError(f"module 'radixgen.engine' has no attribute {name!r}")


__all__ = ["Engine", "FinishReason", "GenerationOutput", "RequestOutput", "RequestStatus", "SamplingParams"]
