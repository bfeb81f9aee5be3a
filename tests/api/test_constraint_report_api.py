"""The constraint report and partial objects as clients see them: the official ``openai`` client
and raw HTTP against a live server."""

from __future__ import annotations

import json
from typing import Any

import httpx
import jsonschema
import openai

from tests.api.conftest import LiveServer
from tests.constraints.test_partial import contained

MOVIE = {"type": "object", "properties": {
    "title": {"type": "string", "maxLength": 6}, "year": {"type": "integer", "minimum": 1900, "maximum": 2100},
    "cast": {"type": "array", "items": {"type": "string", "maxLength": 5}, "minItems": 2, "maxItems": 3}},
    "required": ["title", "year", "cast"], "additionalProperties": False}
CHAT = [{"role": "user", "content": "A movie as JSON."}]
FORMAT = {"type": "json_schema", "json_schema": {"name": "movie", "schema": MOVIE}}
REPORT_FIELDS = {"kind", "backend", "valid", "ended", "forced_tokens", "drafted_tokens", "accepted_tokens", "rollbacks",
                 "validator_retries", "steered_tokens", "searched_values"}


def client(server: LiveServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="none")


def sse_events(server: LiveServer, path: str, body: dict[str, Any]) -> list[dict[str, Any]]:
    with httpx.stream("POST", server.url + path, json={**body, "stream": True}, timeout=60) as response:
        assert response.status_code == 200, response.read()
        lines = [line for line in response.iter_lines() if line.startswith("data: {")]
    return [json.loads(line[len("data: "):]) for line in lines]


def check_report(report: dict[str, Any], text: str) -> None:
    assert set(report) == REPORT_FIELDS and report["kind"] == "json_schema" and report["backend"]
    try:
        jsonschema.validate(json.loads(text), MOVIE)
        valid = True
    except (json.JSONDecodeError, jsonschema.ValidationError):
        valid = False
    assert report["valid"] is valid and report["ended"] in ("complete", "budget_closed", "max_tokens")
    assert report["valid"] == (report["ended"] != "max_tokens")


def test_every_constrained_answer_carries_a_report_and_free_text_none(server: LiveServer) -> None:
    c = client(server)
    for seed in range(3):
        resp = c.chat.completions.create(model="tiny", messages=CHAT, max_tokens=80, temperature=0.8, seed=seed,
                                         response_format=FORMAT)  # type: ignore[arg-type]
        choice = resp.choices[0]
        check_report(choice.constraint, choice.message.content)  # type: ignore[attr-defined]
    free = c.chat.completions.create(model="tiny", messages=CHAT, max_tokens=8)
    assert getattr(free.choices[0], "constraint", None) is None
    text = c.completions.create(model="tiny", prompt="Movie:", max_tokens=80, temperature=0,
                                extra_body={"response_format": FORMAT})
    check_report(text.choices[0].constraint, text.choices[0].text)  # type: ignore[attr-defined]
    regex = c.completions.create(model="tiny", prompt="Code:", max_tokens=10, extra_body={"regex": "[0-9]{3}"})
    assert regex.choices[0].constraint["kind"] == "regex"  # type: ignore[attr-defined]


def test_a_stream_reports_on_the_chunk_with_the_finish_reason(server: LiveServer) -> None:
    events = sse_events(server, "/v1/chat/completions", {"model": "tiny", "messages": CHAT, "max_tokens": 80,
                                                         "temperature": 0, "response_format": FORMAT})
    choices = [e["choices"][0] for e in events if e["choices"]]
    text = "".join(ch["delta"].get("content") or "" for ch in choices)
    reports = [ch.get("constraint") for ch in choices]
    assert reports[-1] is not None and choices[-1]["finish_reason"] is not None
    assert all(r is None for r in reports[:-1]), "only the finishing chunk carries it"
    check_report(reports[-1], text)


def test_a_too_small_budget_is_refused_not_reported_complete(server: LiveServer) -> None:
    with httpx.Client(timeout=60) as http:
        r = http.post(server.url + "/v1/chat/completions", json={"model": "tiny", "messages": CHAT, "max_tokens": 3,
                                                                 "response_format": FORMAT})
    assert r.status_code == 400 and "max_tokens" in r.json()["error"]["message"]


def test_streamed_partials_grow_to_the_final_object(server: LiveServer) -> None:
    body = {"model": "tiny", "messages": CHAT, "max_tokens": 120, "temperature": 0.7, "seed": 5,
            "response_format": FORMAT, "stream_options": {"include_partial": True}}
    choices = [e["choices"][0] for e in sse_events(server, "/v1/chat/completions", body) if e["choices"]]
    text = "".join(ch["delta"].get("content") or "" for ch in choices)
    shots = [ch["delta"]["partial"] for ch in choices if "partial" in ch["delta"]]
    assert shots and shots[-1] == json.loads(text)
    assert all(contained(a, b) for a, b in zip(shots, shots[1:], strict=False))
    for member in MOVIE["properties"]:
        assert any(list(s)[-1] == member for s in shots), (member, shots)
    with httpx.Client(timeout=60) as http:  # partials need a JSON answer to follow
        r = http.post(server.url + "/v1/chat/completions", json={**body, "response_format": None, "stream": True})
    assert r.status_code == 400 and "include_partial" in r.json()["error"]["message"]


def test_the_responses_api_reports_on_the_message_item(server: LiveServer) -> None:
    resp = client(server).responses.create(model="tiny", input="A movie as JSON.", max_output_tokens=80,
                                           text={"format": {"type": "json_schema", "name": "movie", "schema": MOVIE}})
    message = next(item for item in resp.output if item.type == "message")
    check_report(message.constraint, resp.output_text)  # type: ignore[union-attr]
    free = client(server).responses.create(model="tiny", input="Hi", max_output_tokens=8)
    assert getattr(next(i for i in free.output if i.type == "message"), "constraint", None) is None
