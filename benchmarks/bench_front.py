"""The front process's own cost: streamed tokens/s one HTTP process carries.

The server runs in its own process (uvicorn, one worker, the real app) over an engine stub that
steps on its own clock, as an engine does: every ``--step-ms`` it hands each running request
one token, so what is measured is the HTTP process alone: templating, request planning, the
per-token output path, SSE framing. A load generator in this process opens many concurrent
streams (chat completions, or text completions) and counts the streamed tokens and events. A
front that keeps up sends one event per token; one that falls behind sends a choice's queued
tokens as one event, so ``events`` below ``tokens`` says the front was saturated at that rate.
The figure to read is tokens per front CPU-second (the front's capacity when it has a core to
itself). ``--before REV`` runs the same load against the front of another commit (checked out
into a temporary worktree) in the same run, for side-by-side ratios.

    python benchmarks/bench_front.py [--streams 64] [--tokens 256] [--step-ms 4] [--before REV]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent


def serve_with_stub(tree: Path, port: int, step_s: float) -> None:
    """Run in the server subprocess: the app of ``tree`` over the engine stub."""
    sys.path.insert(0, str(tree))
    import uvicorn

    from radixgen.api.server import create_app
    from radixgen.config import ServerConfig
    from radixgen.engine.output import FinishReason, RequestOutput
    from radixgen.models.loader import resolve_model_dir

    class StubEngine:
        """An EngineHandle whose "engine" is a task that, every ``step_s`` like an engine step,
        hands every running request one token; each request streams
        max_new_tokens outputs of one token. A front that has ``submit`` is handed the outputs
        as the engine client hands them (straight into its sink), one without it iterates
        ``generate``."""

        def __init__(self) -> None:
            self.info = {"model_path": str(resolve_model_dir(None)), "max_context_len": 8192}
            self.is_healthy, self.dead_reason, self.num_in_flight, self.engine_pid = True, None, 0, None
            self.running: dict[str, list[Any]] = {}  # request id -> [sink, tag, prompt length, made, wanted]
            self.wake = asyncio.Event()

        async def start(self) -> None:
            self.steps = asyncio.create_task(self._step_forever())

        async def shutdown(self) -> None:
            return None

        async def stats(self, timeout: float = 5.0) -> dict[str, Any]:
            return {}

        async def submit(self, request_id: str, prompt_ids: list[int], params: Any, sink: Any, tag: int) -> None:
            self.running[request_id] = [sink, tag, len(prompt_ids), 0, params.max_new_tokens]
            self.wake.set()

        async def abort(self, request_id: str) -> None:
            self.running.pop(request_id, None)

        async def generate(self, request_id: str, prompt_ids: list[int], params: Any, *, stream: bool = True) -> Any:
            queue: asyncio.Queue[Any] = asyncio.Queue()  # a queue per request, as the engine client had

            class Sink:
                def put(self, tag: int, out: Any) -> None:
                    queue.put_nowait(out)

            await self.submit(request_id, prompt_ids, params, Sink(), 0)
            finished = False
            try:
                while not finished:
                    out = await queue.get()
                    finished = out.finished
                    yield out
            finally:
                await self.abort(request_id)

        async def _step_forever(self) -> None:
            loop = asyncio.get_running_loop()
            next_step = loop.time()
            while True:
                if not self.running:
                    self.wake.clear()
                    await self.wake.wait()
                    next_step = loop.time()
                for rid, state in list(self.running.items()):
                    sink, tag, prompt_len, made, n = state
                    made = state[3] = made + 1
                    last = made == n
                    sink.put(tag, RequestOutput(
                        rid, [1000 + made % 100], " tok", last, finish_reason=FinishReason.LENGTH if last else None,
                        prompt_tokens=prompt_len, completion_tokens=made,
                        output_ids=list(range(n)) if last else None, text=" tok" * n if last else None))
                    if last:
                        del self.running[rid]
                next_step += step_s
                await asyncio.sleep(max(0.0, next_step - loop.time()))

    config = ServerConfig(host="127.0.0.1", port=port, max_queued_requests=100_000)
    uvicorn.run(create_app(config, client=StubEngine()), host="127.0.0.1", port=port, log_level="warning")  # type: ignore[arg-type]


def _cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process (Linux /proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


async def _load(url: str, endpoint: str, streams: int, tokens: int) -> dict[str, Any]:
    import httpx

    if endpoint == "chat":
        path, body = "/v1/chat/completions", {"messages": [{"role": "user", "content": "Count."}]}
    else:
        path, body = "/v1/completions", {"prompt": "Count:"}
    body = {**body, "model": "default", "max_tokens": tokens, "stream": True}

    async def one(client: httpx.AsyncClient) -> tuple[int, int]:
        got = events = 0
        async with client.stream("POST", url + path, json=body) as response:
            async for line in response.aiter_lines():
                if line.startswith("data: {"):  # an event may carry several tokens (coalesced)
                    got += line.count(" tok")
                    events += 1
        return got, events

    limits = httpx.Limits(max_connections=streams, max_keepalive_connections=streams)
    async with httpx.AsyncClient(timeout=600, limits=limits) as client:
        await one(client)  # warm: templating caches, the first connection
        started = time.perf_counter()
        counts = await asyncio.gather(*(one(client) for _ in range(streams)))
        elapsed = time.perf_counter() - started
    total = sum(c[0] for c in counts)
    events = sum(c[1] for c in counts)
    return {"endpoint": endpoint, "streams": streams, "tokens": total, "events": events, "seconds": elapsed,
            "tokens_per_s": total / elapsed, "events_per_s": events / elapsed}


def measure(tree: Path, label: str, streams: int, tokens: int, step_ms: float) -> list[dict[str, Any]]:
    import httpx

    port = _free_port()
    env = {**os.environ, "PYTHONPATH": str(tree)}
    server = subprocess.Popen([sys.executable, str(Path(__file__).resolve()), "--serve", str(port), "--tree", str(tree),
                               "--step-ms", str(step_ms)],
                              env=env, cwd=str(tree))
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline or server.poll() is not None:
                raise RuntimeError(f"the front of {label} did not start")
            time.sleep(0.5)
        rows = []
        for endpoint in ("chat", "completions"):
            cpu = _cpu_seconds(server.pid)
            row = asyncio.run(_load(url, endpoint, streams, tokens))
            # the load generator shares this machine's cores: the front's own CPU time says
            # what one front process carries when it has a core to itself
            row["front_cpu_s"] = _cpu_seconds(server.pid) - cpu
            row["tokens_per_front_cpu_s"] = row["tokens"] / row["front_cpu_s"]
            row["events_per_front_cpu_s"] = row["events"] / row["front_cpu_s"]
            rows.append({"front": label, **row})
        return rows
    finally:
        server.terminate()
        server.wait(timeout=30)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--streams", type=int, default=64)
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--step-ms", type=float, default=4.0,
                        help="the stub engine's step time (4 ms x 64 streams offers 16k tokens/s)")
    parser.add_argument("--before", default=None, help="a git revision to measure side by side")
    parser.add_argument("--serve", type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--tree", default=str(ROOT), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve is not None:
        serve_with_stub(Path(args.tree), args.serve, args.step_ms / 1000)
        return
    sys.path.insert(0, str(ROOT))
    from benchmarks.common import print_table, trees_to_measure, write_json

    rows = []
    with trees_to_measure(args.before) as trees:
        for tree, label in trees:
            rows += measure(tree, label, args.streams, args.tokens, args.step_ms)
    print_table(rows, ["front", "endpoint", "streams", "tokens", "events", "seconds", "tokens_per_s", "front_cpu_s",
                       "tokens_per_front_cpu_s", "events_per_front_cpu_s"])
    print("wrote", write_json("bench_front", {"streams": args.streams, "tokens_per_stream": args.tokens, "step_ms": args.step_ms,
                                              "rows": rows}))


if __name__ == "__main__":
    main()
