"""Compile constraints off the scheduler loop: a worker thread, an LRU cache, a timeout."""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor

from radixgen.constraints.backend import Grammar, GrammarBackend
from radixgen.constraints.spec import ConstraintSpec
from radixgen.errors import InvalidConstraintError

logger = logging.getLogger(__name__)

CompileCallback = Callable[[Grammar | None, Exception | None], None]


class GrammarService:
    """Caches compiled grammars by (backend, spec) and compiles misses on one worker thread.

    ``compile_async`` calls back exactly once: with the grammar, with the compile error, or with
    a timeout error if the compile takes longer than ``timeout_s`` once the worker has begun it
    (the request is then failed; the compile finishes in the background and still lands in the
    cache). Time spent queued behind other compiles does not count.
    """

    def __init__(self, backend: GrammarBackend, *, cache_size: int = 256, timeout_s: float = 30.0) -> None:
        self.backend = backend
        self.cache_size = cache_size
        self.timeout_s = timeout_s
        self._cache: OrderedDict[tuple[str, str], Grammar] = OrderedDict()
        self._inflight: dict[tuple[str, str], Future[Grammar]] = {}
        self._started: set[tuple[str, str]] = set()  # in-flight compiles the worker has begun
        self._start_hooks: dict[tuple[str, str], list[Callable[[], None]]] = {}  # timers waiting for that
        self._lock = threading.Lock()
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="radixgen-grammar")
        self.hits = 0
        self.misses = 0

    def compile(self, spec: ConstraintSpec) -> Grammar:
        """Blocking compile (cached)."""
        return self._future(spec).result(timeout=self.timeout_s)

    def compile_async(self, spec: ConstraintSpec, callback: CompileCallback) -> None:
        with self._lock:
            grammar = self._cache.get(spec.key)
            if grammar is not None:
                self._cache.move_to_end(spec.key)
                self.hits += 1
        if grammar is not None:
            callback(grammar, None)
            return
        future = self._future(spec)
        once = threading.Lock()
        done = [False]

        def deliver(grammar: Grammar | None, error: Exception | None) -> None:
            with once:
                if done[0]:
                    return
                done[0] = True
            callback(grammar, error)

        def on_done(f: Future[Grammar]) -> None:
            timer.cancel()
            error = f.exception()
            deliver(None if error else f.result(), error if isinstance(error, Exception) or error is None
                    else RuntimeError(str(error)))

        kind = spec.kind.replace("_", " ")
        timer = threading.Timer(self.timeout_s, lambda: deliver(None, InvalidConstraintError(
            f"compiling the {kind} took longer than {self.timeout_s:.0f} s; it goes on in the background, and the "
            f"same {kind} sent again once it is done is served from the cache (or simplify it)")))
        timer.daemon = True
        # the timeout counts the compile itself, not the wait behind other schemas' compiles (128
        # new schemas at once timed out from the 40th on, refused although each compiles in < 1 s)
        with self._lock:
            waiting = not future.done() and spec.key not in self._started
            if waiting:
                self._start_hooks.setdefault(spec.key, []).append(timer.start)
        if not waiting:
            timer.start()
        future.add_done_callback(on_done)

    def _future(self, spec: ConstraintSpec) -> Future[Grammar]:
        with self._lock:
            if spec.key in self._cache:
                self.hits += 1
                f: Future[Grammar] = Future()
                f.set_result(self._cache[spec.key])
                return f
            pending = self._inflight.get(spec.key)
            if pending is not None:
                return pending
            self.misses += 1
            future = self._pool.submit(self._compile, spec)
            self._inflight[spec.key] = future
        future.add_done_callback(lambda f: self._store(spec, f))
        return future

    def _compile(self, spec: ConstraintSpec) -> Grammar:
        """On the worker: start the waiting requests' timeouts, then compile."""
        with self._lock:
            self._started.add(spec.key)
            hooks = self._start_hooks.pop(spec.key, [])
        for start in hooks:
            start()
        return self.backend.compile(spec)

    def _store(self, spec: ConstraintSpec, future: Future[Grammar]) -> None:
        with self._lock:
            self._inflight.pop(spec.key, None)
            self._started.discard(spec.key)
            self._start_hooks.pop(spec.key, None)
            if future.exception() is None:
                self._cache[spec.key] = future.result()
                while len(self._cache) > self.cache_size:
                    self._cache.popitem(last=False)

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
