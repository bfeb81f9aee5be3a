"""The soak's short version: a few hundred mixed requests (streams, disconnects, give-ups,
duplicate ids, n > 1, constraints, invalid bodies) against a small KV pool; every request ends
complete and valid or with a clear 4xx, and the pool balances afterwards."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import pytest

from benchmarks.soak import check_server, soak
from tests.api.conftest import LiveServer


@pytest.mark.timeout(300)
def test_short_soak_loses_nothing(start_server: Callable[..., LiveServer]) -> None:
    server = start_server("--kv-cache-tokens", "1536", "--max-running-requests", "16")
    report = asyncio.run(soak(server.url, requests=250, duration_s=150, concurrency=24, max_tokens=48, seed=3))
    assert not report.failures, report.failures
    assert report.outcomes["ok"] > 100 and report.outcomes["disconnected mid-stream"] > 0
    assert report.outcomes["invalid refused"] > 0 and report.outcomes["duplicate id handled"] > 0
    stats = check_server(server.url)
    assert stats["kv_balanced"] and stats["healthy"], stats
    assert stats["evicted_tokens"] > 0, "the pool was small enough to evict"
    server.stop()
