"""SECURITY.md's promises: loopback by default, the key guards every route but /health and never
reaches the logs, chat templates cannot reach Python."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import httpx
import pytest

from radixgen.config import ServerConfig
from tests.api.conftest import LiveServer

KEY = "rk-7f3a9c1e5b2d4f60"


def test_loopback_by_default_and_the_key_out_of_reprs() -> None:
    config = ServerConfig(api_key=KEY)
    assert config.host == "127.0.0.1"
    assert KEY not in repr(config)


def test_every_route_but_health_needs_the_key_and_the_key_is_never_logged(
    start_server: Callable[..., LiveServer],
) -> None:
    server = start_server("--log-level", "debug", api_key=KEY)
    routes = [("GET", path) for path in ("/v1/models", "/metrics", "/internal/stats", "/model_info",
                                         "/openapi.json", "/docs")]
    routes += [("POST", path) for path in ("/v1/chat/completions", "/v1/completions", "/generate", "/tokenize")]
    for method, path in routes:
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}):
            response = httpx.request(method, server.url + path, headers=headers, json={}, timeout=30)
            assert response.status_code == 401, (method, path, headers, response.status_code)
            assert response.json()["error"]["type"] == "authentication_error"
            assert KEY not in response.text
    assert httpx.get(server.url + "/health", timeout=10).status_code == 200
    good = httpx.post(server.url + "/v1/completions", headers=server.headers, timeout=60,
                      json={"prompt": f"say {KEY[:4]}", "max_tokens": 3})
    assert good.status_code == 200
    server.stop()
    log = server.output()
    assert '"POST /v1/completions HTTP/1.1" 200' in log, "the debug log was captured"
    assert KEY not in log, "the API key appeared in the server's output"


def test_chat_templates_render_in_a_sandbox(tokenizer: Any) -> None:
    from jinja2.exceptions import SecurityError

    escape = "{{ ''.__class__.__mro__[1].__subclasses__() }}"
    with pytest.raises(SecurityError):
        tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], chat_template=escape, tokenize=False)
