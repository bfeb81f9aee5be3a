"""The DSL's Endpoint backend against a live server: the same programs as on the in-process
Runtime, with the same outputs for the same seed."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import httpx
import pytest

from radixgen import Engine
from radixgen.lang import Endpoint, ProgramError, Runtime, function, gen, run_tools, select
from tests.api.conftest import LiveServer


@pytest.fixture
def endpoint(server: LiveServer) -> Iterator[Endpoint]:
    with Endpoint(server.url) as ep:
        yield ep


@function
def triage(s: Any, ticket: str) -> None:
    with s.system():
        s += "Classify support tickets."
    with s.user():
        s += ticket
    with s.assistant():
        s += "Priority: " + select("priority", ["low", "medium", "high"]) + "\nTeam: "
        s += gen("team", choices=["billing", "shipping", "tech"]) + "\nCode: " + gen("code", regex=r"T-[0-9]{3}")
        s += "\nNote: " + gen("note", max_tokens=8)
    branches = s.fork(2)
    for branch in branches:
        branch += gen("extra", max_tokens=4)
    s.branches = branches


def _outputs(state: Any) -> dict[str, Any]:
    return {"text": state.text(), "priority": state["priority"], "team": state["team"], "code": state["code"],
            "note": state["note"], "scores": state.meta("priority")["scores"],
            "branches": [b["extra"] for b in state.branches]}


def test_same_program_same_seed_same_outputs_on_runtime_and_endpoint(
    endpoint: Endpoint, make_engine: Callable[..., Engine]
) -> None:
    tickets = ["My card was charged twice.", "The parcel never arrived."]
    with Runtime(engine=make_engine(kv_cache_tokens=8192)) as runtime:
        local = [_outputs(triage.run(t, backend=runtime, seed=21, temperature=0.7)) for t in tickets]
    remote = [_outputs(triage.run(t, backend=endpoint, seed=21, temperature=0.7)) for t in tickets]
    for mine, theirs in zip(local, remote, strict=True):
        assert mine["scores"] == pytest.approx(theirs["scores"], abs=1e-4)
        assert {k: v for k, v in mine.items() if k != "scores"} == {k: v for k, v in theirs.items() if k != "scores"}
    assert local[0]["code"].startswith("T-") and local[0]["team"] in ("billing", "shipping", "tech")


def test_endpoint_streams_and_batches(endpoint: Endpoint) -> None:
    state = triage.run("Refund please.", backend=endpoint, seed=5, stream=True)
    chunks = list(state.text_iter())
    assert "".join(chunks) == state.text() and len(chunks) > 12
    states = triage.run_batch([{"ticket": f"Ticket {i}"} for i in range(3)], backend=endpoint, seed=9)
    assert [s.messages()[1]["content"] for s in states] == ["Ticket 0", "Ticket 1", "Ticket 2"]
    assert all(s.meta("note")["cached_tokens"] > 0 for s in states), "the shared system prompt came from the cache"


def test_endpoint_tool_loop_and_limits_of_the_wire(endpoint: Endpoint) -> None:
    def add(a: int, b: int) -> int:
        """Add two integers."""
        return a + b

    run = run_tools("What is 2 + 3?", [add], backend=endpoint, tool_choice="required", max_calls=1, max_tokens=24)
    assert run.calls[0].name == "add" and run.calls[0].result == run.calls[0].arguments.a + run.calls[0].arguments.b

    @function
    def with_validator(s: Any) -> None:
        s += gen("x", json_schema={"type": "integer"}, validators={"$": lambda v: v > 0})

    with pytest.raises(ProgramError, match="validators .* in-process only"):
        with_validator.run(backend=endpoint)


def test_backend_down_and_bad_regex_name_the_step(endpoint: Endpoint) -> None:
    @function
    def bad(s: Any) -> None:
        s += "x" + gen("y", regex="(unclosed")

    with pytest.raises(ProgramError, match=r"step 1 \(gen\('y'\)\).*400.*regex"):
        bad.run(backend=endpoint)

    with (socket_port() as port, Endpoint(f"http://127.0.0.1:{port}", timeout=2) as down,
          pytest.raises(ProgramError, match=r"step 1 .*cannot reach the radixgen server")):
        bad.run(backend=down)


class socket_port:  # noqa: N801 - used as a context manager: a loopback port nobody listens on
    def __enter__(self) -> int:
        import socket

        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))  # bound, not listening: connections are refused
        return int(self.sock.getsockname()[1])

    def __exit__(self, *exc: object) -> None:
        self.sock.close()


def test_tokenize_and_model_info_routes(server: LiveServer) -> None:
    info = httpx.get(server.url + "/model_info", timeout=10).json()
    assert info["max_context_len"] == 1024 and info["chat_roles"]["prefix"]["user"] == "<|im_start|>user\n"
    tokens = httpx.post(server.url + "/tokenize", json={"text": ["hi there", "x"]}, timeout=10).json()["tokens"]
    assert len(tokens) == 2 and all(isinstance(t, int) for t in tokens[0])
    bad = httpx.post(server.url + "/tokenize", json={"text": 5}, timeout=10)
    assert bad.status_code == 400 and "error" in bad.json()
