"""Every configurable limit is enforced with a 4xx in OpenAI's shape that names the limit."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import httpx
import pytest

from tests.api.conftest import LiveServer


def _nested(depth: int) -> dict[str, Any]:
    schema: dict[str, Any] = {"type": "string"}
    for _ in range(depth):
        schema = {"type": "object", "properties": {"a": schema}, "required": ["a"]}
    return schema


def _chat(**extra: Any) -> dict[str, Any]:
    return {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 8, **extra}


def _schema_format(schema: dict[str, Any]) -> dict[str, Any]:
    return {"response_format": {"type": "json_schema", "json_schema": {"name": "s", "schema": schema}}}


@pytest.fixture(scope="module")
def limited(start_server: Callable[..., LiveServer]) -> Iterator[LiveServer]:
    server = start_server("--max-schema-bytes", "2000", "--max-schema-depth", "9", "--max-new-tokens-limit", "50",
                          "--max-n", "2", "--max-request-bytes", "60000", "--max-context-len", "512")
    yield server
    server.stop()


@pytest.mark.parametrize(("body", "status", "names"), [
    (_chat(max_tokens=51), 400, "max_new_tokens_limit"),
    (_chat(n=3), 400, "max_n"),
    (_chat(**_schema_format({"type": "object", "description": "x" * 3000})), 400, "max_schema_bytes"),
    (_chat(**_schema_format(_nested(6))), 400, "max_schema_depth"),
    (_chat(messages=[{"role": "user", "content": "word " * 700}]), 400, "max_context_len"),
    (_chat(messages=[{"role": "user", "content": "x" * 70000}]), 413, "max_request_bytes"),
])
def test_limit_is_enforced_and_named(limited: LiveServer, body: dict[str, Any], status: int, names: str) -> None:
    response = httpx.post(limited.url + "/v1/chat/completions", json=body, timeout=60)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert names in error["message"] and error["type"] == "invalid_request_error"


def test_a_request_within_every_limit_passes(limited: LiveServer) -> None:
    response = httpx.post(limited.url + "/v1/chat/completions", timeout=60,
                          json=_chat(max_tokens=50, n=2, **_schema_format(_nested(3))))
    assert response.status_code == 200, response.text
    assert len(response.json()["choices"]) == 2
    # without max_tokens, a request gets what the limit allows rather than an error
    unbounded = {"messages": [{"role": "user", "content": "hi"}], "ignore_eos": True}
    response = httpx.post(limited.url + "/v1/chat/completions", timeout=60, json=unbounded)
    assert response.status_code == 200 and response.json()["usage"]["completion_tokens"] == 50


def test_json_nested_past_the_parser_is_a_400_not_a_500(server: LiveServer) -> None:
    deep = '{"a":' * 5000 + "1" + "}" * 5000
    body = '{"messages": [{"role": "user", "content": "hi"}], "response_format": {"type": "json_schema", ' \
           '"json_schema": {"name": "s", "schema": ' + deep + "}}}"
    response = httpx.post(server.url + "/v1/chat/completions", content=body,
                          headers={"content-type": "application/json"}, timeout=60)
    assert response.status_code == 400, response.text
    assert "error" in response.json()
    as_string = httpx.post(server.url + "/generate", timeout=60, json={
        "text": "x", "sampling_params": {"json_schema": '{"not":' * 2000 + "{}" + "}" * 2000, "max_new_tokens": 4}})
    assert as_string.status_code == 400 and "levels" in as_string.json()["error"]["message"]


def test_a_schema_whose_requirement_no_backend_enforces_is_a_400_naming_it(server: LiveServer) -> None:
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 8, "response_format": {
        "type": "json_schema", "json_schema": {"name": "s", "schema": {"type": "array", "contains": {"const": 3}}}}}
    response = httpx.post(server.url + "/v1/chat/completions", timeout=60, json=body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert "$.contains" in error["message"] and error["type"] == "invalid_request_error"
    ok = httpx.post(server.url + "/v1/chat/completions", timeout=60, json={**body, "response_format": {
        "type": "json_schema", "json_schema": {"name": "s", "schema": {"type": "array", "items": {"const": 3}}}}})
    assert ok.status_code == 200, "the server goes on serving"


def test_generate_checks_and_defaults_max_new_tokens_the_way_the_openai_routes_do(limited: LiveServer) -> None:
    too_many = httpx.post(limited.url + "/generate", timeout=60, json={
        "text": "go", "sampling_params": {"max_new_tokens": 10**6}})
    assert too_many.status_code == 400, too_many.text
    assert "max_new_tokens is 1000000 but only" in too_many.json()["error"]["message"]
    # none named: SGLang's 128, but never past the server's cap (50 here)
    unnamed = httpx.post(limited.url + "/generate", timeout=60, json={"text": "go", "sampling_params": {"ignore_eos": True}})
    assert unnamed.status_code == 200 and unnamed.json()["meta"]["completion_tokens"] == 50, unnamed.text
