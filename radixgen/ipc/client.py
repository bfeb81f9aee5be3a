"""The HTTP process's handle on the engine process: submit, stream, abort, health.

Outputs arrive one message per engine step (the plain decode rows' deltas as columns,
``engine.output``) and are put straight into each request's output sink
(``engine_handle.OutputSink``). If the engine process dies, every waiting request gets
``EngineDeadError`` (HTTP 503) at once,
and new requests are refused with the same error until it is back.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import multiprocessing as mp
import os
import tempfile
import time
from collections.abc import AsyncIterator
from typing import Any

import zmq
import zmq.asyncio

from radixgen.config import EngineConfig
from radixgen.engine.detokenizer import ConsumerText
from radixgen.engine.output import DeltaReader, RequestOutput
from radixgen.engine.params import SamplingParams
from radixgen.errors import EngineDeadError, OverloadedError
from radixgen.ipc.handle import OutputSink
from radixgen.ipc.messages import (
    Abort,
    AddRequest,
    Hello,
    Outputs,
    Ping,
    Ready,
    Shutdown,
    Stats,
    StatsQuery,
)
from radixgen.ipc.process import FRONT_TIMEOUT_S, engine_process_main, listen_addresses

logger = logging.getLogger(__name__)

_SHUTDOWN_SEND_S = 5.0


class EngineClient:
    def __init__(self, config: EngineConfig, *, restarts: int = 0, attach: str | None = None) -> None:
        """``restarts``: how many times a crashed engine process is started again. ``attach``:
        the folder of an engine started on its own (``radixgen engine --listen``) to use
        instead of spawning one; it outlives this client, which pings it and, when it stops
        answering, fails what is in flight (503) until it answers again."""
        self.config = config
        self.attach = attach
        self.restarts_left = restarts
        self.num_restarts = 0
        self._closing = False
        self.info: dict[str, Any] = {}
        self.dead_reason: str | None = "engine not started"
        self._sinks: dict[str, tuple[OutputSink, int, ConsumerText | None]] = {}
        """Unfinished requests: where their outputs go (sink, tag, and the text made here for a
        request the engine does not detokenize)."""
        self._deltas = DeltaReader()  # it keeps the batch columns the engine sends once (engine/output.py)
        self.tokenizer: Any = None
        """Set by the server once loaded: the text of requests without stop strings or a
        constraint is then made here from their token ids, off the engine's loop."""
        self._stats_waiters: dict[int, asyncio.Future[dict[str, Any]]] = {}
        self._stats_ids = itertools.count()
        self._process: Any = None
        self._tasks: list[asyncio.Task[None]] = []
        self._ctx: zmq.asyncio.Context | None = None  # made in the event loop, by start()
        self._last_heard = time.monotonic()
        if attach is not None:
            self._requests_addr, self._outputs_addr = listen_addresses(attach)
            return
        self._dir = tempfile.mkdtemp(prefix="radixgen-")
        os.chmod(self._dir, 0o700)
        self._generation = 0
        self._new_addresses()

    def _new_addresses(self) -> None:
        """Fresh sockets for each engine process: messages queued for a dead one (adds, aborts of
        requests that already failed) must not reach its successor."""
        self._generation += 1
        self._requests_addr = f"ipc://{self._dir}/requests-{self._generation}"
        self._outputs_addr = f"ipc://{self._dir}/outputs-{self._generation}"

    def _bind(self) -> None:
        # the engine process may have connected already: ZeroMQ retries a connect until the bind
        if self._ctx is None:
            self._ctx = zmq.asyncio.Context()
        self._to_engine = self._ctx.socket(zmq.PUSH)
        self._from_engine = self._ctx.socket(zmq.PULL)
        if self.attach is not None:  # the listening engine bound them
            self._to_engine.connect(self._requests_addr)
            self._from_engine.connect(self._outputs_addr)
            return
        self._to_engine.bind(self._requests_addr)
        self._from_engine.bind(self._outputs_addr)

    # ---- lifecycle ----------------------------------------------------------------------

    def launch(self) -> None:
        """Spawn the engine process without waiting for it. ``radixgen serve`` calls this before
        it imports the HTTP stack, so that the model loads while the server's own imports run
        (they ran one after the other before: benchmarks/bench_startup.py)."""
        if self._process is not None or self.attach is not None:
            return
        spawn = mp.get_context("spawn")
        self._deltas = DeltaReader()
        self._process = spawn.Process(
            target=engine_process_main, args=(self.config, self._requests_addr, self._outputs_addr),
            name="radixgen-engine", daemon=True,
        )
        self._process.start()

    async def start(self, timeout: float = 600.0) -> None:
        """Launch the engine process (unless ``launch`` did) and wait until it is ready."""
        if self.attach is not None:
            await self._attach(timeout)
            return
        self.launch()
        self._bind()
        ready = asyncio.ensure_future(self._from_engine.recv_pyobj())
        while not ready.done():
            await asyncio.wait([ready], timeout=0.5)
            if not ready.done() and not self._process.is_alive():
                ready.cancel()
                raise EngineDeadError(f"the engine process exited during start-up (code {self._process.exitcode})")
            timeout -= 0.5
            if timeout <= 0:
                ready.cancel()
                raise EngineDeadError("the engine process did not become ready in time")
        first = ready.result()
        assert isinstance(first, Ready), f"unexpected first message {first!r}"
        self.info = first.info
        self.dead_reason = None
        self._tasks = [asyncio.create_task(self._receive_loop()), asyncio.create_task(self._watch_process())]

    async def _attach(self, timeout: float) -> None:
        """Say hello to the listening engine and wait for its ready message (what it sends
        before that is for an earlier front: outputs of requests it aborts for us)."""
        self._bind()
        await asyncio.wait_for(self._to_engine.send_pyobj(Hello()), timeout)
        deadline = time.monotonic() + timeout
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0 or not await self._from_engine.poll(remaining * 1000):
                raise EngineDeadError(f"no engine answered at {self.attach} within {timeout:.0f} s")
            message = await self._from_engine.recv_pyobj()
            if isinstance(message, Ready):
                break
        self.info = message.info
        self.dead_reason = None
        self._last_heard = time.monotonic()
        self._tasks = [asyncio.create_task(self._receive_loop()), asyncio.create_task(self._heartbeat())]

    async def _heartbeat(self) -> None:
        """Ping the attached engine each second; one silent for ``FRONT_TIMEOUT_S`` is taken for
        dead (what is in flight fails with 503) until it answers again, when this front attaches
        anew (its hello aborts whatever the engine still ran for us)."""
        while True:
            await asyncio.sleep(1.0)
            with contextlib.suppress(zmq.ZMQError, asyncio.TimeoutError):
                await asyncio.wait_for(self._to_engine.send_pyobj(Ping()), 1.0)
            silent = time.monotonic() - self._last_heard
            if self.dead_reason is None and silent > FRONT_TIMEOUT_S:
                self._fail_in_flight(f"the engine at {self.attach} has not answered for {silent:.0f} s")
            elif self.dead_reason is not None and silent < 1.5:
                with contextlib.suppress(zmq.ZMQError, asyncio.TimeoutError):
                    await asyncio.wait_for(self._to_engine.send_pyobj(Hello()), 1.0)

    def _fail_in_flight(self, reason: str) -> None:
        self.dead_reason = reason
        logger.error("%s; failing %d in-flight requests", reason, len(self._sinks))
        failure = f"the engine stopped while serving this request: {reason}"
        for sink, tag, _ in self._sinks.values():
            sink.put(tag, EngineDeadError(failure))
        self._sinks.clear()
        for waiter in self._stats_waiters.values():
            if not waiter.done():
                waiter.set_exception(EngineDeadError(reason))

    async def shutdown(self) -> None:
        self._closing = True
        if self.attach is not None:  # the engine outlives its fronts: only let go of it
            self._let_go()
            return
        # a PUSH socket without a live peer blocks the send: a dead engine held the server's
        # shutdown until its supervisor killed it (30 s in the tests)
        if self._process is not None and self._process.is_alive():
            if self._ctx is None:  # launched, never started: nothing to drain (it ignores SIGTERM)
                self._process.kill()
            else:
                with contextlib.suppress(zmq.ZMQError, asyncio.TimeoutError):
                    await asyncio.wait_for(self._to_engine.send_pyobj(Shutdown()), _SHUTDOWN_SEND_S)
        if self._process is not None:
            await asyncio.to_thread(self._process.join, 20)
            if self._process.is_alive():
                self._process.kill()
        self._let_go()

    def _let_go(self) -> None:
        """Stop this front's tasks and close its sockets."""
        for task in self._tasks:
            task.cancel()
        if self._ctx is not None:
            self._to_engine.close(linger=0)
            self._from_engine.close(linger=0)
            self._ctx.term()

    @property
    def is_healthy(self) -> bool:
        return self.dead_reason is None

    @property
    def num_in_flight(self) -> int:
        return len(self._sinks)

    @property
    def engine_pid(self) -> int | None:
        if self._process is not None:
            return int(self._process.pid)
        pid = self.info.get("pid")
        return int(pid) if pid is not None else None

    # ---- requests -----------------------------------------------------------------------

    async def generate(
        self, request_id: str, prompt_ids: list[int], params: SamplingParams, *, stream: bool = True
    ) -> AsyncIterator[RequestOutput]:
        """Yield the request's outputs; closing the generator early aborts it in the engine."""
        sink = OutputSink()
        await self._submit(request_id, prompt_ids, params, sink, 0, stream)
        finished = False
        try:
            while not finished:
                for _, out in await sink.take() or ():
                    if isinstance(out, BaseException):
                        raise out
                    finished = out.finished
                    yield out
        finally:
            if not finished:
                await self.abort(request_id)

    async def submit(self, request_id: str, prompt_ids: list[int], params: SamplingParams, sink: OutputSink,
                     tag: int) -> None:
        await self._submit(request_id, prompt_ids, params, sink, tag, True)

    async def _submit(self, request_id: str, prompt_ids: list[int], params: SamplingParams, sink: OutputSink,
                      tag: int, stream: bool) -> None:
        if self.dead_reason is not None:
            raise EngineDeadError(f"the engine is not available: {self.dead_reason}")
        if len(self._sinks) >= self.config.max_queued_requests:
            raise OverloadedError(
                f"{len(self._sinks)} requests in flight (max_queued_requests={self.config.max_queued_requests})"
            )
        if request_id in self._sinks:
            raise ValueError(f"request id {request_id!r} is already in use")
        text = self._consumer_text(prompt_ids, params)
        self._sinks[request_id] = (sink, tag, text)
        try:
            await self._to_engine.send_pyobj(AddRequest(request_id, prompt_ids, params, stream, text is None))
        except BaseException:
            self._sinks.pop(request_id, None)
            raise

    def _consumer_text(self, prompt_ids: list[int], params: SamplingParams) -> ConsumerText | None:
        """The text maker for a request whose text the engine need not make, or None. Prompt ids
        outside the vocabulary are the engine's to reject (a 400), not the text maker's to crash on."""
        if self.tokenizer is None or params.engine_needs_text:
            return None
        return ConsumerText.for_prompt(self.tokenizer, prompt_ids, params.skip_special_tokens)

    async def abort(self, request_id: str) -> None:
        if self._sinks.pop(request_id, None) is not None and self.dead_reason is None:
            with contextlib.suppress(zmq.ZMQError):
                await self._to_engine.send_pyobj(Abort(request_id))

    async def stats(self, timeout: float = 5.0) -> dict[str, Any]:
        if self.dead_reason is not None:
            raise EngineDeadError(f"the engine is not available: {self.dead_reason}")
        key = next(self._stats_ids)
        future: asyncio.Future[dict[str, Any]] = asyncio.get_running_loop().create_future()
        self._stats_waiters[key] = future
        try:
            await self._to_engine.send_pyobj(StatsQuery(key))
            return await asyncio.wait_for(future, timeout)
        finally:
            self._stats_waiters.pop(key, None)

    # ---- background tasks ---------------------------------------------------------------

    async def _receive_loop(self) -> None:
        while True:
            message = await self._from_engine.recv_pyobj()
            self._last_heard = time.monotonic()
            if isinstance(message, Outputs):
                sinks = self._sinks
                blocks = message.blocks
                for out in message.outputs:
                    entry = sinks.get(out.request_id)
                    if entry is not None:
                        if entry[2] is not None:
                            entry[2].fill(out)
                        entry[0].put(entry[1], out)
                        if out.finished:
                            del sinks[out.request_id]
                if blocks is not None:  # one-token deltas of requests that go on (engine/output.py)
                    for out in self._deltas.expand(blocks):
                        entry = sinks.get(out.request_id)
                        if entry is not None:
                            if entry[2] is not None:
                                entry[2].fill(out)
                            entry[0].put(entry[1], out)
            elif isinstance(message, Ready):  # the attached engine answers again after a silence
                self.info, self.dead_reason = message.info, None
                self._deltas = DeltaReader()
                logger.warning("the engine at %s answers again", self.attach)
            elif isinstance(message, Stats):
                waiter = self._stats_waiters.get(message.key)
                if waiter is not None and not waiter.done():
                    waiter.set_result(message.stats)

    async def _watch_process(self) -> None:
        while True:
            await asyncio.sleep(0.25)
            if self._process is not None and not self._process.is_alive():
                self._fail_in_flight(f"engine process exited (code {self._process.exitcode})")
                if self.restarts_left > 0 and not self._closing:
                    await self._restart()
                return

    async def _restart(self) -> None:
        """Start a new engine process; until it is ready, requests get 503 (``dead_reason``)."""
        self.restarts_left -= 1
        self.num_restarts += 1
        logger.warning("restarting the engine process (%d restarts left after this one)", self.restarts_left)
        receive = self._tasks[0]
        receive.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await receive
        self._to_engine.close(linger=0)
        self._from_engine.close(linger=0)
        self._new_addresses()
        self._process = None
        self.dead_reason = "the engine process is restarting"
        try:
            await self.start()
        except EngineDeadError as e:
            self.dead_reason = f"the engine process could not be restarted: {e}"
            logger.error(self.dead_reason)
