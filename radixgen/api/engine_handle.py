"""What the HTTP front needs from an engine, whatever runs it: one process
(``engine_client.EngineClient``), Ray Serve replicas (``cluster.ray_serve.ClusterClient``), or a
stub in the front benchmark."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any, Protocol

from radixgen.engine.request import RequestOutput, SamplingParams


class EngineHandle(Protocol):
    info: dict[str, Any]
    """The engine's description once started (model_path, max_context_len, ...)."""
    dead_reason: str | None
    """Why the engine cannot serve now (requests get 503), or None."""

    async def start(self, timeout: float = 600.0) -> None: ...

    async def shutdown(self) -> None: ...

    @property
    def is_healthy(self) -> bool: ...

    @property
    def num_in_flight(self) -> int: ...

    @property
    def engine_pid(self) -> int | None: ...

    def generate(self, request_id: str, prompt_ids: list[int], params: SamplingParams, *,
                 stream: bool = True) -> AsyncIterator[RequestOutput]:
        """The request's outputs; closing the iterator early aborts the request."""
        ...

    async def stats(self, timeout: float = 5.0) -> dict[str, Any]: ...
