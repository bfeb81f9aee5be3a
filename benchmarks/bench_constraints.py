"""Constrained decoding costs and coverage, in one run on the SmolLM2 tokenizer.

1. Compile time: radixgen's default backend through its service (spec checks included) vs raw
   xgrammar, on the test-suite schemas and on realistic API schemas (benchmarks/data).
2. Per-token constraint cost (mask fill + apply + accept), walking the suite's valid instances.
3. Batch mask cost with 64 constrained rows vs the unconstrained step.
4. End-to-end on the real model: seconds per JSON object and tokens/s, constrained vs
   unconstrained generation of the same number of tokens, batch 1 and 32.
5. JSON-Schema-Test-Suite score (automaton + steering validators).

    python benchmarks/bench_constraints.py [--skip-e2e]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.common import print_table, write_json  # noqa: E402
from radixgen.constraints import GrammarService, allocate_bitmask, apply_bitmask, make_backend  # noqa: E402
from radixgen.constraints.conformance import score_suite, serialize  # noqa: E402
from radixgen.constraints.spec import schema_spec  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
SUITE = ROOT / "tests" / "data" / "json-schema-test-suite"
API = json.loads((ROOT / "tests" / "data" / "api_schemas.json").read_text())


def pct(xs: list[float], q: float) -> float:
    return float(np.percentile(xs, q)) if xs else float("nan")


def suite_cases() -> list[dict[str, Any]]:
    return [case for f in sorted(SUITE.glob("*.json")) for case in json.loads(f.read_text())]


def compile_times(tokenizer: Any, schemas: list[Any]) -> dict[str, Any]:
    import xgrammar as xgr

    ours, raw, failed_ours, failed_raw = [], [], 0, 0
    service = GrammarService(make_backend("auto", tokenizer, 49152, [tokenizer.eos_token_id]), cache_size=0)
    info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=49152, stop_token_ids=[tokenizer.eos_token_id])
    compiler = xgr.GrammarCompiler(info, max_threads=1)  # its cache on, as in our backend
    for schema in schemas:
        start = time.perf_counter()
        try:
            service.compile(schema_spec(schema))
            ours.append(time.perf_counter() - start)
        except Exception:  # noqa: BLE001
            failed_ours += 1
        start = time.perf_counter()
        try:
            compiler.compile_json_schema(json.dumps(schema), any_whitespace=False, separators=(", ", ": "))
            raw.append(time.perf_counter() - start)
        except Exception:  # noqa: BLE001
            failed_raw += 1
    return {"n": len(schemas), "ours_p50_ms": pct(ours, 50) * 1e3, "ours_p95_ms": pct(ours, 95) * 1e3,
            "xgrammar_p50_ms": pct(raw, 50) * 1e3, "xgrammar_p95_ms": pct(raw, 95) * 1e3,
            "ours_failed": failed_ours, "xgrammar_failed": failed_raw}


def per_token_costs(tokenizer: Any, service: GrammarService) -> dict[str, float]:
    fill, apply, accept = [], [], []
    mask = allocate_bitmask(1, 49152)
    logits = torch.zeros(1, 49152)
    for case in suite_cases():
        try:
            grammar = service.compile(schema_spec(case["schema"]))
        except Exception:  # noqa: BLE001
            continue
        for t in case["tests"]:
            if not t["valid"]:
                continue
            matcher = grammar.matcher()
            for tok in tokenizer.encode(serialize(t["data"], case["schema"], case["schema"] if isinstance(case["schema"], dict) else {}),
                                        add_special_tokens=False):
                a = time.perf_counter()
                matcher.fill_bitmask(mask, 0)
                b = time.perf_counter()
                apply_bitmask(logits, torch.from_numpy(mask))
                c = time.perf_counter()
                ok = matcher.accept(tok)
                d = time.perf_counter()
                if not ok:
                    break
                fill.append(b - a)
                apply.append(c - b)
                accept.append(d - c)
    total = [f + a + c for f, a, c in zip(fill, apply, accept, strict=True)]
    return {"tokens": len(total), "fill_p50_us": pct(fill, 50) * 1e6, "fill_p95_us": pct(fill, 95) * 1e6,
            "apply_p50_us": pct(apply, 50) * 1e6, "accept_p50_us": pct(accept, 50) * 1e6,
            "total_p50_us": pct(total, 50) * 1e6, "total_p95_us": pct(total, 95) * 1e6}


def batch_mask_cost(tokenizer: Any, service: GrammarService, batch: int = 64) -> dict[str, float]:
    matchers = [service.compile(schema_spec(API[i % len(API)]["schema"])).matcher() for i in range(batch)]
    mask = allocate_bitmask(batch, 49152)
    logits = torch.randn(batch, 49152)
    times = []
    for _ in range(20):
        start = time.perf_counter()
        for i, m in enumerate(matchers):
            m.fill_bitmask(mask, i)
        apply_bitmask(logits, torch.from_numpy(mask))
        times.append(time.perf_counter() - start)
    return {"batch": batch, "mask_ms_p50": pct(times, 50) * 1e3}


def end_to_end(batch_sizes: list[int], dtype: str) -> list[dict[str, Any]]:
    """Seconds per JSON object: constrained with and without jump-forward, and unconstrained
    generation of the same number of tokens (EOS ignored)."""
    import jsonschema

    from radixgen import Engine, EngineConfig, SamplingParams

    rows = []
    for jump in (False, True):
        engine = Engine(EngineConfig(dtype=dtype, jump_forward=jump))  # type: ignore[arg-type]
        for batch in batch_sizes:
            specs = [API[i % len(API)] for i in range(batch)]
            prompts = [engine.apply_chat_template([{"role": "user", "content": f"Fill in a {s['name'].replace('_', ' ')} as JSON."}])
                       for s in specs]
            engine.generate(prompts, SamplingParams(max_new_tokens=1))  # prompts cached for both runs alike
            steps = engine.scheduler.stats.num_decode_steps
            start = time.perf_counter()
            outs = engine.generate(prompts, [SamplingParams(max_new_tokens=200, temperature=0, json_schema=s["schema"])
                                             for s in specs])
            constrained_s = time.perf_counter() - start
            decode_steps = engine.scheduler.stats.num_decode_steps - steps
            valid = 0
            for o, s in zip(outs, specs, strict=True):
                try:
                    jsonschema.validate(json.loads(o.text), s["schema"])
                    valid += 1
                except Exception:  # noqa: BLE001
                    pass
            lengths = [o.completion_tokens for o in outs]
            start = time.perf_counter()
            engine.generate(prompts, [SamplingParams(max_new_tokens=n, temperature=0, ignore_eos=True) for n in lengths])
            free_s = time.perf_counter() - start
            rows.append({"jump_forward": jump, "batch": batch, "valid": f"{valid}/{batch}", "tokens": sum(lengths),
                         "decode_steps": decode_steps, "constrained_s_per_object": constrained_s / batch,
                         "free_s_per_object": free_s / batch, "ratio_to_free": constrained_s / free_s})
        engine.shutdown()
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--skip-e2e", action="store_true")
    parser.add_argument("--dtype", default="float32")
    args = parser.parse_args()
    from transformers import AutoTokenizer

    from radixgen.models.loader import resolve_model_dir

    tokenizer = AutoTokenizer.from_pretrained(resolve_model_dir(None))
    service = GrammarService(make_backend("auto", tokenizer, 49152, [tokenizer.eos_token_id]), timeout_s=60)
    results: dict[str, Any] = {}
    print("== compile time (ms)")
    results["compile"] = [{"schemas": "test-suite", **compile_times(tokenizer, [c["schema"] for c in suite_cases()])},
                          {"schemas": "api", **compile_times(tokenizer, [s["schema"] for s in API])}]
    print_table(results["compile"], list(results["compile"][0]))
    print("\n== per-token constraint cost (fill + apply + accept), microseconds")
    results["per_token"] = per_token_costs(tokenizer, service)
    print_table([results["per_token"]], list(results["per_token"]))
    print("\n== mask for a batch of constrained rows")
    results["batch_mask"] = batch_mask_cost(tokenizer, service)
    print_table([results["batch_mask"]], list(results["batch_mask"]))
    print("\n== JSON-Schema-Test-Suite (draft 2020-12)")
    score = score_suite(sorted(SUITE.glob("*.json")), service, tokenizer, tokenizer.eos_token_id)
    results["suite"] = {"right": score.right, "total": score.total, "invalid_accepted": score.invalid_accepted,
                        **dict(score.counts), "unsupported_files": sorted(score.unsupported)}
    print(f"right {score.right}/{score.total} ({score.right / score.total:.1%}), invalid accepted {score.invalid_accepted}")
    rows = [{"file": f, **dict(c)} for f, c in score.per_file.items() if c["valid_rejected"] or c["invalid_accepted"]]
    print_table(rows, ["file", "valid_accepted", "valid_rejected", "invalid_rejected", "invalid_accepted"])
    if not args.skip_e2e:
        print("\n== end to end on SmolLM2 (greedy): constrained vs unconstrained, same token counts")
        results["e2e"] = end_to_end([1, 32], args.dtype)
        print_table(results["e2e"], list(results["e2e"][0]))
    print(f"wrote {write_json('bench_constraints', results)}")


if __name__ == "__main__":
    main()
