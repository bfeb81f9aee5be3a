"""Drive a model through the KV pool by hand: extend any rows by any tokens, get every logit."""

from __future__ import annotations

import numpy as np
import torch

from radixgen.engine.kv_pool import KVPool
from radixgen.engine.plan import StepKind, StepPlan
from radixgen.kernels import CpuKernels, cpu_kernels
from radixgen.models import CausalLM
from radixgen.models.attention import AttentionBackend, create_backend
from radixgen.models.attention.cpu import CpuAttention


class PoolHarness:
    def __init__(
        self, model: CausalLM, num_slots: int = 4096, max_rows: int = 8, max_context_len: int = 1024,
        attention: str | None = None, attention_kernels: CpuKernels | None = None, padded_prefill: bool = False,
        device: str = "cpu", small_linear_max_tokens: int = 0,
    ) -> None:
        """``attention``: an attention backend by name (``create_backend``); None: the ``cpu``
        backend with ``attention_kernels``' attention kernels (None: its SDPA paths alone),
        ``padded_prefill`` choosing its one-masked-call prefill. The fused layer ops run
        whatever ``torch.ops.radixgen`` dispatches to (the C++ kernels once the extension is
        loaded in this process); ``small_linear_max_tokens`` as the engine sets it."""
        cfg = model.config
        self.model = model
        model.set_small_linear_max_tokens(small_linear_max_tokens)
        self.pool = KVPool(
            num_slots=num_slots, num_layers=cfg.num_layers, num_kv_heads=cfg.num_kv_heads,
            head_dim=cfg.head_dim, dtype=model.embed.dtype, device=device, max_rows=max_rows,
            max_context_len=max_context_len,
        )
        self.attention: AttentionBackend
        if attention is None:
            self.attention = CpuAttention(self.pool.req_to_token, self.pool.k.dtype, cfg.head_dim, attention_kernels,
                                          padded_prefill=padded_prefill)
        else:
            self.attention = create_backend(attention, req_to_token=self.pool.req_to_token, dtype=self.pool.k.dtype,
                                            head_dim=cfg.head_dim, kernels=attention_kernels)
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
        metadata = self.attention.prepare(plan.attention_batch())
        device = self.pool.k.device
        all_rows = torch.arange(plan.num_tokens, device=device)
        logits = self.model(
            torch.from_numpy(plan.input_ids).to(device), torch.from_numpy(positions).to(device), self.attention,
            metadata, self.pool.k, self.pool.v, all_rows,
        )
        return list(logits.cpu().split(extend.tolist()))


PATHS = ["sdpa", "sdpa-padded", "native", "reference", "triton"]
"""sdpa: the cpu attention backend without its kernels (gather + SDPA decode, per-request
prefill); sdpa-padded: the same with prefill padded under one mask; native: every CPU kernel
the engine would use, its default (the small-batch linears, the prefill-attention kernel in
bfloat16 where it is native); reference: the ``torch`` attention backend; triton: the
``triton`` backend (interpreted on a CPU). The fused layer ops take the C++ kernels on every
path once the extension is loaded; ``tests/models/test_native_ops.py`` holds them to their
PyTorch definitions and runs a model on the definitions alone."""


def harness_for(model: CausalLM, path: str) -> PoolHarness:
    """A harness running ``model`` on one of ``PATHS`` (skips the test where the CPU kernels
    do not build)."""
    import pytest

    if path.startswith("sdpa"):
        return PoolHarness(model, padded_prefill=path == "sdpa-padded")
    if path == "reference":
        return PoolHarness(model, attention="torch")
    if path == "triton":
        return PoolHarness(model, attention="triton")
    kernels = cpu_kernels()
    if kernels is None:
        pytest.skip("the CPU kernels do not build here")
    return PoolHarness(model, attention_kernels=kernels, small_linear_max_tokens=2)
