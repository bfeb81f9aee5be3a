"""/v1/completions and the native routes the DSL's Endpoint backend talks to: /generate, /tokenize,
/model_info."""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncGenerator
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, StreamingResponse

from radixgen.api.jobs import ChoiceResult, apply, merge_streams, run_jobs, usage
from radixgen.api.params import build_params, check_model, constraint_fields, new_token_limit
from radixgen.api.protocol import (
    CompletionChoice,
    CompletionRequest,
    CompletionResponse,
    GenerateRequest,
    TokenizeRequest,
)
from radixgen.api.sse import sse, stream_response
from radixgen.engine.output import RequestOutput
from radixgen.engine.params import SamplingParams
from radixgen.errors import InvalidParamsError
from radixgen.ipc.handle import EngineHandle
from radixgen.templates import role_markers

router = APIRouter()


# ---- /v1/completions ----------------------------------------------------------------------


def _text_logprobs(tokenizer: Any, token_ids: list[int], logprobs: list[float],
                   top_logprobs: list[list[tuple[int, float]]]) -> dict[str, Any]:
    """The legacy completions logprobs object for some tokens."""
    return {"tokens": [tokenizer.decode([t]) for t in token_ids], "token_logprobs": logprobs,
            "top_logprobs": [{tokenizer.decode([t]): v for t, v in tops} for tops in top_logprobs] or None}


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
    check_model(req, request)
    constraint = constraint_fields(req)
    state = request.app.state
    client: EngineHandle = state.client
    prompts = await asyncio.to_thread(_completion_prompts, state.tokenizer, req.prompt)  # off the event loop
    top = req.logprobs or 0
    jobs = []
    base_id = f"cmpl-{uuid.uuid4().hex[:24]}"
    for p_index, ids in enumerate(prompts):
        for j in range(req.n):
            params = build_params(req, len(ids), client.info, max_tokens=req.max_tokens or 16,
                                  logprobs=req.logprobs is not None, top_logprobs=top, seed_offset=j,
                                  constraint=constraint)
            jobs.append((f"{base_id}-{p_index}-{j}", ids, params))
    model = state.model_name
    started = time.perf_counter()
    if req.stream:
        return _completion_stream(request, req, jobs, base_id, model, started)
    results = await run_jobs(request, client, jobs, "completions", started)
    if results is None:
        return JSONResponse({}, status_code=499)  # nobody is listening any more
    choices = []
    for i, ((_, ids, _), r) in enumerate(zip(jobs, results, strict=True)):
        text = (state.tokenizer.decode(ids) + r.text) if req.echo else r.text
        lp = None
        if req.logprobs is not None:
            lp = _text_logprobs(state.tokenizer, r.token_ids, r.logprobs, r.top_logprobs)
        choices.append(CompletionChoice(index=i, text=text, finish_reason=r.finish_reason, logprobs=lp,
                                        shortened=r.shortened or None, constraint_warnings=r.constraint_warnings,
                                        constraint=r.constraint))
    return CompletionResponse(id=base_id, model=model, choices=choices, usage=usage(results, req.n))


def _completion_stream(request: Request, req: CompletionRequest, jobs: list[tuple[str, list[int], SamplingParams]],
                       base_id: str, model: str, started: float) -> StreamingResponse:
    state = request.app.state
    created = int(time.time())
    results = [ChoiceResult() for _ in jobs]
    last_token_at: list[float | None] = [None] * len(jobs)
    # a text-only chunk is framed by hand: the JSON sse() gives, without encoding a dict per token
    text_chunk = ('data: {"id":' + json.dumps(base_id) + ',"object":"text_completion","created":' + str(created)
                  + ',"model":' + json.dumps(model) + ',"choices":[{"index":')

    async def body() -> AsyncGenerator[str, None]:
        async for item in merge_streams(request, jobs):
            if item is None:
                yield ": keep-alive\n\n"
                continue
            i, out = item
            apply(results[i], out, streamed=True)
            request.app.state.metrics.observe_latency(last_token_at, i, out, started)
            if not out.finished and req.logprobs is None:  # the path of almost every token
                if out.new_text:
                    yield f'{text_chunk}{i},"text":{json.dumps(out.new_text)},"finish_reason":null,"logprobs":null}}]}}\n\n'
                continue
            if out.new_text or out.finished:
                yield sse({"id": base_id, "object": "text_completion", "created": created, "model": model,
                            "choices": [{"index": i, "text": out.new_text,
                                         "finish_reason": results[i].finish_reason if out.finished else None,
                                         "logprobs": _text_logprobs(state.tokenizer, out.new_token_ids,
                                                                    out.new_logprobs or [], out.new_top_logprobs or [])
                                         if req.logprobs is not None and out.new_token_ids else None,
                                         **({"shortened": True} if out.finished and results[i].shortened else {}),
                                         **({"constraint_warnings": results[i].constraint_warnings}
                                            if out.finished and results[i].constraint_warnings else {}),
                                         **_report(results[i] if out.finished else None)}]})
        if req.stream_options is not None and req.stream_options.include_usage:
            yield sse({"id": base_id, "object": "text_completion", "created": created, "model": model, "choices": [],
                        "usage": usage(results, req.n).model_dump(exclude_none=True)})
        yield sse("[DONE]")

    return stream_response(request, "completions", results, started, body())


# ---- /generate (native) ---------------------------------------------------------------------


@router.post("/generate", response_model=None)
async def generate(req: GenerateRequest, request: Request) -> Any:
    state = request.app.state
    client: EngineHandle = state.client
    if (req.text is None) == (req.input_ids is None):
        raise InvalidParamsError("give exactly one of text and input_ids")
    ids = _completion_prompts(state.tokenizer, req.text if req.text is not None else req.input_ids)[0]
    sp = dict(req.sampling_params)
    # SGLang's native default: 128 new tokens when the request names none
    max_new = new_token_limit(len(ids), client.info, sp.pop("max_new_tokens", None), name="max_new_tokens",
                              default=128)
    try:
        params = SamplingParams(max_new_tokens=max_new, **sp)
    except TypeError as e:
        raise InvalidParamsError(f"sampling_params: {e}") from None
    rid = req.request_id or f"gen-{uuid.uuid4().hex[:24]}"
    started = time.perf_counter()
    if req.stream:
        return _generate_stream(request, rid, ids, params, started)
    results = await run_jobs(request, client, [(rid, ids, params)], "generate", started)
    if results is None:
        return JSONResponse({}, status_code=499)  # nobody is listening any more
    result = results[0]
    return {"text": result.text, "token_ids": result.token_ids,
            "meta": {"request_id": rid, "finish_reason": result.finish_reason, "prompt_tokens": len(ids),
                     "completion_tokens": len(result.token_ids), "cached_tokens": result.cached_tokens,
                     "logprobs": result.logprobs or None, "prompt_logprobs": result.prompt_logprobs,
                     "shortened": result.shortened,
                     "constraint": result.constraint.to_dict() if result.constraint is not None else None}}


def _generate_stream(request: Request, rid: str, ids: list[int], params: SamplingParams,
                     started: float) -> StreamingResponse:
    result = ChoiceResult()
    last_token_at: list[float | None] = [None]

    async def body() -> AsyncGenerator[str, None]:
        async for item in merge_streams(request, [(rid, ids, params)]):
            if item is None:
                yield ": keep-alive\n\n"
                continue
            _, out = item
            apply(result, out, streamed=True)
            request.app.state.metrics.observe_latency(last_token_at, 0, out, started)
            yield sse({"text": out.new_text, "token_ids": out.new_token_ids, "finished": out.finished,
                       "meta": _meta(out)})
        yield sse("[DONE]")

    return stream_response(request, "generate", [result], started, body())


@router.post("/tokenize")
async def tokenize(req: TokenizeRequest, request: Request) -> dict[str, Any]:
    encode = request.app.state.tokenizer.encode
    if isinstance(req.text, str):
        return {"tokens": list(encode(req.text, add_special_tokens=False))}
    return {"tokens": [list(encode(text, add_special_tokens=False)) for text in req.text]}


@router.get("/model_info")
async def model_info(request: Request) -> dict[str, Any]:
    """What the DSL's Endpoint needs: the context size and the chat template's role markers."""
    state = request.app.state
    try:  # cheap (three template renders) and only the DSL asks, once per Endpoint
        roles: dict[str, Any] | None = role_markers(state.tokenizer).to_json()
    except ValueError:  # a model without a chat template: no role blocks
        roles = None
    return {"model": state.model_name, "max_context_len": state.client.info["max_context_len"],
            "chat_roles": roles}


def _report(result: ChoiceResult | None) -> dict[str, Any]:
    """A finished choice's constraint report as its chunk's field (nothing when unconstrained)."""
    report = result.constraint if result is not None else None
    return {"constraint": report.to_dict()} if report is not None else {}


def _meta(out: RequestOutput) -> dict[str, Any]:
    return {"request_id": out.request_id, "finish_reason": out.finish_reason.value if out.finish_reason else None,
            "prompt_tokens": out.prompt_tokens, "completion_tokens": out.completion_tokens,
            "cached_tokens": out.cached_tokens, "prompt_logprobs": out.prompt_logprobs, "shortened": out.shortened,
            "constraint": out.constraint.to_dict() if out.constraint is not None else None}


