"""An idle engine gives its OpenMP team back (engine/compute_threads.py): the team's workers
leave the process, and the engine's loop releases it once it has nothing to run, not while it
steps."""

from __future__ import annotations

import os
import sys
import threading
import time
from collections.abc import Callable

import pytest
import torch

from radixgen import Engine, SamplingParams
from radixgen.engine import compute_threads
from radixgen.engine import step as step_module


def _thread_count() -> int:
    return len(os.listdir("/proc/self/task"))


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="counts threads through /proc")
def test_releasing_a_threads_team_ends_its_workers() -> None:
    counts: dict[str, int] = {}
    released: list[bool] = []
    threads_before = torch.get_num_threads()

    def run_a_region_then_release() -> None:
        torch.set_num_threads(3)  # two workers beside this thread, whatever the cores
        a = torch.randn(512, 512)
        (a @ a).sum()
        counts["with team"] = _thread_count()
        released.append(compute_threads.release_idle_team())
        counts["released"] = _thread_count()

    try:
        worker = threading.Thread(target=run_a_region_then_release)
        worker.start()
        worker.join()
    finally:
        torch.set_num_threads(threads_before)
    assert released == [True], "torch's OpenMP runtime was not found or refused the release"
    assert counts["with team"] - counts["released"] == 2, counts


@pytest.mark.parametrize("overlap", [False, True])
def test_an_engine_releases_its_teams_when_it_goes_idle(make_engine: Callable[..., Engine],
                                                        monkeypatch: pytest.MonkeyPatch, overlap: bool) -> None:
    """Released on every thread that runs the engine's steps: the loop thread, and with the
    overlapped loop its device worker too (that team, left alone, throttled a second engine)."""
    calls: list[tuple[str, bool]] = []
    holder: dict[str, Engine] = {}

    def recording_release() -> bool:
        engine = holder.get("engine")
        calls.append((threading.current_thread().name, engine is not None and engine.scheduler.has_work()))
        return True

    monkeypatch.setattr(step_module, "release_idle_team", recording_release)
    engine = holder["engine"] = make_engine(overlap=overlap)
    per_release = 2 if overlap else 1

    def wait_for_calls(count: int) -> None:
        deadline = time.monotonic() + 10
        while len(calls) < count and time.monotonic() < deadline:
            time.sleep(0.01)

    wait_for_calls(per_release)  # loading the model used the team
    assert len(calls) == per_release
    time.sleep(0.7)  # idle wake-ups of the loop release nothing more
    assert len(calls) == per_release
    out = engine.generate([[1, 2, 3]], SamplingParams(max_new_tokens=8, ignore_eos=True))[0]
    assert len(out.token_ids) == 8
    wait_for_calls(2 * per_release)
    assert len(calls) == 2 * per_release, "the teams were not released after the request"
    assert all(not busy for _, busy in calls), "released while the engine had work"
    threads = {name.split("_")[0] for name, _ in calls}
    assert threads == ({engine._thread.name, "radixgen-device"} if overlap else {engine._thread.name}), threads


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/maps")
def test_the_native_kernels_share_torchs_openmp_runtime() -> None:
    """Two runtimes would each keep a team of their own on the same cores (every step's regions
    spinning against each other): the extension must resolve to the runtime torch loaded."""
    from radixgen.kernels import cpu_kernels

    if cpu_kernels() is None:
        pytest.skip("the native kernels are not built here")
    with open("/proc/self/maps") as maps:
        runtimes = {line.split()[-1] for line in maps
                    if os.path.basename(line.split()[-1]).startswith(("libgomp", "libiomp", "libomp"))}
    assert len(runtimes) == 1, runtimes
