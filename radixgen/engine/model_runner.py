"""Runs the model on a StepPlan: host arrays -> device tensors once, forward, last-token logits."""

from __future__ import annotations

import logging
import os
from typing import NamedTuple

import numpy as np
import torch

from radixgen.config import AttentionBackend, EngineConfig
from radixgen.engine.graph_runner import DecodeRunner, create_decode_runner, pad_decode
from radixgen.engine.kv_pool import KVPool
from radixgen.engine.plan import StepPlan
from radixgen.host_memory import (
    keep_freed_memory_for_reuse,
    move_into_huge_pages,
    release_freed_memory,
)
from radixgen.kernels import CpuKernels, cpu_kernels, quant_layout
from radixgen.models import CausalLM, LoadedModel, load_model, torch_dtype
from radixgen.models.attention import create_backend
from radixgen.models.quantized import QuantizedLinear
from radixgen.models.tuning import KernelChoices, kernel_choices
from radixgen.staging import upload

logger = logging.getLogger(__name__)


def available_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def set_compute_threads(num_threads: int | None) -> int:
    """Use at most the cores this process may run on: oversubscribed torch threads spin-wait
    against each other (measured here: a decode step went from 60 ms to 478 ms)."""
    threads = num_threads or available_cores()
    if torch.get_num_threads() != threads:
        torch.set_num_threads(threads)
    return threads


CPU_KV_CACHE_GB = 2.0


def kv_cache_bytes(config: EngineConfig) -> int:
    """The KV pool's size in bytes: ``kv_cache_gb``, else 2 GiB on CPU and on CUDA
    ``mem_fraction`` of the device memory free now (after the weights)."""
    if config.kv_cache_gb is not None:
        return int(config.kv_cache_gb * 2**30)
    if not config.is_cuda:
        return int(CPU_KV_CACHE_GB * 2**30)
    free, _ = torch.cuda.mem_get_info(torch.device(config.device))
    return int(free * config.mem_fraction)


def describe_weights(model: CausalLM) -> str:
    """What holds the model's linear weights, for the log and ``Engine.info``."""
    quantized = [m for m in model.modules() if isinstance(m, QuantizedLinear)]
    if not quantized:
        return f"dense {str(model.embed.dtype).removeprefix('torch.')}"
    bits = sorted({quant_layout.value_bits(kind) for m in quantized for kind in m.kinds})
    return f"{'/'.join(map(str, bits))}-bit blocks ({len(quantized)} linears)"


class Forward(NamedTuple):
    """A step's forward on the device (``ModelRunner.forward_with``)."""

    logits: torch.Tensor
    """float32 [B + sum(verify_counts) + S, vocab] (``ModelRunner.forward``), no mask applied."""
    uploaded: list[torch.Tensor]
    """The caller's extra host arrays, on the device."""
    bitmask: torch.Tensor | None
    """``plan.bitmask`` on the device (the grammar masks known before the forward), if any."""


DEFAULT_SMALL_LINEAR_MAX_TOKENS = 2
"""Where nothing was measured: batch-1 and batch-2 decode run the linears as matrix-vector
products (the rule measured on AVX-512 and AVX2 EPYCs, benchmarks/README.md)."""


class ModelRunner:
    def __init__(
        self, model: CausalLM, pool: KVPool, device: torch.device,
        attention_backend: AttentionBackend = "auto", small_linear_max_tokens: int | None = None,
        tune_kernels: bool = False, cuda_graphs: bool = False, cuda_graph_max_batch: int = 0,
    ) -> None:
        """``small_linear_max_tokens`` None: as measured (``tune_kernels``), else
        ``DEFAULT_SMALL_LINEAR_MAX_TOKENS``. ``tune_kernels``: on CPU, pick each op's
        implementation by timing it on this machine (``models/tuning.py``; cached).
        ``cuda_graphs``: on CUDA, decode steps of up to ``cuda_graph_max_batch`` rows replay
        graphs captured here (``graph_runner.py``)."""
        self.model = model
        self.pool = pool
        self.device = device
        self.kernels: CpuKernels | None = cpu_kernels() if device.type == "cpu" else None
        self.kernel_choices: KernelChoices | None = None
        if device.type == "cpu" and tune_kernels:
            self.kernel_choices = kernel_choices(model, pool.k.dtype, self.kernels, threads=torch.get_num_threads())
            logger.info("kernels %s on %s: %s", "measured" if self.kernel_choices.measured else "as measured before",
                        self.kernel_choices.cpu, self.kernel_choices.describe())
        if small_linear_max_tokens is None:
            small_linear_max_tokens = (self.kernel_choices.small_linear_max_tokens(DEFAULT_SMALL_LINEAR_MAX_TOKENS)
                                       if self.kernel_choices else DEFAULT_SMALL_LINEAR_MAX_TOKENS)
        model.set_small_linear_max_tokens(small_linear_max_tokens if self.kernels is not None else 0)
        self.attention = create_backend(
            attention_backend, req_to_token=pool.req_to_token, dtype=pool.k.dtype, head_dim=pool.k.shape[-1],
            kernels=self.kernels, cpu_choices=self.kernel_choices.summary() if self.kernel_choices else None,
        )
        logger.info("attention backend: %s", self.attention.name)
        if small_linear_max_tokens <= 0:
            model.drop_plain_weights()
        self.weights = describe_weights(model)
        large_steps = self.kernel_choices.quant_large_steps() if self.kernel_choices else None
        self.full_precision_max_tokens: int | None = None
        """The largest step whose linears compute in the model's own precision (None: every step):
        a float32 model's large steps may run on bfloat16 tiles where that measured faster, and a
        step that verifies drafts must choose as a decode step would."""
        if large_steps is not None:
            self.weights += _run_large_steps(model, pool.k.dtype, *large_steps)
            implementation, from_tokens = large_steps
            if implementation.startswith("tiles_") and \
                    getattr(torch, implementation.removeprefix("tiles_")).itemsize < pool.k.dtype.itemsize:
                self.full_precision_max_tokens = from_tokens - 1
        logger.info("weights: %s", self.weights)
        if device.type == "cpu":
            placed = model.weight_arena  # a GGUF's records, written into huge pages at load
            moved = move_into_huge_pages([*model.parameters(), *model.buffers()], placed=placed)
            release_freed_memory()  # the heap pages the weights left
            logger.info("weights in huge pages: %.1f MiB written there at load, %.1f MiB moved",
                        (placed.used if placed else 0) / 2**20, moved / 2**20)
        self.decode_runner: DecodeRunner = create_decode_runner(
            model, self.attention, pool, cuda_graphs=cuda_graphs, max_batch=min(cuda_graph_max_batch, pool.max_rows))

    def kernels_in_use(self) -> dict[str, str]:
        """Which implementation runs each tuned op (the measured choices; empty when not tuned)."""
        return self.kernel_choices.summary() if self.kernel_choices else {}

    @classmethod
    def from_config(cls, config: EngineConfig, loaded: LoadedModel | None = None) -> tuple[ModelRunner, LoadedModel]:
        set_compute_threads(config.num_threads)
        if config.device == "cpu":
            keep_freed_memory_for_reuse()
        else:  # kernels launch on the current device: cuda:N must be it
            torch.cuda.set_device(torch.device(config.device))
        loaded = loaded or load_model(config.model, dtype=config.model_dtype, device=config.device,
                                      weights=config.weights)
        cfg = loaded.config
        dtype = torch_dtype(config.model_dtype)
        max_context = min(config.max_context_len or cfg.max_position_embeddings, cfg.max_position_embeddings)
        per_token = KVPool.bytes_per_token(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, dtype)
        num_slots = config.kv_cache_tokens or int(kv_cache_bytes(config) // per_token)
        pool = KVPool(
            num_slots=num_slots, num_layers=cfg.num_layers, num_kv_heads=cfg.num_kv_heads,
            head_dim=cfg.head_dim, dtype=dtype, device=config.device,
            max_rows=config.max_running_requests, max_context_len=max_context,
        )
        logger.info("KV pool: %d tokens (%.2f GiB), context %d", num_slots, num_slots * per_token / 2**30, max_context)
        runner = cls(
            loaded.model, pool, torch.device(config.device), config.attention_backend, config.small_linear_max_tokens,
            tune_kernels=config.tune_kernels and os.environ.get("RADIXGEN_TUNE_KERNELS", "1") != "0",
            cuda_graphs=config.cuda_graphs, cuda_graph_max_batch=config.cuda_graph_max_batch,
        )
        return runner, loaded

    def forward(self, plan: StepPlan) -> torch.Tensor:
        """float32 logits [B + sum(verify_counts) + S, vocab], no grammar mask applied: the last
        new token of every request; then, per request with forced tokens to verify, the
        positions just before each of them; then the S prompt positions of ``plan.prompt_scoring``."""
        return self.forward_with(plan, []).logits

    def forward_with(self, plan: StepPlan, extra: list[np.ndarray]) -> Forward:
        """``forward``, with ``extra`` host arrays (the sampler's) and ``plan.bitmask`` uploaded in
        the step's one copy."""
        padded = self.decode_runner.padded_size(plan)
        if padded is not None:  # a decode step the decode runner takes (CUDA graphs), padded to its bucket
            inputs = pad_decode(plan, padded)
            batch, input_ids, positions, last = inputs.batch, inputs.input_ids, inputs.positions, inputs.logits_index
        else:
            last = np.cumsum(plan.extend_lens) - 1
            if plan.verify_counts is not None and plan.verify_counts.any():
                verify_rows = [np.arange(end - m - 1, end - 1)
                               for end, m in zip(last + 1, plan.verify_counts, strict=True) if m]
                last = np.concatenate([last, *verify_rows])
            if plan.prompt_scoring is not None:
                last = np.concatenate([last, plan.prompt_scoring.token_index])
            batch, input_ids, positions = plan.attention_batch(), plan.input_ids, plan.positions
        # the step's inputs, the attention backend's index arrays and the grammar bitmask in one copy
        masks = [] if plan.bitmask is None else [plan.bitmask]
        ids_d, positions_d, last_d, *rest = upload(
            [input_ids, positions, last, *masks, *extra, *self.attention.host_arrays(batch)], self.device)
        bitmask = rest.pop(0) if masks else None  # applied by the step with the other masks (constrained.mask_logits)
        extra_uploaded, attention_arrays = rest[: len(extra)], rest[len(extra) :]
        if padded is not None:
            logits = self.decode_runner.run(inputs, [ids_d, positions_d, last_d, *attention_arrays])[: plan.batch_size]
        else:
            metadata = self.attention.prepare_uploaded(batch, attention_arrays)
            logits = self.model(ids_d, positions_d, self.attention, metadata, self.pool.k, self.pool.v, last_d)
        return Forward(logits, extra_uploaded, bitmask)


def split_prompt_scores(plan: StepPlan, logits: torch.Tensor) -> tuple[torch.Tensor, np.ndarray]:
    """Take the prompt-scoring rows off the end of ``logits``: (the rest, each scored position's
    log-probability of the prompt token that follows it)."""
    scoring = plan.prompt_scoring
    assert scoring is not None
    count = len(scoring.targets)
    rows = logits[logits.shape[0] - count :]
    targets = torch.from_numpy(scoring.targets).to(rows.device)
    chosen = rows.gather(1, targets[:, None]).squeeze(1) - torch.logsumexp(rows, dim=-1)
    return logits[: logits.shape[0] - count], chosen.cpu().numpy()


def _run_large_steps(model: torch.nn.Module, dtype: torch.dtype, implementation: str, from_tokens: int) -> str:
    """Set a quantized model's linears to run steps of ``from_tokens`` or more as tuning chose:
    on a dense copy, or on tiles decoded per step; returns what the weights' description adds."""
    quantized = [m for m in model.modules() if isinstance(m, QuantizedLinear)]  # before each gains a child
    if implementation == "dense":
        held = sum(m.add_dense(dtype, from_tokens) for m in quantized)
        return (f"; steps of {from_tokens}+ tokens on a dense {str(dtype).removeprefix('torch.')} copy "
                f"({held / 2**20:.0f} MiB more), measured faster here")
    tile_dtype = getattr(torch, implementation.removeprefix("tiles_"))
    for m in quantized:
        m.set_tiles(from_tokens, tile_dtype)
    return (f"; steps of {from_tokens}+ tokens on {str(tile_dtype).removeprefix('torch.')} tiles decoded per step, "
            "measured faster here")
