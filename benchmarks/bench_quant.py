"""Quantized weights: decode throughput of the bundled GGUF (or ``--model``) held as float32,
bfloat16, int8 and int4, side by side in one run, and llama.cpp on the same file when
llama-cpp-python is installed (skipped with a message otherwise).

Each configuration runs in its own subprocess, one after the other (two torch runtimes in one
process slow each other's thread teams). Greedy, EOS ignored, radix cache off, prompts of 128
tokens, ``--new-tokens`` (64) each; batch sizes ``--batch-sizes`` (1,8,64). Also reported: the
bytes of weights each engine holds.

    python benchmarks/bench_quant.py [--model PATH.gguf] [--batch-sizes 1,8,64] [--new-tokens 64]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.common import print_table, prompts_of_lengths, write_json  # noqa: E402

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
    for batch in map(int, args.batch_sizes.split(",")):
        prompts = prompts_of_lengths(engine.tokenizer, [128] * batch, seed=batch)
        start = time.perf_counter()
        engine.generate(prompts, params)
        tok_s = batch * args.new_tokens / (time.perf_counter() - start)
        print(json.dumps({"batch": batch, "tok_s": tok_s, "weight_bytes": weight_bytes}), flush=True)
    engine.shutdown()


def llama_cpp_worker(args: argparse.Namespace) -> None:
    import llama_cpp
    from transformers import AutoTokenizer

    from radixgen.models.loader import default_gguf_path, resolve_model_dir

    path = args.model or str(default_gguf_path())
    tokenizer = AutoTokenizer.from_pretrained(resolve_model_dir(args.model))
    llm = llama_cpp.Llama(model_path=path, n_ctx=512, n_threads=args.threads, verbose=False)
    for batch in map(int, args.batch_sizes.split(",")):
        if batch != 1:
            continue  # llama-cpp-python serves one sequence at a time
        (prompt,) = prompts_of_lengths(tokenizer, [128], seed=batch)
        llm.reset()
        start = time.perf_counter()
        produced = 0
        for _token in llm.generate(prompt, temp=0.0):
            produced += 1
            if produced == args.new_tokens:
                break
        print(json.dumps({"batch": 1, "tok_s": produced / (time.perf_counter() - start), "weight_bytes": None}),
              flush=True)


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
    parser.add_argument("--batch-sizes", default="1,8,64")
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--threads", type=int, default=2, help="llama.cpp threads")
    parser.add_argument("--worker", choices=["radixgen", "llama.cpp"], help=argparse.SUPPRESS)
    parser.add_argument("--weights", default="auto", help=argparse.SUPPRESS)
    parser.add_argument("--dtype", default="float32", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker == "radixgen":
        radixgen_worker(args)
        return
    if args.worker == "llama.cpp":
        llama_cpp_worker(args)
        return
    rows: list[dict[str, Any]] = []
    for weights, dtype in CONFIGS:
        for batch, rec in run("radixgen", args, weights, dtype).items():
            rows.append({"engine": "radixgen", "weights": weights, "dtype": dtype, "batch": batch,
                         "tok_s": rec["tok_s"], "weight_MB": rec["weight_bytes"] / 1e6})
    try:
        import llama_cpp  # noqa: F401

        for batch, rec in run("llama.cpp", args).items():
            rows.append({"engine": "llama.cpp", "weights": "gguf", "dtype": "-", "batch": batch, "tok_s": rec["tok_s"],
                         "weight_MB": None})
    except ImportError:
        print("llama-cpp-python is not installed: the llama.cpp rows are skipped "
              "(pip install llama-cpp-python, built as benchmarks/peers documents)")
    base = {r["batch"]: r["tok_s"] for r in rows if r["weights"] == "float" and r["dtype"] == "float32"}
    for r in rows:
        r["vs_float32"] = r["tok_s"] / base[r["batch"]] if r["batch"] in base else None
    print_table(rows, ["engine", "weights", "dtype", "batch", "tok_s", "vs_float32", "weight_MB"])
    path = write_json("bench_quant", {"new_tokens": args.new_tokens, "rows": rows})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
