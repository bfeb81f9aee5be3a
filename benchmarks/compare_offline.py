"""radixgen's Engine.generate against vLLM's LLM.generate on the same token ids, one after the other.

    python benchmarks/compare_offline.py [--dtype bfloat16] [--cases plain-64,shared-system-64,...] [--rounds 2] [--skip-vllm]
        [--before REV]

``--before REV`` runs radixgen at that git revision too (a temporary worktree, its own copy of
this script's worker), alternating with this tree every round: the before/after check of a change.

Cases (greedy, EOS ignored, every output exactly ``new_tokens`` long):

- ``plain-64``: 64 distinct prompts of 90-110 tokens, 128 new tokens each (decode-bound);
- ``shared-system-64``: 64 prompts sharing one 1,100-token system prompt, each with its own
  12-24-token question, 128 new each (~70k prompt tokens: prefill-bound without a prefix cache);
- ``long-prefill``: the same prompts with one new token, the prefill alone, cache off;
- ``single``: one 100-token prompt, 256 new tokens.

Each case but ``long-prefill`` runs with the prefix cache off and on; with it on, both engines
drop what the previous run cached first (``reset_prefix_cache``), so sharing happens inside the
run only. radixgen and vLLM run in their own subprocesses one after the other (two torch runtimes
in one process slow each other down); vLLM runs from its own virtualenv (RADIXGEN_PEERS/vllm, see
benchmarks/README.md) through ``peers/vllm_offline.py``, bound to the same cores.

Besides tok/s and the ratio, the table gives each row's share of the machine's ceiling: the
model's matmul FLOPs per token (2 x its linear weights, the LM head included) over a bf16/fp32
matmul of the model's shape measured here on all threads. For decode rows the ceiling counts
prompt and output tokens (what an engine without a cache must compute); for ``long-prefill`` the
share is of the matmul peak itself.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.common import (  # noqa: E402
    print_table,
    prompts_of_lengths,
    trees_to_measure,
    vllm_cpu_env,
    write_json,
)
from radixgen.models.loader import resolve_model_dir  # noqa: E402
from radixgen.paths import cache_dir  # noqa: E402

PEERS = Path(os.environ.get("RADIXGEN_PEERS", cache_dir() / "peers"))
_CACHE_ON_FIRST = "COMPARE_OFFLINE_CACHE_ON_FIRST"
CASES = ("plain-64", "shared-system-64", "long-prefill", "single")
WORD_TEXT = ("order parcel refund window tracking agent phone week delivery customer cache tree token batch "
             "schedule memory kernel request answer question price hotel train ticket weather password form "
             "charger engine queue prefix model layer budget service market river garden winter letter")
WORDS = WORD_TEXT.split()


def question(tokenizer: Any, rng: random.Random, length: int) -> list[int]:
    """A distinct run of ordinary words, exactly ``length`` tokens."""
    ids: list[int] = []
    while len(ids) < length:
        ids += tokenizer.encode(" " + " ".join(rng.choices(WORDS, k=16)), add_special_tokens=False)
    return ids[:length]


def build_cases(tokenizer: Any, names: list[str], seed: int) -> list[dict[str, Any]]:
    rng = random.Random(seed)
    plain = [question(tokenizer, rng, rng.randint(90, 110)) for _ in range(64)]
    system = prompts_of_lengths(tokenizer, [1100], seed=seed)[0]
    shared = [system + question(tokenizer, rng, rng.randint(12, 24)) for _ in range(64)]
    single = [question(tokenizer, rng, 100)]
    specs = {"plain-64": (plain, 128, (False, True), 1), "shared-system-64": (shared, 128, (False, True), 1),
             "long-prefill": (shared, 1, (False,), 1), "single": (single, 256, (False, True), 3)}
    cases = []
    for name in names:
        prompts, new_tokens, caches, repeats = specs[name]
        for cache in caches:
            cases.append({"name": name, "prompts": prompts, "new_tokens": new_tokens, "prefix_cache": cache,
                          "repeats": repeats})
    return cases


def flops_per_token(cfg: dict[str, Any]) -> float:
    h, inter, layers = cfg["hidden_size"], cfg["intermediate_size"], cfg["num_hidden_layers"]
    head_dim = cfg.get("head_dim") or h // cfg["num_attention_heads"]
    q, kv = cfg["num_attention_heads"] * head_dim, cfg["num_key_value_heads"] * head_dim
    per_layer = h * q + 2 * h * kv + q * h + 3 * h * inter
    return 2.0 * (layers * per_layer + cfg["vocab_size"] * h)


def matmul_peak(dtype: torch.dtype, cfg: dict[str, Any]) -> float:
    """FLOP/s of the model's largest linear (hidden x intermediate) at 2,048 rows: the best of
    six rounds of ten calls."""
    a = torch.randn(2048, cfg["hidden_size"], dtype=dtype)
    w = torch.randn(cfg["intermediate_size"], cfg["hidden_size"], dtype=dtype)
    best = float("inf")
    for _ in range(6):
        start = time.perf_counter()
        for _ in range(10):
            torch.nn.functional.linear(a, w)
        best = min(best, (time.perf_counter() - start) / 10)
    return 2.0 * a.shape[0] * a.shape[1] * w.shape[0] / best


def radixgen_worker(cases_path: str, dtype: str, weights: str) -> None:
    from radixgen import Engine, EngineConfig, SamplingParams

    cases = json.loads(Path(cases_path).read_text())
    # the second engine of a process measured slower in some runs: rounds alternate which goes first
    cache_on_first = os.environ.get(_CACHE_ON_FIRST) == "1"
    for cache in sorted({c["prefix_cache"] for c in cases}, reverse=cache_on_first):
        engine = Engine(EngineConfig(dtype=dtype, weights=weights, kv_cache_gb=4.0,  # type: ignore[arg-type]
                                     disable_radix_cache=not cache))
        engine.generate(cases[0]["prompts"][:8], SamplingParams(max_new_tokens=8, temperature=0))
        for case in (c for c in cases if c["prefix_cache"] == cache):
            params = SamplingParams(max_new_tokens=case["new_tokens"], temperature=0, ignore_eos=True)
            walls = []
            for _ in range(case["repeats"]):
                engine.reset_prefix_cache()
                start = time.perf_counter()
                outs = engine.generate(case["prompts"], params)
                walls.append(time.perf_counter() - start)
                generated = sum(o.completion_tokens for o in outs)
                assert generated == len(case["prompts"]) * case["new_tokens"], generated
            print(json.dumps({"name": case["name"], "prefix_cache": cache, "wall_s": statistics.median(walls),
                              "generated": generated}), flush=True)
        engine.shutdown()


def run(cmd: list[str], env: dict[str, str] | None = None, cwd: Path | None = None) -> dict[tuple[str, bool], dict[str, Any]]:
    proc = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, **(env or {})}, cwd=cwd)
    if proc.returncode != 0:
        raise RuntimeError(f"{cmd[:3]} failed:\n{proc.stderr[-3000:]}")
    results = {}
    for line in proc.stdout.splitlines():
        if line.startswith("{"):
            rec = json.loads(line)
            results[(rec["name"], rec["prefix_cache"])] = rec
    return results


def _keep_fastest(best: dict[tuple[str, bool], dict[str, Any]], results: dict[tuple[str, bool], dict[str, Any]]) -> None:
    for key, rec in results.items():
        if key not in best or rec["wall_s"] < best[key]["wall_s"]:
            best[key] = rec


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    parser.add_argument("--cases", default=",".join(CASES))
    parser.add_argument("--weights", default="float", choices=["float", "int8", "int4", "auto"],
                        help="radixgen's weights (vLLM runs the float checkpoint; float is like-for-like, auto "
                             "is radixgen's default: on the bundled GGUF its own Q4_1 blocks)")
    parser.add_argument("--skip-vllm", action="store_true")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--rounds", type=int, default=1,
                        help="run the engines this many times in alternation and keep each one's fastest wall "
                             "per case (this machine's speed drifts by 20%% over minutes)")
    parser.add_argument("--before", help="a git revision whose radixgen runs beside this tree's")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        radixgen_worker(args.worker, args.dtype, args.weights)
        return
    from transformers import AutoTokenizer

    model_dir = resolve_model_dir(None)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    cases = build_cases(tokenizer, args.cases.split(","), args.seed)
    model_config = json.loads((model_dir / "config.json").read_text())
    per_token = flops_per_token(model_config)
    peak = matmul_peak(getattr(torch, args.dtype), model_config)
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump(cases, f)
    vllm_python = PEERS / "vllm" / "bin" / "python"
    with_vllm = not args.skip_vllm and vllm_python.exists()
    if not args.skip_vllm and not with_vllm:
        print(f"no vLLM virtualenv at {vllm_python.parent.parent}: radixgen rows only")
    ours: dict[tuple[str, bool], dict[str, Any]] = {}
    theirs: dict[tuple[str, bool], dict[str, Any]] = {}
    before: dict[tuple[str, bool], dict[str, Any]] = {}
    with trees_to_measure(args.before) as trees:
        for round_index in range(args.rounds):
            for tree, label in trees:
                script = tree / "benchmarks" / "compare_offline.py"
                _keep_fastest(ours if label == "this tree" else before, run(
                    [sys.executable, str(script), "--worker", f.name, "--dtype", args.dtype, "--weights", args.weights],
                    env={_CACHE_ON_FIRST: str(round_index % 2)}, cwd=tree))
            _run_vllm(args, with_vllm, vllm_python, model_dir, f.name, theirs)
    os.unlink(f.name)
    rows = []
    for case in cases:
        key = (case["name"], case["prefix_cache"])
        prompt_tokens = sum(len(p) for p in case["prompts"])
        generated = len(case["prompts"]) * case["new_tokens"]
        row: dict[str, Any] = {"case": case["name"], "prefix_cache": case["prefix_cache"], "prompt_tokens": prompt_tokens,
                               "generated": generated}
        sources = [("radixgen", ours), ("vllm", theirs)] + ([(args.before, before)] if args.before else [])
        for label, results in sources:
            rec = results.get(key)
            if rec is None:
                row[f"{label}_tok_s"] = row[f"{label}_ceiling"] = None
                continue
            row[f"{label}_tok_s"] = (prompt_tokens if case["new_tokens"] == 1 else generated) / rec["wall_s"]
            work = (prompt_tokens + generated) * per_token
            row[f"{label}_ceiling"] = work / rec["wall_s"] / peak
        row["ratio"] = (row["radixgen_tok_s"] / row["vllm_tok_s"]) if row.get("vllm_tok_s") else None
        if args.before:
            row["vs_before"] = row["radixgen_tok_s"] / row[f"{args.before}_tok_s"]
        rows.append(row)
    print(f"matmul peak {peak / 1e9:.0f} GFLOP/s ({args.dtype}, {torch.get_num_threads()} threads), "
          f"{per_token / 1e9:.3f} GFLOP per token; long-prefill tok/s counts prompt tokens")
    print_table(rows, list(rows[0]))
    path = write_json(f"compare_offline-{args.dtype}-{args.weights}",
                      {"matmul_peak_flops": peak, "flops_per_token": per_token, "rounds": args.rounds,
                       "before": args.before, "rows": rows})
    print(f"wrote {path}")


def _run_vllm(args: argparse.Namespace, with_vllm: bool, vllm_python: Path, model_dir: Path, cases_path: str,
              theirs: dict[tuple[str, bool], dict[str, Any]]) -> None:
    if not with_vllm:
        return
    try:
        _keep_fastest(theirs, run(
            [str(vllm_python), str(Path(__file__).parent / "peers" / "vllm_offline.py"), cases_path,
             "--model", str(model_dir), "--dtype", args.dtype], env=vllm_cpu_env(vllm_python.parent.parent)))
    except RuntimeError as e:  # radixgen's rows are still worth printing
        print(e)


if __name__ == "__main__":
    main()
