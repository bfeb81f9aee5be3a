"""Decode forwards through a graph runner: CUDA graphs on a GPU, the model called directly on a CPU.

A small model's decode step on a GPU is a few hundred kernel launches whose device work is
shorter than the launching, so on CUDA the decode forward of each batch-size bucket (1, 2, 4,
8, then every 8 up to ``cuda_graph_max_batch``) is captured once at start-up over static input,
metadata and logits buffers and replayed; a step is padded up to its bucket. Pad rows decode
token 0 at position 0 into the pool's pad slot, reading one key of the batch's first row, and
their logits are cut off before sampling.

The step code is the same on every device: ``ModelRunner`` asks its runner for the size a plan
runs at (``padded_size``; None: not a decode step this runner takes, the model runs it directly)
and hands it the uploaded arrays. ``EagerDecode`` (CPU, and CUDA with ``--no-cuda-graphs``)
runs the model on them; given buckets it pads as the graphs do, which is how the padding is
tested without a GPU. ``CudaGraphDecode`` copies them into the static buffers and replays.

Grammar masks are applied to the graph's output logits after the replay, outside the graph: a
step's mask arrives in its upload (or, overlapped, after its forward), and keeping it out keeps
one graph per bucket for free and constrained batches alike, at one gather-add over the
constrained step's [B, vocab] logits.
"""

from __future__ import annotations

import logging
import time
from abc import ABC, abstractmethod
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
import torch

from radixgen.engine.kv_pool import PAD_SLOT, KVPool
from radixgen.engine.plan import StepKind, StepPlan
from radixgen.models import CausalLM
from radixgen.models.attention import AttentionBackend, AttentionBatch

logger = logging.getLogger(__name__)


def decode_buckets(max_batch: int) -> tuple[int, ...]:
    """The batch sizes graphs are captured for: 1, 2, 4, 8, then every 8, up to ``max_batch``
    (itself included)."""
    sizes = [s for s in (1, 2, 4) if s < max_batch] + list(range(8, max_batch, 8))
    return (*sizes, max_batch) if max_batch >= 1 else ()


@dataclass
class DecodeInputs:
    """One decode forward's host arrays, padded to ``size`` rows."""

    size: int
    input_ids: np.ndarray
    positions: np.ndarray
    logits_index: np.ndarray
    batch: AttentionBatch


def pad_decode(plan: StepPlan, size: int) -> DecodeInputs:
    """A decode plan's inputs with ``size - B`` pad rows after its own: token 0 at position 0,
    written to the pad slot, attending one key of the first row (their logits are discarded)."""
    batch = plan.attention_batch()
    count = size - plan.batch_size
    assert count >= 0, f"a batch of {plan.batch_size} does not fit a bucket of {size}"
    if count:
        zeros = np.zeros(count, dtype=np.int64)
        batch = replace(
            batch, rows=np.concatenate([batch.rows, np.full(count, batch.rows[0])]),
            prefix_lens=np.concatenate([batch.prefix_lens, zeros]),
            extend_lens=np.concatenate([batch.extend_lens, zeros + 1]),
            positions=np.concatenate([batch.positions, zeros]),
            out_cache_loc=np.concatenate([batch.out_cache_loc, zeros + PAD_SLOT]),
        )
    input_ids = np.concatenate([plan.input_ids, np.zeros(count, dtype=np.int64)]) if count else plan.input_ids
    return DecodeInputs(size, input_ids, batch.positions, np.arange(size, dtype=np.int64), batch)


class DecodeRunner(ABC):
    """Runs the decode forwards a plan's size fits (module docstring)."""

    name: str
    buckets: tuple[int, ...]

    def padded_size(self, plan: StepPlan) -> int | None:
        """The batch size ``plan`` runs at here; None for a step this runner does not take (not
        a plain decode step, or larger than its largest bucket)."""
        if (plan.kind is not StepKind.DECODE or not self.buckets
                or plan.verify_counts is not None or plan.prompt_scoring is not None):
            return None
        for size in self.buckets:
            if size >= plan.batch_size:
                return size
        return None

    @abstractmethod
    def run(self, inputs: DecodeInputs, uploaded: list[torch.Tensor]) -> torch.Tensor:
        """float32 logits [size, vocab]; ``uploaded``: the input ids, positions, logits index and
        the attention backend's ``host_arrays(inputs.batch)``, on the device."""


class EagerDecode(DecodeRunner):
    """The model called on every step. Without buckets it takes no step (the runner's direct
    path runs them unpadded); with them it pads like the graphs."""

    name = "eager"

    def __init__(self, model: CausalLM, attention: AttentionBackend, pool: KVPool,
                 buckets: tuple[int, ...] = ()) -> None:
        self.model, self.attention, self.pool, self.buckets = model, attention, pool, buckets

    def run(self, inputs: DecodeInputs, uploaded: list[torch.Tensor]) -> torch.Tensor:
        input_ids, positions, logits_index, *attention_arrays = uploaded
        metadata = self.attention.prepare_uploaded(inputs.batch, attention_arrays)
        return self.model(input_ids, positions, self.attention, metadata, self.pool.k, self.pool.v, logits_index)


class CudaGraphDecode(DecodeRunner):
    """One CUDA graph per bucket over static buffers (``capture``). With ``replay=False`` the
    model runs eagerly on the same static buffers and metadata the graphs read: the path the
    tests take on a CPU."""

    name = "cuda_graphs"

    def __init__(self, model: CausalLM, attention: AttentionBackend, pool: KVPool, buckets: tuple[int, ...],
                 replay: bool = True) -> None:
        if not buckets:
            raise ValueError("CUDA graphs need at least one batch size to capture")
        self.model, self.attention, self.pool, self.buckets = model, attention, pool, buckets
        self.replay = replay
        largest = buckets[-1]
        device = pool.req_to_token.device
        self.input_ids = torch.zeros(largest, dtype=torch.int64, device=device)
        self.positions = torch.zeros(largest, dtype=torch.int64, device=device)
        self.logits_index = torch.arange(largest, dtype=torch.int64, device=device)
        self.static_attention = attention.decode_graph_state(largest, pool.max_context_len)
        self.graphs: dict[int, Any] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        self.capture_s = 0.0
        self.graph_bytes = 0

    def _forward(self, size: int) -> torch.Tensor:
        return self.model(self.input_ids[:size], self.positions[:size], self.attention,
                          self.static_attention.metadata(size), self.pool.k, self.pool.v, self.logits_index[:size])

    def capture(self) -> None:
        """Capture every bucket's graph (largest first, all in one memory pool); logs the time
        and the memory the graphs hold."""
        self.graphs.clear()
        self.outputs.clear()
        if not self.replay:
            return
        start = time.perf_counter()
        before = torch.cuda.memory_reserved()
        pool = torch.cuda.graph_pool_handle()
        self.static_attention.reset()  # pad values: every bucket's rows are valid to run
        self.input_ids.zero_()
        self.positions.zero_()
        with torch.inference_mode():
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                for size in reversed(self.buckets):
                    for _ in range(2):  # compiles the Triton kernels and settles the allocator
                        self._forward(size)
                    graph = torch.cuda.CUDAGraph()
                    with torch.cuda.graph(graph, pool=pool, stream=stream):
                        self.outputs[size] = self._forward(size)
                    self.graphs[size] = graph
            torch.cuda.current_stream().wait_stream(stream)
        torch.cuda.synchronize()
        self.capture_s = time.perf_counter() - start
        self.graph_bytes = torch.cuda.memory_reserved() - before
        logger.info("CUDA graphs: %d batch sizes (%s) captured in %.2f s, holding %.1f MiB", len(self.buckets),
                    ",".join(map(str, self.buckets)), self.capture_s, self.graph_bytes / 2**20)

    def run(self, inputs: DecodeInputs, uploaded: list[torch.Tensor]) -> torch.Tensor:
        size = inputs.size
        input_ids, positions, _logits_index, *attention_arrays = uploaded
        self.input_ids[:size].copy_(input_ids, non_blocking=True)
        self.positions[:size].copy_(positions, non_blocking=True)
        self.static_attention.load(size, attention_arrays)
        if not self.replay:
            return self._forward(size)
        self.graphs[size].replay()
        return self.outputs[size]


def create_decode_runner(model: CausalLM, attention: AttentionBackend, pool: KVPool, *, cuda_graphs: bool,
                         max_batch: int) -> DecodeRunner:
    """CUDA graphs where asked for on a GPU with an attention backend that can be captured,
    else eager; the choice is logged."""
    on_cuda = pool.req_to_token.device.type == "cuda"
    if on_cuda and cuda_graphs and max_batch >= 1:
        if attention.supports_decode_graphs:
            runner = CudaGraphDecode(model, attention, pool, decode_buckets(max_batch))
            runner.capture()
            return runner
        logger.warning("attention backend %s cannot be captured in CUDA graphs: decode runs eagerly", attention.name)
    return EagerDecode(model, attention, pool)
