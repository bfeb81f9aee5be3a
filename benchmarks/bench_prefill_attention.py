"""Prefill attention: the native pool-reading kernel vs the per-request SDPA path, per layer.

SmolLM2's shape (9 query heads, 3 kv heads, head size 64), bf16 (the AVX-512 BF16 kernel, plain
loops elsewhere) or float32 (the AVX2 kernel), through ``attend_pool`` with the engine's own plans
(``build_attention_plan`` with and without the kernel); the rounds alternate so the machine's
noise hits both alike. FLOP/s counts the causal half of Q.K and P.V.

    python benchmarks/bench_prefill_attention.py [--rounds 3] [--dtype float32] [--answers]

``--answers`` adds the engine's greedy answers to 64 chat prompts (64 new tokens, bundled model)
with the kernel against SDPA: how many are token for token the same.
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
from benchmarks.common import chat_prompts, first_differences, print_table, write_json  # noqa: E402
from radixgen import Engine, EngineConfig, SamplingParams  # noqa: E402
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


def _case(requests: int, prefix: int, extend: int, dtype: torch.dtype) -> tuple[
        StepPlan, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    length = prefix + extend
    slots = requests * length + 1
    k = torch.randn(slots, KV_HEADS, HEAD_DIM, generator=gen).to(dtype)
    v = torch.randn(slots, KV_HEADS, HEAD_DIM, generator=gen).to(dtype)
    req_to_token = torch.zeros(requests, length + 1, dtype=torch.long)
    req_to_token[:, :length] = (torch.randperm(slots - 1, generator=gen) + 1).view(requests, length)
    new = req_to_token[:, prefix:length].reshape(-1).numpy()
    plan = StepPlan(
        StepKind.PREFILL, [None] * requests, np.arange(requests), np.full(requests, prefix),  # type: ignore[list-item]
        np.full(requests, extend), np.zeros(requests * extend, dtype=np.int64),
        np.tile(np.arange(prefix, length), requests), new,
    )
    q = torch.randn(requests * extend, HEADS, HEAD_DIM, generator=gen).to(dtype)
    return plan, req_to_token, q, k, v


def answers_agree(dtype: str) -> dict[str, Any]:
    engine = Engine(EngineConfig(dtype=dtype, kv_cache_gb=1.0, disable_radix_cache=True))  # type: ignore[arg-type]
    attention = engine.runner.attention
    kernel = attention.prefill_kernel
    prompts = chat_prompts(engine)
    params = SamplingParams(max_new_tokens=64, temperature=0, ignore_eos=True)
    got = {}
    for name, prefill in (("kernel", kernel), ("sdpa", None)):
        attention.prefill_kernel = prefill
        got[name] = [o.token_ids for o in engine.generate(prompts, params)]
    engine.shutdown()
    first = first_differences(got["sdpa"], got["kernel"])
    return {"engine_uses_kernel": kernel is not None, "identical": sum(f == 64 for f in first), "of": len(first),
            "first_differences": sorted(f for f in first if f < 64)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16")
    parser.add_argument("--answers", action="store_true", help="also compare the engine's greedy answers")
    args = parser.parse_args()
    dtype = getattr(torch, args.dtype)
    kernels = cpu_kernels()
    if kernels is None:
        sys.exit("the CPU kernels do not build here")
    if dtype == torch.float32 and not kernels.prefill_attention_native(dtype):
        sys.exit("the float32 prefill kernel needs a build with AVX2 and FMA")
    layer = LayerAttention(scale=HEAD_DIM**-0.5)
    rows: list[dict[str, Any]] = []
    for name, requests, prefix, extend in CASES:
        plan, req_to_token, q, k, v = _case(requests, prefix, extend, dtype)
        paths = {
            "sdpa_ms": build_attention_plan(plan.attention_batch(), req_to_token, torch.device("cpu"), dtype),
            "kernel_ms": build_attention_plan(plan.attention_batch(), req_to_token, torch.device("cpu"), dtype,
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
    print(f"per layer, {args.dtype}, {torch.get_num_threads()} threads, best of {args.rounds} alternating rounds")
    print_table(rows, ["case", "sdpa_ms", "kernel_ms", "speedup", "sdpa_gflop_s", "kernel_gflop_s"])
    agreement = answers_agree(args.dtype) if args.answers else None
    if agreement is not None:
        print("greedy answers, kernel vs sdpa (64 chat prompts, 64 new tokens):", agreement)
    write_json(f"bench_prefill_attention-{args.dtype}", {
        "threads": torch.get_num_threads(), "dtype": args.dtype,
        "native": kernels.prefill_attention_native(dtype), "rows": rows, "answers": agreement,
    })


if __name__ == "__main__":
    main()
