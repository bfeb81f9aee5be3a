"""Which implementation of each CPU op runs on this machine: what the CPU has rules some out, and
a short timing on the model's own shapes picks among the rest.

The same kernel can win on one CPU and lose on another: the native bf16 prefill attention is ~4x
faster than SDPA on an AMD EPYC with AVX-512 BF16 and 0.25-0.35x of it on a Xeon whose oneDNN
runs SDPA's matmuls on AMX tiles (benchmarks/README.md). So every op with more than one
implementation is timed once per machine, torch version, kernel build, thread count and model shape, and the
result cached under ``$RADIXGEN_CACHE/tuning`` beside the built kernels; ``radixgen tune``
times again. An implementation the machine cannot run is skipped with its reason, never timed
or chosen. ``EngineConfig.tune_kernels=False`` keeps the fixed rules instead.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import torch

from radixgen.host_memory import release_freed_memory
from radixgen.kernels import CpuKernels, build_signature
from radixgen.models.attention.base import AttentionBatch, LayerAttention
from radixgen.models.attention.cpu import CpuAttention
from radixgen.models.decoder import CausalLM
from radixgen.models.layers import Linear
from radixgen.models.quantized import QuantizedLinear
from radixgen.paths import cache_dir

logger = logging.getLogger(__name__)

CPU_FLAGS = ("avx2", "avx512f", "avx512_bf16", "avx512_vnni", "amx_tile", "amx_bf16", "amx_int8")
"""The flags that decide which kernels can run fast (the ones benchmark tables print)."""

# Another implementation replaces the first (the fixed rule's) only when this much faster:
# timings of a shared machine wander by a few percent, and a choice should not flip with them.
MARGIN = 0.05
PREFILL_TOKENS = 1024  # a long prompt: where the prefill implementations were measured apart
DECODE_BATCH, DECODE_CONTEXT = 16, 512
_REPEATS = 5


@dataclass(frozen=True)
class CpuFeatures:
    model_name: str
    flags: frozenset[str]

    @classmethod
    def detect(cls) -> CpuFeatures:
        """The CPU's model name and flags (Linux ``/proc/cpuinfo``; unknown elsewhere)."""
        name, flags = "unknown", frozenset[str]()
        try:
            for line in Path("/proc/cpuinfo").read_text().splitlines():
                key, _, value = line.partition(":")
                if key.strip() == "model name" and name == "unknown":
                    name = value.strip()
                elif key.strip() == "flags" and not flags:
                    flags = frozenset(value.split())
        except OSError:
            pass
        return cls(name, flags)

    def label(self) -> str:
        wanted = [f for f in CPU_FLAGS if f in self.flags]
        return f"{self.model_name} ({' '.join(wanted) or 'no AVX2'})"


@dataclass(frozen=True)
class Implementation:
    name: str
    unavailable: str | None = None
    """Why it cannot run here; None: it can."""


@dataclass
class OpChoice:
    op: str
    chosen: str
    times_ms: dict[str, float] = field(default_factory=dict)
    skipped: dict[str, str] = field(default_factory=dict)
    """Implementations the machine cannot run, with the reason."""

    def describe(self) -> str:
        timed = ", ".join(f"{name} {ms:.3g} ms" for name, ms in self.times_ms.items())
        return f"{self.op}={self.chosen}" + (f" ({timed})" if timed else "")


def choose(op: str, implementations: list[Implementation], time_ms: Callable[[str], float]) -> OpChoice:
    """Time the implementations that run here and pick the fastest; the first listed (the fixed
    rule's choice) keeps its place unless another beats it by ``MARGIN``."""
    runnable = [i.name for i in implementations if i.unavailable is None]
    skipped = {i.name: i.unavailable for i in implementations if i.unavailable is not None}
    if not runnable:
        raise ValueError(f"no implementation of {op} runs here: {skipped}")
    if len(runnable) == 1:
        return OpChoice(op, runnable[0], {}, skipped)
    times = {name: time_ms(name) for name in runnable}
    chosen = runnable[0]
    for name in runnable[1:]:
        if times[name] < times[chosen] * (1 - MARGIN):
            chosen = name
    return OpChoice(op, chosen, times, skipped)


@dataclass
class KernelChoices:
    """What the model runner applies: the chosen implementation of every tuned op."""

    cpu: str
    choices: list[OpChoice]
    measured: bool = True
    """False: read from the cache."""

    def chosen(self, op: str, default: str) -> str:
        return next((c.chosen for c in self.choices if c.op == op), default)

    def small_linear_max_tokens(self, default: int) -> int:
        """The most tokens a step may have and still run the linears as ``small_linear``: every
        size up to it won its timing."""
        tokens = 0
        for size in (1, 2):
            choice = self.chosen(f"linear_{size}_token", "")
            if choice == "":
                return default
            if choice != "small_linear":
                break
            tokens = size
        return tokens

    def quant_large_steps(self) -> tuple[str, int] | None:
        """How a quantized model's large steps run: (the implementation chosen at the largest
        timed decode-batch size, ``dense`` or ``tiles_<dtype>``; the smallest timed size from which
        it won at every larger one), or None where the blocks won there. Where they did, the
        prefill chunk's winner serves steps of that chunk's size and more."""
        sizes = sorted(_quant_step_tokens(c.op) for c in self.choices if c.op.startswith("quant_linear_"))
        decode = [size for size in sizes if size <= _HEAD_MAX_TOKENS]
        if decode and (found := self._won_throughout(decode)) is not None:
            return found
        chunk = [size for size in sizes if size > _HEAD_MAX_TOKENS]
        return self._won_throughout(chunk) if chunk else None

    def _won_throughout(self, sizes: list[int]) -> tuple[str, int] | None:
        winner = self.chosen(f"quant_linear_{sizes[-1]}_tokens", "blocks")
        if winner == "blocks":
            return None
        from_tokens = sizes[-1]
        for size in reversed(sizes[:-1]):
            if self.chosen(f"quant_linear_{size}_tokens", "") != winner:
                break
            from_tokens = size
        return winner, from_tokens

    def summary(self) -> dict[str, str]:
        return {c.op: c.chosen for c in self.choices}

    def describe(self) -> str:
        return "; ".join(c.describe() for c in self.choices)


def _quant_step_tokens(op: str) -> int:
    """The step size a ``quant_linear_<tokens>_tokens`` choice was timed at."""
    return int(op.removeprefix("quant_linear_").removesuffix("_tokens"))


def _run_each(linears: Sequence[Callable[[torch.Tensor], object]], inputs: list[torch.Tensor]) -> None:
    """Each linear on its input, each output let go before the next is made: a list of them all
    held a 512-token step's outputs of several layers at once (~100 MB for a 0.5B model, at the
    peak of a first start)."""
    for linear, x in zip(linears, inputs, strict=True):
        linear(x)


def _timed_ms(run: Callable[[], object], repeats: int = _REPEATS) -> float:
    """Best-of-``repeats`` milliseconds of ``run`` after one warm-up call."""
    run()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        best = min(best, time.perf_counter() - start)
    return best * 1e3


def _attention_case(
    model: CausalLM, dtype: torch.dtype, batch: AttentionBatch, pool_slots: int, max_len: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, LayerAttention]:
    cfg = model.config
    heads, kv_heads, head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    generator = torch.Generator().manual_seed(0)
    k_cache = torch.randn(pool_slots, kv_heads, head_dim, generator=generator).to(dtype)
    v_cache = torch.randn(pool_slots, kv_heads, head_dim, generator=generator).to(dtype)
    q = torch.randn(batch.num_tokens, heads, head_dim, generator=generator).to(dtype)
    req_to_token = torch.zeros(batch.batch_size, max_len, dtype=torch.int64)
    for b in range(batch.batch_size):
        length = int(batch.seq_lens[b])
        req_to_token[b, :length] = torch.arange(1 + b * max_len, 1 + b * max_len + length)
    return q, k_cache, v_cache, req_to_token, LayerAttention(scale=head_dim**-0.5)


def _time_attention(
    model: CausalLM, dtype: torch.dtype, kernels: CpuKernels, batch: AttentionBatch, max_len: int,
    configure: Callable[[CpuAttention], None],
) -> float:
    q, k_cache, v_cache, req_to_token, layer = _attention_case(
        model, dtype, batch, 1 + batch.batch_size * max_len, max_len)
    backend = CpuAttention(req_to_token, dtype, q.shape[-1], kernels)
    configure(backend)
    metadata = backend.prepare(batch)
    return _timed_ms(lambda: backend.forward(q, None, None, k_cache, v_cache, layer, metadata))


def _prefill_batch(tokens: int) -> AttentionBatch:
    return AttentionBatch(
        rows=np.zeros(1, dtype=np.int64), prefix_lens=np.zeros(1, dtype=np.int64),
        extend_lens=np.array([tokens], dtype=np.int64), positions=np.arange(tokens, dtype=np.int64),
        out_cache_loc=np.arange(1, tokens + 1, dtype=np.int64),
    )


def _decode_batch(batch: int, context: int) -> AttentionBatch:
    return AttentionBatch(
        rows=np.arange(batch, dtype=np.int64), prefix_lens=np.full(batch, context - 1, dtype=np.int64),
        extend_lens=np.ones(batch, dtype=np.int64), positions=np.full(batch, context - 1, dtype=np.int64),
        out_cache_loc=np.array([1 + b * context + context - 1 for b in range(batch)], dtype=np.int64),
        is_decode=True,
    )


def _choose_prefill(model: CausalLM, dtype: torch.dtype, kernels: CpuKernels | None) -> OpChoice:
    native_missing = None
    if kernels is None:
        native_missing = "the native kernels are not built on this machine"
    elif dtype not in (torch.bfloat16, torch.float32):
        native_missing = "the native prefill kernel takes bfloat16 or float32 pools"
    elif dtype == torch.float32 and not kernels.prefill_attention_native(dtype):
        native_missing = "the float32 prefill kernel needs AVX2 and FMA"
    rule_native = kernels is not None and kernels.prefill_attention_for(dtype) is not None
    implementations = [Implementation("native", native_missing), Implementation("sdpa")]
    if not rule_native:
        implementations.reverse()  # the fixed rule's choice first
    batch = _prefill_batch(PREFILL_TOKENS)

    def time_ms(name: str) -> float:
        assert kernels is not None
        def configure(backend: CpuAttention) -> None:
            backend.prefill_kernel = kernels.prefill_attention if name == "native" else None
        return _time_attention(model, dtype, kernels, batch, PREFILL_TOKENS, configure)

    return choose("prefill_attention", implementations, time_ms)


def _choose_decode(model: CausalLM, dtype: torch.dtype, kernels: CpuKernels | None) -> OpChoice:
    implementations = [
        Implementation("native", None if kernels is not None else "the native kernels are not built on this machine"),
        Implementation("sdpa"),
    ]
    batch = _decode_batch(DECODE_BATCH, DECODE_CONTEXT)

    def time_ms(name: str) -> float:
        assert kernels is not None
        def configure(backend: CpuAttention) -> None:
            if name == "sdpa":
                backend.decode_kernel = None
                backend.shared_prefix_kernel = None
        return _time_attention(model, dtype, kernels, batch, DECODE_CONTEXT, configure)

    return choose("decode_attention", implementations, time_ms)


def _plain_linears(model: CausalLM) -> list[Linear]:
    """Every linear a decode step runs, the LM head included: timed over all of them, the
    weights stream from memory as in a real step (one layer's would sit in the cache and
    favour whichever implementation computes faster rather than reads faster)."""
    linears = [m for layer in model.decoder_layers() for m in layer.modules() if isinstance(m, Linear)]
    if isinstance(model.lm_head, Linear):
        linears.append(model.lm_head)
    return [m for m in linears if m.weight.numel()]


def _choose_small_linear(model: CausalLM, kernels: CpuKernels | None, tokens: int) -> OpChoice | None:
    linears = _plain_linears(model)
    if not linears:
        return None  # quantized weights: their own kernel at every size
    packed = any(m._packed is not None for m in linears)
    implementations = [
        Implementation("small_linear", None if kernels is not None else "the native kernels are not built on this machine"),
        Implementation("onednn" if packed else "torch_linear"),
    ]
    dtype = linears[0].weight.dtype
    inputs = [torch.randn(tokens, m.weight.shape[1]).to(dtype) for m in linears]

    def time_ms(name: str) -> float:
        saved = [m.small_linear_max_tokens for m in linears]
        limit = tokens if name == "small_linear" else 0
        try:
            for m in linears:
                m.small_linear_max_tokens = limit
            return _timed_ms(lambda: _run_each(linears, inputs))
        finally:
            for m, value in zip(linears, saved, strict=True):
                m.small_linear_max_tokens = value

    return choose(f"linear_{tokens}_token", implementations, time_ms)


QUANT_STEP_SIZES = (32, 64, 128, 512)
"""Step sizes (tokens) at which a quantized model's linears are timed on the blocks against tiles
decoded per step and a dense copy: decode batches of 32, 64 and 128, a prefill chunk of 512."""
_QUANT_TIMED_LAYERS = 4
"""Layers timed (with the LM head up to ``_HEAD_MAX_TOKENS``): at these sizes the step is
compute-bound, so a few layers rank the implementations as the whole model would."""
_HEAD_MAX_TOKENS = 128
"""The largest step size timed with the LM head: a prefill runs the head for one row per request,
so a prefill chunk's timing leaves it out (AVX2: the 8-bit head's blocks beat float32 tiles at
every size while the layers' 5- and 6-bit blocks lose to them at 512 tokens, and with the
152k-row head in the timing the blocks won there too)."""


def _quantized_linears(model: CausalLM, tokens: int) -> list[QuantizedLinear]:
    layers = model.decoder_layers()[:_QUANT_TIMED_LAYERS]
    found = [m for layer in layers for m in layer.modules() if isinstance(m, QuantizedLinear)]
    head = model.lm_head if isinstance(model.lm_head, QuantizedLinear) else (
        model.quantized_embed.head if model.quantized_embed is not None else None)
    return found + ([head] if head is not None and tokens <= _HEAD_MAX_TOKENS else [])


_DENSE_COPY_MAX_BYTES = 768 << 20
"""A dense copy of every quantized linear is an option only up to this size: a real model's (2 GB
in float32 for a 0.5B) would hold the file's weights several times over, whatever it saved, and
timing it (a 150k-row head's dense copy among them) set the start's peak memory."""


def _hopeless(earlier: list[OpChoice], tokens: int) -> dict[str, str]:
    """Implementations that cannot win at ``tokens`` by what they took at a smaller size: one
    ``r`` times slower than the winner at ``n`` tokens is not timed at ``tokens`` if r exceeds
    twice tokens / n, since the winner's cost grows at most in proportion to the tokens and
    another's does not shrink (twice: room for timing noise). bfloat16 tiles on a CPU without bf16
    products: ~130x, minutes of timing."""
    lost: dict[str, str] = {}
    for choice in earlier:
        if not choice.times_ms:
            continue
        best, ratio = min(choice.times_ms.values()), 2 * tokens / _quant_step_tokens(choice.op)
        lost |= {name: f"{ms:.3g} ms against {best:.3g} at {choice.op}" for name, ms in choice.times_ms.items()
                 if ms > ratio * best}
    return lost


def _choose_quant_linear(model: CausalLM, dtype: torch.dtype, tokens: int, kernels: CpuKernels | None,
                         lost: dict[str, str] | None = None) -> OpChoice | None:
    """The blocks, tiles decoded per step (bfloat16, and float32 for a float32 model), or a dense
    copy where one is small enough to keep; none of those in ``lost`` (name: why it is not timed)."""
    linears = _quantized_linears(model, tokens)
    if not linears:
        return None
    every = [m for m in model.modules() if isinstance(m, QuantizedLinear)]
    no_kernels = None if kernels is not None else "the native kernels are not built on this machine"
    implementations = [Implementation("blocks"), Implementation("tiles_bfloat16", no_kernels)]
    if dtype == torch.float32:
        implementations.append(Implementation("tiles_float32", no_kernels))
    too_large = sum(m.out_features * m.in_features for m in every) * dtype.itemsize > _DENSE_COPY_MAX_BYTES
    implementations.append(Implementation("dense", "a dense copy of every linear would pass "
                                                   f"{_DENSE_COPY_MAX_BYTES >> 20} MiB" if too_large else None))
    lost = lost or {}
    implementations = [i if i.unavailable or i.name not in lost else Implementation(i.name, lost[i.name])
                       for i in implementations]
    inputs = [torch.randn(tokens, m.in_features).to(dtype) for m in linears]

    def time_ms(name: str) -> float:
        try:
            for m in linears:
                if name == "dense":
                    m.add_dense(dtype, 1)
                elif name.startswith("tiles_"):
                    m.set_tiles(1, getattr(torch, name.removeprefix("tiles_")))
            return _timed_ms(lambda: _run_each(linears, inputs), repeats=3)
        finally:
            for m in linears:
                m.drop_dense()
                m.set_tiles(0, torch.float32)
            release_freed_memory()  # malloc keeps freed memory otherwise (host_memory.py)

    return choose(f"quant_linear_{tokens}_tokens", implementations, time_ms)


def _cache_key(features: CpuFeatures, model: CausalLM, dtype: torch.dtype, threads: int,
               kernels: CpuKernels | None) -> str:
    cfg = model.config
    plain = _plain_linears(model)
    linears = [len(plain), sorted({(tuple(m.weight.shape), str(m.weight.dtype), m._packed is not None) for m in plain})]
    signature = {
        "cpu": features.model_name, "flags": sorted(features.flags & set(CPU_FLAGS)), "torch": torch.__version__,
        # changed kernels may run faster or offer another implementation: time them again
        "threads": threads, "kernels": build_signature() if kernels is not None else None, "dtype": str(dtype),
        # torch's and oneDNN's own instruction-set limits change what the timed code runs
        "isa_limits": [os.environ.get(name) for name in ("ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA")],
        "attention": [cfg.num_heads, cfg.num_kv_heads, cfg.head_dim], "linears": linears,
        "quantized": sorted({(m.out_features, m.in_features, *m.kinds) for m in model.modules()
                             if isinstance(m, QuantizedLinear)}),
    }
    return hashlib.sha256(json.dumps(signature, sort_keys=True).encode()).hexdigest()[:20]


def _cache_path(key: str) -> Path:
    return cache_dir() / "tuning" / f"{key}.json"


def measure(model: CausalLM, dtype: torch.dtype, kernels: CpuKernels | None, features: CpuFeatures) -> KernelChoices:
    """Time every op's implementations on ``model``'s shapes (about a second for a small model)."""
    with torch.inference_mode():
        choices = [_choose_prefill(model, dtype, kernels), _choose_decode(model, dtype, kernels)]
        for tokens in (1, 2):
            choice = _choose_small_linear(model, kernels, tokens)
            if choice is not None:
                choices.append(choice)
        lost: dict[str, str] = {}
        if not features.flags & {"avx512_bf16", "amx_bf16"}:  # oneDNN's bf16 products run emulated, ~100x slower
            lost["tiles_bfloat16"] = "no bf16 dot-product instructions on this CPU (avx512_bf16, amx_bf16)"
        timed: list[OpChoice] = []
        for tokens in QUANT_STEP_SIZES:
            choice = _choose_quant_linear(model, dtype, tokens, kernels, lost | _hopeless(timed, tokens))
            if choice is not None:
                timed.append(choice)
        choices += timed
    return KernelChoices(features.label(), choices)


def kernel_choices(
    model: CausalLM, dtype: torch.dtype, kernels: CpuKernels | None, *, threads: int, rerun: bool = False,
    features: CpuFeatures | None = None,
) -> KernelChoices:
    """The cached choices for this machine and model shape, measured (and cached) when there are
    none or ``rerun``."""
    features = features or CpuFeatures.detect()
    path = _cache_path(_cache_key(features, model, dtype, threads, kernels))
    if not rerun and path.exists():
        try:
            data = json.loads(path.read_text())
            return KernelChoices(data["cpu"], [OpChoice(**c) for c in data["choices"]], measured=False)
        except (ValueError, KeyError, TypeError):
            logger.warning("ignoring an unreadable kernel-choice cache %s", path)
    start = time.perf_counter()
    result = measure(model, dtype, kernels, features)
    logger.info("timed the kernels' implementations in %.1f s", time.perf_counter() - start)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps({"cpu": result.cpu, "choices": [asdict(c) for c in result.choices]}, indent=1))
        tmp.replace(path)
    except OSError as exc:
        logger.warning("could not cache the kernel choices (%s); the next start times them again", exc)
    return result

