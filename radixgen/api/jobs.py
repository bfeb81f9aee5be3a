"""Running a route's engine requests: one or many to the end with disconnects and the shutdown
deadline watched (``run_jobs``), or their outputs merged as they come for a stream
(``merge_streams``); each choice's result gathered from its outputs (``ChoiceResult``)."""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from fastapi import Request

from radixgen.api.drain import Drain
from radixgen.api.protocol import PromptTokensDetails, Usage
from radixgen.constraints.report import ConstraintReport
from radixgen.engine.output import FinishReason, RequestOutput
from radixgen.engine.params import SamplingParams
from radixgen.errors import InvalidParamsError
from radixgen.ipc.handle import EngineHandle, OutputSink

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
    constraint: ConstraintReport | None = None


def usage(results: list[ChoiceResult], choices_per_prompt: int | None = None) -> Usage:
    """The token counts of an answer's choices, for every route: each prompt counted once (its
    ``choices_per_prompt`` choices come in a row and share it; None: all choices share one
    prompt), with its cached tokens as its best choice's."""
    per_prompt = choices_per_prompt or max(len(results), 1)
    groups = [results[i : i + per_prompt] for i in range(0, len(results), per_prompt)]
    prompt = sum(group[0].prompt_tokens for group in groups)
    cached = sum(max(r.cached_tokens for r in group) for group in groups)
    completion = sum(len(r.token_ids) for r in results)
    return Usage(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion,
                 prompt_tokens_details=PromptTokensDetails(cached_tokens=cached))


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
        result.constraint = out.constraint


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


Job = tuple[str, list[int], SamplingParams]  # (request id, prompt ids, params)


async def run_jobs(request: Request, client: EngineHandle, jobs: list[Job], endpoint: str,
                   started: float) -> list[ChoiceResult] | None:
    """Run non-streaming requests to the end; None when the client went away (all aborted)."""
    results = [ChoiceResult() for _ in jobs]
    tasks = [asyncio.create_task(consume(client, rid, ids, p, r)) for (rid, ids, p), r in zip(jobs, results, strict=True)]
    try:
        await until_done_or_gone(request, tasks)
    except ClientGone:
        request.app.state.metrics.record(endpoint, 499, results, started)
        return None
    request.app.state.metrics.record(endpoint, 200, results, started)
    return results


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
