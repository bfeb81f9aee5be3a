"""A program's state ``s``: its text, captured variables and chat messages.

``s += ...`` does not wait: each state runs its steps in order on a worker thread of its own, so
the branches of ``s.fork(n)`` and the programs of ``run_batch`` generate at the same time and the
engine batches them. Reading (``s["x"]``, ``s.text()``) waits for the steps before it.
"""

from __future__ import annotations

import collections
import contextlib
import json
import queue
import random
import threading
from collections.abc import Iterator
from typing import Any

from radixgen.constraints.partial import PartialJson
from radixgen.lang.backends import Backend
from radixgen.lang.ir import Concat, Expr, Gen, RoleBegin, RoleEnd, Select
from radixgen.templates import ROLES

_END = object()


class ProgramError(RuntimeError):
    """A step of a program failed; the message names the step."""


class ProgramState:
    def __init__(self, backend: Backend, *, seed: int | None = None, defaults: dict[str, Any] | None = None,
                 stream: bool = False, name: str = "program") -> None:
        self.backend = backend
        self._name = name
        self._defaults = dict(defaults or {})
        self._seeds = random.Random(seed) if seed is not None else None
        self._text = ""
        self._vars: dict[str, Any] = {}
        self._meta: dict[str, dict[str, Any]] = {}
        self._messages: list[dict[str, str]] = []
        self._open_role: tuple[str, int] | None = None
        # steps wait here; a worker thread runs them and exits when none are left
        self._pending: collections.deque[tuple[int, str | Expr]] = collections.deque()
        self._lock = threading.Lock()
        self._idle = threading.Event()
        self._idle.set()
        self._working = False
        self._num_steps = 0
        self._error: BaseException | None = None
        self._stream: queue.SimpleQueue[Any] | None = queue.SimpleQueue() if stream else None
        self._partials: dict[str, queue.SimpleQueue[Any]] = {}  # a JSON gen's name -> its partial values
        self._closed = False

    # ---- writing ------------------------------------------------------------------------

    def __iadd__(self, item: Any) -> ProgramState:
        if not isinstance(item, (str, Expr)):
            raise TypeError(f"cannot append {type(item).__name__} to a program; use str, gen() or select()")
        with self._lock:
            self._num_steps += 1
            self._pending.append((self._num_steps, item))
            self._idle.clear()
            if not self._working:
                self._working = True
                threading.Thread(target=self._work, name=f"radixgen-{self._name}", daemon=True).start()
        return self

    @contextlib.contextmanager
    def _role(self, role: str) -> Iterator[None]:
        self += RoleBegin(role)
        yield
        self += RoleEnd(role)

    def system(self) -> contextlib.AbstractContextManager[None]:
        return self._role("system")

    def user(self) -> contextlib.AbstractContextManager[None]:
        return self._role("user")

    def assistant(self) -> contextlib.AbstractContextManager[None]:
        return self._role("assistant")

    def tool(self) -> contextlib.AbstractContextManager[None]:
        """A tool's result, as the chat template shows role ``tool``."""
        return self._role("tool")

    def fork(self, n: int) -> list[ProgramState]:
        """``n`` copies of this state that continue independently; their requests share the
        prefix so far in the radix cache."""
        if not isinstance(n, int) or n < 1:
            raise ValueError(f"fork needs a count >= 1, got {n!r}")
        self.sync()
        if n > 1:
            self.backend.cache_prefix(self._text)
        forks = []
        for i in range(n):
            seed = self._seeds.getrandbits(63) if self._seeds is not None else None
            child = ProgramState(self.backend, seed=seed, defaults=self._defaults, name=f"{self._name}.fork{i}")
            child._text, child._vars, child._meta = self._text, dict(self._vars), dict(self._meta)
            child._messages, child._open_role = list(self._messages), self._open_role
            forks.append(child)
        return forks

    # ---- reading ------------------------------------------------------------------------

    def sync(self) -> None:
        """Wait for every step so far; raise the first failure."""
        self._idle.wait()
        if self._error is not None:
            raise self._error

    def __getitem__(self, name: str) -> Any:
        self.sync()
        if name not in self._vars:
            raise KeyError(f"no variable {name!r} in this program; it has {sorted(self._vars)}")
        return self._vars[name]

    def get(self, name: str, default: Any = None) -> Any:
        self.sync()
        return self._vars.get(name, default)

    def __contains__(self, name: str) -> bool:
        self.sync()
        return name in self._vars

    def text(self) -> str:
        self.sync()
        return self._text

    def messages(self) -> list[dict[str, str]]:
        """The closed role blocks so far as chat messages."""
        self.sync()
        return [dict(m) for m in self._messages]

    def meta(self, name: str) -> dict[str, Any]:
        """What the backend reported for generation ``name`` (tokens, cached tokens, finish
        reason) or, for a select, the score of every choice."""
        self.sync()
        return self._meta[name]

    def constraint(self, name: str) -> dict[str, Any] | None:
        """What the constraint did to generation ``name`` (how it ended, whether it is valid,
        what was forced, drafted, rolled back, steered or searched), or None when it had none."""
        return self.meta(name).get("constraint")

    def text_iter(self) -> Iterator[str]:
        """With ``run(..., stream=True)``: the text as it is appended, generations token by token."""
        if self._stream is None:
            raise ValueError("text_iter needs a state from run(..., stream=True)")
        while True:
            chunk = self._stream.get()
            if chunk is _END:
                break
            yield chunk
        if self._error is not None:
            raise self._error

    def partials(self, name: str) -> Iterator[Any]:
        """With ``run(..., stream=True)``: the JSON value of generation ``name`` as it grows,
        complete values only (each contains the one before; the last is the whole value)."""
        if self._stream is None:
            raise ValueError("partials needs a state from run(..., stream=True)")
        values = self._partial_queue(name)
        while True:
            value = values.get()
            if value is _END:
                break
            yield value
        if self._error is not None:
            raise self._error

    def _partial_queue(self, name: str) -> queue.SimpleQueue[Any]:
        with self._lock:
            values = self._partials.get(name)
            if values is None:
                values = self._partials[name] = queue.SimpleQueue()
                if self._closed:  # the program is over: no such generation will come
                    values.put(_END)
            return values

    def close_stream(self) -> None:
        """The program's function returned: end ``text_iter`` after the last step."""
        if self._stream is not None:
            self._idle.wait()
            self._stream.put(_END)
            self._end_partials()

    def fail_stream(self, error: BaseException) -> None:
        self._error = self._error or error
        if self._stream is not None:
            self._stream.put(_END)
            self._end_partials()

    def _end_partials(self) -> None:
        with self._lock:
            self._closed = True
            for values in self._partials.values():
                values.put(_END)

    def __repr__(self) -> str:
        return f"ProgramState({self._name}, {len(self._text)} chars, vars={sorted(self._vars)})"

    # ---- running ------------------------------------------------------------------------

    def _work(self) -> None:
        while True:
            with self._lock:
                if not self._pending:
                    self._working = False
                    self._idle.set()
                    return
                number, item = self._pending.popleft()
            if self._error is not None:  # after a failure, later steps are skipped
                continue
            try:
                self._execute(item)
            except Exception as e:  # noqa: BLE001 - reported to the reader, with the step
                what = "text" if isinstance(item, str) else item.describe()
                self._error = ProgramError(f"{self._name}: step {number} ({what}) failed: {type(e).__name__}: {e}")
                self._error.__cause__ = e

    def _append(self, text: str) -> None:
        self._text += text
        if self._stream is not None and text:
            self._stream.put(text)

    def _execute(self, item: str | Expr) -> None:
        if isinstance(item, str):
            self._append(item)
        elif isinstance(item, Concat):
            for part in item.parts:
                self._execute(part)
        elif isinstance(item, Gen):
            self._gen(item)
        elif isinstance(item, Select):
            self._select(item)
        elif isinstance(item, RoleBegin):
            self._begin_role(item.role)
        elif isinstance(item, RoleEnd):
            self._end_role(item.role)
        else:
            raise TypeError(f"unknown program step {item!r}")

    def _gen(self, item: Gen) -> None:
        params = {"max_new_tokens": 128, **self._defaults, **item.params}
        if "seed" not in params and self._seeds is not None:
            params["seed"] = self._seeds.getrandbits(63)
        on_text = self._append if self._stream else None
        partials = None
        if self._stream is not None and item.name is not None and params.get("json_schema") is not None:
            partials, values = PartialJson(), self._partial_queue(item.name)

            def on_text(text: str) -> None:
                self._append(text)
                value = partials.feed(text)
                if value is not None:
                    values.put(value)

        result = self.backend.generate(self._text, params, on_text=on_text)
        if partials is not None:
            last = partials.feed("", final=True)
            if last is not None:
                values.put(last)
            values.put(_END)
        if self._stream is None:
            self._text += result.text
        if params.get("json_schema") is not None and result.meta.get("finish_reason") == "length":
            # only with budget steering off (EngineConfig.budget_steering): otherwise the engine
            # closes the value in time, or refuses a max_tokens below the schema's shortest output
            raise ValueError(f"the JSON value was cut off at max_tokens={params['max_new_tokens']} before it was "
                             f"complete: raise max_tokens or bound the schema (maxLength, maxItems)")
        if item.name is not None:
            self._vars[item.name] = _parse(result.text, params.get("json_schema"))
            self._meta[item.name] = result.meta

    def _select(self, item: Select) -> None:
        results = self.backend.score_choices(self._text, item.choices)
        # normalised by length, so a long choice is not penalised for its number of tokens
        scores = [sum(r.prompt_logprobs or ()) / max(len(r.prompt_logprobs or ()), 1) for r in results]
        best = max(range(len(scores)), key=scores.__getitem__)
        self._append(item.choices[best])
        if item.name is not None:
            self._vars[item.name] = item.choices[best]
            self._meta[item.name] = {
                "scores": dict(zip(item.choices, scores, strict=True)),
                "cached_tokens": dict(zip(item.choices, (r.meta.get("cached_tokens", 0) for r in results), strict=True)),
            }

    def _begin_role(self, role: str) -> None:
        if role not in ROLES:
            raise ValueError(f"unknown role {role!r}; use one of {ROLES}")
        if self._open_role is not None:
            raise ValueError(f"a {role} block opened inside the {self._open_role[0]} block; close it first")
        markers = self.backend.markers
        self._append(markers.first_prefix[role] if not self._text else markers.prefix[role])
        self._open_role = (role, len(self._text))

    def _end_role(self, role: str) -> None:
        assert self._open_role is not None and self._open_role[0] == role
        self._messages.append({"role": role, "content": self._text[self._open_role[1]:]})
        self._open_role = None
        self._append(self.backend.markers.suffix[role])


def _parse(text: str, schema: Any) -> Any:
    """A JSON-schema generation's value: the pydantic model or the parsed JSON."""
    if schema is None:
        return text
    if isinstance(schema, type) and hasattr(schema, "model_validate_json"):
        return schema.model_validate_json(text)
    return json.loads(text)
