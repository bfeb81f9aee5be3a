"""An idle engine hands its OpenMP team back, so that it does not slow every other team down.

OpenMP gives each thread that opens a parallel region a team of worker threads of its own, kept
after the region. GNU OpenMP (torch's ``libgomp``) counts the workers of every team in the
process, and once they outnumber the cores a worker that finishes a region spins about a hundred
times instead of about 300,000 before it sleeps: each short region of a decode step then waits on
a futex wake-up. One engine's loop thread owns one team; a second engine in the same process
(a program holding two models, a benchmark alternating two set-ups, a user's own torch code on
another thread) tips the count over, and the busy engine's steps take up to twice as long while
the other one only sits there. Releasing the team of an engine that has gone idle restores the
count; the next step builds the team again (a thread start, once per busy spell).
"""

from __future__ import annotations

import ctypes
import logging
import os
from functools import cache
from typing import Any

logger = logging.getLogger(__name__)

_OMP_PAUSE_SOFT = 1  # omp_pause_resource_t's omp_pause_soft
_RUNTIMES = ("libgomp", "libiomp", "libomp")


@cache
def _pause_all() -> Any:
    """``omp_pause_resource_all`` of the OpenMP runtime this process has loaded (torch's own, or
    one preloaded in its place), or None where there is none to find or it predates OpenMP 5."""
    try:
        with open("/proc/self/maps") as maps:
            paths = {line.split()[-1] for line in maps if "/" in line}
    except OSError:  # not Linux: nothing to release
        return None
    for path in sorted(paths):
        if os.path.basename(path).startswith(_RUNTIMES) and ".so" in path:
            try:
                pause = ctypes.CDLL(path).omp_pause_resource_all  # already loaded: the same handle
            except (OSError, AttributeError):
                continue
            pause.argtypes, pause.restype = [ctypes.c_int], ctypes.c_int
            return pause
    return None


def release_idle_team() -> bool:
    """Free the calling thread's OpenMP team (call it between parallel regions only). Whether a
    runtime took the request."""
    pause = _pause_all()
    if pause is None:
        return False
    released = pause(_OMP_PAUSE_SOFT) == 0
    if not released:
        logger.debug("the OpenMP runtime kept this thread's team")
    return released
