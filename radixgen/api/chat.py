"""Chat prompts and tool calls: messages -> prompt ids, tools -> prompt text and constraints,
model output -> tool calls.

Templates that know tools (they reference ``tools``) get them natively; for the others (the
bundled SmolLM2's ChatML among them) the tools are described in a system message with the one
call format we parse back: a JSON object ``{"name": ..., "arguments": {...}}``.
"""

from __future__ import annotations

import json
import re
from typing import Any

from radixgen.api.protocol import ChatCompletionRequest, Tool, ToolCall, ToolCallFunction
from radixgen.errors import InvalidParamsError
from radixgen.templates import TOOL_SYSTEM_PROMPT


def _message_text(content: Any) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    parts = []
    for part in content:
        if part.get("type") != "text":
            raise InvalidParamsError(f"message content part of type {part.get('type')!r} is not supported; send text")
        parts.append(part.get("text", ""))
    return "".join(parts)


def _template_knows_tools(tokenizer: Any) -> bool:
    template = getattr(tokenizer, "chat_template", None) or ""
    return "tools" in template


def tool_mode(req: ChatCompletionRequest) -> tuple[str, Tool | None]:
    """('none' | 'auto' | 'required' | 'named', the named tool)."""
    if not req.tools:
        if req.tool_choice not in (None, "none", "auto"):
            raise InvalidParamsError("tool_choice needs tools")
        return "none", None
    choice = req.tool_choice if req.tool_choice is not None else "auto"
    if choice in ("none", "auto", "required"):
        return str(choice), None
    if isinstance(choice, dict) and choice.get("type") == "function":
        name = (choice.get("function") or {}).get("name")
        for tool in req.tools:
            if tool.function.name == name:
                return "named", tool
        raise InvalidParamsError(f"tool_choice names function {name!r}, which is not in tools")
    raise InvalidParamsError("tool_choice must be 'none', 'auto', 'required' or {'type': 'function', 'function': {'name': ...}}")


def chat_prompt_ids(tokenizer: Any, req: ChatCompletionRequest, mode: str) -> list[int]:
    messages: list[dict[str, Any]] = []
    for m in req.messages:
        content = _message_text(m.content)
        msg: dict[str, Any] = {"role": "system" if m.role == "developer" else m.role, "content": content}
        if m.tool_calls:
            calls = [{"name": tc.function.name, "arguments": json.loads(tc.function.arguments or "{}")}
                     for tc in m.tool_calls]
            if _template_knows_tools(tokenizer):
                msg["tool_calls"] = [tc.model_dump() for tc in m.tool_calls]
            else:  # show the model its own earlier calls in the format it is asked to use
                msg["content"] = content + json.dumps(calls[0] if len(calls) == 1 else calls)
        if m.tool_call_id:
            msg["tool_call_id"] = m.tool_call_id
        messages.append(msg)
    kwargs: dict[str, Any] = {}
    if req.tools and mode != "none":
        if _template_knows_tools(tokenizer):
            kwargs["tools"] = [t.model_dump() for t in req.tools]
        else:
            described = "\n".join(json.dumps(t.function.model_dump(exclude_none=True)) for t in req.tools)
            messages.insert(0 if messages[0]["role"] != "system" else 1,
                            {"role": "system", "content": TOOL_SYSTEM_PROMPT.format(tools=described)})
    # transformers renders chat templates in a sandboxed (immutable) Jinja environment
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, **kwargs)
    return list(tokenizer.encode(text, add_special_tokens=False))


def _parameters(tool: Tool) -> dict[str, Any]:
    return tool.function.parameters or {"type": "object", "properties": {}}


def tool_call_schema(mode: str, tools: list[Tool], named: Tool | None) -> dict[str, Any]:
    """The constraint of a forced call: the named tool's arguments, or one of the tools' calls."""
    if mode == "named":
        assert named is not None
        return _parameters(named)
    return {"anyOf": [
        {"type": "object", "properties": {"name": {"const": t.function.name}, "arguments": _parameters(t)},
         "required": ["name", "arguments"], "additionalProperties": False}
        for t in tools
    ]}


def forced_tool_call(mode: str, named: Tool | None, text: str) -> ToolCall:
    """The call a constrained output encodes."""
    if mode == "named":
        assert named is not None
        return ToolCall(function=ToolCallFunction(name=named.function.name, arguments=text))
    call = json.loads(text)
    return ToolCall(function=ToolCallFunction(name=call["name"], arguments=json.dumps(call["arguments"])))


_CALL_TAG = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)


def parse_tool_calls(text: str, tools: list[Tool]) -> list[ToolCall] | None:
    """Tool calls in a free-form answer (tool_choice auto), or None if it is a plain answer."""
    names = {t.function.name for t in tools}
    candidates = _CALL_TAG.findall(text) or [text.strip()]
    calls = []
    for candidate in candidates:
        try:
            obj = json.loads(candidate)
        except json.JSONDecodeError:
            return None
        for item in obj if isinstance(obj, list) else [obj]:
            if not isinstance(item, dict) or item.get("name") not in names:
                return None
            args = item.get("arguments", item.get("parameters", {}))
            if isinstance(args, str):
                try:
                    args = json.loads(args)
                except json.JSONDecodeError:
                    return None
            if not isinstance(args, dict):
                return None
            calls.append(ToolCall(function=ToolCallFunction(name=item["name"], arguments=json.dumps(args))))
    return calls or None
