"""What every OpenAI route shares: request fields -> engine types, running one or many engine
requests (with disconnect handling and stream merging), SSE framing, metrics recording."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import time
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

from fastapi import HTTPException, Request

from radixgen.api.drain import Drain
from radixgen.api.engine_handle import EngineHandle, OutputSink
from radixgen.api.protocol import (
    ChoiceLogprobs,
    PromptTokensDetails,
    SamplingFields,
    TokenLogprob,
    TopLogprob,
    Usage,
)
from radixgen.engine.request import FinishReason, RequestOutput, SamplingParams
from radixgen.errors import EngineDeadError, InvalidParamsError, PromptTooLongError

_KEEPALIVE_S = 10.0


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
    prompt_logprobs: list[float] | None = None
    shortened: bool = False
    constraint_warnings: list[str] | None = None


# ---- request -> engine types --------------------------------------------------------------


def check_model(req: SamplingFields, request: Request) -> None:
    """The model name and the request-size limits every route shares."""
    config = request.app.state.config
    if req.n > config.max_n:
        raise InvalidParamsError(f"n is {req.n}; the limit (max_n) is {config.max_n}")
    name = request.app.state.model_name
    if req.model is not None and req.model not in (name, "default", config.model):
        raise HTTPException(404, f"model {req.model!r} does not exist here; available: {name!r}")


def constraint_fields(req: Any) -> dict[str, Any]:
    """SamplingParams constraint keywords from response_format and the regex / choices extensions."""
    fields: dict[str, Any] = {}
    fmt = getattr(req, "response_format", None)
    if fmt is not None and fmt.type == "json_object":
        fields["json_object"] = True
    elif fmt is not None and fmt.type == "json_schema":
        spec = fmt.json_schema or {}
        schema = spec.get("schema")
        if schema is None:
            raise InvalidParamsError("response_format.json_schema.schema is required for type 'json_schema'")
        fields["json_schema"] = schema
    if getattr(req, "regex", None) is not None:
        fields["regex"] = req.regex
    if getattr(req, "choices", None) is not None:
        fields["choices"] = tuple(req.choices)
    if len(fields) > 1:
        raise InvalidParamsError(f"give at most one of response_format, regex and choices; got {', '.join(fields)}")
    return fields


def build_params(req: SamplingFields, prompt_len: int, engine_info: dict[str, Any], *, max_tokens: int | None,
                 logprobs: bool = False, top_logprobs: int = 0, seed_offset: int = 0,
                 constraint: dict[str, Any] | None = None) -> SamplingParams:
    max_context = engine_info["max_context_len"]
    room = max_context - prompt_len
    if room < 1:
        raise PromptTooLongError(f"the prompt has {prompt_len} tokens; the context holds {max_context} "
                                 f"(max_context_len): shorten it")
    if max_tokens is not None and max_tokens > room:
        raise PromptTooLongError(
            f"max_tokens is {max_tokens} but only {room} tokens fit after the {prompt_len}-token prompt "
            f"(context {max_context}, max_context_len): lower max_tokens or shorten the prompt"
        )
    cap = engine_info.get("max_new_tokens_limit")
    bias = None
    if req.logit_bias:
        try:
            bias = {int(token): value for token, value in req.logit_bias.items()}
        except ValueError:
            raise InvalidParamsError("logit_bias keys must be token ids (integers as strings), "
                                     f"got {sorted(req.logit_bias)[:3]}") from None
    # a field the request leaves out takes the model's generation_config value, then OpenAI's default
    model = engine_info.get("sampling_defaults") or {}
    return SamplingParams(
        max_new_tokens=max_tokens or (room if cap is None else min(room, cap)),
        temperature=model.get("temperature", 1.0) if req.temperature is None else req.temperature,
        top_p=model.get("top_p", 1.0) if req.top_p is None else req.top_p,
        top_k=int(model.get("top_k", -1)) if req.top_k is None else req.top_k,
        min_p=model.get("min_p", 0.0) if req.min_p is None else req.min_p,
        presence_penalty=req.presence_penalty or 0.0,
        frequency_penalty=req.frequency_penalty or 0.0,
        repetition_penalty=model.get("repetition_penalty", 1.0) if req.repetition_penalty is None
        else req.repetition_penalty,
        seed=None if req.seed is None else req.seed + seed_offset,
        stop=tuple([req.stop] if isinstance(req.stop, str) else req.stop or ()),
        stop_token_ids=tuple(req.stop_token_ids or ()),
        ignore_eos=req.ignore_eos,
        logit_bias=bias,
        min_new_tokens=req.min_tokens,
        speculative=req.speculative,
        logprobs=logprobs,
        top_logprobs=top_logprobs,
        **(constraint or {}),
    )


def usage(results: list[ChoiceResult]) -> Usage:
    prompt = results[0].prompt_tokens if results else 0
    completion = sum(len(r.token_ids) for r in results)
    cached = max((r.cached_tokens for r in results), default=0)
    return Usage(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion,
                 prompt_tokens_details=PromptTokensDetails(cached_tokens=cached))


# ---- running requests ---------------------------------------------------------------------


async def consume(client: EngineHandle, request_id: str, prompt_ids: list[int], params: SamplingParams,
                   result: ChoiceResult, on_delta: Any = None) -> ChoiceResult:
    stream = on_delta is not None or params.logprobs or bool(params.top_logprobs)
    async for out in client.generate(request_id, prompt_ids, params, stream=stream):
        apply(result, out, stream)
        if on_delta is not None:
            await on_delta(out)
    return result


def apply(result: ChoiceResult, out: RequestOutput, streamed: bool) -> None:
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
        result.prompt_logprobs = out.prompt_logprobs
        result.shortened = out.shortened
        result.constraint_warnings = out.constraint_warnings


async def client_gone(request: Request) -> None:
    """Return when the ASGI server says the client went away. The body has been read, so the
    next message is ``http.disconnect`` (sent at once when the connection drops, or when the
    response is complete); waiting on it sees a dropped client without polling."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def until_done_or_gone(request: Request, tasks: list[asyncio.Task[Any]]) -> list[Any]:
    """Wait for the tasks; if the client disconnects first, or the server's shutdown deadline
    passes, cancel them (aborting in the engine)."""
    watcher = asyncio.create_task(client_gone(request))
    deadline_passed: asyncio.Future[None] = asyncio.get_running_loop().create_future()
    pending: set[asyncio.Future[Any]] = set(tasks)
    drain: Drain = request.app.state.drain

    def pass_deadline() -> None:
        if not deadline_passed.done():
            deadline_passed.set_result(None)

    try:
        with drain.on_abort(pass_deadline):
            while pending:
                done, _ = await asyncio.wait(pending | {watcher, deadline_passed}, return_when=asyncio.FIRST_COMPLETED)
                pending -= done
                if (watcher in done or deadline_passed in done) and pending:
                    for t in pending:
                        t.cancel()
                    await asyncio.gather(*pending, return_exceptions=True)
                    if deadline_passed in done:
                        raise Drain.error()
                    raise ClientGone()
    finally:
        watcher.cancel()
    return [t.result() for t in tasks]


def _openai_error_event(status: int, kind: str, message: str) -> str:
    return sse({"error": {"message": message, "type": kind, "code": status}})


async def recorded_stream(request: Request, endpoint: str, results: list[ChoiceResult], started: float,
                          body: AsyncGenerator[str, None],
                          error_event: Callable[[int, str, str], str] = _openai_error_event) -> AsyncGenerator[str, None]:
    """A route's SSE body with what every stream needs around it: a failure after the first byte
    reported in-band (the status line has gone out), a client that went away counted as 499, the
    request recorded in the metrics either way."""
    status = 200
    try:
        async with contextlib.aclosing(body) as frames:  # a closed stream closes its body at once
            async for framed in frames:
                yield framed
    except asyncio.CancelledError:
        status = 499
        raise
    except Exception as e:  # noqa: BLE001 - after the first byte the status cannot change: report in-band
        status, kind = stream_failure(e)
        yield error_event(status, kind, str(e))
    finally:
        record(request, endpoint, status, results, started)


def stream_failure(e: Exception) -> tuple[int, str]:
    """The HTTP status and OpenAI error type of an exception raised mid-stream, where the
    status line has been sent and the error can only be reported in-band."""
    if isinstance(e, ValueError):
        return 400, "invalid_request_error"
    if isinstance(e, EngineDeadError):
        return 503, "service_unavailable"
    return 500, "server_error"


Job = tuple[str, list[int], SamplingParams]  # (request id, prompt ids, params)


async def run_jobs(request: Request, client: EngineHandle, jobs: list[Job], endpoint: str,
                   started: float) -> list[ChoiceResult] | None:
    """Run non-streaming requests to the end; None when the client went away (all aborted)."""
    results = [ChoiceResult() for _ in jobs]
    tasks = [asyncio.create_task(consume(client, rid, ids, p, r)) for (rid, ids, p), r in zip(jobs, results, strict=True)]
    try:
        await until_done_or_gone(request, tasks)
    except ClientGone:
        record(request, endpoint, 499, results, started)
        return None
    record(request, endpoint, 200, results, started)
    return results


class TokenBytes:
    """Each token's own bytes (xgrammar's decoded vocabulary: byte-level BPE and byte-fallback
    tokens read as the bytes they stand for). Decoding one token to text and encoding it again
    gave U+FFFD's bytes for a token holding part of a UTF-8 character. Built on first use (~1 s)."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self._vocab: list[bytes] | None = None

    def __call__(self, token_id: int) -> list[int]:
        if self._vocab is None:
            import xgrammar

            self._vocab = list(xgrammar.TokenizerInfo.from_huggingface(self.tokenizer).decoded_vocab)
        if 0 <= token_id < len(self._vocab):
            return list(self._vocab[token_id])
        return list(self.tokenizer.decode([token_id]).encode())


def token_logprobs(tokenizer: Any, result: ChoiceResult, with_top: bool, token_bytes: TokenBytes) -> ChoiceLogprobs:
    content = []
    for i, (tok, lp) in enumerate(zip(result.token_ids, result.logprobs, strict=False)):
        tops = []
        if with_top and i < len(result.top_logprobs):
            tops = [TopLogprob(token=tokenizer.decode([t]), logprob=v, bytes=token_bytes(t))
                    for t, v in result.top_logprobs[i]]
        content.append(TokenLogprob(token=tokenizer.decode([tok]), logprob=lp, bytes=token_bytes(tok), top_logprobs=tops))
    return ChoiceLogprobs(content=content)


def sse(payload: Any) -> str:
    data = payload if isinstance(payload, str) else json.dumps(payload, separators=(",", ":"))
    return f"data: {data}\n\n"


async def merge_streams(
    request: Request, jobs: list[tuple[str, list[int], SamplingParams]]
) -> AsyncIterator[tuple[int, RequestOutput] | None]:
    """Outputs of several requests as they come, tagged with their choice index; None = quiet.
    What arrived together goes out together: a choice's queued outputs become one (when the
    front falls behind the engine, an event costs far more than a token: bench_front.py). Past
    the server's shutdown deadline the stream ends with ``ShuttingDownError``; leaving early
    aborts the requests that have not finished."""
    client: EngineHandle = request.app.state.client
    sink = OutputSink()
    unfinished: dict[int, str] = {}
    try:
        for index, (rid, ids, params) in enumerate(jobs):
            await client.submit(rid, ids, params, sink, index)
            unfinished[index] = rid
        drain: Drain = request.app.state.drain
        with drain.on_abort(lambda: sink.put(-1, Drain.error())):
            while unfinished:
                batch = await sink.take(_KEEPALIVE_S)
                if batch is None:
                    yield None
                    continue
                pending: dict[int, RequestOutput] = {}
                for index, got in batch:
                    if isinstance(got, BaseException):
                        raise got
                    pending[index] = coalesce(pending[index], got) if index in pending else got
                    if got.finished:
                        unfinished.pop(index, None)
                for index, out in pending.items():
                    yield index, out
    finally:
        for rid in unfinished.values():
            await client.abort(rid)


def coalesce(earlier: RequestOutput, later: RequestOutput) -> RequestOutput:
    """Two consecutive outputs of one request as one (the later one's final fields)."""
    logprobs = None if earlier.new_logprobs is None and later.new_logprobs is None else (
        (earlier.new_logprobs or []) + (later.new_logprobs or []))
    tops = None if earlier.new_top_logprobs is None and later.new_top_logprobs is None else (
        (earlier.new_top_logprobs or []) + (later.new_top_logprobs or []))
    return dataclasses.replace(later, new_token_ids=earlier.new_token_ids + later.new_token_ids,
                               new_text=earlier.new_text + later.new_text, new_logprobs=logprobs,
                               new_top_logprobs=tops)


# ---- metrics ---------------------------------------------------------------------------------


def observe_latency(metrics: Any, last: list[float | None], i: int, out: RequestOutput, started: float) -> None:
    if not out.new_token_ids:
        return
    now = time.perf_counter()
    previous = last[i]
    if previous is None:
        metrics.ttft.observe(now - started)
    else:
        metrics.itl.observe(now - previous)
    last[i] = now


def record(request: Request, endpoint: str, status: int, results: list[ChoiceResult], started: float) -> None:
    metrics = request.app.state.metrics
    metrics.requests.labels(endpoint=endpoint, status=str(status)).inc()
    if results and status == 200:
        metrics.prompt_tokens.inc(results[0].prompt_tokens)
        metrics.cached_tokens.inc(results[0].cached_tokens)
        metrics.generation_tokens.inc(sum(len(r.token_ids) for r in results))
        metrics.e2e.observe(time.perf_counter() - started)

