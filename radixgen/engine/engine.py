"""Engine: the in-process front of the scheduler loop.

The loop runs in a background thread (each of its steps is ``step.StepPipeline``). Callers hand requests over through a queue that the loop
drains once per step; requests that arrive while others run join the batch at the next step.
Results come back through a per-request callback that the loop calls.
"""

from __future__ import annotations

import asyncio
import atexit
import itertools
import logging
import os
import queue
import random
import threading
import uuid
import weakref
from collections.abc import AsyncGenerator, Callable, Generator, Sequence
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from radixgen.config import EngineConfig
from radixgen.constraints import Grammar
from radixgen.constraints.partial import PartialJson
from radixgen.engine.constrained import ConstrainedDecoding
from radixgen.engine.inbox import AbortRequest, Admit, AdmitCompiled, InboxItem, RunOnLoop, Wake
from radixgen.engine.model_runner import ModelRunner
from radixgen.engine.output import FinishReason, GenerationOutput, RequestOutput, StepDeltas
from radixgen.engine.params import SamplingParams, context_room
from radixgen.engine.request import Request
from radixgen.engine.sampler import Sampler, SamplingBatchCache
from radixgen.engine.scheduler import Scheduler
from radixgen.engine.step import OverlapPipeline, StepPipeline
from radixgen.errors import (
    EngineDeadError,
    InvalidConstraintError,
    InvalidParamsError,
    OverloadedError,
    PromptTooLongError,
)
from radixgen.models import LoadedModel

logger = logging.getLogger(__name__)

Prompt = str | Sequence[int]


def _shutdown_at_exit(engine: weakref.ref[Engine]) -> Callable[[], None]:
    def shutdown() -> None:
        alive = engine()
        if alive is not None:
            alive.shutdown()

    return shutdown


@dataclass
class _Startup:
    """What the loop thread's start-up hands the constructor: the model it was given (or None:
    load it), then the runner and model it built, or why it failed."""

    loaded: LoadedModel | None
    runner: ModelRunner | None = None
    error: BaseException | None = None


@dataclass
class _Collector:
    """Keeps the final output of one non-streaming request (set on the loop thread)."""

    final: RequestOutput | None = None

    def __call__(self, out: RequestOutput) -> None:
        if out.finished:
            self.final = out

    def result(self, req: Request) -> GenerationOutput:
        assert self.final is not None
        params = req.params
        return GenerationOutput.of_final(self.final, list(req.output_logprobs) if params.logprobs else None,
                                         list(req.output_top_logprobs) if params.top_logprobs else None)


class Engine:
    """Load a model and serve generation requests with continuous batching.

    ``Engine(EngineConfig(...))`` or ``Engine(dtype="bfloat16")`` (keywords override fields).
    """

    def __init__(
        self, config: EngineConfig | None = None, *, loaded: LoadedModel | None = None,
        after_step: Callable[[], None] | None = None, **overrides: Any,
    ) -> None:
        """``after_step`` runs on the loop thread after every step (e.g. to ship a step's outputs
        to another process in one message)."""
        self.config = replace(config or EngineConfig(), **overrides)
        self._after_step = after_step
        self._thread = threading.Thread(target=self._loop, name="radixgen-engine", daemon=True)
        self._ready = threading.Event()
        self._started = threading.Event()
        # before the loop thread exists: a failing _init_front sets it, and the loop waits on it
        self._stopped = threading.Event()
        self._startup = _Startup(loaded)
        # The model is built and run on the loop thread only: a forward on a different thread
        # from the one that first ran torch's OpenMP work took ~50% longer here (60-67 ms vs
        # 40-44 ms per SmolLM2 decode step).
        self._thread.start()
        self._ready.wait()
        if self._startup.error is not None:
            raise self._startup.error
        assert self._startup.runner is not None and self._startup.loaded is not None
        self.runner, loaded = self._startup.runner, self._startup.loaded
        try:
            self._init_front(loaded)
        except BaseException:
            self._stopped.set()
            self._started.set()
            raise
        # An engine still running when the interpreter exits is shut down first: left to
        # finalisation, a native worker thread (the grammar compiler's) was destroyed still
        # joinable and the process aborted ('terminate called without an active exception').
        self._at_exit = _shutdown_at_exit(weakref.ref(self))
        atexit.register(self._at_exit)

    def _init_front(self, loaded: LoadedModel) -> None:
        self.tokenizer = loaded.tokenizer
        self.model_config = loaded.config
        self.model_path = loaded.path
        self.sampling_defaults = dict(loaded.sampling_defaults)
        pool = self.runner.pool
        self.constraints = ConstrainedDecoding(self.config, self.tokenizer, self.model_config.vocab_size,
                                               list(self.model_config.eos_token_ids))
        self.scheduler = Scheduler(self.config, pool, self.tokenizer, self.model_config.eos_token_ids,
                                   steering=self.constraints.steering, vocab_size=self.model_config.vocab_size)
        self.scheduler.planner.drafter.max_step_tokens = self.runner.full_precision_max_tokens
        self.sampler = Sampler(self.model_config.vocab_size, self.config.max_running_requests, self.runner.device)
        self._inbox: queue.SimpleQueue[InboxItem] = queue.SimpleQueue()
        self._rng = random.Random(self.config.seed)
        self._ids = itertools.count()
        self._dead_reason: str | None = None
        self._active_ids: set[str] = set()
        self.pipeline = (OverlapPipeline if self.config.use_overlap else StepPipeline)(self.scheduler, self.runner, self.sampler, self.constraints,
                                     SamplingBatchCache(self.model_config.vocab_size, self.runner.device,
                                                        self.scheduler.kv.row_params,
                                                        tuple(self.model_config.eos_token_ids),
                                                        self.scheduler.planner.decode_batch))
        self._aborted_while_compiling: set[str] = set()
        self._lock = threading.Lock()
        self._started.set()  # the loop may begin serving

    # ---- public API ---------------------------------------------------------------------

    def tokenize(self, prompt: Prompt) -> list[int]:
        if isinstance(prompt, str):
            return list(self.tokenizer.encode(prompt, add_special_tokens=False))
        ids = list(prompt)
        vocab = self.model_config.vocab_size
        if not all(isinstance(t, int) and 0 <= t < vocab for t in ids):
            raise InvalidParamsError(f"token ids must be integers in [0, {vocab})")
        return ids

    def apply_chat_template(self, messages: list[dict[str, Any]], **kwargs: Any) -> list[int]:
        """Token ids of a chat, ending with the assistant turn's opening."""
        text = self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, **kwargs)
        return self.tokenize(text)

    def add_request(
        self, prompt: Prompt, params: SamplingParams | None = None, *,
        request_id: str | None = None, on_output: Callable[[RequestOutput], None] | None = None,
        stream: bool = True, delta_sink: StepDeltas | None = None, detokenize: bool = True,
    ) -> Request:
        """Submit one request; ``on_output`` is called on the engine thread with each delta
        (``stream=True``) or only with the final output. With ``delta_sink``, the one-token deltas
        of its plain decode steps are appended there instead (``Request.delta_sink``). With
        ``detokenize=False`` the outputs carry no text unless the engine needs it
        (``SamplingParams.engine_needs_text``): the caller makes it from the token ids."""
        self._check_alive()
        params = params or SamplingParams()
        prompt_ids = self.tokenize(prompt)
        self._check_limits(prompt_ids, params)
        request_id = request_id or f"req-{next(self._ids)}-{uuid.uuid4().hex[:8]}"
        with self._lock:
            if len(self._active_ids) >= self.config.max_queued_requests:
                raise OverloadedError(
                    f"{len(self._active_ids)} requests are in flight (max_queued_requests="
                    f"{self.config.max_queued_requests}); retry later"
                )
            if request_id in self._active_ids:
                raise InvalidParamsError(f"request id {request_id!r} is already in use; ids must be unique")
            self._active_ids.add(request_id)
            seed = params.seed if params.seed is not None else self._rng.getrandbits(63)
        req = Request(
            request_id=request_id, prompt_ids=prompt_ids, params=params, rng_seed=seed,
            on_output=self._wrap_callback(on_output), stream=stream, delta_sink=delta_sink,
            detokenize=detokenize or params.engine_needs_text,
        )
        if params.prompt_logprob_start is not None:
            req.prompt_logprobs = np.full(len(prompt_ids) - params.prompt_logprob_start, np.nan, dtype=np.float32)
        if params.constraint is None:
            self._inbox.put(Admit(req))
        else:  # compile off the loop; the request joins when its grammar is ready
            self.constraints.grammars().compile_async(
                params.constraint, lambda grammar, error: self._inbox.put(AdmitCompiled(req, grammar, error))
            )
        return req

    def abort(self, request_id: str) -> None:
        self._inbox.put(AbortRequest(request_id))

    @property
    def num_active(self) -> int:
        """Requests submitted and not finished yet."""
        with self._lock:
            return len(self._active_ids)

    def abort_all(self) -> int:
        """Abort every request in flight; return how many there were."""
        with self._lock:
            active = list(self._active_ids)
        for request_id in active:
            self.abort(request_id)
        return len(active)

    def generate(
        self, prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
    ) -> Any:
        """Blocking generation. One prompt -> one GenerationOutput; a list -> a list, in order."""
        single = isinstance(prompts, str) or (
            isinstance(prompts, Sequence) and bool(prompts) and isinstance(prompts[0], int)
        )
        batch: list[Prompt] = [prompts] if single else list(prompts)  # type: ignore[list-item,arg-type]
        if isinstance(sampling_params, Sequence):
            params_list = list(sampling_params)
            if len(params_list) != len(batch):
                raise InvalidParamsError(
                    f"got {len(params_list)} sampling params for {len(batch)} prompts; pass one or one each"
                )
        else:
            params_list = [sampling_params or SamplingParams()] * len(batch)
        done = threading.Semaphore(0)
        collectors = []
        submitted: list[Request] = []
        try:
            for prompt, params in zip(batch, params_list, strict=True):
                collector = _Collector()

                def on_output(out: RequestOutput, c: _Collector = collector) -> None:
                    c(out)
                    if out.finished:
                        done.release()

                submitted.append(self.add_request(prompt, params, on_output=on_output, stream=False))
                collectors.append(collector)
            for _ in submitted:
                while not done.acquire(timeout=1.0):
                    self._check_alive()
        except BaseException:
            for req in submitted:
                self.abort(req.request_id)
            raise
        results = [c.result(r) for c, r in zip(collectors, submitted, strict=True)]
        return results[0] if single else results

    async def generate_stream(
        self, prompt: Prompt, params: SamplingParams | None = None, *, request_id: str | None = None,
        stream: bool = True, include_partial: bool = False,
    ) -> AsyncGenerator[RequestOutput, None]:
        """Yield deltas as they are produced (``stream=False``: only the final output); leaving
        the loop early aborts the request. Every asyncio caller of the engine streams this way.
        ``include_partial``: each delta in which a JSON value completed carries ``partial``, the
        answer so far as an object of its complete values."""
        partials = PartialJson() if include_partial else None
        loop = asyncio.get_running_loop()
        deltas: asyncio.Queue[RequestOutput] = asyncio.Queue()

        def push(out: RequestOutput) -> None:  # engine thread -> this event loop
            loop.call_soon_threadsafe(deltas.put_nowait, out)

        req = self.add_request(prompt, params, request_id=request_id, on_output=push, stream=stream)
        finished = False
        try:
            while not finished:
                try:
                    out = await asyncio.wait_for(deltas.get(), timeout=1.0)
                except asyncio.TimeoutError:
                    self._check_alive()
                    continue
                finished = out.finished
                if partials is not None:
                    out.partial = partials.feed(out.new_text, final=finished)
                yield out
        finally:
            if not finished:
                self.abort(req.request_id)

    def iter_outputs(self, prompt: Prompt, params: SamplingParams | None = None, *,
                     request_id: str | None = None, include_partial: bool = False,
                     ) -> Generator[RequestOutput, None, None]:
        """``generate_stream`` for a blocking caller (a thread): deltas as they are produced;
        closing the iterator early, or an exception in the caller's loop, aborts the request."""
        partials = PartialJson() if include_partial else None
        deltas: queue.SimpleQueue[RequestOutput] = queue.SimpleQueue()
        req = self.add_request(prompt, params, request_id=request_id, on_output=deltas.put)
        finished = False
        try:
            while not finished:
                try:
                    out = deltas.get(timeout=1.0)
                except queue.Empty:
                    self._check_alive()
                    continue
                finished = out.finished
                if partials is not None:
                    out.partial = partials.feed(out.new_text, final=finished)
                yield out
        finally:
            if not finished:
                self.abort(req.request_id)

    def shutdown(self) -> None:
        at_exit = getattr(self, "_at_exit", None)
        if at_exit is not None:
            atexit.unregister(at_exit)
        self.constraints.shutdown()
        self._stopped.set()
        self._inbox.put(Wake())
        self._thread.join(timeout=30)

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    # ---- introspection (tests, /metrics) ------------------------------------------------

    def run_on_loop(self, fn: Callable[[], Any], timeout: float = 30.0) -> Any:
        """Run ``fn`` on the engine thread between steps and return its result."""
        box: queue.Queue[tuple[bool, Any]] = queue.Queue()

        def call() -> None:
            try:
                box.put((True, fn()))
            except BaseException as e:  # noqa: BLE001 - handed back to the caller
                box.put((False, e))

        self._inbox.put(RunOnLoop(call))
        ok, value = box.get(timeout=timeout)
        if not ok:
            raise value
        return value

    def reset_prefix_cache(self) -> int:
        """Drop the radix tree's cached prefixes that no running request holds (what vLLM's
        ``LLM.reset_prefix_cache`` and SGLang's ``/flush_cache`` do); return the tokens dropped."""
        return self.run_on_loop(self.scheduler.kv.drop_unused_prefixes)

    def kv_accounting(self) -> dict[str, int]:
        """Slots free / held by requests / held by the tree / pool size, read on the engine thread."""
        return self.run_on_loop(self.kv_accounting_on_loop)

    def kv_accounting_on_loop(self) -> dict[str, int]:
        """The same, for callers already on the engine thread."""
        pool = self.scheduler.pool
        return {"free": pool.available(), "held_by_requests": self.scheduler.held_by_requests(),
                "held_by_tree": self.scheduler.tree.cached_tokens(), "pool_size": pool.num_slots,
                "active_requests": len(self.scheduler.requests)}

    def info(self) -> dict[str, Any]:
        """What a front (the server's engine client, a Ray replica's caller) needs to know."""
        pool = self.runner.pool
        return {"max_context_len": pool.max_context_len, "kv_slots": pool.num_slots,
                "vocab_size": self.model_config.vocab_size, "model_path": str(self.model_path),
                "max_new_tokens_limit": self.config.max_new_tokens_limit,
                "sampling_defaults": self.sampling_defaults, "architecture": self.model_config.architecture,
                "pid": os.getpid(), "model": self.config.model, "kernels": self.runner.kernels_in_use(),
                "weights": self.runner.weights}

    def stats_snapshot(self) -> dict[str, Any]:
        """KV accounting and scheduler counters, read consistently on the engine thread. The
        queue and running counts are read now, not from the last step: an engine that went idle
        after an abort takes no step that would record them."""
        def read() -> dict[str, Any]:
            planner = self.scheduler.planner
            now = {"queue_depth": len(planner.waiting), "running": len(planner.running)}
            return {**self.kv_accounting_on_loop(), **self.scheduler.stats.snapshot(), **now}

        return self.run_on_loop(read)

    @property
    def dead_reason(self) -> str | None:
        """Why the engine no longer serves requests (None while it does)."""
        if self._dead_reason is not None:
            return self._dead_reason
        return "shut down" if self._stopped.is_set() else None

    # ---- internals ----------------------------------------------------------------------

    def _check_alive(self) -> None:
        if self._dead_reason is not None or self._stopped.is_set():
            raise EngineDeadError(f"the engine is not running: {self._dead_reason or 'shut down'}")

    def _check_limits(self, prompt_ids: list[int], params: SamplingParams) -> None:
        if not prompt_ids:
            raise InvalidParamsError("the prompt is empty; give at least one token")
        cap = self.config.max_new_tokens_limit
        if cap is not None and params.max_new_tokens > cap:
            raise InvalidParamsError(f"max_new_tokens is {params.max_new_tokens}; the limit (max_new_tokens_limit) is {cap}")
        context_room(len(prompt_ids), self.runner.pool.max_context_len, params.max_new_tokens)
        spec = params.constraint
        if spec is not None and spec.kind in ("json_schema", "structural"):
            what = "json_schema" if spec.kind == "json_schema" else "the structural constraint (its schemas)"
            if len(spec.value) > self.config.max_schema_bytes:
                raise InvalidConstraintError(f"{what} is {len(spec.value)} bytes; the limit (max_schema_bytes) "
                                             f"is {self.config.max_schema_bytes}")
            if spec.depth > self.config.max_schema_depth:
                raise InvalidConstraintError(f"{what} nests {spec.depth} levels deep; the limit (max_schema_depth) "
                                             f"is {self.config.max_schema_depth}")
        vocab = self.model_config.vocab_size
        if params.logit_bias and max(params.logit_bias) >= vocab:
            raise InvalidParamsError(f"logit_bias names token {max(params.logit_bias)}; this model's token ids are "
                                     f"below {vocab}")
        start = params.prompt_logprob_start
        if start is not None and start > len(prompt_ids):
            raise InvalidParamsError(
                f"prompt_logprob_start is {start} but the prompt has only {len(prompt_ids)} tokens"
            )
        if len(prompt_ids) + 1 > self.runner.pool.num_slots:
            raise PromptTooLongError(
                f"prompt has {len(prompt_ids)} tokens but the KV pool holds {self.runner.pool.num_slots}"
            )

    def _wrap_callback(self, fn: Callable[[RequestOutput], None] | None) -> Callable[[RequestOutput], None]:
        def on_output(out: RequestOutput) -> None:
            if out.finished:
                with self._lock:
                    self._active_ids.discard(out.request_id)
            if fn is None:
                return
            try:
                fn(out)
            except Exception:  # a caller's callback must not take the loop down
                logger.exception("output callback of %s failed", out.request_id)

        return on_output

    def _drain_inbox(self, block: bool) -> None:
        try:
            item = self._inbox.get(timeout=0.5) if block else self._inbox.get_nowait()
        except queue.Empty:
            return
        while True:
            match item:
                case Admit(req):
                    self.scheduler.add_request(req)
                case AdmitCompiled(req, grammar, error):
                    self._add_compiled(req, grammar, error)
                case AbortRequest(request_id) if not self.scheduler.abort(request_id):
                    with self._lock:  # still compiling, or already gone (then nothing to remember)
                        compiling = request_id in self._active_ids
                    if compiling:
                        self._aborted_while_compiling.add(request_id)
                case RunOnLoop(call):
                    self.pipeline.settle()  # a call sees a step boundary, never a step in flight
                    call()
            try:
                item = self._inbox.get_nowait()
            except queue.Empty:
                return

    def _add_compiled(self, req: Request, grammar: Grammar | None, error: Exception | None) -> None:
        self.scheduler.add_request(req)
        if req.request_id in self._aborted_while_compiling:
            self._aborted_while_compiling.discard(req.request_id)
            self.scheduler.abort(req.request_id)
        elif error is not None or grammar is None:
            req.user_error = isinstance(error, ValueError)
            self.scheduler.stats.num_constraint_refusals += req.user_error
            self.scheduler.abort(req.request_id, FinishReason.ERROR, error=str(error))
        else:
            if grammar.not_enforced:  # attach keeps them in the request's constraint state
                logger.info("%s: the grammar does not enforce %s; validators check it",
                            req.request_id, "; ".join(grammar.not_enforced))
            try:
                self.constraints.attach(req, grammar, self.runner.pool.max_context_len)
            except ValueError as e:  # the request cannot be served as asked (its budget): say why
                req.user_error = True
                self.scheduler.stats.num_constraint_refusals += 1
                self.scheduler.abort(req.request_id, FinishReason.ERROR, error=str(e))

    def _loop(self) -> None:
        try:
            self._startup.runner, self._startup.loaded = ModelRunner.from_config(self.config, self._startup.loaded)
        except BaseException as e:  # reported by __init__
            self._startup.error = e
            self._ready.set()
            return
        self._ready.set()
        self._started.wait()
        if self._stopped.is_set():  # __init__ failed after the model was built
            return
        team_in_use = not self.config.is_cuda  # loading the model ran parallel regions here
        try:
            while not self._stopped.is_set():
                idle = not (self.scheduler.has_work() or self.pipeline.in_flight)
                if idle and team_in_use:
                    self.pipeline.release_compute_threads()
                    team_in_use = False
                self._drain_inbox(block=idle)
                if not self.config.is_cuda and (self.scheduler.has_work() or self.pipeline.in_flight):
                    team_in_use = True
                self.pipeline.run()
                if self._after_step is not None:
                    self._after_step()
        except BaseException as e:  # the loop itself broke: fail everything, refuse new work
            logger.exception("engine loop died")
            self._dead_reason = f"{type(e).__name__}: {e}"
        finally:
            self.pipeline.close()
            for request_id in list(self.scheduler.requests):
                self.scheduler.abort(request_id, FinishReason.ERROR, error=self._dead_reason or "engine shut down")
            if self._after_step is not None:
                self._after_step()
            self.scheduler.stats.close()
