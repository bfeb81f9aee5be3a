"""The engine in its own process, for the server: requests in and outputs out over ZeroMQ.

ZeroMQ rather than multiprocessing pipes: its sockets queue messages without a reader thread
on the HTTP side (zmq.asyncio plugs into the event loop), and one message per step carries the
outputs of the whole batch. Messages (ipc/messages.py) are pickled dataclasses between our own
two processes, over ipc sockets in a private temporary folder.
"""

from __future__ import annotations

import gc
import logging
import os
import signal
import threading
import time
from typing import Any

from radixgen.config import EngineConfig
from radixgen.engine.output import FinishReason, RequestOutput, StepDeltas
from radixgen.ipc.messages import (
    Abort,
    AddRequest,
    EngineMessage,
    FrontMessage,
    Hello,
    Outputs,
    Ping,
    Pong,
    Ready,
    Shutdown,
    Stats,
    StatsQuery,
)

logger = logging.getLogger(__name__)


FRONT_TIMEOUT_S = 5.0
"""A listening engine aborts what its front started once the front has not pinged for this long
(a front pings every second): nobody would read those outputs."""


def engine_process_main(config: EngineConfig, requests_addr: str, outputs_addr: str, *, listen: bool = False) -> None:
    """Entry point of the engine process: spawned by the server's EngineClient (it lives as
    long as that server), or, with ``listen``, started on its own (``radixgen engine --listen``)
    at addresses it binds, for servers that attach to it one after another: it outlives them,
    with its model loaded and its prefix cache warm. A front says hello when it attaches (what
    an earlier front left running is aborted) and pings while attached."""
    import zmq

    logging.basicConfig(level=getattr(logging, config.log_level.upper(), logging.INFO),
                        format="%(asctime)s %(levelname)s engine %(name)s: %(message)s")
    stop = threading.Event()
    if listen:  # SIGTERM / SIGINT: stop serving (what runs is aborted), exit 0
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda *_: stop.set())
    else:
        _exit_with_parent(os.getppid())
        # The server decides when this process ends (after its drain, with a shutdown message).
        # A SIGTERM or SIGINT sent to the whole process group (a terminal's Ctrl-C, a service
        # manager stopping the group) must not kill the engine under a draining server, which
        # would then fail what it was finishing and start a new engine.
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, signal.SIG_IGN)

    ctx = zmq.Context()
    inbox = ctx.socket(zmq.PULL)
    outbox = ctx.socket(zmq.PUSH)
    for socket, address in ((inbox, requests_addr), (outbox, outputs_addr)):
        if listen:
            socket.bind(address)
        else:
            socket.connect(address)
    loop = _EngineLoop(config, outbox)
    if listen:
        logger.info("engine listening at %s (requests) and %s (outputs)", requests_addr, outputs_addr)
    else:
        loop.send(Ready(loop.engine.info()))
    try:
        loop.serve(inbox, stop, listen)
    finally:
        loop.engine.shutdown()
        inbox.close(linger=0)
        outbox.close(linger=100)
        ctx.term()
        skip_exit_collection()


class _EngineLoop:
    """The engine process's side of the messages: requests in, one ``Outputs`` per step out."""

    def __init__(self, config: EngineConfig, outbox: Any) -> None:
        from radixgen.engine.engine import Engine

        self._outbox = outbox
        self._send_lock = threading.Lock()
        self._pending: list[RequestOutput] = []
        self.deltas = StepDeltas()  # the plain decode rows' deltas, as columns (engine/output.py)
        self.engine = Engine(config, after_step=self._flush)
        self.last_ping = time.monotonic()
        # Everything alive now (torch, transformers, the model: ~300k tracked objects) lives as long
        # as the process: out of the collector's view, a full collection costs microseconds instead
        # of a ~240 ms stall of the engine loop each time serving's allocations trigger one.
        gc.collect()
        gc.freeze()

    def send(self, message: EngineMessage) -> None:
        with self._send_lock:
            self._outbox.send_pyobj(message)

    def _collect(self, out: RequestOutput) -> None:  # engine thread
        self._pending.append(out)

    def _flush(self) -> None:  # engine thread, after each step: one message for the whole batch
        blocks = self.deltas.take()
        if self._pending or blocks is not None:
            batch = self._pending[:]
            self._pending.clear()
            self.send(Outputs(batch, blocks))

    def serve(self, inbox: Any, stop: threading.Event, listen: bool) -> None:
        while not stop.is_set():
            if inbox.poll(250):
                if not self.handle(inbox.recv_pyobj()):
                    return
            elif listen and time.monotonic() - self.last_ping > FRONT_TIMEOUT_S and self.engine.num_active:
                logger.warning("no front has pinged for %.0f s: aborting its %d requests",
                               time.monotonic() - self.last_ping, self.engine.abort_all())

    def handle(self, message: FrontMessage) -> bool:
        """Act on one message; False once told to shut down."""
        match message:
            case AddRequest():
                self._add(message)
            case Abort(request_id):
                self.engine.abort(request_id)
            case Ping():
                self.last_ping = time.monotonic()
                self.send(Pong())
            case Hello():  # a front attaches: one at a time, so what runs is an earlier one's
                self.last_ping = time.monotonic()
                aborted = self.engine.abort_all()
                self.deltas.forget()
                if aborted:
                    logger.warning("a front attached: aborted the %d requests an earlier one left running", aborted)
                self.send(Ready(self.engine.info()))
            case StatsQuery(key):
                self.send(Stats(key, {**self.engine.stats_snapshot(), "gc_frozen_objects": gc.get_freeze_count()}))
            case Shutdown():
                return False
        return True

    def _add(self, message: AddRequest) -> None:
        try:
            self.engine.add_request(message.prompt_ids, message.params, request_id=message.request_id,
                                    on_output=self._collect, stream=message.stream, delta_sink=self.deltas,
                                    detokenize=message.detokenize)
        except ValueError as e:  # a user error the front door did not catch
            self.send(Outputs([RequestOutput(request_id=message.request_id, new_token_ids=[], new_text="",
                                             finished=True, finish_reason=FinishReason.ERROR, error=str(e),
                                             user_error=True)], None))


def listen_addresses(folder: str) -> tuple[str, str]:
    """The request and output addresses of an engine listening in ``folder`` (ipc sockets)."""
    return f"ipc://{folder}/requests", f"ipc://{folder}/outputs"


def _exit_with_parent(parent: int, period_s: float = 0.5) -> None:
    """End this process when the server process that spawned it is gone. A server killed with
    SIGKILL (an OOM kill, a supervisor's hard stop) cannot stop its engine, which then kept
    its model and KV pool in memory with no one to serve; a restarted server starts its own."""

    def watch() -> None:
        while True:
            time.sleep(period_s)
            if os.getppid() != parent:  # re-parented: the server process has exited
                logger.error("the server process %d is gone; the engine process exits", parent)
                os._exit(1)  # nothing left to drain: no one can receive the outputs

    threading.Thread(target=watch, name="radixgen-parent-watch", daemon=True).start()


def skip_exit_collection() -> None:
    """Call last before a process with a model loaded exits: the interpreter's final garbage
    collection walked every object torch, transformers and the engine made, ~1.8 s of each
    server or engine process's exit (0.6 s with the objects frozen out of the collector's view).
    Finalizers, atexit handlers and stream flushes still run."""
    gc.freeze()
