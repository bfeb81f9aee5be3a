"""/v1/chat/completions: chat templates, constraints from response_format, tool calls."""

from __future__ import annotations

import json
import time
from collections.abc import AsyncGenerator
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, StreamingResponse

from radixgen.api.chat import ToolPlan
from radixgen.api.chat_plan import plan_chat
from radixgen.api.jobs import ChoiceResult, apply, merge_streams, run_jobs, usage
from radixgen.api.protocol import (
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    DeltaMessage,
    ResponseMessage,
    Usage,
)
from radixgen.api.sse import sse, stream_response, token_logprobs
from radixgen.constraints.partial import PartialJson
from radixgen.engine.params import SamplingParams
from radixgen.errors import InvalidParamsError
from radixgen.ipc.handle import EngineHandle

router = APIRouter()


# ---- /v1/chat/completions -----------------------------------------------------------------


@router.post("/v1/chat/completions", response_model=None)
async def chat_completions(req: ChatCompletionRequest, request: Request) -> Any:
    plan = await plan_chat(req, request)
    state = request.app.state
    client: EngineHandle = state.client
    tools, jobs, base_id, model = plan.tools, plan.jobs, plan.base_id, plan.model
    legacy, top = tools.legacy, req.top_logprobs or 0
    started = time.perf_counter()
    if req.stream:
        return _chat_stream(request, req, tools, jobs, base_id, model, started)
    if req.stream_options is not None and req.stream_options.include_partial:
        raise InvalidParamsError("stream_options.include_partial needs stream: true")
    results = await run_jobs(request, client, jobs, "chat", started)
    if results is None:
        return JSONResponse({}, status_code=499)  # nobody is listening any more
    choices = []
    for i, r in enumerate(results):
        content, thought, calls, reason = tools.finish(r.text, r.finish_reason)
        message = ResponseMessage(content=content, reasoning_content=thought, tool_calls=calls)
        if legacy and calls:
            message = ResponseMessage(content=content, reasoning_content=thought, function_call=calls[0].function)
            reason = "function_call"
        choices.append(ChatChoice(index=i, message=message, finish_reason=reason,
                                  logprobs=token_logprobs(state.tokenizer, r, bool(top), state.token_bytes) if req.logprobs else None,
                                  shortened=r.shortened or None, constraint_warnings=r.constraint_warnings,
                                  constraint=r.constraint))
    return ChatCompletionResponse(id=base_id, model=model, choices=choices, usage=usage(results))


def _as_function_call(delta: DeltaMessage) -> DeltaMessage:
    """A streamed tool-call delta in the legacy function_call form."""
    if not delta.tool_calls:
        return delta
    function = delta.tool_calls[0].get("function") or {}
    return DeltaMessage(role=delta.role, content=delta.content,
                        function_call={k: function[k] for k in ("name", "arguments") if k in function})


def _wants_partials(req: ChatCompletionRequest) -> bool:
    """``stream_options.include_partial``, checked: it needs a JSON answer to follow."""
    if req.stream_options is None or not req.stream_options.include_partial:
        return False
    if req.response_format is None or req.response_format.type not in ("json_schema", "json_object"):
        raise InvalidParamsError("stream_options.include_partial needs response_format of type json_schema or "
                                 "json_object: the partial objects follow a JSON answer")
    return True


def _add_partials(partials: PartialJson, deltas: list[DeltaMessage], *, final: bool) -> None:
    """Put the answer so far on each delta whose content completed a value (at the answer's end,
    the last delta gets the whole answer)."""
    for n, d in enumerate(deltas):
        last = final and n == len(deltas) - 1
        if d.content or last:
            partial = partials.feed(d.content or "", final=last)
            if partial is not None:
                d.partial = partial


def _chat_stream(request: Request, req: ChatCompletionRequest, tools: ToolPlan,
                 jobs: list[tuple[str, list[int], SamplingParams]], base_id: str, model: str,
                 started: float) -> StreamingResponse:
    state = request.app.state
    created = int(time.time())
    results = [ChoiceResult() for _ in jobs]
    readers = [tools.reader() for _ in jobs]
    last_token_at: list[float | None] = [None] * len(jobs)

    def chunk(choices: list[ChatChunkChoice], usage: Usage | None = None) -> str:
        return sse(ChatCompletionChunk(id=base_id, created=created, model=model, choices=choices,
                                        usage=usage).model_dump(exclude_none=True))

    # the common chunk (a choice's text, nothing else) is framed without building models: the
    # same JSON chunk() gives, at a fraction of the cost per token
    text_chunk = ('data: {"id":' + json.dumps(base_id) + ',"object":"chat.completion.chunk","created":' + str(created)
                  + ',"model":' + json.dumps(model) + ',"choices":[{"index":')

    plain_text = readers[0].passes_text_through and not tools.legacy
    partials = [PartialJson() for _ in jobs] if _wants_partials(req) else None

    async def body() -> AsyncGenerator[str, None]:
        for i in range(len(jobs)):
            yield chunk([ChatChunkChoice(index=i, delta=DeltaMessage(role="assistant", content=""))])
        async for item in merge_streams(request, jobs):
            if item is None:
                yield ": keep-alive\n\n"
                continue
            i, out = item
            apply(results[i], out, streamed=True)
            request.app.state.metrics.observe_latency(last_token_at, i, out, started)
            reader = readers[i]
            if plain_text and not out.finished and not req.logprobs:  # the path of almost every token
                if out.new_text:
                    reader.content += out.new_text
                    partial = partials[i].feed(out.new_text) if partials is not None else None
                    if partial is not None:
                        yield chunk([ChatChunkChoice(index=i, delta=DeltaMessage(content=out.new_text, partial=partial))])
                        continue
                    yield f'{text_chunk}{i},"delta":{{"content":{json.dumps(out.new_text)}}}}}]}}\n\n'
                continue
            logprobs = None
            if req.logprobs and out.new_token_ids:
                part = ChoiceResult(token_ids=out.new_token_ids, logprobs=out.new_logprobs or [],
                                    top_logprobs=out.new_top_logprobs or [])
                logprobs = token_logprobs(state.tokenizer, part, bool(req.top_logprobs), state.token_bytes)
            deltas = reader.feed(out.new_text)
            reason = None
            if out.finished:
                deltas += reader.finish()
                reason = reader.result(results[i].finish_reason)[3]
            if logprobs is not None and not deltas:
                deltas = [DeltaMessage()]
            if partials is not None:
                _add_partials(partials[i], deltas, final=out.finished)
            if tools.legacy:
                deltas = [_as_function_call(d) for d in deltas]
                reason = "function_call" if reason == "tool_calls" else reason
            if len(deltas) == 1 and logprobs is None and not out.finished and deltas[0].content is not None and (
                    deltas[0].model_fields_set == {"content"}) and deltas[0].partial is None:
                yield f'{text_chunk}{i},"delta":{{"content":{json.dumps(deltas[0].content)}}}}}]}}\n\n'
                continue
            for n, d in enumerate(deltas):
                last = n == len(deltas) - 1
                yield chunk([ChatChunkChoice(index=i, delta=d, finish_reason=reason if last else None,
                                             logprobs=logprobs if last else None,
                                             shortened=(results[i].shortened or None) if last and out.finished else None,
                                             constraint_warnings=results[i].constraint_warnings
                                             if last and out.finished else None,
                                             constraint=results[i].constraint if last and out.finished else None)])
            if out.finished and not deltas:
                yield chunk([ChatChunkChoice(index=i, delta=DeltaMessage(), finish_reason=reason,
                                             shortened=results[i].shortened or None,
                                             constraint_warnings=results[i].constraint_warnings,
                                             constraint=results[i].constraint)])
        if req.stream_options is not None and req.stream_options.include_usage:
            yield chunk([], usage=usage(results))
        yield sse("[DONE]")

    return stream_response(request, "chat", results, started, body())


