"""Prefix cache on the real model: multi-turn sessions over shared system prompts, cache on vs off.

Each session picks one of a few long system prompts, then asks several questions in turn, each
turn resending the whole history (system + earlier questions and the model's answers), as chat
clients do. Sessions start staggered and overlap. Reports the prefix-cache hit rate and
time-to-first-token percentiles for the same workload with the radix cache on and off.

    python benchmarks/bench_prefix.py [--sessions 12] [--turns 3] [--dtype float32]
"""

from __future__ import annotations

import argparse
import asyncio
import random
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.common import print_table, prompts_of_lengths, write_json  # noqa: E402
from radixgen import Engine, EngineConfig, SamplingParams  # noqa: E402


async def run_session(engine: Engine, system: list[int], questions: list[list[int]], new_tokens: int,
                      start_delay: float, ttfts: list[float]) -> None:
    await asyncio.sleep(start_delay)
    history = list(system)
    params = SamplingParams(max_new_tokens=new_tokens, temperature=0, ignore_eos=True)
    for q in questions:
        history = history + q
        sent = time.perf_counter()
        first = None
        answer: list[int] = []
        async for delta in engine.generate_stream(history, params):
            if first is None and delta.new_token_ids:
                first = time.perf_counter() - sent
            answer.extend(delta.new_token_ids)
        assert first is not None
        ttfts.append(first)
        history = history + answer


def run(engine: Engine, args: argparse.Namespace) -> dict[str, Any]:
    rng = random.Random(args.seed)
    systems = prompts_of_lengths(engine.tokenizer, [args.system_len] * args.num_systems, seed=args.seed)
    sessions = []
    for s in range(args.sessions):
        qs = prompts_of_lengths(engine.tokenizer, [rng.randint(20, 40) for _ in range(args.turns)], seed=1000 + s)
        sessions.append((systems[s % args.num_systems], qs, s * args.stagger))
    ttfts: list[float] = []
    before = engine.scheduler.stats.snapshot()

    async def main() -> None:
        await asyncio.gather(*(run_session(engine, sys_, qs, args.new_tokens, delay, ttfts) for sys_, qs, delay in sessions))

    start = time.perf_counter()
    asyncio.run(main())
    wall = time.perf_counter() - start
    after = engine.scheduler.stats.snapshot()
    prompt = after["prompt_tokens"] - before["prompt_tokens"]
    cached = after["cached_prompt_tokens"] - before["cached_prompt_tokens"]
    return {
        "requests": len(ttfts), "hit_rate": cached / prompt if prompt else 0.0,
        "ttft_p50_s": float(np.percentile(ttfts, 50)), "ttft_p95_s": float(np.percentile(ttfts, 95)),
        "wall_s": wall, "prompt_tokens": prompt,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sessions", type=int, default=12)
    parser.add_argument("--turns", type=int, default=3)
    parser.add_argument("--num-systems", type=int, default=3)
    parser.add_argument("--system-len", type=int, default=300)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--stagger", type=float, default=0.4, help="seconds between session starts")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    rows = []
    for cache in (True, False):
        engine = Engine(EngineConfig(dtype=args.dtype, disable_radix_cache=not cache))  # type: ignore[arg-type]
        engine.generate([1, 2, 3, 4], SamplingParams(max_new_tokens=2))  # warm-up
        result = run(engine, args)
        engine.shutdown()
        rows.append({"radix_cache": "on" if cache else "off", **result})
    on, off = rows
    print_table(rows, ["radix_cache", "requests", "hit_rate", "ttft_p50_s", "ttft_p95_s", "wall_s", "prompt_tokens"])
    reduction = 1 - on["ttft_p95_s"] / off["ttft_p95_s"]
    print(f"TTFT p95 with the cache is {reduction:.0%} lower; hit rate {on['hit_rate']:.0%} "
          f"(targets: >= 40% lower, >= 70% hits)")
    print(f"wrote {write_json('bench_prefix', {'args': vars(args), 'rows': rows, 'ttft_p95_reduction': reduction})}")


if __name__ == "__main__":
    main()
