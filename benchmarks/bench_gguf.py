"""A GGUF file as users bring it: start time (fresh cache and warm), what the start writes to disk,
resident and peak memory, decode at batch 1 / 16 / 64 and a 512-token prefill, for radixgen's
defaults and ``weights="float"``, beside llama.cpp's ``llama-bench`` (prefill 512, batch-1 decode)
and ``llama-batched-bench`` (decode at each batch) on the same file and threads, in one run.

    python benchmarks/bench_gguf.py [MODEL.gguf] [--llama-cpp BUILD/bin] [--threads 2] [--configs auto,float]

MODEL: default, the real test model (Qwen2.5-Coder-0.5B-Instruct Q4_K_M, ``packaged_models.py``).
Each radixgen figure comes from its own process (``--worker``): a fresh start runs with an empty
``$RADIXGEN_CACHE`` (only the kernel build linked in: it is per machine, not per model), a warm one
with the cache that start left. Start time: the process's start until ``Engine(...)`` returns;
peaks: the process's maximum resident set by then (fresh and warm); resident: after the start. KV pool: 8,192 tokens.
Decode rows: prompts of 32 tokens, 64 new tokens each, EOS ignored, radix cache off; the rate is
the tokens after the first over the time after the first. Prefill: one 512-token prompt, one new
token.

llama.cpp (a prerequisite of this benchmark only): build the release that the llama-cpp-python
source vendors, e.g. ``pip download --no-deps --no-binary :all: llama-cpp-python==0.3.36``, then in
its ``vendor/llama.cpp``: ``cmake -B build -DGGML_NATIVE=ON -DLLAMA_CURL=OFF && cmake --build build
-j2 --target llama-bench llama-batched-bench``, and pass ``--llama-cpp vendor/llama.cpp/build/bin``.
Without it the llama.cpp rows are skipped with a message.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.common import print_table, prompts_of_lengths, write_json  # noqa: E402

KV_TOKENS = 8192
BATCHES = (1, 16, 64)
PROMPT_TOKENS, NEW_TOKENS, PREFILL_TOKENS = 32, 64, 512


def worker(args: argparse.Namespace) -> None:
    """One start and (``--measure``) the speed rows; prints one JSON line."""
    import resource

    import psutil

    start = time.monotonic()
    from radixgen import Engine, EngineConfig, SamplingParams

    engine = Engine(EngineConfig(model=args.model, weights=args.weights, kv_cache_tokens=KV_TOKENS,
                                 max_context_len=2048, disable_radix_cache=True))
    out: dict[str, Any] = {
        "start_s": time.monotonic() - start + args.interpreter_s,
        "resident_MiB": psutil.Process().memory_info().rss / 2**20,
        "start_peak_MiB": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "weights": engine.info()["weights"], "dtype": str(engine.runner.model.embed.dtype).removeprefix("torch."),
    }
    if args.measure:
        tok = engine.tokenizer
        warm = SamplingParams(max_new_tokens=4, temperature=0, ignore_eos=True)
        engine.generate(prompts_of_lengths(tok, [64, 80], seed=99), warm)
        prompt = prompts_of_lengths(tok, [PREFILL_TOKENS], seed=7)
        t = time.perf_counter()
        engine.generate(prompt, SamplingParams(max_new_tokens=1, temperature=0))
        out["prefill_tok_s"] = PREFILL_TOKENS / (time.perf_counter() - t)
        for batch in BATCHES:
            prompts = prompts_of_lengths(tok, [PROMPT_TOKENS] * batch, seed=batch)
            t = time.perf_counter()
            engine.generate(prompts, SamplingParams(max_new_tokens=1, temperature=0, ignore_eos=True))
            first = time.perf_counter() - t
            t = time.perf_counter()
            engine.generate(prompts, SamplingParams(max_new_tokens=NEW_TOKENS, temperature=0, ignore_eos=True))
            total = time.perf_counter() - t
            out[f"decode_b{batch}_tok_s"] = batch * (NEW_TOKENS - 1) / (total - first)
    engine.shutdown()
    out["peak_MiB"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(json.dumps(out), flush=True)


def run_worker(model: Path, weights: str, cache: Path, measure: bool) -> dict[str, Any]:
    # the interpreter's own start is counted: the launch time is passed in (CLOCK_MONOTONIC is one
    # clock for every process of the machine)
    launched = time.monotonic()
    cmd = [sys.executable, __file__, str(model), "--worker", "--weights", weights,
           "--launched", repr(launched), *(["--measure"] if measure else [])]
    env = {**os.environ, "RADIXGEN_CACHE": str(cache), "TOKENIZERS_PARALLELISM": "false"}
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if proc.returncode:
        raise RuntimeError(f"radixgen {weights} failed:\n{proc.stderr[-3000:]}")
    return json.loads([ln for ln in proc.stdout.splitlines() if ln.startswith("{")][-1])


def cache_bytes(cache: Path) -> int:
    """What the starts wrote for the model (the kernel build, shared by every model, aside)."""
    return sum(f.stat().st_size for f in cache.rglob("*") if f.is_file() and "kernels" not in f.parts)


def radixgen_rows(model: Path, configs: list[str]) -> list[dict[str, Any]]:
    from radixgen.paths import cache_dir

    kernels = cache_dir() / "kernels"
    rows = []
    for weights in configs:
        with tempfile.TemporaryDirectory(prefix="radixgen-bench-gguf-") as tmp:
            cache = Path(tmp)
            if kernels.exists():
                (cache / "kernels").symlink_to(kernels)
            fresh = run_worker(model, weights, cache, measure=False)
            written = cache_bytes(cache)
            warm = run_worker(model, weights, cache, measure=True)
        rows.append({"engine": f"radixgen {weights}", "holds": warm["weights"], "dtype": warm["dtype"],
                     "fresh_start_s": fresh["start_s"], "warm_start_s": warm["start_s"],
                     "cache_MiB": written / 2**20, "resident_MiB": warm["resident_MiB"],
                     "fresh_peak_MiB": fresh["start_peak_MiB"], "warm_peak_MiB": warm["start_peak_MiB"],
                     "run_peak_MiB": warm["peak_MiB"],
                     **{k: v for k, v in warm.items() if k.endswith("tok_s")}})
    return rows


def llama_cpp_row(model: Path, bin_dir: Path | None, threads: int) -> dict[str, Any] | None:
    if bin_dir is None or not (bin_dir / "llama-bench").exists():
        print(f"no llama-bench in {bin_dir} (see this file's docstring to build it): the llama.cpp row is skipped")
        return None
    bench = subprocess.run([str(bin_dir / "llama-bench"), "-m", str(model), "-t", str(threads), "-p",
                            str(PREFILL_TOKENS), "-n", str(NEW_TOKENS), "-r", "3", "-o", "json"],
                           capture_output=True, text=True)
    if bench.returncode:
        raise RuntimeError(f"llama-bench failed:\n{bench.stderr[-3000:]}")
    row: dict[str, Any] = {"engine": "llama.cpp", "holds": "the file (mmap)", "dtype": "-"}
    for rec in json.loads(bench.stdout):
        key = "prefill_tok_s" if rec.get("n_prompt") else "decode_b1_tok_s"
        row[key] = rec["avg_ts"]
    batched = subprocess.run([str(bin_dir / "llama-batched-bench"), "-m", str(model), "-t", str(threads), "-tb",
                              str(threads), "-c", str(KV_TOKENS), "-b", "2048", "-ub", "512", "-npp",
                              str(PROMPT_TOKENS), "-ntg", str(NEW_TOKENS), "-npl", ",".join(map(str, BATCHES))],
                             capture_output=True, text=True)
    if batched.returncode:
        raise RuntimeError(f"llama-batched-bench failed:\n{batched.stderr[-3000:]}")
    # its table: |    PP |     TG |    B |   N_KV |   T_PP s | S_PP t/s |   T_TG s | S_TG t/s |      T s |    S t/s |
    for line in batched.stdout.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) >= 8 and re.fullmatch(r"\d+", cells[2] or "x"):
            row[f"decode_b{int(cells[2])}_tok_s"] = float(cells[7])
    start = time.monotonic()  # llama.cpp's start: load the file and answer one token
    subprocess.run([str(bin_dir / "llama-bench"), "-m", str(model), "-t", str(threads), "-p", "0", "-n", "1",
                    "-r", "1"], capture_output=True, text=True)
    row["warm_start_s"] = time.monotonic() - start
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model", nargs="?", default=None, help="a .gguf file (default: the real test model)")
    parser.add_argument("--llama-cpp", type=Path, default=None, help="the folder holding llama-bench")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--configs", default="auto,float", help="radixgen weights= values to run")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--measure", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--weights", default="auto", help=argparse.SUPPRESS)
    parser.add_argument("--launched", type=float, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        args.interpreter_s = 0.0
        if args.launched is not None:
            args.interpreter_s = time.monotonic() - args.launched
        worker(args)
        return
    if args.model is None:
        from radixgen.models.packaged_models import real_model_gguf

        args.model = str(real_model_gguf())
    model = Path(args.model)
    file_mib = model.stat().st_size / 2**20
    rows = radixgen_rows(model, args.configs.split(","))
    llama = llama_cpp_row(model, args.llama_cpp, args.threads)
    if llama:
        rows.append(llama)
    print(f"model: {model.name} ({file_mib:.0f} MiB); targets: resident <= {1.25 * file_mib + 600:.0f} MiB, "
          f"peak <= {1.25 * file_mib + 800:.0f} MiB, cache <= {0.25 * file_mib:.0f} MiB, warm start <= 5 s")
    columns = ["engine", "holds", "dtype", "fresh_start_s", "warm_start_s", "cache_MiB", "resident_MiB",
               "fresh_peak_MiB", "warm_peak_MiB",
               "prefill_tok_s", *(f"decode_b{b}_tok_s" for b in BATCHES)]
    print_table(rows, columns)
    if llama:
        for r in rows[:-1]:
            ratios = {k: r[k] / llama[k] for k in columns if k.endswith("tok_s") and r.get(k) and llama.get(k)}
            print(f"{r['engine']} / llama.cpp: " + ", ".join(f"{k.removesuffix('_tok_s')} {v:.2f}x"
                                                           for k, v in ratios.items()))
    path = write_json("bench_gguf", {"model": model.name, "file_MiB": file_mib, "threads": args.threads,
                                     "rows": rows})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
