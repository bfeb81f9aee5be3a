"""What the HTTP front needs from an engine, whatever runs it: one process
(``engine_client.EngineClient``), Ray Serve replicas (``cluster.ray_serve.ClusterClient``), or a
stub in the front benchmark; and the sink their outputs reach a streaming route through."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any, Protocol

from radixgen.engine.output import RequestOutput
from radixgen.engine.params import SamplingParams

Delivery = tuple[int, "RequestOutput | BaseException"]
"""(tag, an output) or (tag, why the request failed)."""


class OutputSink:
    """Where the outputs of one HTTP request's engine requests land, each tagged with its choice.

    The engine client puts outputs here as it receives them (no task per request in between),
    and the route takes everything that arrived since its last look in one call: when the front
    is slower than the engine, a choice's queued tokens go out as one event, not one each."""

    __slots__ = ("_items", "_waiter")

    def __init__(self) -> None:
        self._items: list[Delivery] = []
        self._waiter: asyncio.Future[None] | None = None

    def put(self, tag: int, item: RequestOutput | BaseException) -> None:
        self._items.append((tag, item))
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    async def take(self, timeout: float | None = None) -> list[Delivery] | None:
        """What has arrived, oldest first, waiting for it if nothing has; None after ``timeout``
        seconds of quiet (a stream's keep-alive)."""
        if not self._items:
            loop = asyncio.get_running_loop()
            waiter = self._waiter = loop.create_future()
            # a timer handle, not asyncio.timeout: its context manager cost more than the wait
            timer = loop.call_later(timeout, _settle, waiter) if timeout is not None else None
            try:
                await waiter
            finally:
                if timer is not None:
                    timer.cancel()
                self._waiter = None
            if not self._items:
                return None
        items, self._items = self._items, []
        return items


def _settle(waiter: asyncio.Future[None]) -> None:
    if not waiter.done():
        waiter.set_result(None)


async def pump_into(sink: OutputSink, tag: int, outputs: AsyncIterator[RequestOutput]) -> None:
    """Feed an engine's output iterator into a sink (for handles without a native ``submit``);
    cancelling the task closes the iterator, which aborts the request."""
    try:
        async for out in outputs:
            sink.put(tag, out)
    except asyncio.CancelledError:
        raise
    except Exception as e:  # noqa: BLE001 - handed to the route reading the sink
        sink.put(tag, e)


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

    async def submit(self, request_id: str, prompt_ids: list[int], params: SamplingParams, sink: OutputSink,
                     tag: int) -> None:
        """Start a streamed request whose outputs go into ``sink`` under ``tag``, the final one
        last; a failure on the way arrives there as an exception. Raises at once when the
        request is refused (overload, a dead engine)."""
        ...

    async def abort(self, request_id: str) -> None:
        """End a submitted request that has not finished (nothing if it has)."""
        ...

    async def stats(self, timeout: float = 5.0) -> dict[str, Any]: ...
