"""/v1/responses: OpenAI's Responses API, served by the chat pipeline.

A Responses request becomes a chat request (instructions as the system message, input items as
messages, function tools and ``text.format`` as tools and ``response_format``), so templates,
constraints, budget steering and tool calls behave as in /v1/chat/completions. Answers are built
from the ``openai`` package's own response types. ``previous_response_id`` continues a stored
conversation: its messages and answer are kept in memory (bounded, with a time limit); the radix
cache still holds their KV, so a follow-up pays only for its new tokens.
"""

from __future__ import annotations

import json
import time
import uuid
from collections import OrderedDict
from collections.abc import AsyncGenerator
from dataclasses import dataclass
from typing import Any

from fastapi import APIRouter, HTTPException, Request
from fastapi.responses import JSONResponse, StreamingResponse
from openai.types.responses import (
    Response,
    ResponseFunctionToolCall,
    ResponseOutputMessage,
    ResponseOutputText,
    ResponseReasoningItem,
    ResponseUsage,
)
from openai.types.responses.response_usage import InputTokensDetails, OutputTokensDetails

from radixgen.api.chat import OutputReader
from radixgen.api.chat_plan import ChatPlan, plan_chat
from radixgen.api.jobs import ChoiceResult, apply, merge_streams, run_jobs, usage
from radixgen.api.protocol import (
    ChatCompletionRequest,
    DeltaMessage,
    ResponsesRequest,
    ToolCall,
    Usage,
)
from radixgen.api.sse import sse, stream_response
from radixgen.errors import InvalidParamsError

router = APIRouter()

MAX_STORED_RESPONSES = 1024
STORED_RESPONSE_TTL_S = 3600.0


@dataclass
class StoredConversation:
    messages: list[dict[str, Any]]
    """The conversation up to and including the stored answer, as chat messages."""
    expires_at: float


class ConversationStore:
    """Responses kept for previous_response_id: the newest MAX_STORED_RESPONSES, each for
    STORED_RESPONSE_TTL_S (per server process, in memory)."""

    def __init__(self, size: int = MAX_STORED_RESPONSES, ttl_s: float = STORED_RESPONSE_TTL_S) -> None:
        self.size, self.ttl_s = size, ttl_s
        self._items: OrderedDict[str, StoredConversation] = OrderedDict()

    def put(self, response_id: str, messages: list[dict[str, Any]]) -> None:
        self._items[response_id] = StoredConversation(messages, time.monotonic() + self.ttl_s)
        while len(self._items) > self.size:
            self._items.popitem(last=False)

    def get(self, response_id: str) -> list[dict[str, Any]]:
        item = self._items.get(response_id)
        if item is None or item.expires_at < time.monotonic():
            self._items.pop(response_id, None)
            raise HTTPException(404, f"previous_response_id {response_id!r} is unknown or expired here (responses "
                                     f"are kept in memory for {self.ttl_s:.0f} s, the newest {self.size}; "
                                     "one created with store=false is not kept)")
        return item.messages


def _text_of(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") not in ("input_text", "output_text", "text"):
                raise InvalidParamsError("only text content is supported (input_text / output_text parts)")
            parts.append(str(part.get("text", "")))
        return "".join(parts)
    raise InvalidParamsError("a message's content must be a string or a list of text parts")


def input_messages(req: ResponsesRequest) -> list[dict[str, Any]]:
    """The request's input items as chat messages."""
    if isinstance(req.input, str):
        return [{"role": "user", "content": req.input}]
    messages: list[dict[str, Any]] = []
    for item in req.input:
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "assistant", "system", "developer"):
                raise InvalidParamsError(f"an input message's role must be user, assistant, system or developer, got {role!r}")
            messages.append({"role": role, "content": _text_of(item.get("content", ""))})
        elif kind == "function_call":
            call = {"id": item.get("call_id") or item.get("id") or f"call-{uuid.uuid4().hex[:24]}", "type": "function",
                    "function": {"name": item.get("name"), "arguments": item.get("arguments", "{}")}}
            if messages and messages[-1]["role"] == "assistant" and messages[-1].get("tool_calls"):
                messages[-1]["tool_calls"].append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            output = item.get("output")
            messages.append({"role": "tool", "tool_call_id": item.get("call_id"),
                             "content": output if isinstance(output, str) else json.dumps(output)})
        else:
            raise InvalidParamsError(f"input items of type {kind!r} are not supported (message, function_call, "
                                     "function_call_output)")
    return messages


def as_chat_request(req: ResponsesRequest, history: list[dict[str, Any]]) -> ChatCompletionRequest:
    messages = ([{"role": "system", "content": req.instructions}] if req.instructions else []) + history
    body: dict[str, Any] = {"model": req.model, "messages": messages, "max_tokens": req.max_output_tokens,
                            "temperature": req.temperature, "top_p": req.top_p, "seed": req.seed,
                            "parallel_tool_calls": req.parallel_tool_calls}
    if req.tools:
        tools = []
        for tool in req.tools:
            if tool.get("type") != "function":
                raise InvalidParamsError(f"tools of type {tool.get('type')!r} are not supported here (function)")
            tools.append({"type": "function", "function": {k: tool[k] for k in ("name", "description", "parameters")
                                                           if tool.get(k) is not None}})
        body["tools"] = tools
    choice = req.tool_choice
    if isinstance(choice, dict) and choice.get("type") == "function":
        choice = {"type": "function", "function": {"name": choice.get("name")}}
    body["tool_choice"] = choice
    fmt = (req.text or {}).get("format") or {"type": "text"}
    if fmt.get("type") == "json_schema":
        body["response_format"] = {"type": "json_schema", "json_schema": {"name": fmt.get("name", "output"),
                                                                          "schema": fmt.get("schema")}}
    elif fmt.get("type") == "json_object":
        body["response_format"] = {"type": "json_object"}
    elif fmt.get("type") != "text":
        raise InvalidParamsError(f"text.format.type must be text, json_object or json_schema, got {fmt.get('type')!r}")
    return ChatCompletionRequest.model_validate({k: v for k, v in body.items() if v is not None})


def _output_items(reader: OutputReader, result: ChoiceResult, message_id: str) -> tuple[list[Any], list[ToolCall] | None]:
    """The response's output items from a finished reader: a reasoning item, the text message
    (when there is text, or nothing else; with the constraint's report on it, radixgen's
    extension), then the function calls."""
    content, thought, calls, _ = reader.result(result.finish_reason)
    items: list[Any] = []
    if thought:
        items.append(ResponseReasoningItem(type="reasoning", id=f"rs-{message_id}", summary=[],
                                           content=[{"type": "reasoning_text", "text": thought}]))  # type: ignore[list-item]
    if content or not calls:
        text = ResponseOutputText(type="output_text", text=content or "", annotations=[])
        message = ResponseOutputMessage(type="message", id=message_id, role="assistant", status="completed",
                                        content=[text])
        if result.constraint is not None:  # an extra field: the openai type allows them
            message.constraint = result.constraint.to_dict()  # type: ignore[attr-defined]
        items.append(message)
    items += [ResponseFunctionToolCall(type="function_call", id=f"fc-{c.id}", call_id=c.id, name=c.function.name,
                                       arguments=c.function.arguments, status="completed") for c in calls or []]
    return items, calls


def _response(req: ResponsesRequest, plan: ChatPlan, result: ChoiceResult, output: list[Any], created: float,
              status: str = "completed") -> Response:
    incomplete = result.finish_reason == "length"
    return Response(
        id=plan.base_id, object="response", created_at=created, model=plan.model, output=output,
        status="incomplete" if incomplete and status == "completed" else status,  # type: ignore[arg-type]
        incomplete_details={"reason": "max_output_tokens"} if incomplete else None,  # type: ignore[arg-type]
        instructions=req.instructions, metadata=req.metadata, max_output_tokens=req.max_output_tokens,
        parallel_tool_calls=req.parallel_tool_calls is not False, previous_response_id=req.previous_response_id,
        temperature=req.temperature, top_p=req.top_p, tool_choice=_tool_choice(req), tools=req.tools or [],  # type: ignore[arg-type]
        text=req.text or {"format": {"type": "text"}},  # type: ignore[arg-type]
        usage=_response_usage(usage([result])),
    )


def _response_usage(counted: Usage) -> ResponseUsage:
    """The Responses API's names for the counts every route computes (``jobs.usage``)."""
    cached = counted.prompt_tokens_details.cached_tokens if counted.prompt_tokens_details is not None else 0
    return ResponseUsage(input_tokens=counted.prompt_tokens, output_tokens=counted.completion_tokens,
                         total_tokens=counted.total_tokens,
                         input_tokens_details=InputTokensDetails(cached_tokens=cached or 0, cache_write_tokens=0),
                         output_tokens_details=OutputTokensDetails(reasoning_tokens=0))


def _tool_choice(req: ResponsesRequest) -> Any:
    return req.tool_choice if req.tool_choice is not None else "auto"


def _remember(request: Request, req: ResponsesRequest, history: list[dict[str, Any]], result_text: str,
              calls: list[ToolCall] | None, response_id: str) -> None:
    if req.store is False:
        return
    answer: dict[str, Any] = {"role": "assistant", "content": None if calls else result_text}
    if calls:
        answer["tool_calls"] = [c.model_dump() for c in calls]
    request.app.state.responses.put(response_id, [*history, answer])


@router.post("/v1/responses", response_model=None)
async def create_response(req: ResponsesRequest, request: Request) -> Any:
    store: ConversationStore = request.app.state.responses
    history = (list(store.get(req.previous_response_id)) if req.previous_response_id else []) + input_messages(req)
    plan = await plan_chat(as_chat_request(req, history), request, id_prefix="resp")
    created = time.time()
    started = time.perf_counter()
    message_id = f"msg-{uuid.uuid4().hex[:24]}"
    if req.stream:
        return _stream(request, req, plan, history, created, started, message_id)
    results = await run_jobs(request, request.app.state.client, plan.jobs, "responses", started)
    if results is None:
        return JSONResponse({}, status_code=499)
    reader = plan.tools.reader()
    reader.feed(results[0].text)
    reader.finish()
    output, calls = _output_items(reader, results[0], message_id)
    _remember(request, req, history, reader.content, calls, plan.base_id)
    return _response(req, plan, results[0], output, created).model_dump(exclude_none=True)


def _stream(request: Request, req: ResponsesRequest, plan: ChatPlan, history: list[dict[str, Any]],
            created: float, started: float, message_id: str) -> StreamingResponse:
    """OpenAI's event sequence: created, in_progress, the output item with its text or argument
    deltas, the item done, completed (with the whole response)."""
    result = ChoiceResult()
    reader = plan.tools.reader()
    events = _ResponseEvents(message_id, reader)
    last_token_at: list[float | None] = [None]
    empty = _response(req, plan, result, [], created, status="in_progress").model_dump(exclude_none=True)

    async def body() -> AsyncGenerator[str, None]:
        yield events.event("response.created", response=empty)
        yield events.event("response.in_progress", response=empty)
        async for item in merge_streams(request, plan.jobs):
            if item is None:
                yield ": keep-alive\n\n"
                continue
            _, out = item
            apply(result, out, streamed=True)
            request.app.state.metrics.observe_latency(last_token_at, 0, out, started)
            deltas = reader.feed(out.new_text)
            if out.finished:
                deltas += reader.finish()
            for delta in deltas:
                for text in events.on_delta(delta):
                    yield text
        items, calls = _output_items(reader, result, message_id)
        closing, output = events.closing(items)
        for text in closing:
            yield text
        _remember(request, req, history, reader.content, calls, plan.base_id)
        final = _response(req, plan, result, output, created).model_dump(exclude_none=True)
        yield events.event("response.completed" if final["status"] == "completed" else "response.incomplete",
                           response=final)

    return stream_response(request, "responses", [result], started, body(),
                           lambda status, kind, message: events.event("error", code=str(status), message=message,
                                                                      param=None))


class _ResponseEvents:
    """The Responses API's streamed events of one answer, numbered in order. Output items are
    indexed in the order they open: the reasoning item, the message, each function call."""

    def __init__(self, message_id: str, reader: OutputReader) -> None:
        self.message_id, self.reasoning_id = message_id, f"rs-{message_id}"
        self.reader = reader
        self.opened: list[tuple[str, int]] = []  # (kind, call index)
        self._seq = 0
        self._pending_text = ""  # whitespace not yet shown: between calls it opens no message

    def event(self, kind: str, **fields: Any) -> str:
        self._seq += 1
        return sse({"type": kind, "sequence_number": self._seq - 1, **fields})

    def _index(self, kind: str, call: int = -1) -> int:
        return self.opened.index((kind, call))

    def _open_message(self) -> list[str]:
        self.opened.append(("message", -1))
        return [self.event("response.output_item.added", output_index=self._index("message"), item={
            "type": "message", "id": self.message_id, "role": "assistant", "status": "in_progress", "content": []})]

    def on_delta(self, delta: DeltaMessage) -> list[str]:
        out: list[str] = []
        if delta.reasoning_content:
            if ("reasoning", -1) not in self.opened:
                self.opened.append(("reasoning", -1))
                out.append(self.event("response.output_item.added", output_index=self._index("reasoning"), item={
                    "type": "reasoning", "id": self.reasoning_id, "summary": [], "status": "in_progress"}))
            out.append(self.event("response.reasoning_text.delta", item_id=self.reasoning_id,
                                  output_index=self._index("reasoning"), content_index=0,
                                  delta=delta.reasoning_content))
        text = self._pending_text + (delta.content or "")
        if ("message", -1) not in self.opened and text and not text.strip():
            self._pending_text = text
        elif text:
            self._pending_text = ""
            if ("message", -1) not in self.opened:
                out += self._open_message()
                out.append(self.event("response.content_part.added", item_id=self.message_id,
                                      output_index=self._index("message"), content_index=0,
                                      part={"type": "output_text", "text": "", "annotations": []}))
            out.append(self.event("response.output_text.delta", item_id=self.message_id,
                                  output_index=self._index("message"), content_index=0, delta=text, logprobs=[]))
        for call in delta.tool_calls or []:
            number = call["index"]
            if "id" in call:
                self.opened.append(("call", number))
                out.append(self.event("response.output_item.added", output_index=self._index("call", number), item={
                    "type": "function_call", "id": f"fc-{call['id']}", "call_id": call["id"],
                    "name": call["function"]["name"], "arguments": "", "status": "in_progress"}))
            if call["function"].get("arguments"):
                out.append(self.event("response.function_call_arguments.delta",
                                      item_id=f"fc-{self.reader.calls[number].id}",
                                      output_index=self._index("call", number), delta=call["function"]["arguments"]))
        return out

    def closing(self, items: list[Any]) -> tuple[list[str], list[Any]]:
        """The events that close every opened item, and the answer's output items in their order."""
        out: list[str] = []
        by_kind: dict[tuple[str, int], Any] = {}
        for it in items:
            number = sum(key[0] == "call" for key in by_kind) if it.type == "function_call" else -1
            by_kind[("call" if it.type == "function_call" else it.type, number)] = it
        if not self.opened or (("message", -1) in by_kind and ("message", -1) not in self.opened):
            out += self._open_message()  # an empty answer still has its (empty) message
        output = [by_kind[key] for key in self.opened]
        reader = self.reader
        for index, (kind, _) in enumerate(self.opened):
            done = output[index]
            if kind == "reasoning":
                out.append(self.event("response.reasoning_text.done", item_id=self.reasoning_id, output_index=index,
                                      content_index=0, text=reader.reasoning))
            elif kind == "message" and reader.content:
                out.append(self.event("response.output_text.done", item_id=self.message_id, output_index=index,
                                      content_index=0, text=reader.content, logprobs=[]))
                out.append(self.event("response.content_part.done", item_id=self.message_id, output_index=index,
                                      content_index=0,
                                      part={"type": "output_text", "text": reader.content, "annotations": []}))
            elif kind == "call":
                out.append(self.event("response.function_call_arguments.done", item_id=done.id, output_index=index,
                                      name=done.name, arguments=done.arguments))
            out.append(self.event("response.output_item.done", output_index=index,
                                  item=done.model_dump(exclude_none=True)))
        return out, output
