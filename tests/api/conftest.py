"""A live server on 127.0.0.1 (a free port) over the tiny model, started as users start it."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class LiveServer:
    def __init__(self, args: list[str], api_key: str | None = None) -> None:
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.api_key = api_key
        cmd = [sys.executable, "-m", "radixgen.api.cli", "serve", "--port", str(self.port), "--log-level", "warning", *args]
        if api_key:
            cmd += ["--api-key", api_key]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                     env={**os.environ, "TOKENIZERS_PARALLELISM": "false"})
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited: {self.proc.stdout.read() if self.proc.stdout else ''}")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.3)
        self.stop()
        raise RuntimeError("server did not become healthy in time")

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def stats(self) -> dict[str, Any]:
        return httpx.get(self.url + "/internal/stats", headers=self.headers, timeout=10).json()

    def wait_idle(self, timeout: float = 30) -> dict[str, Any]:
        """Poll until no request is active; return the stats (KV accounting included)."""
        deadline = time.monotonic() + timeout
        while True:
            stats = self.stats()
            if stats["active_requests"] == 0 or time.monotonic() > deadline:
                return stats
            time.sleep(0.1)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)


@pytest.fixture(scope="session")
def start_server(tiny_model_dir: Path) -> Iterator[Callable[..., LiveServer]]:
    started: list[LiveServer] = []

    def start(*extra: str, api_key: str | None = None) -> LiveServer:
        server = LiveServer(["--model", str(tiny_model_dir), "--kv-cache-tokens", "8192", "--max-context-len", "1024",
                             "--served-model-name", "tiny", *extra], api_key=api_key)
        started.append(server)
        return server

    yield start
    for s in started:
        s.stop()


@pytest.fixture(scope="session")
def server(start_server: Callable[..., LiveServer]) -> LiveServer:
    return start_server()


@pytest.fixture(autouse=True)
def _server_kv_invariant(request: pytest.FixtureRequest) -> Iterator[None]:
    yield
    if "server" in request.fixturenames:
        srv: LiveServer = request.getfixturevalue("server")
        stats = srv.wait_idle()
        assert stats["active_requests"] == 0, stats
        assert stats["held_by_requests"] == 0, stats
        assert stats["free"] + stats["held_by_tree"] == stats["pool_size"], stats
