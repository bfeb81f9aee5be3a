"""Constrained decoding costs and coverage, in one run on the SmolLM2 tokenizer.

1. Compile time of each backend through our service (spec checks and schema rewriting included)
   and of raw xgrammar, on the test-suite schemas and on realistic API schemas (tests/data).
2. Per-token constraint cost (mask fill + apply + accept), walking the suite's valid instances.
3. Batch mask cost with 64 constrained rows vs the unconstrained step.
4. End-to-end on the real model: seconds per JSON object and tokens/s, constrained vs
   unconstrained generation of the same number of tokens, batch 1 and 32.
5. JSON-Schema-Test-Suite score (automaton + steering validators) of each backend, with objects
   closed (the default) and open; drafts 7 and 4 with the default backend.
6. Budget steering on the real model: on the API schemas and on larger real-world configs
   (benchmarks/data/realworld_schemas.json), at max_tokens 64 / 128 / 256, temperature 0.7:
   the share of outputs complete and valid, steered to close, refused up front (the schema's
   shortest output does not fit), and generated tokens/s, with steering on and off side by side.

    python benchmarks/bench_constraints.py [--skip-e2e] [--skip-budget] [--only-budget]
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
from radixgen.constraints import (  # noqa: E402
    GrammarOptions,
    GrammarService,
    allocate_bitmask,
    make_backend,
)
from radixgen.constraints.conformance import score_suite, serialize  # noqa: E402
from radixgen.constraints.spec import schema_spec  # noqa: E402
from radixgen.kernels.ops import apply_bitmask  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
SUITE = ROOT / "tests" / "data" / "json-schema-test-suite"
API = json.loads((ROOT / "tests" / "data" / "api_schemas.json").read_text())
REALWORLD = json.loads((ROOT / "benchmarks" / "data" / "realworld_schemas.json").read_text())


def pct(xs: list[float], q: float) -> float:
    return float(np.percentile(xs, q)) if xs else float("nan")


def suite_cases() -> list[dict[str, Any]]:
    return [case for f in sorted(SUITE.glob("*.json")) for case in json.loads(f.read_text())]


def compile_times(tokenizer: Any, schemas: list[Any], backend: str) -> dict[str, Any]:
    """Through our service (spec checks and schema rewriting included), cache off."""
    times, failed = [], 0
    service = GrammarService(make_backend(backend, tokenizer, 49152, [tokenizer.eos_token_id]), cache_size=0,
                             timeout_s=60)
    for schema in schemas:
        start = time.perf_counter()
        try:
            service.compile(schema_spec(schema))
            times.append(time.perf_counter() - start)
        except Exception:  # noqa: BLE001
            failed += 1
    return {"backend": backend, "n": len(schemas), "p50_ms": pct(times, 50) * 1e3, "p95_ms": pct(times, 95) * 1e3,
            "failed": failed}


def raw_xgrammar_compile_times(tokenizer: Any, schemas: list[Any]) -> dict[str, Any]:
    """xgrammar called directly, as other engines call it: the reference for our compile target."""
    import xgrammar as xgr

    info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=49152, stop_token_ids=[tokenizer.eos_token_id])
    compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)  # cold, like ours with cache_size=0
    times, failed = [], 0
    for schema in schemas:
        start = time.perf_counter()
        try:
            compiler.compile_json_schema(json.dumps(schema), any_whitespace=False, separators=(", ", ": "))
            times.append(time.perf_counter() - start)
        except Exception:  # noqa: BLE001
            failed += 1
    return {"backend": "xgrammar (raw)", "n": len(schemas), "p50_ms": pct(times, 50) * 1e3,
            "p95_ms": pct(times, 95) * 1e3, "failed": failed}


def suite_instances(tokenizer: Any) -> list[tuple[Any, list[int]]]:
    """(schema, token ids) of every valid instance in the test suite, in our serialization."""
    out = []
    for case in suite_cases():
        root = case["schema"] if isinstance(case["schema"], dict) else {}
        for t in case["tests"]:
            if t["valid"]:
                out.append((case["schema"], tokenizer.encode(serialize(t["data"], case["schema"], root),
                                                              add_special_tokens=False)))
    return out


def api_instances(tokenizer: Any, service: GrammarService, walks: int = 4, max_tokens: int = 150) -> list[tuple[Any, list[int]]]:
    """Token sequences for the API schemas (which come without instances): seeded random walks
    through their automata, preferring to end once the automaton allows it."""
    import random

    out = []
    mask = allocate_bitmask(1, 49152)
    eos = tokenizer.eos_token_id
    for entry in API:
        for seed in range(walks):
            rng = random.Random(seed)
            matcher = service.compile(schema_spec(entry["schema"])).matcher()
            ids: list[int] = []
            while len(ids) < max_tokens:
                matcher.fill_bitmask(mask, 0)
                allowed = np.flatnonzero(np.unpackbits(mask[0].view(np.uint8), bitorder="little")[:49152])
                token = eos if eos in allowed and rng.random() < 0.5 else int(rng.choice(allowed))
                if token == eos:
                    break
                matcher.accept(token)
                ids.append(token)
            out.append((entry["schema"], ids))
    return out


def per_token_costs(service: GrammarService, instances: list[tuple[Any, list[int]]]) -> dict[str, Any]:
    fill, apply, accept = [], [], []
    mask = allocate_bitmask(1, 49152)
    logits = torch.zeros(1, 49152)
    for schema, ids in instances:
        try:
            grammar = service.compile(schema_spec(schema))
        except Exception:  # noqa: BLE001
            continue
        matcher = grammar.matcher()
        for tok in ids:
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
    return {"backend": service.backend.name, "tokens": len(total), "fill_p50_us": pct(fill, 50) * 1e6,
            "fill_p95_us": pct(fill, 95) * 1e6, "apply_p50_us": pct(apply, 50) * 1e6,
            "accept_p50_us": pct(accept, 50) * 1e6, "total_p50_us": pct(total, 50) * 1e6,
            "total_p95_us": pct(total, 95) * 1e6}


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
    return {"backend": service.backend.name, "batch": batch, "mask_ms_p50": pct(times, 50) * 1e3}


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
            cut = sum(o.finish_reason.value == "length" for o in outs)  # unfinished, not invalid
            rows.append({"jump_forward": jump, "batch": batch, "valid": f"{valid}/{batch}", "cut_at_max_tokens": cut,
                         "tokens": sum(lengths),
                         "decode_steps": decode_steps, "constrained_s_per_object": constrained_s / batch,
                         "free_s_per_object": free_s / batch, "ratio_to_free": constrained_s / free_s})
        engine.shutdown()
    return rows


def budget_runs(dtype: str, budgets: list[int], seeds: int) -> list[dict[str, Any]]:
    """Complete-and-valid share and throughput with budget steering on and off, same requests."""
    import jsonschema

    from radixgen import Engine, EngineConfig, SamplingParams

    rows = []
    for steering in (False, True):
        engine = Engine(EngineConfig(dtype=dtype, budget_steering=steering))  # type: ignore[arg-type]
        spent = [0.0]  # seconds inside steering's per-token decision (walks included)
        steer = engine.scheduler.appender.steering
        if steer is not None:
            decide = steer.after_accept

            def timed(*args: Any, _decide: Any = decide, _spent: list[float] = spent) -> Any:
                start = time.perf_counter()
                try:
                    return _decide(*args)
                finally:
                    _spent[0] += time.perf_counter() - start

            steer.after_accept = timed  # type: ignore[method-assign]
        for label, specs in (("api", API), ("real-world", REALWORLD)):
            prompts = [engine.apply_chat_template([{"role": "user", "content": f"Write a complete {s['name'].replace('_', ' ')} "
                                                                                  "as JSON, with realistic values."}])
                       for s in specs]
            engine.generate(prompts, SamplingParams(max_new_tokens=1))  # prompts cached for both runs alike
            for budget in budgets:
                jobs = [(p, SamplingParams(max_new_tokens=budget, temperature=0.7, seed=seed, json_schema=s["schema"]))
                        for seed in range(seeds) for p, s in zip(prompts, specs, strict=True)]
                spent[0] = 0.0
                start = time.perf_counter()
                outs = engine.generate([p for p, _ in jobs], [params for _, params in jobs])
                elapsed = time.perf_counter() - start
                valid = refused = steered = cut = invalid = 0
                for out, (_, params) in zip(outs, jobs, strict=True):
                    if out.finish_reason.value == "error" and out.user_error:
                        refused += 1
                        continue
                    cut += out.finish_reason.value == "length"
                    steered += out.shortened
                    try:
                        jsonschema.validate(json.loads(out.text), params.json_schema)
                        valid += out.finish_reason.value == "stop"
                    except Exception:  # noqa: BLE001 - cut off (unparseable) or invalid
                        invalid += out.finish_reason.value == "stop"
                served = len(outs) - refused
                rows.append({"steering": "on" if steering else "off", "schemas": label, "max_tokens": budget,
                             "requests": len(outs), "refused": refused,
                             "complete_valid_pct": 100 * valid / served if served else float("nan"),
                             "steered_pct": 100 * steered / served if served else float("nan"),
                             "cut_at_length": cut, "invalid_stop": invalid,
                             "tokens": sum(o.completion_tokens for o in outs),
                             "tok_per_s": sum(o.completion_tokens for o in outs) / elapsed,
                             "steering_pct_of_time": 100 * spent[0] / elapsed})
        engine.shutdown()
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--skip-e2e", action="store_true")
    parser.add_argument("--skip-budget", action="store_true")
    parser.add_argument("--only-budget", action="store_true", help="the budget-steering table alone")
    parser.add_argument("--budget-seeds", type=int, default=3, help="samples per schema and budget")
    parser.add_argument("--dtype", default="float32")
    args = parser.parse_args()
    from transformers import AutoTokenizer

    from radixgen.models.loader import resolve_model_dir

    tokenizer = AutoTokenizer.from_pretrained(resolve_model_dir(None))
    results: dict[str, Any] = {}
    if not args.skip_budget:
        print("== budget steering on the real model (temperature 0.7): complete and valid within max_tokens")
        results["budget"] = budget_runs(args.dtype, [64, 128, 256], args.budget_seeds)
        print_table(results["budget"], list(results["budget"][0]))
        if args.only_budget:
            print(f"wrote {write_json('bench_constraints', results)}")
            return
    backends = ["auto", "xgrammar", "llguidance", "outlines"]
    services = {b: GrammarService(make_backend(b, tokenizer, 49152, [tokenizer.eos_token_id]), timeout_s=60)
                for b in backends}
    print("\n== compile time (ms), cache off")
    results["compile"] = []
    # outlines builds an eager index per schema: on the test suite's 383 schemas that takes many
    # minutes (its JSON-Schema-Test-Suite score, 692 right / 0 invalid accepted, comes from
    # score_suite alone), so it is measured on the API schemas only
    suite_backends = [b for b in backends if b != "outlines"]
    for label, schemas in (("test-suite", [c["schema"] for c in suite_cases()]), ("api", [s["schema"] for s in API])):
        for backend in suite_backends if label == "test-suite" else backends:
            results["compile"].append({"schemas": label, **compile_times(tokenizer, schemas, backend)})
        results["compile"].append({"schemas": label, **raw_xgrammar_compile_times(tokenizer, schemas)})
    print_table(results["compile"], list(results["compile"][0]))
    print("\n== per-token constraint cost (fill + apply + accept), microseconds")
    instances = {"test-suite": suite_instances(tokenizer), "api": api_instances(tokenizer, services["xgrammar"])}
    results["per_token"] = [{"schemas": label, **per_token_costs(services[b], inst)}
                            for label, inst in instances.items()
                            for b in (suite_backends if label == "test-suite" else backends)]
    print_table(results["per_token"], list(results["per_token"][0]))
    print("\n== mask for a batch of 64 constrained rows (API schemas)")
    results["batch_mask"] = [batch_mask_cost(tokenizer, services[b]) for b in backends]
    print_table(results["batch_mask"], list(results["batch_mask"][0]))
    print("\n== JSON-Schema-Test-Suite (draft 2020-12): automaton + steering validators")
    results["suite"] = []
    files = sorted(SUITE.glob("*.json"))
    default_score = None
    for backend in suite_backends:
        for open_objects in (False, True):
            service = GrammarService(make_backend(backend, tokenizer, 49152, [tokenizer.eos_token_id],
                                                  options=GrammarOptions(open_objects=open_objects)), timeout_s=60)
            score = score_suite(files, service, tokenizer, tokenizer.eos_token_id)
            results["suite"].append({"backend": backend, "objects": "open" if open_objects else "closed (default)",
                                     "right": score.right, "total": score.total, "pct": 100 * score.right / score.total,
                                     "invalid_accepted": score.invalid_accepted,
                                     "unsupported_files": sorted(score.unsupported)})
            if backend == "auto" and not open_objects:
                default_score = score
    print_table(results["suite"], ["backend", "objects", "right", "total", "pct", "invalid_accepted"])
    assert default_score is not None
    print("\nper file, default settings, where anything is wrong:")
    rows = [{"file": f, **dict(c)} for f, c in default_score.per_file.items() if c["valid_rejected"] or c["invalid_accepted"]]
    print_table(rows, ["file", "valid_accepted", "valid_rejected", "invalid_rejected", "invalid_accepted"])
    print("\n== JSON-Schema-Test-Suite drafts 7 and 4 (each read by its own rules), default backend")
    results["suite_drafts"] = []
    for draft in ("draft7", "draft4"):
        score = score_suite(sorted((SUITE / draft).glob("*.json")), services["auto"], tokenizer, tokenizer.eos_token_id,
                            draft=draft)
        results["suite_drafts"].append({"draft": draft, "right": score.right, "total": score.total,
                                        "pct": 100 * score.right / score.total, "invalid_accepted": score.invalid_accepted})
    print_table(results["suite_drafts"], list(results["suite_drafts"][0]))
    if not args.skip_e2e:
        print("\n== end to end on SmolLM2 (greedy): constrained vs unconstrained, same token counts")
        results["e2e"] = end_to_end([1, 32], args.dtype)
        print_table(results["e2e"], list(results["e2e"][0]))
    print(f"wrote {write_json('bench_constraints', results)}")


if __name__ == "__main__":
    main()
