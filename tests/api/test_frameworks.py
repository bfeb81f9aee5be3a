"""Agent frameworks against a live server (the tiny model), called as their users call them: each
test asserts what the framework hands back (a parsed model, a tool call whose arguments validate)."""

from __future__ import annotations

import json
from typing import Literal

import jsonschema
from pydantic import BaseModel

from tests.api.conftest import LiveServer


class Paint(BaseModel):
    color: Literal["red", "green", "blue"]
    ok: bool


PROMPT = "Paint the wall and say whether it went well."


def test_langchain_openai(server: LiveServer) -> None:
    from langchain_core.messages import HumanMessage, ToolMessage
    from langchain_core.tools import tool
    from langchain_openai import ChatOpenAI

    llm = ChatOpenAI(base_url=server.url + "/v1", api_key="unused", model="tiny", max_tokens=40,  # type: ignore[arg-type]
                     temperature=0, max_retries=0)
    answer = llm.invoke("Count to five.")
    assert isinstance(answer.content, str)
    streamed = "".join(str(chunk.content) for chunk in llm.stream("Count to five."))
    assert streamed == answer.content
    for method in ("json_schema", "function_calling"):
        parsed = llm.with_structured_output(Paint, method=method).invoke(PROMPT)  # type: ignore[arg-type]
        assert isinstance(parsed, Paint), method

    @tool
    def paint(color: Literal["red", "green", "blue"], ok: bool) -> str:
        """Paint the wall."""
        return f"painted {color}"

    with_tools = llm.bind_tools([paint], tool_choice="paint")
    call_message = with_tools.invoke(PROMPT)
    (call,) = call_message.tool_calls
    assert call["name"] == "paint"
    jsonschema.validate(call["args"], Paint.model_json_schema())
    result = paint.invoke(call["args"])
    follow_up = llm.bind_tools([paint]).invoke(
        [HumanMessage(PROMPT), call_message, ToolMessage(result, tool_call_id=call["id"])])
    assert follow_up.response_metadata["finish_reason"] in ("stop", "length", "tool_calls")


def test_pydantic_ai_agents(server: LiveServer) -> None:
    from pydantic_ai import Agent
    from pydantic_ai.models.openai import OpenAIChatModel
    from pydantic_ai.providers.openai import OpenAIProvider

    model = OpenAIChatModel("tiny", provider=OpenAIProvider(base_url=server.url + "/v1", api_key="unused"))
    settings = {"max_tokens": 60, "temperature": 0.0}
    structured = Agent(model, output_type=Paint, model_settings=settings)  # type: ignore[arg-type]
    assert isinstance(structured.run_sync(PROMPT).output, Paint)



def test_instructor_tools_and_json_schema_modes(server: LiveServer) -> None:
    import instructor
    import openai

    raw = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
    for mode in (instructor.Mode.TOOLS, instructor.Mode.JSON_SCHEMA):
        client = instructor.from_openai(raw, mode=mode)
        painted = client.chat.completions.create(model="tiny", response_model=Paint, max_retries=0, max_tokens=40,
                                                 messages=[{"role": "user", "content": PROMPT}])
        assert isinstance(painted, Paint), mode


class Sketch(BaseModel):
    """What instructor's JSON mode can get from a model that does not follow a schema given
    only in its prompt (that mode sends ``json_object``): any JSON object validates."""

    color: str | None = None
    ok: bool | None = None


def test_instructor_json_mode_gets_a_json_object_it_parses(server: LiveServer) -> None:
    import instructor
    import openai

    raw = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
    client = instructor.from_openai(raw, mode=instructor.Mode.JSON)
    for seed in range(3):  # sampled: a server that ignored json_object would send text it cannot parse
        sketch, completion = client.chat.completions.create_with_completion(
            model="tiny", response_model=Sketch, max_retries=0, max_tokens=60, temperature=1.0, seed=seed,
            messages=[{"role": "user", "content": PROMPT}])
        assert isinstance(sketch, Sketch)
        assert isinstance(json.loads(completion.choices[0].message.content or ""), dict)
