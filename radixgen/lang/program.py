"""``@function`` programs and how they run: once, streamed, or as a batch."""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from radixgen.lang.backends import Backend
from radixgen.lang.state import ProgramError, ProgramState

_default_backend: Backend | None = None


def set_default_backend(backend: Backend | None) -> None:
    """The backend programs use when ``run`` is not given one."""
    global _default_backend
    _default_backend = backend


def _backend(backend: Backend | None) -> Backend:
    chosen = backend or _default_backend
    if chosen is None:
        raise ValueError("no backend: pass backend=Runtime() or Endpoint(url), or call set_default_backend")
    return chosen


class Program:
    def __init__(self, fn: Callable[..., Any]) -> None:
        self.fn = fn
        self.name = fn.__name__
        functools.update_wrapper(self, fn)

    def run(self, *args: Any, backend: Backend | None = None, seed: int | None = None, stream: bool = False,
            **kwargs: Any) -> ProgramState:
        """Run the program and return its state. Keywords the function does not take but
        SamplingParams has (``temperature``, ``max_new_tokens``...) become defaults of its gens.
        ``seed`` makes every generation reproducible (each gets a seed drawn from it in order).
        ``stream=True`` returns at once; read ``state.text_iter()``."""
        args_of_fn, defaults = self._split_kwargs(kwargs)
        state = ProgramState(_backend(backend), seed=seed, defaults=defaults, stream=stream, name=self.name)
        if stream:
            threading.Thread(target=self._run_streamed, args=(state, args, args_of_fn), daemon=True,
                             name=f"radixgen-{self.name}").start()
            return state
        self.fn(state, *args, **args_of_fn)
        state.sync()
        return state

    def _run_streamed(self, state: ProgramState, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        try:
            self.fn(state, *args, **kwargs)
        except BaseException as e:  # noqa: BLE001 - handed to the reader of the stream
            state.fail_stream(ProgramError(f"{self.name} raised {type(e).__name__}: {e}"))
            return
        state.close_stream()

    def run_batch(self, batch: Sequence[dict[str, Any]], *, backend: Backend | None = None,
                  seed: int | None = None, num_threads: int | None = None, progress_bar: bool = False,
                  **defaults: Any) -> list[ProgramState]:
        """Run the program once per dict of arguments, concurrently (the engine batches their
        requests); states come back in order. Item i uses seed ``seed + i`` when a seed is given."""
        chosen = _backend(backend)
        items = list(batch)
        if not items:
            return []

        def run_one(i: int) -> ProgramState:
            try:
                return self.run(backend=chosen, seed=None if seed is None else seed + i, **defaults, **items[i])
            except ProgramError as e:
                raise ProgramError(f"run_batch item {i}: {e}") from e

        workers = num_threads or min(64, len(items))
        with ThreadPoolExecutor(workers, thread_name_prefix=f"radixgen-{self.name}") as pool:
            futures = [pool.submit(run_one, i) for i in range(len(items))]
            if progress_bar:
                from concurrent.futures import as_completed

                from tqdm.auto import tqdm

                for _ in tqdm(as_completed(futures), total=len(futures), desc=self.name):
                    pass
            return [f.result() for f in futures]

    def _split_kwargs(self, kwargs: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
        import inspect

        from radixgen.engine.params import SamplingParams

        accepted = inspect.signature(self.fn).parameters
        takes_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in accepted.values())
        sampling_fields = set(SamplingParams.__dataclass_fields__) - {"constraint"}
        mine, defaults = {}, {}
        for key, value in kwargs.items():
            if key in accepted or takes_any or key not in sampling_fields:
                mine[key] = value
            else:
                defaults[key] = value
        return mine, defaults

    def __call__(self, *args: Any, **kwargs: Any) -> ProgramState:
        return self.run(*args, **kwargs)


def function(fn: Callable[..., Any]) -> Program:
    """Make ``fn(s, ...)`` a program: ``fn.run(...)``, ``fn.run_batch([...])``."""
    return Program(fn)
