"""Offline throughput: radixgen's Engine.generate vs transformers' model.generate.

Same model, same prompts, same number of new tokens (EOS ignored), greedy, in one run:
batch 1/8/32/64 with equal (256-token) and mixed (64-512) prompt lengths, per dtype.

    python benchmarks/bench_offline.py [--dtypes float32,bfloat16] [--batch-sizes 1,8,32,64]
"""

from __future__ import annotations

import argparse
import gc
import random
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.common import print_table, prompts_of_lengths, write_json  # noqa: E402
from radixgen import Engine, EngineConfig, SamplingParams  # noqa: E402
from radixgen.models.loader import resolve_model_dir  # noqa: E402


def lengths_for(mode: str, batch: int, seed: int) -> list[int]:
    if mode == "equal":
        return [256] * batch
    rng = random.Random(seed + batch)
    return [rng.randint(64, 512) for _ in range(batch)]


def run_radixgen(engine: Engine, prompts: list[list[int]], new_tokens: int) -> float:
    params = SamplingParams(max_new_tokens=new_tokens, temperature=0, ignore_eos=True)
    start = time.perf_counter()
    outs = engine.generate(prompts, params)
    elapsed = time.perf_counter() - start
    assert all(o.completion_tokens == new_tokens for o in outs)
    return len(prompts) * new_tokens / elapsed


@torch.inference_mode()
def run_transformers(model: Any, pad_id: int, prompts: list[list[int]], new_tokens: int) -> float:
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(prompts):  # left padding, as generate expects for decoder-only models
        ids[i, width - len(p) :] = torch.tensor(p)
        mask[i, width - len(p) :] = 1
    start = time.perf_counter()
    out = model.generate(
        input_ids=ids, attention_mask=mask, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
        do_sample=False, pad_token_id=pad_id,
    )
    elapsed = time.perf_counter() - start
    assert out.shape[1] - width == new_tokens
    return len(prompts) * new_tokens / elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--batch-sizes", default="1,8,32,64")
    parser.add_argument("--modes", default="equal,mixed")
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--skip-transformers", action="store_true")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    from transformers import AutoModelForCausalLM

    model_dir = resolve_model_dir(None)
    rows: list[dict[str, Any]] = []
    for dtype in args.dtypes.split(","):
        engine = Engine(EngineConfig(dtype=dtype, kv_cache_gb=4.0))  # type: ignore[arg-type]
        hf = None
        if not args.skip_transformers:
            hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, dtype)).eval()
        pad_id = engine.tokenizer.pad_token_id or 0
        warm = prompts_of_lengths(engine.tokenizer, [64, 80], seed=99)
        run_radixgen(engine, warm, 8)
        if hf is not None:
            run_transformers(hf, pad_id, warm, 8)
        for mode in args.modes.split(","):
            for batch in map(int, args.batch_sizes.split(",")):
                prompts = prompts_of_lengths(engine.tokenizer, lengths_for(mode, batch, args.seed), seed=args.seed + batch)
                ours = run_radixgen(engine, prompts, args.new_tokens)
                theirs = run_transformers(hf, pad_id, prompts, args.new_tokens) if hf is not None else None
                row = {"dtype": dtype, "prompts": mode, "batch": batch, "radixgen_tok_s": ours,
                       "transformers_tok_s": theirs, "ratio": ours / theirs if theirs else None}
                rows.append(row)
                print_table([row], list(row))
                sys.stdout.flush()
        engine.shutdown()
        del engine, hf
        gc.collect()
    print()
    print_table(rows, ["dtype", "prompts", "batch", "radixgen_tok_s", "transformers_tok_s", "ratio"])
    path = write_json("bench_offline", {"new_tokens": args.new_tokens, "rows": rows})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
