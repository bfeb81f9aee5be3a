"""Fuzz the HTTP API from its own OpenAPI document with schemathesis: valid and invalid bodies
for every route. Whatever arrives, the server answers without a 5xx, every error is in OpenAI's
shape, and the KV pool is whole afterwards."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
from schemathesis import GenerationMode

from tests.api.conftest import LiveServer

pytestmark = pytest.mark.timeout(600)

# a short context keeps each generated request quick on the tiny model
FUZZ_ARGS = ("--max-context-len", "256", "--max-new-tokens-limit", "16", "--max-n", "4")
FUZZ_EXAMPLES = int(os.environ.get("RADIXGEN_FUZZ_EXAMPLES", "60"))
tried: dict[str, int] = {}


@pytest.fixture(scope="module")
def fuzz_server(start_server: Callable[..., LiveServer]) -> Iterator[LiveServer]:
    server = start_server(*FUZZ_ARGS)
    yield server
    server.stop()


def _operations(server: LiveServer) -> list[Any]:
    schema = schemathesis.openapi.from_url(server.url + "/openapi.json")
    return [result.ok() for result in schema.get_all_operations()]


def _check(case: Any, response: Any) -> None:
    key = f"{case.method} {case.path}"
    assert response.status_code < 500, f"{key} -> {response.status_code}: {response.text[:500]}"
    if response.status_code >= 400:
        error = response.json()["error"]
        assert isinstance(error["message"], str) and error["message"], response.text
        assert isinstance(error["type"], str) and error["code"] == response.status_code, response.text


@pytest.mark.parametrize("mode", [GenerationMode.POSITIVE, GenerationMode.NEGATIVE])
def test_no_5xx_and_errors_in_openai_shape(fuzz_server: LiveServer, mode: GenerationMode) -> None:
    operations = _operations(fuzz_server)
    assert {f"{op.method.upper()} {op.path}" for op in operations} >= {
        "POST /v1/chat/completions", "POST /v1/completions", "POST /generate", "POST /tokenize"}
    for operation in operations:
        if mode is GenerationMode.NEGATIVE and operation.method.upper() == "GET":
            continue  # nothing to make invalid in a GET without parameters
        key = f"{mode.value} {operation.method.upper()} {operation.path}"

        @given(case=operation.as_strategy(generation_mode=mode))
        @settings(max_examples=FUZZ_EXAMPLES, deadline=None, database=None,
                  suppress_health_check=list(HealthCheck), phases=[Phase.generate])
        def fuzz(case: Any) -> None:
            _check(case, case.call(base_url=fuzz_server.url, timeout=60))
            tried[key] = tried.get(key, 0) + 1  # noqa: B023 - fuzz() runs within this iteration

        fuzz()


def test_fuzzed_server_is_healthy_and_whole(fuzz_server: LiveServer) -> None:
    assert httpx.get(fuzz_server.url + "/health").status_code == 200
    stats = fuzz_server.wait_idle()
    assert stats["active_requests"] == 0 and stats["held_by_requests"] == 0
    assert stats["free"] + stats["held_by_tree"] == stats["pool_size"]
    print(f"fuzz cases tried: {sum(tried.values())}: {tried}")
