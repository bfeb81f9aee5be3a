"""Quantized weights: decode throughput of the bundled GGUF (or ``--model``) held as float32,
bfloat16, int8 and int4, side by side in one run, and llama.cpp on the same file and the same
prompt tokens at batch 1 when its virtualenv exists (``$RADIXGEN_PEERS/llamacpp``, as
``compare_serving.py`` documents; skipped with a message otherwise).

Each configuration runs in its own subprocess, one after the other (two runtimes in one process
slow each other's thread teams). Greedy, EOS ignored, radix cache off, prompts of 128 tokens,
``--new-tokens`` (64) each; batch sizes ``--batch-sizes`` (1,8,32,64). Reported: output tokens per
second end to end (the prompt's prefill included), the decode rate after the first token, the
time to it, and the bytes of weights each engine holds.

    python benchmarks/bench_quant.py [--model PATH.gguf] [--batch-sizes 1,8,32,64] [--new-tokens 64]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.common import print_table, prompts_of_lengths, write_json  # noqa: E402
from radixgen.paths import cache_dir  # noqa: E402

PEERS = Path(os.environ.get("RADIXGEN_PEERS", cache_dir() / "peers"))

CONFIGS = [("float", "float32"), ("float", "bfloat16"), ("int8", "float32"), ("auto", "float32")]
"""auto runs the file's own blocks (the bundled one: Q4_1 linears, Q8_0 embedding); int8 runs the
dequantized float checkpoint quantized to 8 bits at load (what --weights int8 does for any float
checkpoint), since a GGUF's blocks are always taken as they are."""


def radixgen_worker(args: argparse.Namespace) -> None:
    from radixgen import Engine, EngineConfig, SamplingParams

    model = args.model
    if args.weights == "int8":  # the float checkpoint the GGUF converts to
        from radixgen.models.loader import resolve_model_dir

        model = str(resolve_model_dir(args.model))
    engine = Engine(EngineConfig(model=model, weights=args.weights, dtype=args.dtype, kv_cache_gb=2.0,
                                 disable_radix_cache=True))
    weight_bytes = engine.runner.model.weight_bytes()
    params = SamplingParams(max_new_tokens=args.new_tokens, temperature=0, ignore_eos=True)
    engine.generate(prompts_of_lengths(engine.tokenizer, [64, 80], seed=99), SamplingParams(
        max_new_tokens=8, temperature=0, ignore_eos=True))
    first_token = SamplingParams(max_new_tokens=1, temperature=0, ignore_eos=True)
    for batch in map(int, args.batch_sizes.split(",")):
        prompts = prompts_of_lengths(engine.tokenizer, [128] * batch, seed=batch)
        start = time.perf_counter()
        engine.generate(prompts, first_token)  # the cache is off: the same prefill as below
        first_s = time.perf_counter() - start
        start = time.perf_counter()
        engine.generate(prompts, params)
        total_s = time.perf_counter() - start
        print(json.dumps({"batch": batch, "tok_s": batch * args.new_tokens / total_s, "first_token_s": first_s,
                          "decode_tok_s": batch * (args.new_tokens - 1) / (total_s - first_s),
                          "weight_bytes": weight_bytes}), flush=True)
    engine.shutdown()


def run_llama_cpp(args: argparse.Namespace) -> dict[int, dict[str, Any]] | None:
    """Batch 1 (llama-cpp-python serves one sequence at a time) on the prompt radixgen's batch-1
    row ran, in the peers' virtualenv; None where that does not exist."""
    from transformers import AutoTokenizer

    from radixgen.models.loader import default_gguf_path, resolve_model_dir

    python = PEERS / "llamacpp" / "bin" / "python"
    if not python.exists():
        return None
    tokenizer = AutoTokenizer.from_pretrained(resolve_model_dir(args.model))
    prompts = [prompts_of_lengths(tokenizer, [128], seed=seed)[0] for seed in (1, 2, 3)]  # seed 1: radixgen's
    with tempfile.NamedTemporaryFile("w", suffix=".json") as ids:
        json.dump(prompts, ids)
        ids.flush()
        proc = subprocess.run([str(python), str(Path(__file__).with_name("peers") / "llamacpp_decode.py"),
                               "--model", args.model or str(default_gguf_path()), "--prompts", ids.name,
                               "--new-tokens", str(args.new_tokens), "--threads", str(args.threads)],
                              capture_output=True, text=True)
    if proc.returncode:
        raise RuntimeError(f"llama.cpp failed:\n{proc.stderr[-3000:]}")
    records = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    # the median of three prompts' runs, key by key
    row = {key: sorted(r[key] for r in records)[len(records) // 2] for key in records[0]}
    return {1: {**row, "weight_bytes": None}}


def run(kind: str, args: argparse.Namespace, weights: str = "", dtype: str = "") -> dict[int, dict[str, Any]]:
    cmd = [sys.executable, __file__, "--worker", kind, "--weights", weights or "auto", "--dtype", dtype or "float32",
           "--batch-sizes", args.batch_sizes, "--new-tokens", str(args.new_tokens), "--threads", str(args.threads),
           *(["--model", args.model] if args.model else [])]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode:
        raise RuntimeError(f"{kind} {weights} {dtype} failed:\n{proc.stderr[-3000:]}")
    return {rec["batch"]: rec for rec in map(json.loads, (ln for ln in proc.stdout.splitlines() if ln.startswith("{")))}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="a .gguf file (default: the bundled SmolLM2 Q4_1)")
    parser.add_argument("--batch-sizes", default="1,8,32,64")
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--threads", type=int, default=2, help="llama.cpp threads")
    parser.add_argument("--configs", default=",".join(f"{w}:{d}" for w, d in CONFIGS),
                        help="radixgen's weights:dtype pairs to run (default: all four)")
    parser.add_argument("--worker", choices=["radixgen"], help=argparse.SUPPRESS)
    parser.add_argument("--weights", default="auto", help=argparse.SUPPRESS)
    parser.add_argument("--dtype", default="float32", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker == "radixgen":
        radixgen_worker(args)
        return
    rows: list[dict[str, Any]] = []
    for weights, dtype in (pair.split(":") for pair in args.configs.split(",")):
        for batch, rec in run("radixgen", args, weights, dtype).items():
            rows.append({"engine": "radixgen", "weights": weights, "dtype": dtype, "batch": batch,
                         "tok_s": rec["tok_s"], "decode_tok_s": rec["decode_tok_s"],
                         "first_token_s": rec["first_token_s"], "weight_MB": rec["weight_bytes"] / 1e6})
    llama = run_llama_cpp(args) if "1" in args.batch_sizes.split(",") else None
    if llama is None:
        print(f"no llama-cpp-python virtualenv at {PEERS / 'llamacpp'} (python -m venv there, then pip install "
              "llama-cpp-python): the llama.cpp row is skipped")
    for batch, rec in (llama or {}).items():
        rows.append({"engine": "llama.cpp", "weights": "gguf", "dtype": "-", "batch": batch, "tok_s": rec["tok_s"],
                     "decode_tok_s": rec["decode_tok_s"], "first_token_s": rec["first_token_s"], "weight_MB": None})
    base = {r["batch"]: r["tok_s"] for r in rows if r["weights"] == "float" and r["dtype"] == "float32"}
    base = base or {r["batch"]: r["tok_s"] for r in rows[:1]}
    for r in rows:
        r["vs_float32"] = r["tok_s"] / base[r["batch"]] if r["batch"] in base else None
    print_table(rows, ["engine", "weights", "dtype", "batch", "tok_s", "decode_tok_s", "first_token_s", "vs_float32",
                       "weight_MB"])
    path = write_json("bench_quant", {"new_tokens": args.new_tokens, "rows": rows})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
