"""Prefill attention: the native bf16 pool-reading kernel vs the per-request SDPA path, per layer.

SmolLM2's shape (9 query heads, 3 kv heads, head size 64), bf16, through ``attend_pool`` with the
engine's own plans (``build_attention_plan`` with and without the kernel); the rounds alternate
so the machine's noise hits both alike. FLOP/s counts the causal half of Q.K and P.V.

    python benchmarks/bench_prefill_attention.py [--rounds 3]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.common import print_table, write_json  # noqa: E402
from radixgen.engine.plan import StepKind, StepPlan  # noqa: E402
from radixgen.kernels import cpu_kernels  # noqa: E402
from radixgen.models.attention import LayerAttention  # noqa: E402
from radixgen.models.attention.cpu import attend_pool, build_attention_plan  # noqa: E402

HEADS, KV_HEADS, HEAD_DIM = 9, 3, 64
# (name, requests, cached prefix, new tokens each)
CASES = [
    ("one 1.1k prompt", 1, 0, 1100),
    ("64 prompts of 100", 64, 0, 100),
    ("8 x 256 after a 1.1k prefix", 8, 1100, 256),
    ("one 4k prompt", 1, 0, 4096),
]


def _case(requests: int, prefix: int, extend: int) -> tuple[StepPlan, torch.Tensor, torch.Tensor, torch.Tensor,
                                                              torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    length = prefix + extend
    slots = requests * length + 1
    k = torch.randn(slots, KV_HEADS, HEAD_DIM, generator=gen).bfloat16()
    v = torch.randn(slots, KV_HEADS, HEAD_DIM, generator=gen).bfloat16()
    req_to_token = torch.zeros(requests, length + 1, dtype=torch.long)
    req_to_token[:, :length] = (torch.randperm(slots - 1, generator=gen) + 1).view(requests, length)
    new = req_to_token[:, prefix:length].reshape(-1).numpy()
    plan = StepPlan(
        StepKind.PREFILL, [None] * requests, np.arange(requests), np.full(requests, prefix),  # type: ignore[list-item]
        np.full(requests, extend), np.zeros(requests * extend, dtype=np.int64),
        np.tile(np.arange(prefix, length), requests), new,
    )
    q = torch.randn(requests * extend, HEADS, HEAD_DIM, generator=gen).bfloat16()
    return plan, req_to_token, q, k, v


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    kernels = cpu_kernels()
    if kernels is None:
        sys.exit("the CPU kernels do not build here")
    layer = LayerAttention(scale=HEAD_DIM**-0.5)
    rows: list[dict[str, Any]] = []
    for name, requests, prefix, extend in CASES:
        plan, req_to_token, q, k, v = _case(requests, prefix, extend)
        paths = {
            "sdpa_ms": build_attention_plan(plan.attention_batch(), req_to_token, torch.device("cpu"), torch.bfloat16),
            "kernel_ms": build_attention_plan(plan.attention_batch(), req_to_token, torch.device("cpu"), torch.bfloat16,
                                              prefill_kernel=kernels.prefill_attention),
        }
        times: dict[str, list[float]] = {key: [] for key in paths}
        for _ in range(args.rounds):
            for key, attn in paths.items():
                attend_pool(q, k, v, attn, layer)  # warm
                start = time.perf_counter()
                for _ in range(3):
                    attend_pool(q, k, v, attn, layer)
                times[key].append((time.perf_counter() - start) / 3 * 1e3)
        # causal: each query sees its prefix and the new tokens up to itself
        flops = 4 * HEADS * HEAD_DIM * requests * (extend * prefix + extend * (extend + 1) / 2)
        row: dict[str, Any] = {"case": name}
        for key, values in times.items():
            row[key] = min(values)
        row["speedup"] = row["sdpa_ms"] / row["kernel_ms"]
        row["kernel_gflop_s"] = flops / (row["kernel_ms"] * 1e-3) / 1e9
        row["sdpa_gflop_s"] = flops / (row["sdpa_ms"] * 1e-3) / 1e9
        rows.append(row)
    print(f"per layer, bf16, {torch.get_num_threads()} threads, best of {args.rounds} alternating rounds")
    print_table(rows, ["case", "sdpa_ms", "kernel_ms", "speedup", "sdpa_gflop_s", "kernel_gflop_s"])
    write_json("bench_prefill_attention", {
        "threads": torch.get_num_threads(), "native_bf16_dot": kernels.prefill_attention_native(), "rows": rows,
    })


if __name__ == "__main__":
    main()
