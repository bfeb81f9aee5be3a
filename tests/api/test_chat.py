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


def test_coalesced_outputs_carry_both_pieces_and_the_later_final_state() -> None:
    from radixgen.api.jobs import coalesce
    from radixgen.engine.output import FinishReason, RequestOutput

    first = RequestOutput("r", [5], "He", False, new_logprobs=[-0.5], new_top_logprobs=[[(5, -0.5)]])
    last = RequestOutput("r", [6, 7], "llo", True, finish_reason=FinishReason.STOP, new_logprobs=[-1.0, -2.0],
                         new_top_logprobs=[[(6, -1.0)], [(7, -2.0)]], output_ids=[5, 6, 7], text="Hello")
    both = coalesce(first, last)
    assert (both.new_token_ids, both.new_text, both.new_logprobs) == ([5, 6, 7], "Hello", [-0.5, -1.0, -2.0])
    assert both.new_top_logprobs == [[(5, -0.5)], [(6, -1.0)], [(7, -2.0)]]
    assert both.finished and both.finish_reason is FinishReason.STOP and both.output_ids == [5, 6, 7]
    plain = coalesce(RequestOutput("r", [1], "a", False), RequestOutput("r", [2], "b", False))
    assert plain.new_logprobs is None and plain.new_top_logprobs is None and plain.new_text == "ab"


def test_a_score_that_could_not_be_taken_never_makes_a_call() -> None:
    from radixgen.tool_formats import best_call

    assert best_call([-5.0, -2.0], [-6.0, -9.0], -1.0) == (1, 7.0, True)
    assert best_call([-5.0, float("-inf")], [-6.0, -9.0], -1.0) == (0, 1.0, True)
    assert best_call([-5.0, -2.0], [float("-inf"), float("-inf")], -1.0)[2] is False
    assert best_call([-9.0], [-6.0], -1.0) == (0, -3.0, False)
