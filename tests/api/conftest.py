"""A live server on 127.0.0.1 (a free port) over the tiny model, started as users start it."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from radixgen.ipc.launch import ServerProcess


class LiveServer(ServerProcess):
    """``radixgen serve`` as users start it, plus the test's view of its KV accounting."""

    def __init__(self, args: list[str], api_key: str | None = None, env: dict[str, str] | None = None) -> None:
        self.api_key = api_key
        super().__init__(*args, *(["--api-key", api_key] if api_key else []), timeout=240, env=env)

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
