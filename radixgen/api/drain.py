"""Graceful shutdown: on SIGTERM the server refuses new requests (503 with Retry-After), lets
the ones in flight finish until ``--shutdown-timeout``, ends what is left with 503 (an error
event on a stream), and only then stops; a second signal stops it at once."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Iterator
from typing import Any

import uvicorn

from radixgen.errors import EngineDeadError

logger = logging.getLogger(__name__)

_POLL_S = 0.05
_AFTER_ABORT_S = 5.0  # for the aborted handlers to write their 503s before the server stops


class ShuttingDownError(EngineDeadError):
    """The server is stopping and this request did not finish within the shutdown timeout."""


class Drain:
    def __init__(self, timeout_s: float) -> None:
        self.timeout_s = timeout_s
        self.draining = False
        self.in_flight = 0
        self._aborts: set[Callable[[], None]] = set()

    @contextlib.contextmanager
    def request(self) -> Iterator[None]:
        """Count an HTTP request as in flight while it runs (a stream until its last byte)."""
        self.in_flight += 1
        try:
            yield
        finally:
            self.in_flight -= 1

    @contextlib.contextmanager
    def on_abort(self, callback: Callable[[], None]) -> Iterator[None]:
        """Call ``callback`` (on the event loop) if the deadline passes while this block runs."""
        self._aborts.add(callback)
        try:
            yield
        finally:
            self._aborts.discard(callback)

    @staticmethod
    def error() -> ShuttingDownError:
        return ShuttingDownError("the server is shutting down and this request did not finish within its "
                                 "shutdown timeout; retry it on another instance or once this one is back")

    async def run(self) -> None:
        self.draining = True
        logger.info("draining: %d requests in flight, %.0f s to finish", self.in_flight, self.timeout_s)
        deadline = time.monotonic() + self.timeout_s
        while self.in_flight and time.monotonic() < deadline:
            await asyncio.sleep(_POLL_S)
        if self.in_flight:
            logger.warning("shutdown timeout: ending %d requests with 503", len(self._aborts))
            for abort in list(self._aborts):
                abort()
            deadline = time.monotonic() + _AFTER_ABORT_S
            while self.in_flight and time.monotonic() < deadline:
                await asyncio.sleep(_POLL_S)


class DrainingServer(uvicorn.Server):
    """uvicorn's server with the first SIGTERM / SIGINT starting a drain instead of stopping.
    Exits 0 after a drain (uvicorn re-raises a signal it handled itself, which ends the
    process with the signal's status)."""

    def __init__(self, config: uvicorn.Config, drain: Drain) -> None:
        super().__init__(config)
        self.drain = drain
        self._loop: asyncio.AbstractEventLoop | None = None

    async def startup(self, sockets: Any = None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().startup(sockets)

    def handle_exit(self, sig: int, frame: Any) -> None:
        if self.drain.draining or self._loop is None:
            super().handle_exit(sig, frame)  # a second signal, or one during start-up: stop now
            return
        self.drain.draining = True  # refuse new requests from this moment on
        self._loop.call_soon_threadsafe(self._start_drain)

    def _start_drain(self) -> None:
        task = asyncio.ensure_future(self.drain.run())
        task.add_done_callback(lambda _: setattr(self, "should_exit", True))
