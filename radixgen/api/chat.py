"""Chat prompts and tool calls: messages -> prompt ids, tools -> prompt text and a structural
constraint in the model family's call format, model output -> content, reasoning and calls.

The call format and the reasoning markers come from the loaded tokenizer's chat template
(``radixgen.tool_formats``, ``radixgen.reasoning``), found once when the server starts.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field
from typing import Any

from radixgen import reasoning, tool_formats
from radixgen.api.protocol import (
    ChatCompletionRequest,
    DeltaMessage,
    Tool,
    ToolCall,
    ToolCallFunction,
)
from radixgen.errors import InvalidParamsError
from radixgen.reasoning import ReasoningMarkers, ReasoningSplitter
from radixgen.tool_formats import CallFormat, CallParser


@dataclass(frozen=True)
class ChatFormat:
    """How the loaded model's template writes tool calls and reasoning."""

    calls: CallFormat
    reasoning: ReasoningMarkers | None = None

    @classmethod
    def of(cls, tokenizer: Any) -> ChatFormat:
        return cls(tool_formats.detect(tokenizer), reasoning.detect(tokenizer))


def _message_text(content: Any) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    parts = []
    for part in content:
        if part.get("type") != "text":
            raise InvalidParamsError(f"message content part of type {part.get('type')!r} is not supported; send text")
        parts.append(part.get("text", ""))
    return "".join(parts)


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


def _arguments(text: str | None) -> Any:
    text = text or "{}"
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        raise InvalidParamsError(f"a tool call's arguments in messages are not JSON: {text[:80]!r}") from None


def chat_prompt_ids(tokenizer: Any, req: ChatCompletionRequest, mode: str, fmt: ChatFormat) -> list[int]:
    native = fmt.calls.template_renders_tools
    messages: list[dict[str, Any]] = []
    for m in req.messages:
        content = _message_text(m.content)
        msg: dict[str, Any] = {"role": "system" if m.role == "developer" else m.role, "content": content}
        if m.tool_calls:
            arguments = [_arguments(tc.function.arguments) for tc in m.tool_calls]  # each must be JSON
            if native:
                msg["tool_calls"] = [{"id": tc.id, "type": "function", "function": {
                    "name": tc.function.name, "arguments": args}} for tc, args in zip(m.tool_calls, arguments, strict=True)]
            else:  # show the model its own earlier calls in the format it is asked to use
                msg["content"] = content + fmt.calls.render_calls(
                    [(tc.function.name, tc.function.arguments or "{}") for tc in m.tool_calls])
        if m.role == "tool" and not native:  # SmolLM2's documented layout of a tool's result
            msg = {"role": "user", "content": f"<tool_response>\n{content}\n</tool_response>"}
        elif m.tool_call_id:
            msg["tool_call_id"] = m.tool_call_id
        messages.append(msg)
    kwargs: dict[str, Any] = {}
    if req.tools and mode != "none":
        if native:
            kwargs["tools"] = [t.model_dump(exclude_none=True) for t in req.tools]
        else:
            described = fmt.calls.system_prompt([t.model_dump(exclude_none=True)["function"] for t in req.tools])
            if messages and messages[0]["role"] == "system":
                messages[0] = {**messages[0], "content": messages[0]["content"] + "\n\n" + described}
            else:
                messages.insert(0, {"role": "system", "content": described})
    # transformers renders chat templates in a sandboxed (immutable) Jinja environment
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, **kwargs)
    return list(tokenizer.encode(text, add_special_tokens=False))


def _parameters(tool: Tool) -> dict[str, Any]:
    return tool.function.parameters or {"type": "object", "properties": {}}


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


@dataclass
class ToolPlan:
    """How one chat request treats tools and reasoning: the constraint, and reading the output back."""

    mode: str = "none"
    tools: list[Tool] = field(default_factory=list)
    named: Tool | None = None
    single: bool = False
    """parallel_tool_calls=false: at most one call."""
    legacy: bool = False
    """The request used functions / function_call: answer with message.function_call."""
    fmt: ChatFormat = field(default_factory=lambda: ChatFormat(tool_formats.GENERIC))
    scored: bool = False
    """The scored decision chose ``named`` (tool_decision): several calls of it may follow."""

    @property
    def calls_tools(self) -> bool:
        return self.mode in ("auto", "required", "named")

    def constraint(self, response: dict[str, Any]) -> dict[str, Any]:
        """SamplingParams constraint keywords: tool calls in the family's format, and the
        request's own constraint (``response``, from response_format) after any reasoning."""
        answers_json = "json_schema" in response or "json_object" in response
        if self.calls_tools and response:
            if self.mode != "auto" and not self.scored:  # the scores choosing a call is auto's own decision
                raise InvalidParamsError("a forced tool call (tool_choice required or named) cannot be combined with "
                                         "response_format, regex or choices")
            if not answers_json:
                return response  # a regex or choices answer: it wins, the tools stay described
        markers = self.fmt.reasoning
        if self.calls_tools:
            offered = [self.named] if self.named is not None else self.tools
            # with a response_format the turn is a call block or the final answer in its schema,
            # as OpenAI's API (and agent SDKs with an output type and tools) expect
            free_text = self.mode == "auto" and not answers_json
            structure: dict[str, Any] = {"tool_calls": self.fmt.calls.structure(
                [(t.function.name, _parameters(t)) for t in offered], free_text=free_text,
                min_calls=0 if free_text else 1,
                max_calls=1 if self.single or self.legacy or (self.mode == "named" and not self.scored) else None)}
            if answers_json and self.mode == "auto":
                structure["json_schema"] = response.get("json_schema", {"type": "object"})
        elif markers is not None and answers_json:
            structure = {"json_schema": response.get("json_schema", {"type": "object"})}
        else:
            return response
        if markers is not None:
            structure["reasoning"] = markers.structure()
        return {"structural": structure}

    def reader(self) -> OutputReader:
        return OutputReader(self)

    def finish(self, text: str, finish_reason: str | None) -> tuple[str | None, str | None, list[ToolCall] | None, str | None]:
        """(content, reasoning, tool_calls, finish_reason) of a finished output."""
        reader = self.reader()
        reader.feed(text)
        reader.finish()
        return reader.result(finish_reason)


class OutputReader:
    """Reads one choice's output as it streams: reasoning, content and tool calls, as chat deltas.

    Call arguments stream as they are generated; the non-streamed answer is this same reader
    fed the whole text, so the streamed fragments concatenate to it byte for byte."""

    def __init__(self, plan: ToolPlan) -> None:
        self.plan = plan
        markers = plan.fmt.reasoning
        self._splitter = ReasoningSplitter(markers) if markers is not None else None
        self._parser: CallParser | None = plan.fmt.calls.parser() if plan.calls_tools else None
        self._ids: list[str] = []
        self.content = ""
        self.reasoning = ""

    @property
    def passes_text_through(self) -> bool:
        """No reasoning to split and no calls to read: the output is the content as it comes."""
        return self._splitter is None and self._parser is None

    def feed(self, text: str) -> list[DeltaMessage]:
        thought, answer = self._splitter.feed(text) if self._splitter is not None else ("", text)
        return self._deltas(thought, answer, final=False)

    def finish(self) -> list[DeltaMessage]:
        thought = self._splitter.finish() if self._splitter is not None else ""
        return self._deltas(thought, "", final=True)

    def _deltas(self, thought: str, answer: str, *, final: bool) -> list[DeltaMessage]:
        out = []
        if thought:
            self.reasoning += thought
            out.append(DeltaMessage(reasoning_content=thought))
        if self._parser is None:
            if answer:
                self.content += answer
                out.append(DeltaMessage(content=answer))
            return out
        events = self._parser.feed(answer) if answer else tool_formats.CallEvents()
        if final:
            ended = self._parser.finish()
            events.content += ended.content
        if events.content:
            self.content += events.content
            out.append(DeltaMessage(content=events.content))
        started = dict(events.started)
        self._ids += [new_call_id() for _ in events.started]
        calls: list[dict[str, Any]] = []
        for index in sorted(started.keys() | {i for i, _ in events.arguments}):
            fragment = "".join(a for i, a in events.arguments if i == index)
            if index in started:
                calls.append({"index": index, "id": self._ids[index], "type": "function",
                              "function": {"name": started[index], "arguments": fragment}})
            else:
                calls.append({"index": index, "function": {"arguments": fragment}})
        if calls:
            out.append(DeltaMessage(tool_calls=calls))
        return out

    @property
    def calls(self) -> list[ToolCall]:
        parsed = self._parser.calls if self._parser is not None else []
        return [ToolCall(id=self._ids[i], function=ToolCallFunction(name=c.name, arguments=c.arguments))
                for i, c in enumerate(parsed)]

    def result(self, finish_reason: str | None) -> tuple[str | None, str | None, list[ToolCall] | None, str | None]:
        calls = self.calls or None
        reason = "tool_calls" if calls and finish_reason == "stop" else finish_reason
        content = self.content if self.content.strip() or not calls else None
        return content, self.reasoning or None, calls, reason
