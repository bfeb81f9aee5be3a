from __future__ import annotations

import pytest

from radixgen.api.chat import ChatFormat, ToolPlan, tool_mode
from radixgen.api.protocol import ChatCompletionRequest, Tool
from radixgen.errors import InvalidParamsError
from radixgen.reasoning import ReasoningMarkers
from radixgen.tool_formats import HERMES

TOOLS = [Tool.model_validate({"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}})]


def test_tool_modes() -> None:
    base = {"messages": [{"role": "user", "content": "hi"}]}
    assert tool_mode(ChatCompletionRequest.model_validate(base))[0] == "none"
    with_tools = {**base, "tools": [t.model_dump() for t in TOOLS]}
    assert tool_mode(ChatCompletionRequest.model_validate(with_tools))[0] == "auto"
    mode, named = tool_mode(ChatCompletionRequest.model_validate(
        {**with_tools, "tool_choice": {"type": "function", "function": {"name": "get_weather"}}}))
    assert mode == "named" and named is not None
    with pytest.raises(InvalidParamsError, match="needs tools"):
        tool_mode(ChatCompletionRequest.model_validate({**base, "tool_choice": "required"}))


def test_plan_constraints_follow_the_mode_and_parallel_setting() -> None:
    auto = ToolPlan("auto", TOOLS).constraint({})["structural"]["tool_calls"]
    assert auto["free_text"] and auto["min_calls"] == 0 and auto["max_calls"] is None
    assert ToolPlan("auto", TOOLS, single=True).constraint({})["structural"]["tool_calls"]["max_calls"] == 1
    required = ToolPlan("required", TOOLS).constraint({})["structural"]["tool_calls"]
    assert not required["free_text"] and required["min_calls"] == 1
    named = ToolPlan("named", TOOLS, TOOLS[0]).constraint({})["structural"]["tool_calls"]
    assert [c["name"] for c in named["calls"]] == ["get_weather"] and named["max_calls"] == 1
    with pytest.raises(InvalidParamsError, match="cannot be combined"):
        ToolPlan("required", TOOLS).constraint({"regex": "a"})
    # a thinking template: the request's JSON schema comes after the reasoning section
    thinking = ChatFormat(HERMES, ReasoningMarkers("<think>", "</think>"))
    wrapped = ToolPlan(fmt=thinking).constraint({"json_schema": {"type": "object"}})["structural"]
    assert wrapped == {"json_schema": {"type": "object"}, "reasoning": {"begin": "<think>", "end": "</think>"}}
    assert ToolPlan(fmt=thinking).constraint({"regex": "a+"}) == {"regex": "a+"}


def test_reader_splits_reasoning_content_and_calls() -> None:
    plan = ToolPlan("auto", TOOLS, fmt=ChatFormat(HERMES, ReasoningMarkers("<think>", "</think>")))
    text = ('<think>\nThe user wants weather.</think>\nChecking. <tool_call>\n'
            '{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>')
    content, thought, calls, reason = plan.finish(text, "stop")
    assert thought == "The user wants weather." and content == "Checking. " and reason == "tool_calls"
    assert calls is not None and [(c.function.name, c.function.arguments) for c in calls] == [
        ("get_weather", '{"city": "Oslo"}')]
    assert plan.finish(text, "length")[3] == "length"
