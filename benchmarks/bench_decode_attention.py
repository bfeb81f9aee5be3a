"""Decode attention: the native pool-reading kernel vs gather + padded SDPA, side by side.

Two tables in one run:
- per layer (SmolLM2's shape: 9 query heads, 3 kv heads, head size 64), on a pool whose slots
  are scattered the way the allocator scatters them under load, K/V of 8 layers so reads come
  from memory, not cache;
- a whole decode step of the real model through ``Engine`` (attention_backend ``torch`` vs
  ``cpu``, radix cache off): (time of 72 new tokens - time of 8) / 64 steps.

    python benchmarks/bench_decode_attention.py [--dtypes float32,bfloat16] [--skip-engine]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.common import print_table, prompts_of_lengths, write_json  # noqa: E402
from radixgen import Engine, EngineConfig, SamplingParams  # noqa: E402
from radixgen.engine.plan import StepKind, StepPlan  # noqa: E402
from radixgen.kernels import decode_attention_op  # noqa: E402
from radixgen.models.attention import LayerAttention  # noqa: E402
from radixgen.models.attention.base import write_kv  # noqa: E402
from radixgen.models.attention.cpu import attend_pool, build_attention_plan  # noqa: E402

SHAPES = [(1, 100), (24, 800), (64, 300)]  # (requests, context length)
HEADS, KV_HEADS, HEAD_DIM, LAYERS = 9, 3, 64, 8


def per_layer(dtype: torch.dtype, batch: int, length: int) -> dict[str, Any]:
    import numpy as np

    gen = torch.Generator().manual_seed(0)
    slots = batch * length + 1
    k = torch.randn(LAYERS, slots, KV_HEADS, HEAD_DIM, generator=gen).to(dtype)
    v = torch.randn(LAYERS, slots, KV_HEADS, HEAD_DIM, generator=gen).to(dtype)
    req_to_token = torch.zeros(batch, length + 1, dtype=torch.long)
    req_to_token[:, :length] = (torch.randperm(slots - 1, generator=gen)[: batch * length] + 1).view(batch, length)
    plan = StepPlan(
        StepKind.DECODE, [None] * batch, np.arange(batch), np.full(batch, length - 1), np.ones(batch, dtype=np.int64),  # type: ignore[list-item]
        np.zeros(batch, dtype=np.int64), np.full(batch, length - 1), req_to_token[:, length - 1].numpy(),
    )
    q = torch.randn(batch, HEADS, HEAD_DIM, generator=gen).to(dtype)
    new_k = k[0, req_to_token[:, length - 1]]
    new_v = v[0, req_to_token[:, length - 1]]
    row: dict[str, Any] = {"dtype": str(dtype).removeprefix("torch."), "batch": batch, "context": length}
    shape = LayerAttention(scale=HEAD_DIM**-0.5)
    for name, kernel in (("sdpa_ms", None), ("kernel_ms", decode_attention_op())):
        if name == "kernel_ms" and kernel is None:
            continue
        attn = build_attention_plan(plan.attention_batch(), req_to_token, torch.device("cpu"), dtype, kernel)

        def run(attn: Any = attn) -> None:
            for layer in range(LAYERS):
                write_kv(new_k, new_v, k[layer], v[layer], attn.out_cache_loc)
                attend_pool(q, k[layer], v[layer], attn, shape, new_k, new_v)

        run()
        start = time.perf_counter()
        for _ in range(5):
            run()
        row[name] = (time.perf_counter() - start) / (5 * LAYERS) * 1e3
    if "kernel_ms" in row:
        row["speedup"] = row["sdpa_ms"] / row["kernel_ms"]
        kv_bytes = 2 * batch * length * KV_HEADS * HEAD_DIM * k.element_size()  # K and V, read once
        row["kernel_gb_s"] = kv_bytes / (row["kernel_ms"] * 1e-3) / 1e9
    return row


def _generate_s(engine: Engine, prompts: list[list[int]], new_tokens: int) -> float:
    start = time.perf_counter()
    engine.generate(prompts, SamplingParams(max_new_tokens=new_tokens, temperature=0, ignore_eos=True))
    return time.perf_counter() - start


def engine_steps(dtype: str) -> list[dict[str, Any]]:
    rows: dict[tuple[int, int], dict[str, Any]] = {}
    for backend in ("torch", "cpu"):
        engine = Engine(EngineConfig(dtype=dtype, attention_backend=backend, disable_radix_cache=True))  # type: ignore[arg-type]
        for batch, length in SHAPES:
            prompts = prompts_of_lengths(engine.tokenizer, [length] * batch, seed=1)
            engine.generate(prompts[:2], SamplingParams(max_new_tokens=4, temperature=0, ignore_eos=True))

            step_ms = (_generate_s(engine, prompts, 72) - _generate_s(engine, prompts, 8)) / 64 * 1e3
            row = rows.setdefault((batch, length), {"dtype": dtype, "batch": batch, "context": length})
            row["sdpa_step_ms" if backend == "torch" else "kernel_step_ms"] = step_ms
        engine.shutdown()
    for row in rows.values():
        if "kernel_step_ms" in row:
            row["speedup"] = row["sdpa_step_ms"] / row["kernel_step_ms"]
    return list(rows.values())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--skip-engine", action="store_true", help="only the per-layer table")
    args = parser.parse_args()
    dtypes = args.dtypes.split(",")
    if decode_attention_op() is None:
        print("the native kernel did not build here: only the gather + SDPA column is measured")
    layers = [per_layer(getattr(torch, d), b, n) for d in dtypes for b, n in SHAPES]
    print("per layer (ms)")
    print_table(layers, ["dtype", "batch", "context", "sdpa_ms", "kernel_ms", "speedup", "kernel_gb_s"])
    steps: list[dict[str, Any]] = []
    if not args.skip_engine:
        steps = [row for d in dtypes for row in engine_steps(d)]
        print("\nreal-model decode step (ms)")
        print_table(steps, ["dtype", "batch", "context", "sdpa_step_ms", "kernel_step_ms", "speedup"])
    print(f"\nwrote {write_json('bench_decode_attention', {'per_layer': layers, 'decode_step': steps})}")


if __name__ == "__main__":
    main()
