"""Offline throughput: radixgen's Engine.generate vs transformers' model.generate.

Same model, same prompts, same number of new tokens (EOS ignored), greedy, in one run:
batch 1/8/32/64 with equal (256-token) and mixed (64-512) prompt lengths, per dtype. Each engine
runs in its own subprocess (one per engine and dtype), one after the other: two torch runtimes
in one process slow each other's OpenMP thread teams down, which would bias the comparison.

radixgen runs with its radix cache off: the prompts are windows of one repeated paragraph, so
they share prefixes by construction, and a cache hit would skip prefill that transformers pays
for (prefix reuse is measured in bench_prefix.py). Cases of batch <= 8 last a few seconds, so
each is run ``--repeats`` times (3) on both engines and the median is reported.

    python benchmarks/bench_offline.py [--dtypes float32,bfloat16] [--batch-sizes 1,8,32,64] [--model PATH]

``--model`` takes any supported folder, .gguf or hub id (default: the bundled SmolLM2).
``--tiny-families`` runs every family's tiny random-weight checkpoint of the tests
(``tests/models/families.py``) instead, one row per family and case, to show that no family
falls off the fast path (the ratio against transformers stays in line with the others).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import subprocess
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


def repeats_for(batch: int, args: argparse.Namespace) -> int:
    return args.repeats if batch <= 8 else 1


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


def worker(args: argparse.Namespace) -> None:
    """Run every configuration on one engine and dtype; print one JSON line per result."""
    from transformers import AutoModelForCausalLM

    cases = [(mode, batch) for mode in args.modes.split(",") for batch in map(int, args.batch_sizes.split(","))]
    if args.worker == "radixgen":
        engine = Engine(EngineConfig(model=args.model, dtype=args.dtypes, kv_cache_gb=4.0,  # type: ignore[arg-type]
                                     disable_radix_cache=True))
        tokenizer = engine.tokenizer
        warm = prompts_of_lengths(tokenizer, [64, 80], seed=99)
        run_radixgen(engine, warm, 8)
        for mode, batch in cases:
            prompts = prompts_of_lengths(tokenizer, lengths_for(mode, batch, args.seed), seed=args.seed + batch)
            runs = [run_radixgen(engine, prompts, args.new_tokens) for _ in range(repeats_for(batch, args))]
            print(json.dumps({"mode": mode, "batch": batch, "tok_s": statistics.median(runs)}), flush=True)
        engine.shutdown()
        return
    from transformers import AutoTokenizer

    model_dir = resolve_model_dir(args.model)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, args.dtypes)).eval()
    pad_id = tokenizer.pad_token_id or 0
    run_transformers(hf, pad_id, prompts_of_lengths(tokenizer, [64, 80], seed=99), 8)
    for mode, batch in cases:
        prompts = prompts_of_lengths(tokenizer, lengths_for(mode, batch, args.seed), seed=args.seed + batch)
        runs = [run_transformers(hf, pad_id, prompts, args.new_tokens) for _ in range(repeats_for(batch, args))]
        print(json.dumps({"mode": mode, "batch": batch, "tok_s": statistics.median(runs)}), flush=True)


def run_worker(kind: str, dtype: str, args: argparse.Namespace) -> dict[tuple[str, int], float]:
    cmd = [sys.executable, __file__, "--worker", kind, "--dtypes", dtype, "--batch-sizes", args.batch_sizes,
           "--modes", args.modes, "--new-tokens", str(args.new_tokens), "--seed", str(args.seed),
           "--repeats", str(args.repeats), *(["--model", args.model] if args.model else [])]
    proc = subprocess.run(cmd, capture_output=True, text=True, check=True)
    results = {}
    for line in proc.stdout.splitlines():
        if line.startswith("{"):
            rec = json.loads(line)
            results[(rec["mode"], rec["batch"])] = rec["tok_s"]
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--batch-sizes", default="1,8,32,64")
    parser.add_argument("--modes", default="equal,mixed")
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--skip-transformers", action="store_true")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--repeats", type=int, default=3, help="runs per case of batch <= 8 (median reported)")
    parser.add_argument("--model", default=None, help="folder, .gguf or hub id (default: the bundled SmolLM2)")
    parser.add_argument("--tiny-families", action="store_true",
                        help="every family's tiny test checkpoint (defaults then: float32, batch 1,8, equal prompts)")
    parser.add_argument("--worker", choices=["radixgen", "transformers"], help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return
    if args.tiny_families:
        tiny_families(args)
        return
    rows: list[dict[str, Any]] = []
    for dtype in args.dtypes.split(","):
        ours = run_worker("radixgen", dtype, args)
        theirs = {} if args.skip_transformers else run_worker("transformers", dtype, args)
        for (mode, batch), tok_s in ours.items():
            other = theirs.get((mode, batch))
            rows.append({"dtype": dtype, "prompts": mode, "batch": batch, "radixgen_tok_s": tok_s,
                         "transformers_tok_s": other, "ratio": tok_s / other if other else None})
        print_table([r for r in rows if r["dtype"] == dtype], list(rows[0]))
        sys.stdout.flush()
    print()
    print_table(rows, ["dtype", "prompts", "batch", "radixgen_tok_s", "transformers_tok_s", "ratio"])
    path = write_json("bench_offline", {"new_tokens": args.new_tokens, "repeats": args.repeats, "radix_cache": False,
                                        "rows": rows})
    print(f"wrote {path}")


def tiny_families(args: argparse.Namespace) -> None:
    import tempfile

    from transformers import AutoTokenizer

    from tests.models.families import family_configs, save_family_model

    defaults = {"dtypes": "float32,bfloat16", "batch_sizes": "1,8,32,64", "modes": "equal,mixed"}
    if args.dtypes == defaults["dtypes"]:
        args.dtypes = "float32"
    if args.batch_sizes == defaults["batch_sizes"]:
        args.batch_sizes = "1,8"
    if args.modes == defaults["modes"]:
        args.modes = "equal"
    tokenizer = AutoTokenizer.from_pretrained(resolve_model_dir(None))
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as root:
        for name in family_configs():
            args.model = str(save_family_model(name, Path(root) / name, tokenizer))
            for dtype in args.dtypes.split(","):
                ours, theirs = run_worker("radixgen", dtype, args), run_worker("transformers", dtype, args)
                for (mode, batch), tok_s in ours.items():
                    other = theirs[(mode, batch)]
                    rows.append({"family": name, "dtype": dtype, "batch": batch, "radixgen_tok_s": tok_s,
                                 "transformers_tok_s": other, "ratio": tok_s / other})
            print_table([r for r in rows if r["family"] == name], list(rows[0]))
            sys.stdout.flush()
    print()
    print_table(rows, list(rows[0]))
    path = write_json("bench_offline_families", {"new_tokens": args.new_tokens, "modes": args.modes, "rows": rows})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
