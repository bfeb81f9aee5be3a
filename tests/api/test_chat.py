from __future__ import annotations

import json

import pytest

from radixgen.api.chat import parse_tool_calls, tool_call_schema, tool_mode
from radixgen.api.protocol import ChatCompletionRequest, Tool
from radixgen.errors import InvalidParamsError

TOOLS = [Tool.model_validate({"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}})]


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ('{"name": "get_weather", "arguments": {"city": "Paris"}}', [("get_weather", {"city": "Paris"})]),
        ('  <tool_call>{"name": "get_weather", "arguments": "{\\"city\\": \\"Oslo\\"}"}</tool_call>',
         [("get_weather", {"city": "Oslo"})]),
        ('[{"name": "get_weather", "parameters": {"city": "A"}}, {"name": "get_weather", "arguments": {"city": "B"}}]',
         [("get_weather", {"city": "A"}), ("get_weather", {"city": "B"})]),
        ('{"name": "unknown_tool", "arguments": {}}', None),
        ("The weather is nice.", None),
        ('{"name": "get_weather", "arguments": [1]}', None),
    ],
)
def test_parse_tool_calls(text: str, expected: list[tuple[str, dict[str, str]]] | None) -> None:
    calls = parse_tool_calls(text, TOOLS)
    if expected is None:
        assert calls is None
    else:
        assert calls is not None
        assert [(c.function.name, json.loads(c.function.arguments)) for c in calls] == expected


def test_tool_modes_and_schema() -> None:
    base = {"messages": [{"role": "user", "content": "hi"}]}
    assert tool_mode(ChatCompletionRequest.model_validate(base))[0] == "none"
    with_tools = {**base, "tools": [t.model_dump() for t in TOOLS]}
    assert tool_mode(ChatCompletionRequest.model_validate(with_tools))[0] == "auto"
    mode, named = tool_mode(ChatCompletionRequest.model_validate(
        {**with_tools, "tool_choice": {"type": "function", "function": {"name": "get_weather"}}}))
    assert mode == "named" and named is not None
    with pytest.raises(InvalidParamsError, match="needs tools"):
        tool_mode(ChatCompletionRequest.model_validate({**base, "tool_choice": "required"}))
    schema = tool_call_schema("required", TOOLS, None)
    assert schema["anyOf"][0]["properties"]["name"] == {"const": "get_weather"}
