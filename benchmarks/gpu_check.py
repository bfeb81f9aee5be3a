"""The GPU check: radixgen on a CUDA machine, measured from outside, in one table.

Run it from the folder ``make gpu-bundle`` writes (the package source, the bundled model's
config and tokenizer, and the wheels a CUDA image with torch, transformers and triton lacks):

    python3 -m pip install -q --no-index --no-deps --target /tmp/site wheels/*.whl
    PYTHONPATH=/tmp/site:. python3 benchmarks/gpu_check.py [--out DIR]

It runs ``pytest -m cuda`` (the GPU tests), then builds random-weight models of SmolLM2-135M's
shape and of Llama-3.2-1B's shape (with SmolLM2's vocabulary, so every sampled id decodes) in
bfloat16 and measures, greedy with EOS ignored:

- decode tok/s at batch 1 / 64 / 256: (tokens of an 80-token run - a 16-token run) over the
  difference of their times, so prefill and start-up cancel; ``bound_share``: batch 1's rate
  over the HBM bandwidth bound (weights read once per token, ``--hbm-gbs``);
- prefill tok/s: 32 distinct prompts of 512 tokens, one new token each, prefix cache off;
- JSON-schema decoding at batch 64 beside the same batch unconstrained (tok/s of each);
- gpu_busy: CUDA kernel time over wall time during batch-64 decoding (torch.profiler);
- transformers' ``generate`` on a model of the same shape on the same GPU, batch 1 and 64;
- the decode rates again with CUDA graphs and overlapped scheduling each on and off (the main
  row is both on, the defaults on CUDA), with a per-step breakdown from torch.profiler: device
  (kernel) time per step, the time per step the device sits idle waiting on the host, and
  kernel or graph launches per step.

``--device cpu --quick`` runs the same code on tiny models here (the test suite does, so the
script stays runnable where no GPU is). Prints one table and writes ``gpu_check.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from radixgen import Engine, EngineConfig, SamplingParams  # noqa: E402
from radixgen.models import CausalLM, LoadedModel, ModelConfig  # noqa: E402

# Llama-3.2-1B's shape (its config.json), with SmolLM2's vocabulary
LLAMA_1B = dict(
    architectures=["LlamaForCausalLM"], model_type="llama", hidden_size=2048, intermediate_size=8192,
    num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8, head_dim=64, rms_norm_eps=1e-5,
    rope_theta=500000.0, max_position_embeddings=131072, tie_word_embeddings=True, vocab_size=49152,
    rope_scaling={"factor": 32.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
                  "original_max_position_embeddings": 8192, "rope_type": "llama3"},
    bos_token_id=1, eos_token_id=2,
)
TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            head_dim=16)
SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 24}, "age": {"type": "integer", "minimum": 0, "maximum": 150},
    "tags": {"type": "array", "items": {"type": "string", "maxLength": 12}, "maxItems": 4},
}, "required": ["name", "age", "tags"]}


def model_dir() -> Path:
    """The bundled model's config and tokenizer: the bundle's copy, else the converted GGUF."""
    bundled = ROOT / "model"
    if (bundled / "config.json").exists():
        return bundled
    from radixgen.models.loader import resolve_model_dir

    return resolve_model_dir(None, float_weights=False)


def random_model(hf_fields: dict[str, Any], device: str, dtype: torch.dtype, tokenizer: Any) -> LoadedModel:
    """A model of the given config with random weights (std 0.02, norms at 1), built on ``device``."""
    from transformers import AutoConfig

    hf_config = AutoConfig.for_model(**{k: v for k, v in hf_fields.items() if k != "architectures"})
    hf_config.architectures = hf_fields["architectures"]
    cfg = ModelConfig.from_hf(hf_config)
    with torch.device(device):
        model = CausalLM(cfg, dtype, cfg.max_position_embeddings)
    generator = torch.Generator(device=device).manual_seed(0)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight") or ".q_norm." in name or ".k_norm." in name:
                param.fill_(1.0)
            else:
                param.normal_(0.0, 0.02, generator=generator)
    if cfg.tie_word_embeddings:
        model.lm_head.weight = model.embed
    return LoadedModel(model=model.eval(), config=cfg, tokenizer=tokenizer, path=model_dir())


def weight_bytes(loaded: LoadedModel) -> int:
    return loaded.model.weight_bytes()


def _prompts(tokenizer: Any, batch: int, length: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(100, tokenizer.vocab_size - 100, (batch, length), generator=g).tolist()


def _timed(engine: Engine, prompts: list[list[int]], params: Any) -> tuple[float, int]:
    sync()
    start = time.perf_counter()
    outs = engine.generate(prompts, params)
    sync()
    return time.perf_counter() - start, sum(len(o.token_ids) for o in outs)


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def decode_rate(engine: Engine, batch: int, short: int, long: int, seed: int) -> float:
    def run(n: int, s: int) -> tuple[float, int]:
        prompts = _prompts(engine.tokenizer, batch, 64, s)
        return _timed(engine, prompts, SamplingParams(max_new_tokens=n, temperature=0, ignore_eos=True))

    run(4, seed)  # warm: shapes, allocator, kernels' compilation
    t_short, n_short = run(short, seed + 1)
    t_long, n_long = run(long, seed + 2)
    return (n_long - n_short) / max(t_long - t_short, 1e-9)


def prefill_rate(engine: Engine, batch: int, length: int) -> float:
    params = SamplingParams(max_new_tokens=1, temperature=0, ignore_eos=True)
    _timed(engine, _prompts(engine.tokenizer, 2, length, 50), params)
    elapsed, _ = _timed(engine, _prompts(engine.tokenizer, batch, length, 51), params)
    return batch * length / elapsed


def json_rates(engine: Engine, batch: int, new_tokens: int) -> tuple[float, float, int]:
    """(constrained tok/s, unconstrained tok/s, valid answers) at ``batch``."""
    prompts = _prompts(engine.tokenizer, batch, 32, 60)
    constrained = [SamplingParams(max_new_tokens=new_tokens, temperature=0.7, seed=i, json_schema=SCHEMA)
                   for i in range(batch)]
    engine.generate(prompts[:2], constrained[:2])  # compile the grammar, warm
    sync()
    start = time.perf_counter()
    outs = engine.generate(prompts, constrained)
    sync()
    elapsed = time.perf_counter() - start
    valid = sum(_is_object(out.text) for out in outs)
    constrained_rate = sum(len(o.token_ids) for o in outs) / elapsed
    mean_len = max(1, round(sum(len(o.token_ids) for o in outs) / batch))
    plain_time, plain_tokens = _timed(engine, prompts, SamplingParams(max_new_tokens=mean_len, temperature=0.7,
                                                                      seed=1, ignore_eos=True))
    return constrained_rate, plain_tokens / plain_time, valid


def _is_object(text: str) -> bool:
    try:
        return isinstance(json.loads(text), dict)
    except ValueError:
        return False


def gpu_busy(engine: Engine, batch: int, new_tokens: int) -> float | None:
    """CUDA kernel time over wall time while ``batch`` rows decode."""
    if not torch.cuda.is_available():
        return None
    from torch.profiler import ProfilerActivity, profile

    prompts = _prompts(engine.tokenizer, batch, 64, 70)
    params = SamplingParams(max_new_tokens=new_tokens, temperature=0, ignore_eos=True)
    engine.generate(prompts[:2], params)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        elapsed, _ = _timed(engine, prompts, params)
    from torch.autograd import DeviceType

    # kernels and copies on the device, one stream: their time over the wall time
    kernel_us = sum(e.time_range.elapsed_us() for e in prof.events() if e.device_type == DeviceType.CUDA)
    return kernel_us * 1e-6 / elapsed


VARIANTS = {
    "graphs+overlap": {"cuda_graphs": True, "overlap": True},
    "graphs": {"cuda_graphs": True, "overlap": False},
    "overlap": {"cuda_graphs": False, "overlap": True},
    "eager": {"cuda_graphs": False, "overlap": False},
}
_LAUNCHES = ("cudaLaunchKernel", "cuLaunchKernel", "cudaLaunchKernelExC", "cudaGraphLaunch", "cuLaunchKernelEx")


def step_breakdown(engine: Engine, batch: int, new_tokens: int) -> dict[str, float | None]:
    """Per decode step while ``batch`` rows decode: device time, device idle time (wall - device),
    launches. None where there is no GPU."""
    if not torch.cuda.is_available():
        return {"device_ms": None, "idle_ms": None, "launches": None}
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    prompts = _prompts(engine.tokenizer, batch, 64, 80)
    params = SamplingParams(max_new_tokens=new_tokens, temperature=0, ignore_eos=True)
    engine.generate(prompts[:2], params)
    steps_before = engine.scheduler.stats.num_steps
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        elapsed, _ = _timed(engine, prompts, params)
    steps = max(1, engine.scheduler.stats.num_steps - steps_before)
    events = prof.events()
    kernel_s = sum(e.time_range.elapsed_us() for e in events if e.device_type == DeviceType.CUDA) * 1e-6
    launches = sum(1 for e in events if e.device_type == DeviceType.CPU and e.name in _LAUNCHES)
    return {"device_ms": kernel_s * 1e3 / steps, "idle_ms": max(0.0, elapsed - kernel_s) * 1e3 / steps,
            "launches": launches / steps}


def variant_rows(name: str, loaded: LoadedModel, device: str, batches: tuple[int, ...], short: int, long: int,
                 steps: int) -> list[dict[str, Any]]:
    rows = []
    for variant, flags in VARIANTS.items():
        engine = Engine(EngineConfig(device=device, dtype="bfloat16", disable_radix_cache=True,
                                     max_running_requests=max(batches), kv_cache_tokens=max(batches) * 200 + 4096,
                                     max_context_len=1024, **flags), loaded=loaded)
        try:
            row: dict[str, Any] = {"model": name, "variant": variant,
                                   "decode_runner": engine.runner.decode_runner.name}
            for batch in (batches[0], batches[-1]):
                row[f"decode_b{batch}"] = decode_rate(engine, batch, short, long, seed=batch)
                for key, value in step_breakdown(engine, batch, steps).items():
                    row[f"{key}_b{batch}"] = value
        finally:
            engine.shutdown()
        rows.append(row)
        print(json.dumps(row, default=str))
    return rows


def hf_generate_rate(hf_fields: dict[str, Any], device: str, dtype: torch.dtype, batch: int, new_tokens: int,
                     vocab: int) -> float:
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(**{k: v for k, v in hf_fields.items() if k != "architectures"})
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype).eval()
    ids = torch.randint(100, vocab - 100, (batch, 64), device=device)
    kwargs = dict(max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False, pad_token_id=0)
    with torch.no_grad():
        model.generate(ids, **{**kwargs, "max_new_tokens": 4, "min_new_tokens": 4})
        sync()
        start = time.perf_counter()
        model.generate(ids, **kwargs)
        sync()
    rate = batch * new_tokens / (time.perf_counter() - start)
    del model
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return rate


def run_cuda_tests(out: Path) -> dict[str, Any]:
    if not torch.cuda.is_available():
        return {"skipped": "no GPU"}
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-m", "cuda", "-p", "no:cacheprovider", "tests/"],
        cwd=ROOT, capture_output=True, text=True, timeout=240,
        env={**os.environ, "PYTHONUNBUFFERED": "1", "RADIXGEN_TEST_MODEL_DIR": str(model_dir())},
    )
    (out / "pytest_cuda.log").write_text(result.stdout + result.stderr)
    last = (result.stdout.strip().splitlines() or ["(no output)"])[-1]
    print(f"pytest -m cuda: exit {result.returncode}: {last}")
    return {"exit_code": result.returncode, "summary": last}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--quick", action="store_true", help="tiny models and batches (a smoke run on CPU)")
    parser.add_argument("--hbm-gbs", type=float, default=4800.0, help="HBM bandwidth of the GPU (H200: 4.8 TB/s)")
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    parser.add_argument("--skip-tests", action="store_true")
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    report: dict[str, Any] = {"device": torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu",
                              "torch": torch.__version__}
    print(f"device: {report['device']}, torch {torch.__version__}")
    if not args.skip_tests and not args.quick:
        report["cuda_tests"] = run_cuda_tests(out)

    from transformers import AutoTokenizer

    directory = model_dir()
    tokenizer = AutoTokenizer.from_pretrained(directory)
    smollm2 = json.loads((directory / "config.json").read_text())
    shapes = {"SmolLM2-135M": smollm2, "Llama-3.2-1B": LLAMA_1B}
    dtype = torch.bfloat16
    batches = (1, 4) if args.quick else (1, 64, 256)
    short, long = (2, 6) if args.quick else (16, 80)
    rows, variants = [], []
    for name, fields in shapes.items():
        if args.quick:
            fields = {**fields, **TINY}
        loaded = random_model(fields, args.device, dtype, tokenizer)
        row: dict[str, Any] = {"model": name, "weights_GB": weight_bytes(loaded) / 1e9}
        engine = Engine(EngineConfig(device=args.device, dtype="bfloat16", disable_radix_cache=True,
                                     max_running_requests=max(batches), kv_cache_tokens=max(batches) * 200 + 4096,
                                     max_context_len=1024), loaded=loaded)
        try:
            for batch in batches:
                row[f"decode_b{batch}"] = decode_rate(engine, batch, short, long, seed=batch)
            row["step_ms_b1"] = 1e3 / row[f"decode_b{batches[0]}"]
            bound = args.hbm_gbs * 1e9 / weight_bytes(loaded)
            row["bound_share_b1"] = row[f"decode_b{batches[0]}"] / bound
            row["prefill"] = prefill_rate(engine, 4 if args.quick else 32, 64 if args.quick else 512)
            json_batch = 4 if args.quick else 64
            row["json_b64"], row["plain_b64"], valid = json_rates(engine, json_batch, 24 if args.quick else 96)
            row["json_valid"] = f"{valid}/{json_batch}"
            busy = gpu_busy(engine, json_batch, 32)
            row["gpu_busy"] = busy
            row["gpu_busy_b_max"] = gpu_busy(engine, max(batches), 32)
        finally:
            engine.shutdown()
        variants += variant_rows(name, loaded, args.device, batches, short, long, 8 if args.quick else 32)
        del loaded, engine
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        hf_fields = {**fields, "vocab_size": fields.get("vocab_size", 49152)}
        for batch in (1, 4 if args.quick else 64):
            rate = hf_generate_rate(hf_fields, args.device, dtype, batch, 8 if args.quick else 64, tokenizer.vocab_size)
            row[f"hf_b{batch}"] = rate
            ours = row.get(f"decode_b{batch}")
            row[f"vs_hf_b{batch}"] = ours / rate if ours else None
        rows.append(row)
        print(json.dumps(row, default=str))
    report["rows"] = rows
    report["variants"] = variants
    from benchmarks.common import print_table

    columns = ["model", "weights_GB", *[f"decode_b{b}" for b in batches], "step_ms_b1", "bound_share_b1", "prefill",
               "json_b64", "plain_b64", "json_valid", "gpu_busy", "gpu_busy_b_max",
               *[k for k in rows[0] if k.startswith(("hf_", "vs_hf"))]]
    print_table(rows, columns)
    print_table(variants, list(variants[0]))
    (out / "gpu_check.json").write_text(json.dumps(report, indent=2, default=str))
    print(f"wrote {out / 'gpu_check.json'}")


if __name__ == "__main__":
    main()
