"""Drive a model through the KV pool by hand: extend any rows by any tokens, get every logit."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

from radixgen.engine.batch import StepKind, StepPlan, build_attention_plan
from radixgen.engine.kv_pool import KVPool
from radixgen.kernels import CpuKernels, cpu_kernels
from radixgen.models import CausalLM


class PoolHarness:
    def __init__(
        self, model: CausalLM, num_slots: int = 4096, max_rows: int = 8, max_context_len: int = 1024,
        decode_kernel: Callable[..., torch.Tensor] | None = None, kernels: CpuKernels | None = None,
        padded_prefill: bool = False, prefill_kernel: Callable[..., torch.Tensor] | None = None,
        shared_prefix_kernel: Callable[..., tuple[torch.Tensor, torch.Tensor, torch.Tensor]] | None = None,
    ) -> None:
        """``kernels``: the native ops the forward uses (None: PyTorch ops only); decode attention
        uses ``decode_kernel`` either way, as in the engine's attention_backend.
        ``padded_prefill``: the one-masked-call prefill attention other devices use.
        ``prefill_kernel``: the pool-reading prefill attention kernel; ``shared_prefix_kernel``:
        decode rows' shared prefixes attended once per group."""
        self.padded_prefill = padded_prefill
        cfg = model.config
        self.model = model
        self.decode_kernel = decode_kernel
        self.prefill_kernel = prefill_kernel
        self.shared_prefix_kernel = shared_prefix_kernel
        self.kernels = kernels
        self.pool = KVPool(
            num_slots=num_slots, num_layers=cfg.num_layers, num_kv_heads=cfg.num_kv_heads,
            head_dim=cfg.head_dim, dtype=model.embed.dtype, device="cpu", max_rows=max_rows,
            max_context_len=max_context_len,
        )
        self.lengths = [0] * max_rows

    def extend(self, batch: list[tuple[int, list[int]]]) -> list[torch.Tensor]:
        """Append tokens to rows (one entry per request) in one step; logits [n, vocab] per entry."""
        rows = np.array([r for r, _ in batch], dtype=np.int64)
        extend = np.array([len(t) for _, t in batch], dtype=np.int64)
        prefix = np.array([self.lengths[r] for r in rows], dtype=np.int64)
        positions = np.concatenate([np.arange(p, p + n) for p, n in zip(prefix, extend, strict=True)])
        slots = self.pool.slots.alloc(int(extend.sum()))
        assert slots is not None
        self.pool.write(np.repeat(rows, extend), positions, slots)
        is_decode = bool((extend == 1).all() and (prefix > 0).all())
        plan = StepPlan(
            kind=StepKind.DECODE if is_decode else StepKind.PREFILL, requests=[None] * len(batch),  # type: ignore[list-item]
            rows=rows, prefix_lens=prefix, extend_lens=extend,
            input_ids=np.concatenate([np.array(t, dtype=np.int64) for _, t in batch]),
            positions=positions, out_cache_loc=slots,
        )
        for r, n in zip(rows, extend, strict=True):
            self.lengths[r] += int(n)
        attn = build_attention_plan(
            plan, self.pool.req_to_token, torch.device("cpu"), self.pool.k.dtype, self.decode_kernel,
            per_request_prefill=not self.padded_prefill, prefill_kernel=self.prefill_kernel,
            shared_prefix_kernel=self.shared_prefix_kernel,
        )
        all_rows = torch.arange(plan.num_tokens)
        logits = self.model(
            torch.from_numpy(plan.input_ids), torch.from_numpy(positions), attn, self.pool.k, self.pool.v, all_rows,
            self.kernels,
        )
        return list(logits.split(extend.tolist()))


PATHS = ["torch", "torch-padded", "native", "native-sdpa"]
"""torch: PyTorch ops alone (gather + SDPA decode, per-request prefill); torch-padded: the same
with prefill padded under one mask (the path on other devices); native: every CPU kernel the
engine would use, its default (the prefill-attention kernel in bfloat16 where it is native); native-sdpa: the fused layer ops with gather + SDPA decode (attention_backend=sdpa)."""


def harness_for(model: CausalLM, path: str) -> PoolHarness:
    """A harness running ``model`` on one of ``PATHS`` (skips the test where the CPU kernels
    do not build)."""
    import pytest

    if path.startswith("torch"):
        return PoolHarness(model, padded_prefill=path == "torch-padded")
    kernels = cpu_kernels()
    if kernels is None:
        pytest.skip("the CPU kernels do not build here")
    if path == "native":
        return PoolHarness(
            model, decode_kernel=kernels.decode_attention, kernels=kernels,
            prefill_kernel=kernels.prefill_attention_for(model.embed.dtype),
            shared_prefix_kernel=kernels.shared_prefix_attention_for(model.embed.dtype, model.config.head_dim),
        )
    return PoolHarness(model, kernels=kernels)
