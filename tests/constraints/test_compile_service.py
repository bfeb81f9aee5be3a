"""The compile service's timeout: it bounds a compile, not the wait behind other compiles."""

from __future__ import annotations

import threading
import time
from typing import Any

from radixgen.constraints import GrammarService
from radixgen.constraints.backend import Grammar, GrammarBackend, Matcher
from radixgen.constraints.spec import ConstraintSpec, regex_spec
from radixgen.errors import InvalidConstraintError


class _Compiled(Grammar):
    def matcher(self) -> Matcher:
        raise NotImplementedError


class SlowBackend(GrammarBackend):
    """Compiles in a fixed time per spec (longer for one marked slow)."""

    name = "slow"

    def __init__(self, seconds: float, slow: str = "", slow_seconds: float = 0.0) -> None:
        super().__init__(None, 0, [])
        self.seconds, self.slow, self.slow_seconds = seconds, slow, slow_seconds

    def compile(self, spec: ConstraintSpec) -> Grammar:
        time.sleep(self.slow_seconds if spec.value == self.slow else self.seconds)
        return _Compiled()


def compile_all(service: GrammarService, specs: list[ConstraintSpec]) -> list[tuple[Any, Any]]:
    results: list[tuple[Any, Any]] = [(None, None)] * len(specs)
    done = threading.Semaphore(0)

    def keep(i: int) -> Any:
        def callback(grammar: Grammar | None, error: Exception | None) -> None:
            results[i] = (grammar, error)
            done.release()
        return callback

    for i, spec in enumerate(specs):
        service.compile_async(spec, keep(i))
    for _ in specs:
        assert done.acquire(timeout=30)
    return results


def test_compiles_queued_behind_others_do_not_time_out() -> None:
    service = GrammarService(SlowBackend(0.2), timeout_s=0.5)
    results = compile_all(service, [regex_spec(f"[a-z]{{{n}}}") for n in range(1, 7)])  # 1.2 s of compiles in all
    assert all(grammar is not None and error is None for grammar, error in results), results
    service.shutdown()


def test_a_compile_that_takes_too_long_still_times_out() -> None:
    service = GrammarService(SlowBackend(0.05, slow="[0-9]+", slow_seconds=1.0), timeout_s=0.3)
    results = compile_all(service, [regex_spec("[a-z]+"), regex_spec("[0-9]+"), regex_spec("[A-Z]+")])
    assert results[0][0] is not None and results[2][0] is not None
    assert isinstance(results[1][1], InvalidConstraintError) and "took longer than" in str(results[1][1])
    # as the error says, the compile went on: once done, the same constraint is a cache hit
    deadline = time.monotonic() + 10
    while regex_spec("[0-9]+").key in service._inflight and time.monotonic() < deadline:
        time.sleep(0.05)
    hits = service.hits
    (grammar, error), = compile_all(service, [regex_spec("[0-9]+")])
    assert grammar is not None and error is None and service.hits == hits + 1
    service.shutdown()
