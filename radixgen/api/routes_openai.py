"""/v1/chat/completions, /v1/completions and the native /generate.

This module is the one place that turns API requests into engine types (``SamplingParams``,
prompt token ids) and engine outputs into OpenAI shapes.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from fastapi import APIRouter, HTTPException, Request
from fastapi.responses import JSONResponse, StreamingResponse

from radixgen.api.engine_client import EngineClient
from radixgen.api.protocol import (
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChoiceLogprobs,
    CompletionChoice,
    CompletionRequest,
    CompletionResponse,
    DeltaMessage,
    GenerateRequest,
    PromptTokensDetails,
    ResponseMessage,
    SamplingFields,
    TokenLogprob,
    TopLogprob,
    Usage,
)
from radixgen.engine.request import FinishReason, RequestOutput, SamplingParams
from radixgen.errors import InvalidParamsError, PromptTooLongError

router = APIRouter()

_KEEPALIVE_S = 10.0
_DISCONNECT_POLL_S = 0.25


class ClientGone(Exception):
    """The HTTP client disconnected; its requests were aborted."""


@dataclass
class ChoiceResult:
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    prompt_tokens: int = 0
    cached_tokens: int = 0
    logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)


# ---- request -> engine types --------------------------------------------------------------


def _check_model(req: SamplingFields, request: Request) -> None:
    name = request.app.state.config.served_model_name
    if req.model is not None and req.model not in (name, "default"):
        raise HTTPException(404, f"model {req.model!r} does not exist here; available: {name!r}")


def _refuse_unsupported(req: Any) -> None:
    """Constraint fields are refused by name until the constraints engine lands, never ignored:
    ignoring them would hand back unconstrained text to a caller who asked for structure."""
    fmt = getattr(req, "response_format", None)
    if fmt is not None and fmt.type != "text":
        raise InvalidParamsError(f"response_format type {fmt.type!r} is not supported by this server yet; use 'text'")
    for name in ("regex", "choices"):
        if getattr(req, name, None) is not None:
            raise InvalidParamsError(f"{name} is not supported by this server yet")
    if getattr(req, "tools", None) and getattr(req, "tool_choice", None) not in (None, "none"):
        raise InvalidParamsError("tools with tool_choice other than 'none' are not supported by this server yet")


def build_params(req: SamplingFields, prompt_len: int, max_context: int, *, max_tokens: int | None,
                 logprobs: bool = False, top_logprobs: int = 0, seed_offset: int = 0) -> SamplingParams:
    room = max_context - prompt_len
    if room < 1:
        raise PromptTooLongError(f"the prompt has {prompt_len} tokens; the context holds {max_context}: shorten it")
    if max_tokens is not None and max_tokens > room:
        raise PromptTooLongError(
            f"max_tokens is {max_tokens} but only {room} tokens fit after the {prompt_len}-token prompt "
            f"(context {max_context}): lower max_tokens or shorten the prompt"
        )
    return SamplingParams(
        max_new_tokens=max_tokens or room,
        temperature=1.0 if req.temperature is None else req.temperature,
        top_p=1.0 if req.top_p is None else req.top_p,
        top_k=-1 if req.top_k is None else req.top_k,
        min_p=0.0 if req.min_p is None else req.min_p,
        presence_penalty=req.presence_penalty or 0.0,
        frequency_penalty=req.frequency_penalty or 0.0,
        repetition_penalty=1.0 if req.repetition_penalty is None else req.repetition_penalty,
        seed=None if req.seed is None else req.seed + seed_offset,
        stop=req.stop or (),
        stop_token_ids=tuple(req.stop_token_ids or ()),
        ignore_eos=req.ignore_eos,
        logprobs=logprobs,
        top_logprobs=top_logprobs,
    )


def _message_text(content: Any) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    parts = []
    for part in content:
        if part.get("type") != "text":
            raise InvalidParamsError(f"message content part of type {part.get('type')!r} is not supported; send text")
        parts.append(part.get("text", ""))
    return "".join(parts)


def chat_prompt_ids(tokenizer: Any, req: ChatCompletionRequest) -> list[int]:
    messages = []
    for m in req.messages:
        msg: dict[str, Any] = {"role": "system" if m.role == "developer" else m.role, "content": _message_text(m.content)}
        if m.tool_calls:
            msg["tool_calls"] = [tc.model_dump() for tc in m.tool_calls]
        if m.tool_call_id:
            msg["tool_call_id"] = m.tool_call_id
        messages.append(msg)
    # transformers renders chat templates in a sandboxed (immutable) Jinja environment
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return list(tokenizer.encode(text, add_special_tokens=False))


def _usage(results: list[ChoiceResult]) -> Usage:
    prompt = results[0].prompt_tokens if results else 0
    completion = sum(len(r.token_ids) for r in results)
    cached = max((r.cached_tokens for r in results), default=0)
    return Usage(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion,
                 prompt_tokens_details=PromptTokensDetails(cached_tokens=cached))


# ---- running requests ---------------------------------------------------------------------


async def _consume(client: EngineClient, request_id: str, prompt_ids: list[int], params: SamplingParams,
                   result: ChoiceResult, on_delta: Any = None) -> ChoiceResult:
    stream = on_delta is not None or params.logprobs or bool(params.top_logprobs)
    async for out in client.generate(request_id, prompt_ids, params, stream=stream):
        _apply(result, out, stream)
        if on_delta is not None:
            await on_delta(out)
    return result


def _apply(result: ChoiceResult, out: RequestOutput, streamed: bool) -> None:
    result.prompt_tokens, result.cached_tokens = out.prompt_tokens, out.cached_tokens
    if out.error is not None and out.finish_reason is FinishReason.ERROR:
        raise InvalidParamsError(out.error) if out.user_error else RuntimeError(out.error)
    if streamed:
        result.text += out.new_text
        result.token_ids.extend(out.new_token_ids)
        result.logprobs.extend(out.new_logprobs or [])
        result.top_logprobs.extend(out.new_top_logprobs or [])
    if out.finished:
        if not streamed:
            result.text, result.token_ids = out.text or "", list(out.output_ids or [])
        result.finish_reason = out.finish_reason.value if out.finish_reason else None


async def _until_done_or_gone(request: Request, tasks: list[asyncio.Task[Any]]) -> list[Any]:
    """Wait for the tasks; if the client disconnects first, cancel them (aborting in the engine)."""
    pending = set(tasks)
    while pending:
        _, pending = await asyncio.wait(pending, timeout=_DISCONNECT_POLL_S)
        if pending and await request.is_disconnected():
            for t in pending:
                t.cancel()
            await asyncio.gather(*pending, return_exceptions=True)
            raise ClientGone()
    return [t.result() for t in tasks]


def _token_logprobs(tokenizer: Any, result: ChoiceResult, with_top: bool) -> ChoiceLogprobs:
    content = []
    for i, (tok, lp) in enumerate(zip(result.token_ids, result.logprobs, strict=False)):
        text = tokenizer.decode([tok])
        tops = []
        if with_top and i < len(result.top_logprobs):
            tops = [TopLogprob(token=tokenizer.decode([t]), logprob=v, bytes=list(tokenizer.decode([t]).encode()))
                    for t, v in result.top_logprobs[i]]
        content.append(TokenLogprob(token=text, logprob=lp, bytes=list(text.encode()), top_logprobs=tops))
    return ChoiceLogprobs(content=content)


def _sse(payload: Any) -> str:
    data = payload if isinstance(payload, str) else json.dumps(payload, separators=(",", ":"))
    return f"data: {data}\n\n"


async def _merge_streams(
    client: EngineClient, jobs: list[tuple[str, list[int], SamplingParams]]
) -> AsyncIterator[tuple[int, RequestOutput] | None]:
    """Outputs of several requests as they come, tagged with their choice index; None = quiet."""
    queue: asyncio.Queue[Any] = asyncio.Queue()
    done = object()

    async def pump(index: int, rid: str, ids: list[int], params: SamplingParams) -> None:
        try:
            async for out in client.generate(rid, ids, params, stream=True):
                await queue.put((index, out))
        except Exception as e:  # noqa: BLE001 - handed to the consumer
            await queue.put(e)
        finally:
            await queue.put(done)

    tasks = [asyncio.create_task(pump(i, *job)) for i, job in enumerate(jobs)]
    remaining = len(tasks)
    try:
        while remaining:
            try:
                item = await asyncio.wait_for(queue.get(), timeout=_KEEPALIVE_S)
            except asyncio.TimeoutError:
                yield None
                continue
            if item is done:
                remaining -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield item
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


# ---- /v1/chat/completions -----------------------------------------------------------------


@router.post("/v1/chat/completions", response_model=None)
async def chat_completions(req: ChatCompletionRequest, request: Request) -> Any:
    _check_model(req, request)
    _refuse_unsupported(req)
    state = request.app.state
    client: EngineClient = state.client
    prompt_ids = chat_prompt_ids(state.tokenizer, req)
    max_tokens = req.max_completion_tokens or req.max_tokens
    top = req.top_logprobs or 0
    if top and not req.logprobs:
        raise InvalidParamsError("top_logprobs needs logprobs=true")
    params = [build_params(req, len(prompt_ids), client.info["max_context_len"], max_tokens=max_tokens,
                           logprobs=req.logprobs, top_logprobs=top, seed_offset=i) for i in range(req.n)]
    base_id = f"chatcmpl-{uuid.uuid4().hex[:24]}"
    jobs = [(f"{base_id}-{i}", prompt_ids, p) for i, p in enumerate(params)]
    model = state.config.served_model_name
    started = time.perf_counter()
    if req.stream:
        return StreamingResponse(_chat_stream(request, req, jobs, base_id, model, started), media_type="text/event-stream")
    results = [ChoiceResult() for _ in jobs]
    tasks = [asyncio.create_task(_consume(client, rid, ids, p, r)) for (rid, ids, p), r in zip(jobs, results, strict=True)]
    try:
        await _until_done_or_gone(request, tasks)
    except ClientGone:
        _record(request, "chat", 499, results, started)
        return JSONResponse({}, status_code=499)
    _record(request, "chat", 200, results, started)
    choices = [
        ChatChoice(index=i, message=ResponseMessage(content=r.text), finish_reason=r.finish_reason,
                   logprobs=_token_logprobs(state.tokenizer, r, bool(top)) if req.logprobs else None)
        for i, r in enumerate(results)
    ]
    return ChatCompletionResponse(id=base_id, model=model, choices=choices, usage=_usage(results))


async def _chat_stream(request: Request, req: ChatCompletionRequest, jobs: list[tuple[str, list[int], SamplingParams]],
                       base_id: str, model: str, started: float) -> AsyncIterator[str]:
    state = request.app.state
    created = int(time.time())
    results = [ChoiceResult() for _ in jobs]
    last_token_at: list[float | None] = [None] * len(jobs)

    def chunk(choices: list[ChatChunkChoice], usage: Usage | None = None) -> str:
        return _sse(ChatCompletionChunk(id=base_id, created=created, model=model, choices=choices,
                                        usage=usage).model_dump(exclude_none=True))

    for i in range(len(jobs)):
        yield chunk([ChatChunkChoice(index=i, delta=DeltaMessage(role="assistant", content=""))])
    status = 200
    try:
        async for item in _merge_streams(state.client, jobs):
            if item is None:
                yield ": keep-alive\n\n"
                continue
            i, out = item
            _apply(results[i], out, streamed=True)
            _observe_latency(state.metrics, last_token_at, i, out, started)
            if out.new_text or out.finished:
                logprobs = None
                if req.logprobs and out.new_token_ids:
                    part = ChoiceResult(token_ids=out.new_token_ids, logprobs=out.new_logprobs or [],
                                        top_logprobs=out.new_top_logprobs or [])
                    logprobs = _token_logprobs(state.tokenizer, part, bool(req.top_logprobs))
                yield chunk([ChatChunkChoice(
                    index=i, delta=DeltaMessage(content=out.new_text or None),
                    finish_reason=results[i].finish_reason if out.finished else None, logprobs=logprobs)])
        if req.stream_options is not None and req.stream_options.include_usage:
            yield chunk([], usage=_usage(results))
        yield _sse("[DONE]")
    except asyncio.CancelledError:
        status = 499
        raise
    except Exception as e:  # after the first byte an HTTP status cannot change: report in-band
        status = 500
        yield _sse({"error": {"message": str(e), "type": "server_error", "code": 500}})
    finally:
        _record(request, "chat", status, results, started)


# ---- /v1/completions ----------------------------------------------------------------------


def _completion_prompts(tokenizer: Any, prompt: Any) -> list[list[int]]:
    if isinstance(prompt, str):
        prompts = [prompt]
    elif prompt and all(isinstance(t, int) for t in prompt):
        return [list(prompt)]
    else:
        prompts = list(prompt)
    out = []
    for p in prompts:
        if isinstance(p, str):
            out.append(list(tokenizer.encode(p, add_special_tokens=False)))
        else:
            out.append(list(p))
    if not out or any(not p for p in out):
        raise InvalidParamsError("prompt is empty; give at least one token of text")
    vocab = tokenizer.__len__()
    if any(not (0 <= t < vocab) for p in out for t in p):
        raise InvalidParamsError(f"prompt token ids must be in [0, {vocab})")
    return out


@router.post("/v1/completions", response_model=None)
async def completions(req: CompletionRequest, request: Request) -> Any:
    _check_model(req, request)
    _refuse_unsupported(req)
    state = request.app.state
    client: EngineClient = state.client
    prompts = _completion_prompts(state.tokenizer, req.prompt)
    max_context = client.info["max_context_len"]
    top = req.logprobs or 0
    jobs = []
    base_id = f"cmpl-{uuid.uuid4().hex[:24]}"
    for p_index, ids in enumerate(prompts):
        for j in range(req.n):
            params = build_params(req, len(ids), max_context, max_tokens=req.max_tokens or 16,
                                  logprobs=req.logprobs is not None, top_logprobs=top, seed_offset=j)
            jobs.append((f"{base_id}-{p_index}-{j}", ids, params))
    model = state.config.served_model_name
    started = time.perf_counter()
    if req.stream:
        return StreamingResponse(_completion_stream(request, req, jobs, base_id, model, started),
                                 media_type="text/event-stream")
    results = [ChoiceResult() for _ in jobs]
    tasks = [asyncio.create_task(_consume(client, rid, ids, p, r)) for (rid, ids, p), r in zip(jobs, results, strict=True)]
    try:
        await _until_done_or_gone(request, tasks)
    except ClientGone:
        _record(request, "completions", 499, results, started)
        return JSONResponse({}, status_code=499)
    _record(request, "completions", 200, results, started)
    choices = []
    for i, ((_, ids, _), r) in enumerate(zip(jobs, results, strict=True)):
        text = (state.tokenizer.decode(ids) + r.text) if req.echo else r.text
        lp = None
        if req.logprobs is not None:
            lp = {"tokens": [state.tokenizer.decode([t]) for t in r.token_ids], "token_logprobs": r.logprobs,
                  "top_logprobs": [{state.tokenizer.decode([t]): v for t, v in tops} for tops in r.top_logprobs] or None}
        choices.append(CompletionChoice(index=i, text=text, finish_reason=r.finish_reason, logprobs=lp))
    usage = Usage(prompt_tokens=sum(len(ids) for ids in prompts), completion_tokens=sum(len(r.token_ids) for r in results),
                  total_tokens=0, prompt_tokens_details=PromptTokensDetails(cached_tokens=sum(r.cached_tokens for r in results)))
    usage.total_tokens = usage.prompt_tokens + usage.completion_tokens
    return CompletionResponse(id=base_id, model=model, choices=choices, usage=usage)


async def _completion_stream(request: Request, req: CompletionRequest, jobs: list[tuple[str, list[int], SamplingParams]],
                             base_id: str, model: str, started: float) -> AsyncIterator[str]:
    state = request.app.state
    created = int(time.time())
    results = [ChoiceResult() for _ in jobs]
    last_token_at: list[float | None] = [None] * len(jobs)
    status = 200
    try:
        async for item in _merge_streams(state.client, jobs):
            if item is None:
                yield ": keep-alive\n\n"
                continue
            i, out = item
            _apply(results[i], out, streamed=True)
            _observe_latency(state.metrics, last_token_at, i, out, started)
            if out.new_text or out.finished:
                yield _sse({"id": base_id, "object": "text_completion", "created": created, "model": model,
                            "choices": [{"index": i, "text": out.new_text,
                                         "finish_reason": results[i].finish_reason if out.finished else None,
                                         "logprobs": None}]})
        if req.stream_options is not None and req.stream_options.include_usage:
            prompt = sum(len(ids) for _, ids, _ in jobs[:: max(req.n, 1)])
            completion = sum(len(r.token_ids) for r in results)
            yield _sse({"id": base_id, "object": "text_completion", "created": created, "model": model, "choices": [],
                        "usage": {"prompt_tokens": prompt, "completion_tokens": completion,
                                  "total_tokens": prompt + completion}})
        yield _sse("[DONE]")
    except asyncio.CancelledError:
        status = 499
        raise
    except Exception as e:  # noqa: BLE001
        status = 500
        yield _sse({"error": {"message": str(e), "type": "server_error", "code": 500}})
    finally:
        _record(request, "completions", status, results, started)


# ---- /generate (native) ---------------------------------------------------------------------


@router.post("/generate", response_model=None)
async def generate(req: GenerateRequest, request: Request) -> Any:
    state = request.app.state
    client: EngineClient = state.client
    if (req.text is None) == (req.input_ids is None):
        raise InvalidParamsError("give exactly one of text and input_ids")
    ids = _completion_prompts(state.tokenizer, req.text if req.text is not None else req.input_ids)[0]
    sp = dict(req.sampling_params)
    max_new = sp.pop("max_new_tokens", None)
    room = client.info["max_context_len"] - len(ids)
    if max_new is not None and max_new > room:
        raise PromptTooLongError(f"max_new_tokens {max_new} does not fit after the {len(ids)}-token prompt "
                                 f"(context {client.info['max_context_len']})")
    try:
        params = SamplingParams(max_new_tokens=max_new or min(room, 128), **sp)
    except TypeError as e:
        raise InvalidParamsError(f"sampling_params: {e}") from None
    rid = req.request_id or f"gen-{uuid.uuid4().hex[:24]}"
    started = time.perf_counter()
    if req.stream:
        async def events() -> AsyncIterator[str]:
            async for out in client.generate(rid, ids, params, stream=True):
                yield _sse({"text": out.new_text, "token_ids": out.new_token_ids, "finished": out.finished,
                            "meta": _meta(out)})
            yield _sse("[DONE]")
        return StreamingResponse(events(), media_type="text/event-stream")
    result = ChoiceResult()
    task = asyncio.create_task(_consume(client, rid, ids, params, result))
    try:
        await _until_done_or_gone(request, [task])
    except ClientGone:
        return JSONResponse({}, status_code=499)
    _record(request, "generate", 200, [result], started)
    return {"text": result.text, "token_ids": result.token_ids,
            "meta": {"request_id": rid, "finish_reason": result.finish_reason, "prompt_tokens": len(ids),
                     "completion_tokens": len(result.token_ids), "cached_tokens": result.cached_tokens,
                     "logprobs": result.logprobs or None}}


def _meta(out: RequestOutput) -> dict[str, Any]:
    return {"request_id": out.request_id, "finish_reason": out.finish_reason.value if out.finish_reason else None,
            "prompt_tokens": out.prompt_tokens, "completion_tokens": out.completion_tokens,
            "cached_tokens": out.cached_tokens}


# ---- metrics ---------------------------------------------------------------------------------


def _observe_latency(metrics: Any, last: list[float | None], i: int, out: RequestOutput, started: float) -> None:
    if not out.new_token_ids:
        return
    now = time.perf_counter()
    if last[i] is None:
        metrics.ttft.observe(now - started)
    else:
        metrics.itl.observe(now - last[i])
    last[i] = now


def _record(request: Request, endpoint: str, status: int, results: list[ChoiceResult], started: float) -> None:
    metrics = request.app.state.metrics
    metrics.requests.labels(endpoint=endpoint, status=str(status)).inc()
    if results and status == 200:
        metrics.prompt_tokens.inc(results[0].prompt_tokens)
        metrics.cached_tokens.inc(results[0].cached_tokens)
        metrics.generation_tokens.inc(sum(len(r.token_ids) for r in results))
        metrics.e2e.observe(time.perf_counter() - started)
