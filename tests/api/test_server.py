"""The OpenAI-compatible server, through the official client and raw HTTP."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time
from collections.abc import Callable
from typing import Any

import httpx
import openai
import pytest

from radixgen import SamplingParams
from tests.api.conftest import LiveServer

CHAT = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Count to five."}]


def client(server: LiveServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key=server.api_key or "unused", max_retries=0)


def test_models_and_health(server: LiveServer) -> None:
    models = client(server).models.list()
    assert [m.id for m in models.data] == ["tiny"]
    assert httpx.get(server.url + "/health").json()["status"] == "ok"


def test_chat_completion_shape_and_usage(server: LiveServer) -> None:
    resp = client(server).chat.completions.create(model="tiny", messages=CHAT, max_tokens=12, temperature=0,
                                                  extra_body={"ignore_eos": True})
    choice = resp.choices[0]
    assert choice.finish_reason == "length" and choice.message.role == "assistant" and choice.message.content
    assert resp.usage.completion_tokens == 12
    assert resp.usage.total_tokens == resp.usage.prompt_tokens + 12


def test_stream_matches_non_stream_and_reports_usage(server: LiveServer) -> None:
    kwargs = dict(model="tiny", messages=CHAT, max_tokens=16, temperature=0, extra_body={"ignore_eos": True})
    whole = client(server).chat.completions.create(**kwargs).choices[0].message.content

    async def stream() -> tuple[str, list[str | None], object]:
        aclient = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
        parts, reasons, usage = [], [], None
        async for chunk in await aclient.chat.completions.create(**kwargs, stream=True,
                                                                 stream_options={"include_usage": True}):
            if chunk.usage is not None:
                usage = chunk.usage
            for c in chunk.choices:
                parts.append(c.delta.content or "")
                reasons.append(c.finish_reason)
        return "".join(parts), reasons, usage

    text, reasons, usage = asyncio.run(stream())
    assert text == whole
    assert reasons[-1] == "length" and all(r is None for r in reasons[:-1])
    assert usage is not None and usage.completion_tokens == 16  # type: ignore[attr-defined]


def test_completions_list_prompt_and_stream(server: LiveServer) -> None:
    c = client(server)
    resp = c.completions.create(model="tiny", prompt=["Once upon", "The sky is"], max_tokens=8, temperature=0,
                                extra_body={"ignore_eos": True})
    assert [ch.index for ch in resp.choices] == [0, 1]
    assert all(ch.finish_reason == "length" for ch in resp.choices)
    streamed = "".join(ch.choices[0].text for ch in c.completions.create(
        model="tiny", prompt="Once upon", max_tokens=8, temperature=0, stream=True, extra_body={"ignore_eos": True})
        if ch.choices)
    assert streamed == resp.choices[0].text


def test_text_made_by_the_front_is_the_engines(server: LiveServer, make_engine: Callable[..., Any]) -> None:
    """A plain request's text is made in the HTTP process from the token ids (the engine does
    not detokenize it); a stop string makes the engine do it. Both equal the in-process
    engine's text for the same tokens, streamed and whole, at EOS or at the length limit."""
    engine = make_engine()
    c = client(server)
    for prompt in ("Once upon a time", "日本語 🚀 naïve", "The sky is"):
        for extra in ({"ignore_eos": True}, {}):
            body = dict(model="tiny", prompt=prompt, max_tokens=24, temperature=0, extra_body=extra)
            expected = engine.generate(prompt, SamplingParams(max_new_tokens=24, temperature=0, **extra)).text
            whole = c.completions.create(**body).choices[0].text  # type: ignore[call-overload]
            streamed = "".join(ch.choices[0].text for ch in c.completions.create(**body, stream=True)  # type: ignore[call-overload]
                               if ch.choices)
            never = c.completions.create(**{**body, "stop": ["\x00never"]}).choices[0].text  # type: ignore[call-overload]
            assert whole == streamed == never == expected, (prompt, extra)


def _sse_events(server: LiveServer, path: str, body: dict[str, Any]) -> list[dict[str, Any]]:
    with httpx.stream("POST", server.url + path, json={**body, "stream": True}, timeout=60) as response:
        lines = [line for line in response.iter_lines() if line.startswith("data: {")]
    return [json.loads(line[len("data: "):]) for line in lines]


def test_text_events_framed_by_hand_have_the_shape_of_the_generic_ones(server: LiveServer) -> None:
    """Text-only stream events are written without building models; each must carry the same
    fields, in the same layout, as the events built the generic way (the first and the last)."""
    common = {"model": "tiny", "max_tokens": 8, "temperature": 0, "ignore_eos": True}
    for path, body, text_field in (("/v1/completions", {"prompt": "Once upon"}, "text"),
                                   ("/v1/chat/completions", {"messages": CHAT}, "delta")):
        events = _sse_events(server, path, {**common, **body})
        ends = [e for e in events if e["choices"] and e["choices"][0].get("finish_reason")]
        texts = [e for e in events if e["choices"] and not e["choices"][0].get("finish_reason")
                 and (e["choices"][0].get("text") or e["choices"][0].get("delta", {}).get("content"))]
        assert len(ends) == 1 and texts, path
        for event in texts:
            assert list(event) == list(ends[0]), path
            assert event["id"] == ends[0]["id"] and event["created"] == ends[0]["created"]
            choice = event["choices"][0]
            assert list(choice)[:2] == ["index", text_field] and choice["index"] == 0
        if path == "/v1/completions":  # every field OpenAI's completion chunk has, null where unset
            assert all(list(e["choices"][0]) == ["index", "text", "finish_reason", "logprobs"] for e in texts)


def test_a_request_asks_for_speculation_and_the_metrics_count_it(server: LiveServer) -> None:
    c = client(server)
    kwargs: dict[str, Any] = dict(model="tiny", messages=[{"role": "user", "content": "one two one two one two"}],
                                  max_tokens=48, temperature=0)
    plain = c.chat.completions.create(**kwargs, extra_body={"ignore_eos": True, "speculative": False})
    drafted = c.chat.completions.create(**kwargs, extra_body={"ignore_eos": True, "speculative": True})
    assert drafted.choices[0].message.content == plain.choices[0].message.content
    metrics = {line.split()[0]: float(line.split()[1]) for line in httpx.get(server.url + "/metrics").text.splitlines()
               if line.startswith("radixgen_spec_")}
    assert metrics["radixgen_spec_accepted_tokens"] > 0, metrics
    assert 0 < metrics["radixgen_spec_acceptance_rate"] <= 1
    bad = httpx.post(server.url + "/v1/chat/completions", json={**kwargs, "speculative": "maybe"})
    assert bad.status_code == 400 and "speculative" in bad.text


def test_n_seed_and_stop(server: LiveServer) -> None:
    c = client(server)
    kw = dict(model="tiny", messages=CHAT, max_tokens=10, temperature=1.0, seed=123, extra_body={"ignore_eos": True})
    a = c.chat.completions.create(n=3, **kw)
    b = c.chat.completions.create(n=3, **kw)
    texts = [ch.message.content for ch in a.choices]
    assert texts == [ch.message.content for ch in b.choices], "same seed, same outputs"
    assert len(set(texts)) > 1, "the n choices are sampled independently"
    full = c.chat.completions.create(model="tiny", messages=CHAT, max_tokens=30, temperature=0,
                                     extra_body={"ignore_eos": True}).choices[0].message.content
    stop = full[10:13]
    cut = c.chat.completions.create(model="tiny", messages=CHAT, max_tokens=30, temperature=0, stop=[stop],
                                    extra_body={"ignore_eos": True}).choices[0]
    assert cut.finish_reason == "stop" and cut.message.content == full[: full.find(stop)]


def test_cached_tokens_on_repeated_prefix(server: LiveServer) -> None:
    c = client(server)
    system = {"role": "system", "content": "Rules: be brief, be kind, cite sources. " * 10}
    c.chat.completions.create(model="tiny", messages=[system, {"role": "user", "content": "hi"}], max_tokens=2)
    again = c.chat.completions.create(model="tiny", messages=[system, {"role": "user", "content": "hello"}], max_tokens=2)
    assert again.usage.prompt_tokens_details.cached_tokens > 50


def test_logprobs(server: LiveServer) -> None:
    resp = client(server).chat.completions.create(model="tiny", messages=CHAT, max_tokens=4, temperature=0, logprobs=True,
                                                  top_logprobs=2, extra_body={"ignore_eos": True})
    content = resp.choices[0].logprobs.content
    assert len(content) == 4
    assert all(len(t.top_logprobs) == 2 and t.top_logprobs[0].logprob >= t.top_logprobs[1].logprob for t in content)
    assert all(abs(t.logprob - t.top_logprobs[0].logprob) < 1e-5 for t in content), "greedy picks the top token"


@pytest.mark.parametrize(
    ("body", "status", "needle"),
    [
        ("{not json", 400, "not valid JSON"),
        (json.dumps({"model": "nope", "messages": CHAT}), 404, "does not exist"),
        (json.dumps({"messages": CHAT, "temperature": -3}), 400, "temperature"),
        (json.dumps({"messages": CHAT, "top_p": 7}), 400, "top_p"),
        (json.dumps({"messages": []}), 400, "messages"),
        (json.dumps({"messages": CHAT, "max_tokens": 5000}), 400, "max_tokens"),
        (json.dumps({"messages": [{"role": "user", "content": "word " * 1200}]}), 400, "context"),
        (json.dumps({"messages": CHAT, "response_format": {"type": "json_schema", "json_schema": {}}}), 400, "schema"),
        (json.dumps({"messages": CHAT, "regex": "(unclosed"}), 400, "regex"),
        (json.dumps({"messages": CHAT, "response_format": {"type": "json_schema", "json_schema": {"schema": {"type": "strnig"}}}}),
         400, "not a JSON type"),
        (json.dumps({"messages": CHAT, "tools": [{"type": "function", "function": {"name": "f"}}],
                     "tool_choice": {"type": "function", "function": {"name": "g"}}}), 400, "not in tools"),
        (json.dumps({"messages": CHAT, "n": 0}), 400, "n"),
        (json.dumps({"messages": CHAT, "web_search_options": {}}), 400, "'web_search_options' is not supported"),
        (json.dumps({"messages": CHAT, "logit_bias": {"x": 10}}), 400, "logit_bias keys must be token ids"),
        (json.dumps({"messages": CHAT, "logit_bias": {"50": 101}}), 400, "logit_bias"),
        (json.dumps({"messages": CHAT, "max_tokens": 4, "min_tokens": 5}), 400, "min_new_tokens"),
        (json.dumps({"messages": CHAT, "modalities": ["text", "audio"]}), 400, "modalities"),
        (json.dumps({"messages": CHAT, "functions": [{"name": "f"}], "tools": [{"type": "function", "function": {"name": "f"}}]}),
         400, "not both"),
        (json.dumps({"messages": CHAT, "n": 17}), 400, "max_n"),
        (json.dumps({"messages": [{"role": "user", "content": "x" * (5 * 2**20)}]}), 413, "max_request_bytes"),
    ],
)
def test_errors_are_openai_shaped(server: LiveServer, body: str, status: int, needle: str) -> None:
    r = httpx.post(server.url + "/v1/chat/completions", content=body, headers={"content-type": "application/json"})
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert needle in err["message"] and err["type"] and err["code"] == status


def test_unknown_route_is_openai_shaped(server: LiveServer) -> None:
    r = httpx.get(server.url + "/v1/nothing")
    assert r.status_code == 404 and "error" in r.json()


def test_disconnect_mid_stream_frees_kv(server: LiveServer) -> None:
    body = {"model": "tiny", "messages": CHAT, "max_tokens": 900, "stream": True, "ignore_eos": True}
    with httpx.Client(timeout=30) as http, http.stream("POST", server.url + "/v1/chat/completions", json=body) as r:
        lines = r.iter_lines()
        got = [next(lines) for _ in range(6)]
        assert any(line.startswith("data:") for line in got)
        assert server.stats()["active_requests"] == 1
    stats = server.wait_idle()
    assert stats["active_requests"] == 0 and stats["held_by_requests"] == 0


GIVE_UP_BODIES = {
    "/v1/chat/completions": {"model": "tiny", "messages": CHAT, "max_tokens": 900, "ignore_eos": True},
    "/v1/completions": {"model": "tiny", "prompt": "go", "max_tokens": 900, "ignore_eos": True},
    "/v1/responses": {"model": "tiny", "input": "go", "max_output_tokens": 900},  # the random model's EOS is rare
    "/generate": {"text": "go", "sampling_params": {"max_new_tokens": 900, "ignore_eos": True}},
}


@pytest.mark.parametrize("route", list(GIVE_UP_BODIES))
def test_a_client_that_gives_up_on_a_whole_answer_aborts_it(server: LiveServer, route: str) -> None:
    """Not streamed: the client drops the connection while the answer is being generated; the
    engine stops working on it at once (counted as a 499), it does not run to max_tokens."""
    body = GIVE_UP_BODIES[route]

    async def give_up() -> None:
        async with httpx.AsyncClient(timeout=60) as http:
            task = asyncio.create_task(http.post(server.url + route, json=body))
            await _until_active(server, 1)
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)

    def disconnects() -> float:
        text = httpx.get(server.url + "/metrics").text
        return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                   if line.startswith("radixgen_requests_total{") and 'status="499"' in line)

    def gauge(name: str) -> float:
        text = httpx.get(server.url + "/metrics").text
        return next(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name + " "))

    before = disconnects()
    asyncio.run(give_up())
    given_up = time.monotonic()
    stats = server.wait_idle(timeout=5)
    assert stats["active_requests"] == 0 and time.monotonic() - given_up < 3
    assert disconnects() == before + 1
    # the engine went idle without another step: the gauges read its state now, not its last step's
    assert gauge("radixgen_running_requests") == 0 and gauge("radixgen_queue_depth") == 0


def test_the_engine_process_keeps_its_startup_objects_out_of_the_collectors_view(server: LiveServer) -> None:
    """A full garbage collection over torch's, transformers' and the model's objects stalled
    the engine loop for ~240 ms each time serving's allocations triggered one."""
    assert server.stats()["gc_frozen_objects"] > 50_000


def test_metrics_exposes_engine_and_request_counters(server: LiveServer) -> None:
    client(server).chat.completions.create(model="tiny", messages=CHAT, max_tokens=3)
    text = httpx.get(server.url + "/metrics").text
    for name in ("radixgen_requests_total", "radixgen_time_to_first_token_seconds", "radixgen_cache_hit_rate",
                 "radixgen_kv_usage_ratio", "radixgen_scheduler_seconds_per_step", "radixgen_avg_batch_size"):
        assert name in text, name


def test_api_key_and_queue_limit(start_server: Callable[..., LiveServer], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RADIXGEN_API_KEY", "s3cret")  # from the environment: not visible in `ps`
    srv = start_server("--max-queued-requests", "2")
    srv.api_key = "s3cret"
    assert httpx.get(srv.url + "/v1/models").status_code == 401
    assert httpx.get(srv.url + "/v1/models", headers={"Authorization": "Bearer wrong"}).status_code == 401
    assert httpx.get(srv.url + "/health").status_code == 200, "/health needs no key"
    assert httpx.get(srv.url + "/v1/models", headers=srv.headers).status_code == 200

    async def flood() -> list[httpx.Response]:
        async with httpx.AsyncClient(timeout=60, headers=srv.headers) as http:
            body = {"prompt": "go", "max_tokens": 200, "ignore_eos": True}
            return await asyncio.gather(*(http.post(srv.url + "/v1/completions", json=body) for _ in range(6)))

    codes = [r.status_code for r in asyncio.run(flood())]
    assert codes.count(429) >= 1 and codes.count(200) >= 2, codes
    limited = next(r for r in asyncio.run(flood()) if r.status_code == 429)
    assert limited.headers.get("retry-after") and limited.json()["error"]["type"] == "rate_limit_error"
    srv.stop()


async def _until_active(srv: LiveServer, count: int, unless: asyncio.Task[Any] | None = None) -> None:
    """Wait until the server holds ``count`` requests in flight (or ``unless`` is done): the
    engine is killed in the middle of them, not after a fixed sleep that a fast enough engine
    finishes within."""
    deadline = time.monotonic() + 30
    async with httpx.AsyncClient(timeout=10, headers=srv.headers) as http:
        while (await http.get(srv.url + "/internal/stats")).json()["active_requests"] < count:
            if unless is not None and unless.done():
                return
            assert time.monotonic() < deadline, "the requests never started"
            await asyncio.sleep(0.01)


def test_engine_death_gives_503_not_a_hang(start_server: Callable[..., LiveServer]) -> None:
    srv = start_server("--engine-restarts", "0")
    pid = srv.stats()["engine_pid"]

    async def in_flight() -> httpx.Response:
        async with httpx.AsyncClient(timeout=60) as http:
            return await http.post(srv.url + "/v1/completions", json={"prompt": "go", "max_tokens": 900, "ignore_eos": True})

    async def scenario() -> httpx.Response:
        task = asyncio.create_task(in_flight())
        await _until_active(srv, 1)
        os.kill(pid, signal.SIGKILL)
        return await task

    start = time.monotonic()
    resp = asyncio.run(scenario())
    assert resp.status_code == 503 and "engine" in resp.json()["error"]["message"]
    assert time.monotonic() - start < 30
    assert httpx.get(srv.url + "/health").status_code == 503
    assert httpx.post(srv.url + "/v1/completions", json={"prompt": "x"}).status_code == 503
    stopping = time.monotonic()
    srv.stop()  # a dead engine does not hold the server's shutdown (it waited for the kill, 30 s)
    assert time.monotonic() - stopping < 10 and srv.proc.returncode != -signal.SIGKILL


def test_sigterm_drains_then_exits_cleanly(start_server: Callable[..., LiveServer]) -> None:
    """SIGTERM: new requests get 503 with Retry-After at once; a request that finishes within
    --shutdown-timeout gets its answer; the longer ones end with 503 (an error event in a
    stream) at the deadline; the server then exits 0."""
    # the deadline sits well between the short request (~0.2 s here) and the long ones (~4 s)
    srv = start_server("--shutdown-timeout", "1.5")
    long_body = {"prompt": "go", "max_tokens": 1000, "ignore_eos": True}

    async def scenario() -> tuple[httpx.Response, httpx.Response, list[str], httpx.Response, float]:
        async with httpx.AsyncClient(timeout=60) as http:
            long = asyncio.create_task(http.post(srv.url + "/v1/completions", json=long_body))
            events: list[str] = []

            async def streamed() -> None:
                async with http.stream("POST", srv.url + "/v1/completions", json={**long_body, "stream": True}) as r:
                    async for line in r.aiter_lines():
                        if line.startswith("data: "):
                            events.append(line)

            stream = asyncio.create_task(streamed())
            await _until_active(srv, 2)
            # the short one last: sent first, on a loaded core it could end before the others began
            short = asyncio.create_task(http.post(srv.url + "/v1/completions",
                                                  json={"prompt": "hi", "max_tokens": 40, "ignore_eos": True}))
            await _until_active(srv, 3, unless=short)
            srv.proc.send_signal(signal.SIGTERM)
            signalled = time.monotonic()
            await asyncio.sleep(0.3)
            refused = await http.post(srv.url + "/v1/completions", json={"prompt": "late", "max_tokens": 2})
            assert (await http.get(srv.url + "/health")).status_code == 503
            answered = await short
            cut = await long
            await asyncio.wait_for(stream, 30)
            return refused, answered, events, cut, time.monotonic() - signalled

    refused, answered, events, cut, waited = asyncio.run(scenario())
    assert refused.status_code == 503 and refused.headers["retry-after"]
    assert refused.json()["error"]["type"] == "service_unavailable"
    assert answered.status_code == 200 and answered.json()["usage"]["completion_tokens"] == 40
    assert cut.status_code == 503 and "shutting down" in cut.json()["error"]["message"]
    assert '"code":503' in events[-1] and "shutting down" in events[-1], events[-1:]
    assert 1.2 < waited < 10, waited
    assert srv.proc.wait(20) == 0, srv.output()[-2000:]
    srv.stop()


def test_sigterm_to_the_whole_process_group_drains_without_restarting_the_engine(
    start_server: Callable[..., LiveServer],
) -> None:
    """A service manager or a terminal signals the server and its engine process together: the
    engine keeps serving the drain (the request in flight gets its answer), and the server stops
    it once, exiting 0, without starting a new one."""
    srv = start_server("--shutdown-timeout", "20")
    engine = srv.stats()["engine_pid"]

    async def scenario() -> httpx.Response:
        async with httpx.AsyncClient(timeout=60) as http:
            request = asyncio.create_task(http.post(srv.url + "/v1/completions",
                                                    json={"prompt": "go", "max_tokens": 60, "ignore_eos": True}))
            await _until_active(srv, 1, unless=request)
            os.kill(engine, signal.SIGTERM)
            srv.proc.send_signal(signal.SIGTERM)
            return await request

    answered = asyncio.run(scenario())
    assert answered.status_code == 200 and answered.json()["usage"]["completion_tokens"] == 60
    assert srv.proc.wait(30) == 0, srv.output()[-2000:]
    log = srv.output()
    assert "restarting the engine process" not in log and "engine process exited" not in log, log[-2000:]
    deadline = time.monotonic() + 10
    while _running(engine):
        assert time.monotonic() < deadline, "the engine process outlived its server"
        time.sleep(0.2)
    srv.stop()


def _running(pid: int) -> bool:
    """Alive and not a zombie (an orphan's exit is reaped by whatever adopted it, maybe never)."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def test_a_crashed_engine_is_restarted_and_serves_again(start_server: Callable[..., LiveServer]) -> None:
    srv = start_server("--engine-restarts", "1")
    pid = srv.stats()["engine_pid"]

    async def scenario() -> tuple[httpx.Response, list[str]]:
        async with httpx.AsyncClient(timeout=60) as http:
            plain = asyncio.create_task(http.post(srv.url + "/v1/completions",
                                                  json={"prompt": "go", "max_tokens": 900, "ignore_eos": True}))
            events: list[str] = []

            async def streamed() -> None:
                body = {"prompt": "go on", "max_tokens": 900, "ignore_eos": True, "stream": True}
                async with http.stream("POST", srv.url + "/v1/completions", json=body) as response:
                    async for line in response.aiter_lines():
                        if line.startswith("data: "):
                            events.append(line)

            stream = asyncio.create_task(streamed())
            await _until_active(srv, 2)
            os.kill(pid, signal.SIGKILL)
            await asyncio.wait_for(stream, 30)
            return await asyncio.wait_for(plain, 30), events

    resp, events = asyncio.run(scenario())
    assert resp.status_code == 503 and resp.json()["error"]["type"] == "service_unavailable"
    assert any('"error"' in e and "engine" in e for e in events), events[-3:]
    deadline = time.monotonic() + 120
    while httpx.get(srv.url + "/health").status_code != 200:
        assert time.monotonic() < deadline, "the engine did not come back"
        time.sleep(0.5)
    again = httpx.post(srv.url + "/v1/completions", json={"prompt": "hello", "max_tokens": 5}, timeout=60)
    assert again.status_code == 200 and again.json()["usage"]["completion_tokens"] == 5
    stats = srv.wait_idle()
    assert stats["engine_pid"] != pid
    assert stats["held_by_requests"] == 0 and stats["free"] + stats["held_by_tree"] == stats["pool_size"]
    # a server killed outright takes its (restarted) engine with it: no orphan keeps the model
    os.kill(srv.proc.pid, signal.SIGKILL)
    srv.proc.wait(10)
    deadline = time.monotonic() + 10
    while _running(stats["engine_pid"]):
        assert time.monotonic() < deadline, "the engine process outlived its server"
        time.sleep(0.2)
    srv.stop()


COLOR = {"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]}, "ok": {"type": "boolean"}},
         "required": ["color", "ok"], "additionalProperties": False}
TOOLS = [
    {"type": "function", "function": {"name": "paint", "description": "Paint a wall", "parameters": COLOR}},
    {"type": "function", "function": {"name": "wait", "description": "Wait", "parameters": {
        "type": "object", "properties": {"seconds": {"enum": [1, 5, 10]}}, "required": ["seconds"],
        "additionalProperties": False}}},
]


def test_response_format_json_schema_validates(server: LiveServer) -> None:
    import jsonschema

    for temperature in (0.0, 1.0):
        resp = client(server).chat.completions.create(
            model="tiny", messages=CHAT, max_tokens=60, temperature=temperature, seed=4,
            response_format={"type": "json_schema", "json_schema": {"name": "c", "schema": COLOR, "strict": True}})
        assert resp.choices[0].finish_reason == "stop"
        jsonschema.validate(json.loads(resp.choices[0].message.content), COLOR)


def test_regex_and_choices_extensions(server: LiveServer) -> None:
    import re

    c = client(server)
    text = c.chat.completions.create(model="tiny", messages=CHAT, max_tokens=20,
                                     extra_body={"regex": "[0-9]{2}-[a-z]{3}"}).choices[0].message.content
    assert re.fullmatch("[0-9]{2}-[a-z]{3}", text)
    text = c.completions.create(model="tiny", prompt="Pick:", max_tokens=10,
                                extra_body={"choices": ["left", "right"]}).choices[0].text
    assert text in ("left", "right")


def test_forced_tool_calls_validate(server: LiveServer) -> None:
    import jsonschema

    c = client(server)
    named = c.chat.completions.create(model="tiny", messages=CHAT, max_tokens=60, tools=TOOLS,
                                      tool_choice={"type": "function", "function": {"name": "paint"}})
    choice = named.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    (call,) = choice.message.tool_calls
    assert call.function.name == "paint"
    jsonschema.validate(json.loads(call.function.arguments), COLOR)
    required = c.chat.completions.create(model="tiny", messages=CHAT, max_tokens=60, tools=TOOLS, tool_choice="required",
                                         temperature=1.0, seed=2)
    (call,) = required.choices[0].message.tool_calls
    schema = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}[call.function.name]
    jsonschema.validate(json.loads(call.function.arguments), schema)


def test_streamed_tool_call_fragments_concatenate_to_the_arguments(server: LiveServer) -> None:
    kwargs = dict(model="tiny", messages=CHAT, max_tokens=60, tools=TOOLS, temperature=0,
                  tool_choice={"type": "function", "function": {"name": "paint"}})
    whole = client(server).chat.completions.create(**kwargs).choices[0].message.tool_calls[0]
    fragments, names, reasons = [], [], []
    for chunk in client(server).chat.completions.create(**kwargs, stream=True):
        for ch in chunk.choices:
            reasons.append(ch.finish_reason)
            for tc in ch.delta.tool_calls or []:
                if tc.function.name:
                    names.append(tc.function.name)
                fragments.append(tc.function.arguments or "")
    assert names == ["paint"] and reasons[-1] == "tool_calls"
    assert "".join(fragments) == whole.function.arguments
    json.loads("".join(fragments))


def test_auto_tool_choice_answers_in_text_or_a_parsed_call(server: LiveServer) -> None:
    resp = client(server).chat.completions.create(model="tiny", messages=CHAT, max_tokens=20, tools=TOOLS)
    choice = resp.choices[0]
    if choice.finish_reason == "tool_calls":
        assert choice.message.tool_calls[0].function.name in ("paint", "wait")
    else:
        assert choice.message.content is not None and choice.message.tool_calls is None


def test_auto_tools_with_a_response_format_give_valid_calls_or_the_parsed_answer(server: LiveServer) -> None:
    """What agent SDKs with an output type and tools send: every turn is either calls that
    validate for their tool or the final answer in the schema, parsed by the openai client."""
    import jsonschema
    from pydantic import BaseModel

    class Verdict(BaseModel):
        color: str
        done: bool

    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
    strict = [{"type": "function", "function": {**t["function"], "strict": True}} for t in TOOLS]  # parse() wants it
    after_a_result = [*CHAT, {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "wait", "arguments": '{"seconds": 1}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "waited"}]
    outcomes = []
    # the first turn goes through the scored call decision; after a tool's result the grammar
    # alone lets the model call again or answer
    for messages, seed in [(m, seed) for m in (CHAT, after_a_result) for seed in range(5)]:
        resp = client(server).chat.completions.parse(model="tiny", messages=messages, max_tokens=48, tools=strict,
                                                     tool_choice="auto", response_format=Verdict, temperature=1.0,
                                                     seed=seed)
        choice = resp.choices[0]
        if choice.message.tool_calls:
            assert choice.finish_reason == "tool_calls" and not choice.message.content
            for call in choice.message.tool_calls:
                jsonschema.validate(json.loads(call.function.arguments), schemas[call.function.name])
            outcomes.append("calls")
        else:
            assert choice.finish_reason == "stop" and isinstance(choice.message.parsed, Verdict), choice
            outcomes.append("answer")
    assert set(outcomes) == {"calls", "answer"}, outcomes  # both ways out are open (seeded: 7 calls, 3 answers)


def test_a_response_format_the_grammar_cannot_fully_enforce_says_what_it_left_out(server: LiveServer) -> None:
    """A lenient compile (llguidance drops ``not``) is reported on the choice; the answer is
    still checked against the whole schema by the validators."""
    import jsonschema

    schema = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 1, "not": {"multipleOf": 2}}},
              "required": ["n"], "additionalProperties": False}
    fmt = {"type": "json_schema", "json_schema": {"name": "odd", "schema": schema}}
    c = client(server)
    resp = c.chat.completions.create(model="tiny", messages=CHAT, max_tokens=24, temperature=0,
                                     response_format=fmt)  # type: ignore[call-overload]
    choice = resp.choices[0]
    warnings = (choice.model_extra or {}).get("constraint_warnings")
    assert warnings and any('"not"' in w for w in warnings), choice
    if choice.finish_reason == "stop":
        jsonschema.validate(json.loads(choice.message.content or ""), schema)
    plain = c.chat.completions.create(model="tiny", messages=CHAT, max_tokens=24, temperature=0,
                                      response_format={"type": "json_object"})  # type: ignore[call-overload]
    assert (plain.choices[0].model_extra or {}).get("constraint_warnings") is None


def test_json_finishes_within_max_tokens_and_a_budget_too_small_is_a_400(server: LiveServer) -> None:
    """Through the openai client: at a tight budget every answer is complete JSON ('stop', flagged
    shortened where steered, counted in /metrics); below the schema's shortest output, a 400 that
    says how many tokens are needed, with nothing left held."""
    import jsonschema

    schema = {"type": "object", "properties": {"note": {"type": "string"}, "level": {"type": "integer"}},
              "required": ["note", "level"]}
    fmt = {"type": "json_schema", "json_schema": {"name": "n", "schema": schema}}
    c = client(server)
    shortened = 0
    for seed in range(4):
        resp = c.chat.completions.create(model="tiny", messages=CHAT, max_tokens=16, temperature=1.0, seed=seed,
                                         response_format=fmt)  # type: ignore[call-overload]
        choice = resp.choices[0]
        assert choice.finish_reason == "stop"
        jsonschema.validate(json.loads(choice.message.content or ""), schema)
        shortened += bool((choice.model_extra or {}).get("shortened"))
    streamed = c.chat.completions.create(model="tiny", messages=CHAT, max_tokens=16, temperature=1.0, seed=0,
                                         response_format=fmt, stream=True)  # type: ignore[call-overload]
    chunks = list(streamed)
    assert chunks[-1].choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads("".join(ch.choices[0].delta.content or "" for ch in chunks)), schema)
    assert shortened > 0, "the tiny model rambles: some answers were steered to close"
    metrics = httpx.get(server.url + "/metrics").text
    line = next(ln for ln in metrics.splitlines() if ln.startswith("radixgen_shortened_requests "))
    assert float(line.split()[1]) >= shortened
    with pytest.raises(openai.BadRequestError, match=r"at least \d+"):
        c.chat.completions.create(model="tiny", messages=CHAT, max_tokens=3,
                                  response_format=fmt)  # type: ignore[call-overload]
    stats = server.wait_idle()
    assert stats["active_requests"] == 0 and stats["held_by_requests"] == 0
    metrics = httpx.get(server.url + "/metrics").text
    refusals = next(ln for ln in metrics.splitlines() if ln.startswith("radixgen_constraint_refusals "))
    assert float(refusals.split()[1]) >= 1, "the refusal is counted apart from violations"



def _greedy_tokens(server: LiveServer, prompt: str, n: int, **sampling: object) -> list[int]:
    body = {"text": prompt, "sampling_params": {"max_new_tokens": n, "temperature": 0, **sampling}}
    return httpx.post(server.url + "/generate", json=body, timeout=60).json()["token_ids"]


def test_logit_bias_bans_and_forces_tokens(server: LiveServer) -> None:
    c = client(server)
    greedy_ids = _greedy_tokens(server, "Count:", 6)
    greedy = c.completions.create(model="tiny", prompt="Count:", max_tokens=6, temperature=0, logprobs=0)
    greedy_texts = greedy.choices[0].logprobs.tokens
    assert len(greedy_texts) == 6
    banned = c.completions.create(model="tiny", prompt="Count:", max_tokens=6, temperature=0, logprobs=0,
                                  logit_bias={str(t): -100 for t in greedy_ids})
    assert not set(banned.choices[0].logprobs.tokens) & set(greedy_texts), "a token biased by -100 never appears"
    forced = c.completions.create(model="tiny", prompt="Count:", max_tokens=5, temperature=1.0, seed=3, logprobs=0,
                                  logit_bias={str(greedy_ids[0]): 100})
    assert forced.choices[0].logprobs.tokens == [greedy_texts[0]] * 5


def test_min_tokens_masks_stops_until_reached(server: LiveServer) -> None:
    first = _greedy_tokens(server, "Count:", 1)[0]
    stopped = httpx.post(server.url + "/v1/completions", json={
        "prompt": "Count:", "max_tokens": 8, "temperature": 0, "stop_token_ids": [first]}).json()
    assert stopped["usage"]["completion_tokens"] <= 1
    resp = client(server).completions.create(model="tiny", prompt="Count:", max_tokens=8, temperature=0,
                                             extra_body={"stop_token_ids": [first], "min_tokens": 5})
    assert resp.usage.completion_tokens >= 5


def test_legacy_functions_and_ignored_fields(server: LiveServer) -> None:
    import jsonschema

    c = client(server)
    functions = [t["function"] for t in TOOLS]
    resp = c.chat.completions.create(model="tiny", messages=CHAT, max_tokens=60, functions=functions,
                                     function_call={"name": "paint"}, temperature=0)
    choice = resp.choices[0]
    assert choice.finish_reason == "function_call" and choice.message.function_call.name == "paint"
    jsonschema.validate(json.loads(choice.message.function_call.arguments), COLOR)
    pieces, names = [], []
    for chunk in c.chat.completions.create(model="tiny", messages=CHAT, max_tokens=60, functions=functions,
                                           function_call={"name": "paint"}, temperature=0, stream=True):
        for ch in chunk.choices:
            if ch.delta.function_call is not None:
                names += [ch.delta.function_call.name] if ch.delta.function_call.name else []
                pieces.append(ch.delta.function_call.arguments or "")
    assert names == ["paint"] and "".join(pieces) == choice.message.function_call.arguments
    plain = c.chat.completions.create(
        model="tiny", messages=CHAT, max_tokens=40, store=True, metadata={"team": "a"}, service_tier="auto", user="u1",
        modalities=["text"], reasoning_effort="low", prediction={"type": "content", "content": "1 2 3"},
        parallel_tool_calls=False, tools=TOOLS, tool_choice="required")
    assert len(plain.choices[0].message.tool_calls or []) <= 1


def test_served_model_name_follows_the_model() -> None:
    from radixgen.api.server import served_name
    from radixgen.config import ServerConfig

    assert served_name(ServerConfig()) == "SmolLM2-135M-Instruct"
    assert served_name(ServerConfig(model="/models/Qwen3-0.6B/")) == "Qwen3-0.6B"
    assert served_name(ServerConfig(model="/models/llama-3.2-1b-q4_k_m.gguf")) == "llama-3.2-1b-q4_k_m"
    assert served_name(ServerConfig(model="/models/x", served_model_name="prod")) == "prod"


def test_a_request_may_name_the_model_by_its_path(server: LiveServer, tiny_model_dir: object) -> None:
    resp = client(server).chat.completions.create(model=str(tiny_model_dir), messages=CHAT, max_tokens=2)
    assert resp.model == "tiny"


def test_responses_api_through_the_openai_client(server: LiveServer) -> None:
    """create, stream and parse; a two-turn conversation through previous_response_id whose second
    turn is served from the cache; a function-call round trip; an unknown id is a 404."""
    import jsonschema
    from pydantic import BaseModel

    c = client(server)
    first = c.responses.create(model="tiny", input="Count to five.", instructions="You are terse.",
                               max_output_tokens=12, temperature=0)
    assert first.status in ("completed", "incomplete") and first.output[0].type == "message"
    assert first.usage is not None and first.usage.output_tokens == 12 and first.status == "incomplete"
    # instructions are not carried over (OpenAI's rule): a client sends them again
    second = c.responses.create(model="tiny", input="And back to one.", previous_response_id=first.id,
                                instructions="You are terse.", max_output_tokens=6, temperature=0)
    assert second.usage is not None and second.usage.input_tokens_details.cached_tokens >= first.usage.input_tokens
    with pytest.raises(openai.NotFoundError, match="unknown or expired"):
        c.responses.create(model="tiny", input="x", previous_response_id="resp-nope", max_output_tokens=2)

    with c.responses.stream(model="tiny", input="Count to five.", instructions="You are terse.", max_output_tokens=12,
                            temperature=0) as stream:
        events = list(stream)
    deltas = [e.delta for e in events if e.type == "response.output_text.delta"]
    # cut at max_output_tokens: OpenAI's stream then ends with response.incomplete, not completed
    (final,) = [e.response for e in events if e.type == "response.incomplete"]
    assert "".join(deltas) == final.output_text == first.output_text
    assert [e.sequence_number for e in events] == list(range(len(events)))

    class Paint(BaseModel):
        color: str
        ok: bool

    parsed = c.responses.parse(model="tiny", input="Paint something.", text_format=Paint, max_output_tokens=40)
    assert isinstance(parsed.output_parsed, Paint)

    tool = {"type": "function", "name": "paint", "description": "Paint a wall", "parameters": COLOR, "strict": True}
    called = c.responses.create(model="tiny", input="Paint the wall.", tools=[tool], max_output_tokens=40,
                                temperature=0, tool_choice={"type": "function", "name": "paint"})
    (call,) = [item for item in called.output if item.type == "function_call"]
    assert call.name == "paint"
    jsonschema.validate(json.loads(call.arguments), COLOR)
    answered = c.responses.create(model="tiny", previous_response_id=called.id, max_output_tokens=8, tools=[tool],
                                  input=[{"type": "function_call_output", "call_id": call.call_id, "output": "done"}])
    assert answered.output and answered.usage is not None and answered.usage.input_tokens_details.cached_tokens > 0

    # streamed, the call's arguments arrive as deltas (coalesced when the front is behind the
    # engine, as with this tiny model) that add up to the final item's
    with c.responses.stream(model="tiny", input="Paint the wall.", tools=[tool], max_output_tokens=40, temperature=0,
                            tool_choice={"type": "function", "name": "paint"}) as stream:
        events = list(stream)
    fragments = [e.delta for e in events if e.type == "response.function_call_arguments.delta"]
    (done,) = [e for e in events if e.type == "response.function_call_arguments.done"]
    (final,) = [e.response for e in events if e.type == "response.completed"]
    (streamed_call,) = [item for item in final.output if item.type == "function_call"]
    assert fragments and "".join(fragments) == done.arguments == streamed_call.arguments
    assert streamed_call.arguments == call.arguments  # the same greedy call as the non-streamed one
    assert [e.sequence_number for e in events] == list(range(len(events)))


def test_logprob_bytes_are_the_tokens_own_and_completion_streams_carry_logprobs(server: LiveServer) -> None:
    """Token 111 of SmolLM2's vocabulary is the lone byte 0xA1 (part of a UTF-8 character): its
    text decodes to U+FFFD, its bytes must still be [161]. Forced with logit_bias."""
    c = client(server)
    resp = c.chat.completions.create(model="tiny", messages=CHAT, max_tokens=2, temperature=0, logprobs=True,
                                     top_logprobs=2, logit_bias={"111": 100})
    first = resp.choices[0].logprobs.content[0]
    assert first.bytes == [0xA1] and first.top_logprobs[0].bytes == [0xA1]
    pieces = []
    for chunk in c.completions.create(model="tiny", prompt="Count:", max_tokens=5, temperature=0, logprobs=1, stream=True):
        lp = chunk.choices[0].logprobs
        if lp is not None:
            pieces.append((lp.tokens, lp.token_logprobs))
    whole = c.completions.create(model="tiny", prompt="Count:", max_tokens=5, temperature=0, logprobs=1).choices[0].logprobs
    assert [t for tokens, _ in pieces for t in tokens] == whole.tokens
    assert [v for _, values in pieces for v in values] == pytest.approx(whole.token_logprobs)


def test_streams_carry_top_logprobs_and_every_choice_of_n(server: LiveServer) -> None:
    c = client(server)
    kwargs: dict[str, Any] = dict(model="tiny", messages=CHAT, max_tokens=8, temperature=0.8, seed=11, n=2,
                                  logprobs=True, top_logprobs=3)
    whole = c.chat.completions.create(**kwargs)
    texts: dict[int, str] = {}
    tokens: dict[int, list[Any]] = {}
    reasons: dict[int, str | None] = {}
    for chunk in c.chat.completions.create(**kwargs, stream=True):
        for choice in chunk.choices:
            texts[choice.index] = texts.get(choice.index, "") + (choice.delta.content or "")
            tokens.setdefault(choice.index, []).extend(choice.logprobs.content if choice.logprobs else [])
            reasons[choice.index] = choice.finish_reason or reasons.get(choice.index)
    assert sorted(texts) == [0, 1]
    for choice in whole.choices:
        i = choice.index
        assert texts[i] == choice.message.content and reasons[i] == choice.finish_reason
        streamed = [(t.token, round(t.logprob, 4), [(x.token, round(x.logprob, 4)) for x in t.top_logprobs])
                    for t in tokens[i]]
        expected = [(t.token, round(t.logprob, 4), [(x.token, round(x.logprob, 4)) for x in t.top_logprobs])
                    for t in choice.logprobs.content]
        assert streamed == expected and all(len(top) == 3 for _, _, top in streamed)


def test_usage_counts_each_prompt_once_streamed_or_not(server: LiveServer) -> None:
    prompts = ["Hello there", "Count: one, two"]
    lengths = httpx.post(server.url + "/tokenize", json={"text": prompts}, timeout=60).json()["tokens"]
    body = {"model": "tiny", "prompt": prompts, "n": 2, "max_tokens": 3, "temperature": 0, "ignore_eos": True}
    whole = httpx.post(server.url + "/v1/completions", json=body, timeout=60).json()["usage"]
    assert whole["prompt_tokens"] == sum(len(ids) for ids in lengths), "each prompt once, not once per choice"
    assert whole["completion_tokens"] == 12 and whole["total_tokens"] == whole["prompt_tokens"] + 12
    with httpx.stream("POST", server.url + "/v1/completions", timeout=60,
                      json={**body, "stream": True, "stream_options": {"include_usage": True}}) as r:
        chunks = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    streamed = [c["usage"] for c in chunks if c.get("usage")]
    assert len(streamed) == 1 and {k: streamed[0][k] for k in whole if k != "prompt_tokens_details"} == {
        k: v for k, v in whole.items() if k != "prompt_tokens_details"}
