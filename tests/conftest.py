"""Shared fixtures: the real tokenizer, tiny random-weight models, engines with a leak check.

Every engine made through ``make_engine`` (or the shared ones) is checked after each test: all
KV slots are free and no request is left active (DESIGN.md's pool invariant).
"""

from __future__ import annotations

import os
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

# Without a GPU the triton attention backend's kernels run in Triton's interpreter, which must be
# on before anything imports triton.language (xgrammar may).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

from radixgen import Engine, EngineConfig  # noqa: E402
from radixgen.engine import kv_pool  # noqa: E402

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

def _pin_xdist_worker() -> None:
    """Under ``pytest -n N`` each worker runs on a core of its own, as on a one-core machine
    (its servers and engines inherit that and size their threads to it): two workers' torch
    threads sharing both cores spin-wait against each other."""
    worker = os.environ.get("PYTEST_XDIST_WORKER", "")
    if not worker.startswith("gw") or not hasattr(os, "sched_setaffinity"):
        return
    cores = sorted(os.sched_getaffinity(0))
    os.sched_setaffinity(0, {cores[int(worker.removeprefix("gw")) % len(cores)]})


_pin_xdist_worker()
torch.set_num_threads(min(2, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else 2))
# engines keep the fixed kernel rules: choices timed on a busy test machine could differ between
# two engines of one test (tests/models/test_tuning.py starts tuned ones itself)
os.environ["RADIXGEN_TUNE_KERNELS"] = "0"
# every in-process engine's KV pool starts as NaN: a slot read before it was written poisons the
# logits it reaches, where the uninitialised memory of a served pool would hide it
kv_pool.UNWRITTEN_FILL = float("nan")

_live_engines: list[Engine] = []


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def default_model_dir() -> Path:
    """The bundled model's folder; RADIXGEN_TEST_MODEL_DIR names a copy of its config and
    tokenizer instead (the GPU bundle carries one, not the GGUF package)."""
    from radixgen.models.loader import resolve_model_dir

    override = os.environ.get("RADIXGEN_TEST_MODEL_DIR")
    return Path(override) if override else resolve_model_dir(None)


@pytest.fixture(scope="session")
def tokenizer(default_model_dir: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(default_model_dir)


def tiny_hf_config(kind: str = "llama", **overrides: Any) -> Any:
    """A 2-layer config with the real 49152-token vocabulary (so the real tokenizer fits)."""
    from transformers import LlamaConfig, Qwen2Config

    common: dict[str, Any] = dict(
        vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
        rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=2, tie_word_embeddings=True,
    )
    common.update(overrides)
    if kind == "qwen2":
        return Qwen2Config(**common)
    return LlamaConfig(**common)


def make_tiny_hf_model(kind: str = "llama", seed: int = 0, **overrides: Any) -> Any:
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(tiny_hf_config(kind, **overrides), attn_implementation="eager")
    with torch.no_grad():  # larger-than-default weights so logits are not all near zero
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0.0, 0.08)
    return model.eval()


def save_tiny_model(path: Path, tokenizer: Any, kind: str = "llama", seed: int = 0, **overrides: Any) -> Path:
    model = make_tiny_hf_model(kind, seed, **overrides)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory, tokenizer: Any) -> Path:
    return save_tiny_model(tmp_path_factory.mktemp("tiny-llama"), tokenizer)


def _track(engine: Engine) -> Engine:
    _live_engines.append(engine)
    return engine


@pytest.fixture
def make_engine(tiny_model_dir: Path) -> Iterator[Callable[..., Engine]]:
    """Engines on the tiny model (or ``model=``) that are shut down after the test."""
    made: list[Engine] = []

    def factory(**overrides: Any) -> Engine:
        overrides.setdefault("model", str(tiny_model_dir))
        overrides.setdefault("kv_cache_tokens", 4096)
        overrides.setdefault("max_context_len", 1024)
        engine = _track(Engine(EngineConfig(**overrides)))
        made.append(engine)
        return engine

    yield factory
    for engine in made:
        assert_no_leaks(engine)
        engine.shutdown()
        _live_engines.remove(engine)


@pytest.fixture(scope="session")
def tiny_engine(tiny_model_dir: Path) -> Iterator[Engine]:
    engine = _track(Engine(EngineConfig(model=str(tiny_model_dir), kv_cache_tokens=8192, max_context_len=1024)))
    yield engine
    engine.shutdown()


@pytest.fixture(scope="session")
def real_engine() -> Iterator[Engine]:
    engine = _track(Engine(EngineConfig(kv_cache_tokens=16384, max_context_len=2048)))
    yield engine
    engine.shutdown()


class FinalOutputs:
    """An ``on_output`` callback that keeps each request's final output; ``started`` is set at
    the first token any of them streams."""

    def __init__(self) -> None:
        self.started = threading.Event()
        self.finals: dict[str, Any] = {}

    def __call__(self, out: Any) -> None:
        if out.new_token_ids:
            self.started.set()
        if out.finished:
            self.finals[out.request_id] = out

    def wait_for(self, count: int, timeout: float = 30.0) -> None:
        deadline = time.monotonic() + timeout
        while len(self.finals) < count and time.monotonic() < deadline:
            time.sleep(0.01)


def assert_no_leaks(engine: Engine) -> None:
    if not engine._thread.is_alive():
        return
    stats = engine.kv_accounting()
    assert stats["active_requests"] == 0, f"requests left active after the test: {stats}"
    assert stats["held_by_requests"] == 0, f"KV slots still held: {stats}"
    assert stats["free"] + stats["held_by_tree"] == stats["pool_size"], f"KV slots leaked: {stats}"
    engine.run_on_loop(engine.scheduler.check_kv_invariant)


@pytest.fixture(autouse=True)
def _kv_pool_invariant() -> Iterator[None]:
    """After every test, every live engine (the shared ones included) holds no KV."""
    yield
    for engine in list(_live_engines):
        assert_no_leaks(engine)


def _child_processes() -> list[str]:
    """Live (non-zombie) processes whose parent is this test process."""
    children = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == os.getpid() and fields[0] != "Z":
            children.append(stat.parent.name)
    return children


@pytest.fixture(scope="session", autouse=True)
def _nothing_left_running() -> Iterator[None]:
    """Set up first, so torn down last: after every engine, server and kernel of the session
    has been stopped, no engine thread and no child process may remain."""
    yield
    deadline = time.monotonic() + 30
    while True:
        engines = [t.name for t in threading.enumerate() if t.name.startswith("radixgen-engine") and t.is_alive()]
        children = _child_processes() if sys.platform == "linux" else []
        if not engines and not children:
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"left running after the tests: threads {engines}, child processes {children}")
        time.sleep(0.5)
