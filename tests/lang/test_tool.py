"""Typed functions as tools and the tool-calling loop, on the tiny model."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from typing import Annotated, Any

import pytest
from pydantic import BaseModel, Field, ValidationError, field_validator

from radixgen import Engine, tool_formats
from radixgen.lang import Runtime, run_tools, tool


@pytest.fixture
def engine(make_engine: Callable[..., Engine]) -> Engine:
    return make_engine()


@pytest.fixture
def runtime(engine: Engine) -> Iterator[Runtime]:
    with Runtime(engine=engine) as rt:
        yield rt


def test_tool_from_annotations_and_docstring() -> None:
    @tool
    def forecast(city: Annotated[str, Field(min_length=2)], days: Annotated[int, Field(ge=1, le=7)] = 3) -> str:
        """Forecast for a city."""
        return f"{city}:{days}"

    schema = forecast.schema()
    assert forecast.name == "forecast" and forecast.description == "Forecast for a city."
    assert schema["required"] == ["city"]
    assert schema["properties"]["days"]["maximum"] == 7 and schema["properties"]["days"]["default"] == 3
    assert forecast.call({"city": "Oslo"}) == "Oslo:3"
    with pytest.raises(ValidationError):
        forecast.call({"city": "Oslo", "days": 9})
    assert forecast.openai()["function"]["parameters"] == schema

    with pytest.raises(TypeError, match="annotate parameter 'x'"):
        tool(lambda x: x)


def test_required_call_runs_the_function_with_validated_arguments(runtime: Runtime, engine: Engine) -> None:
    seen: list[str] = []

    class Lookup(BaseModel):
        order_id: str = Field(pattern=r"^ORD-[0-9]{4}$")
        quantity: int = Field(ge=1, le=9)

        @field_validator("order_id")
        @classmethod
        def not_the_first_guess(cls, order_id: str) -> str:
            # rejects the first value the model proposes: the loop must roll back and resample
            seen.append(order_id)
            if len(seen) == 1:
                raise ValueError("unknown order")
            return order_id

    received: list[Lookup] = []

    @tool
    def lookup_order(args: Lookup) -> dict[str, Any]:
        """Look an order up."""
        received.append(args)
        return {"status": "shipped", "order_id": args.order_id}

    rollbacks = engine.scheduler.stats.num_rollbacks
    run = run_tools("Where is my order?", [lookup_order], backend=runtime, tool_choice="required",
                    max_calls=1, max_tokens=48, seed=4, temperature=1.0)
    assert [c.name for c in run.calls] == ["lookup_order"]
    arguments = run.calls[0].arguments
    assert received == [arguments] and isinstance(arguments, Lookup)
    assert len(seen) >= 2 and arguments.order_id == seen[-1], "the rejected first guess was resampled"
    assert engine.scheduler.stats.num_rollbacks > rollbacks
    assert isinstance(run.answer, str)
    assert run.state is not None
    messages = run.state.messages()
    assert [m["role"] for m in messages] == ["system", "user", "assistant", "user", "assistant"]
    # the call is written in the server's generic format, so the same parser reads it back
    content, (sent,) = tool_formats.parse(tool_formats.GENERIC, messages[2]["content"])
    assert content == "" and sent.name == "lookup_order" and json.loads(sent.arguments) == arguments.model_dump()
    shown = messages[3]["content"]
    assert shown.startswith("<tool_response>") and shown.endswith("</tool_response>")
    assert json.loads(shown.removeprefix("<tool_response>").removesuffix("</tool_response>")) == {
        "status": "shipped", "order_id": arguments.order_id}
    assert "lookup_order" in messages[0]["content"], "the tools are described to the model"


def test_the_tool_is_picked_among_several_by_score(runtime: Runtime) -> None:
    def echo(text: Annotated[str, Field(max_length=8)]) -> str:
        """Echo the text."""
        return text

    def shout(text: Annotated[str, Field(max_length=8)]) -> str:
        """Shout the text."""
        return text.upper()

    run = run_tools("Say hi", [echo, shout], backend=runtime, tool_choice="required", max_calls=1, max_tokens=40)
    assert run.state is not None
    scores = run.state.meta("tool_0")["scores"]
    assert run.calls[0].name == max(scores, key=scores.__getitem__)
    assert run.calls[0].result in (run.calls[0].arguments.text, run.calls[0].arguments.text.upper())


def test_tool_choice_none_answers_directly(runtime: Runtime) -> None:
    run = run_tools("Hello", [_echo], backend=runtime, tool_choice="none", max_tokens=4)
    assert run.calls == [] and run.state is not None
    assert [m["role"] for m in run.state.messages()] == ["system", "user", "assistant"]
    with pytest.raises(ValueError, match="distinct names"):
        run_tools("Hello", [_echo, _echo], backend=runtime)


def _echo(text: Annotated[str, Field(max_length=8)]) -> str:
    """Echo the text."""
    return text


def test_auto_calls_when_the_scored_gain_reaches_the_threshold(runtime: Runtime) -> None:
    # the gain of a real question over the baseline is a finite number: a threshold below any
    # gain always calls, one above any never does (the tiny model's gains mean nothing else)
    always = run_tools("Echo hi", [_echo], backend=runtime, max_tokens=30, threshold=float("-inf"))
    assert [c.name for c in always.calls] == ["_echo"]
    never = run_tools("Echo hi", [_echo], backend=runtime, max_tokens=4, threshold=float("inf"))
    assert never.calls == [] and never.state is not None
    assert [m["role"] for m in never.state.messages()] == ["system", "user", "assistant"]
