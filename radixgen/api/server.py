"""FastAPI app: OpenAI-compatible routes over an engine in its own process.

``create_app(config)`` builds everything the app needs in its lifespan (engine client,
tokenizer, metrics) and keeps it on ``app.state``; there is no module-level mutable state.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import hmac
import logging
import os
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

from fastapi import APIRouter, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.datastructures import Headers
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Receive, Scope, Send

from radixgen.api.chat import ChatFormat
from radixgen.api.drain import Drain
from radixgen.api.metrics import ServerMetrics
from radixgen.api.protocol import ErrorBody, ErrorResponse, ModelCard, ModelList
from radixgen.api.routes_chat import router as chat_router
from radixgen.api.routes_completions import router as completions_router
from radixgen.api.routes_responses import ConversationStore
from radixgen.api.routes_responses import router as responses_router
from radixgen.api.sse import TokenBytes
from radixgen.api.tool_decision import CallScorer
from radixgen.config import ServerConfig
from radixgen.errors import EngineDeadError, OverloadedError, RadixgenError
from radixgen.ipc.client import EngineClient
from radixgen.ipc.handle import EngineHandle
from radixgen.models.loader import DEFAULT_MODEL_NAME, is_hub_id, load_tokenizer

logger = logging.getLogger(__name__)


def error_response(status: int, message: str, *, kind: str = "invalid_request_error", param: str | None = None,
                   headers: dict[str, str] | None = None) -> JSONResponse:
    body = ErrorResponse(error=ErrorBody(message=message, type=kind, param=param, code=status))
    return JSONResponse(body.model_dump(), status_code=status, headers=headers)


class RequestGuard:
    """The API key, the declared body size and a drain in progress, checked before routing; the
    requests let through are counted while they run (the drain waits for them). A plain ASGI
    middleware: starlette's BaseHTTPMiddleware relays every streamed chunk through a memory
    stream and a task, which cost the front more than the rest of a token's path
    (benchmarks/bench_front.py)."""

    def __init__(self, app: ASGIApp, *, api_key: str | None, max_request_bytes: int, drain: Drain) -> None:
        self.app, self.api_key, self.max_request_bytes, self.drain = app, api_key, max_request_bytes, drain

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            headers = Headers(scope=scope)
            refusal = None
            if self.drain.draining and scope["path"] != "/metrics":
                refusal = error_response(503, "the server is shutting down; send the request to another instance "
                                              "or retry once it is back", kind="service_unavailable",
                                         headers={"Retry-After": "5"})
            elif self.api_key and scope["path"] != "/health":
                given = headers.get("authorization", "")
                if not hmac.compare_digest(given.encode(), f"Bearer {self.api_key}".encode()):
                    refusal = error_response(401, "missing or wrong API key: send 'Authorization: Bearer <key>'",
                                             kind="authentication_error")
            declared = headers.get("content-length")
            if refusal is None and declared is not None and declared.isdigit() and int(declared) > self.max_request_bytes:
                refusal = error_response(413, f"request body is {declared} bytes; the limit (max_request_bytes) is "
                                              f"{self.max_request_bytes}", kind="invalid_request_error")
            if refusal is not None:
                await refusal(scope, receive, send)
                return
            with self.drain.request():
                await self.app(scope, receive, send)
            return
        await self.app(scope, receive, send)


def served_name(config: ServerConfig) -> str:
    """What /v1/models calls the loaded model: --served-model-name, else a hub id as given
    (``Qwen/Qwen3-0.6B``, as vLLM and SGLang call it), else its folder's or GGUF file's name."""
    if config.served_model_name:
        return config.served_model_name
    if config.model is None:
        return DEFAULT_MODEL_NAME
    if is_hub_id(config.model):
        return config.model
    name = Path(config.model).name
    return name.removesuffix(".gguf") or config.model


def status_of(exc: Exception) -> int:
    if isinstance(exc, OverloadedError):
        return 429
    if isinstance(exc, EngineDeadError):
        return 503
    return 400


def _import_tokenizer_stack() -> None:
    """transformers' tokenizer loading, imported while the engine process starts: every model
    configuration class imports transformers' type validators, which pull in torch.distributed,
    and that ran after the engine was ready before."""
    from transformers import AutoTokenizer  # noqa: F401

    with contextlib.suppress(ImportError):  # an internal module: warming it is optional
        import transformers.utils.type_validators  # noqa: F401


def create_app(config: ServerConfig, *, client: EngineHandle | None = None) -> FastAPI:
    app = FastAPI(title="radixgen", version="0.1.0", lifespan=_lifespan(config, client))
    app.include_router(chat_router)
    app.include_router(completions_router)
    app.include_router(responses_router)
    app.include_router(service_router)

    api_key = config.api_key or os.environ.get("RADIXGEN_API_KEY") or None

    app.state.drain = Drain(config.shutdown_timeout)
    app.add_middleware(RequestGuard, api_key=api_key, max_request_bytes=config.max_request_bytes,
                       drain=app.state.drain)

    _install_error_handlers(app)
    return app


def _lifespan(config: ServerConfig, client: EngineHandle | None) -> Callable[[FastAPI], Any]:
    """Start the engine (or attach to it) and the tokenizer-side state before serving; stop it after."""

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        engine: EngineHandle = client or EngineClient(config, restarts=config.engine_restarts,
                                                         attach=config.engine_address)
        warm = asyncio.create_task(asyncio.to_thread(_import_tokenizer_stack))
        await engine.start()
        await warm
        app.state.client = engine
        app.state.tokenizer = load_tokenizer(Path(engine.info["model_path"]))  # the class the engine reads
        if isinstance(engine, EngineClient):  # plain requests' text is made here, off the engine loop
            engine.tokenizer = app.state.tokenizer
        app.state.config = config
        if config.engine_address is not None:  # the model is the attached engine's, not a flag of ours
            app.state.config = dataclasses.replace(config, model=engine.info.get("model"))
        app.state.model_name = served_name(app.state.config)
        app.state.responses = ConversationStore()
        app.state.token_bytes = TokenBytes(app.state.tokenizer)
        app.state.chat_format = ChatFormat.of(app.state.tokenizer)
        app.state.call_scorer = CallScorer(engine, app.state.tokenizer, app.state.chat_format)
        app.state.metrics = ServerMetrics()
        app.state.metrics.set_kernels(engine.info.get("kernels") or {})
        app.state.metrics.set_weights(engine.info.get("weights"))
        logger.info("serving %s on http://%s:%d", app.state.model_name, config.host, config.port)
        try:
            yield
        finally:
            await engine.shutdown()

    return lifespan


def _install_error_handlers(app: FastAPI) -> None:
    """Every error answers in OpenAI's error shape."""

    @app.exception_handler(RadixgenError)
    async def on_radixgen_error(request: Request, exc: RadixgenError) -> JSONResponse:
        status = status_of(exc)
        headers = {"Retry-After": "1"} if status in (429, 503) else None
        kind = {429: "rate_limit_error", 503: "service_unavailable"}.get(status, "invalid_request_error")
        return error_response(status, str(exc), kind=kind, headers=headers)

    @app.exception_handler(ValueError)
    async def on_value_error(request: Request, exc: ValueError) -> JSONResponse:
        return error_response(400, str(exc))

    @app.exception_handler(RequestValidationError)
    async def on_validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        errors = exc.errors()
        first = errors[0] if errors else {}
        where = ".".join(str(p) for p in first.get("loc", ()) if p != "body")
        if first.get("type") == "json_invalid":
            return error_response(400, f"the request body is not valid JSON: {first.get('msg', '')}")
        if first.get("type") == "extra_forbidden":
            return error_response(400, f"field {where!r} is not supported by this server; remove it", param=where)
        return error_response(400, f"{where or 'body'}: {first.get('msg', 'invalid value')}", param=where or None)

    @app.exception_handler(Exception)
    async def on_internal_error(request: Request, exc: Exception) -> JSONResponse:
        logger.exception("internal error on %s", request.url.path)
        return error_response(500, f"internal error: {type(exc).__name__}: {exc}", kind="server_error")

    @app.exception_handler(StarletteHTTPException)
    async def on_http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return error_response(exc.status_code, str(exc.detail), kind=kind)


service_router = APIRouter()
"""Health, the model list, metrics and the engine's counters."""


@service_router.get("/health")
async def health(request: Request) -> JSONResponse:
    engine: EngineHandle = request.app.state.client
    if not engine.is_healthy:
        return error_response(503, f"engine unavailable: {engine.dead_reason}", kind="service_unavailable")
    return JSONResponse({"status": "ok", "in_flight": engine.num_in_flight})


@service_router.get("/v1/models")
async def models(request: Request) -> ModelList:
    engine: EngineHandle = request.app.state.client
    return ModelList(data=[ModelCard(id=request.app.state.model_name, max_model_len=engine.info.get("max_context_len"))])


@service_router.get("/metrics")
async def metrics(request: Request) -> Response:
    engine: EngineHandle = request.app.state.client
    stats: dict[str, Any] | None = None
    if engine.is_healthy:
        try:
            stats = await engine.stats()
        except (EngineDeadError, TimeoutError):
            stats = None
    body = request.app.state.metrics.render(stats)
    return Response(body, media_type="text/plain; version=0.0.4")


@service_router.get("/internal/stats")
async def internal_stats(request: Request) -> JSONResponse:
    """KV accounting and scheduler counters (for tests and debugging)."""
    client: EngineHandle = request.app.state.client
    return JSONResponse({**await client.stats(), "engine_pid": client.engine_pid})
