"""The engine in its own process, for the server: requests in and outputs out over ZeroMQ.

ZeroMQ rather than multiprocessing pipes: its sockets queue messages without a reader thread
on the HTTP side (zmq.asyncio plugs into the event loop), and one message per step carries the
outputs of the whole batch. Messages are pickled Python objects between our own two processes,
over ipc sockets in a private temporary folder.
"""

from __future__ import annotations

import gc
import logging
import os
import threading
import time
from typing import Any

from radixgen.config import EngineConfig
from radixgen.engine.deltas import StepDeltas
from radixgen.engine.request import FinishReason, RequestOutput

logger = logging.getLogger(__name__)


def engine_process_main(config: EngineConfig, requests_addr: str, outputs_addr: str) -> None:
    """Entry point of the engine process (spawned by the server's EngineClient)."""
    import zmq

    logging.basicConfig(level=getattr(logging, config.log_level.upper(), logging.INFO),
                        format="%(asctime)s %(levelname)s engine %(name)s: %(message)s")
    _exit_with_parent(os.getppid())

    from radixgen.engine.engine import Engine
    ctx = zmq.Context()
    inbox = ctx.socket(zmq.PULL)
    inbox.connect(requests_addr)
    outbox = ctx.socket(zmq.PUSH)
    outbox.connect(outputs_addr)
    send_lock = threading.Lock()
    pending: list[RequestOutput] = []
    deltas = StepDeltas()  # the plain decode rows' deltas, as columns (engine/deltas.py)

    def send(message: Any) -> None:
        with send_lock:
            outbox.send_pyobj(message)

    def collect(out: RequestOutput) -> None:  # engine thread
        pending.append(out)

    def flush() -> None:  # engine thread, after each step: one message for the whole batch
        blocks = deltas.take()
        if pending or blocks is not None:
            batch = pending[:]
            pending.clear()
            send(("outputs", (batch, blocks)))

    engine = Engine(config, after_step=flush)
    send(("ready", engine.info()))
    try:
        while True:
            kind, payload = inbox.recv_pyobj()
            if kind == "add":
                request_id, prompt_ids, params, stream, detokenize = payload
                try:
                    engine.add_request(prompt_ids, params, request_id=request_id, on_output=collect, stream=stream,
                                       deltas=deltas, detokenize=detokenize)
                except ValueError as e:  # a user error the front door did not catch
                    send(("outputs", ([RequestOutput(request_id, [], "", True, FinishReason.ERROR, error=str(e),
                                                     user_error=True)], None)))
            elif kind == "abort":
                engine.abort(payload)
            elif kind == "stats":
                send(("stats", (payload, engine.stats_snapshot())))
            elif kind == "shutdown":
                break
    finally:
        engine.shutdown()
        inbox.close(linger=0)
        outbox.close(linger=100)
        ctx.term()
        skip_exit_collection()


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
