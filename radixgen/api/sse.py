"""Server-sent events for every streaming route: framing, the one response helper
(``stream_response``: a failure after the first byte reported in-band, a client that left counted
as 499, the request recorded in the metrics), and per-token log-probabilities."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncGenerator, Callable
from typing import Any

from fastapi import Request
from fastapi.responses import StreamingResponse

from radixgen.api.jobs import ChoiceResult
from radixgen.api.protocol import ChoiceLogprobs, TokenLogprob, TopLogprob
from radixgen.errors import EngineDeadError


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
        request.app.state.metrics.record(endpoint, status, results, started)


def stream_failure(e: Exception) -> tuple[int, str]:
    """The HTTP status and OpenAI error type of an exception raised mid-stream, where the
    status line has been sent and the error can only be reported in-band."""
    if isinstance(e, ValueError):
        return 400, "invalid_request_error"
    if isinstance(e, EngineDeadError):
        return 503, "service_unavailable"
    return 500, "server_error"


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


def stream_response(request: Request, endpoint: str, results: list[ChoiceResult], started: float,
                    body: AsyncGenerator[str, None],
                    error_event: Callable[[int, str, str], str] = _openai_error_event) -> StreamingResponse:
    """A route's streaming response: ``body``'s frames inside ``recorded_stream``."""
    return StreamingResponse(recorded_stream(request, endpoint, results, started, body, error_event),
                             media_type="text/event-stream")
