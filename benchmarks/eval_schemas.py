"""Real-world JSON schemas: mask conformance over their instances, and whether generation finishes valid.

Reads a folder of MaskBench-style files (``{"description", "schema", "tests": [{"data", "valid"}]}``),
by default the practice corpus beside the checkout (``../shared/data/maskbench-practice``).

1. Conformance: each file's instances, serialized as we generate them, fed to the compiled grammar
   (plus the validators that steer generation); right = valid accepted + invalid rejected.
2. Generation: one request per schema, the schema's text in a neutral prompt ("Produce one JSON
   document for this schema"), constrained by it, on the bundled model (or ``--model``). Each
   answer is classified as

   - ``valid``: finished (stop) and the schema's own draft validator (formats checked) accepts it;
   - ``invalid``: finished, yet the validator rejects it (the engine claimed a valid answer: a bug);
   - ``cut``: ended at max_tokens;
   - ``violation``: ended ``constraint_violation`` (validators kept rejecting after the retries);
   - ``refused_budget`` / ``refused_compile``: refused before generation, with the reason;
   - ``error``: an internal fault; ``unjudged``: the validator itself could not run (a remote $ref).

   Every failure is printed with the schema's file name and the output's tail.

    python benchmarks/eval_schemas.py [DIR] [--gen N] [--max-tokens M] [--temperature T] [--backend B]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.common import cpu_model, print_table, write_json  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
PRACTICE = ROOT.parent / "shared" / "data" / "maskbench-practice"
PROMPT = "Produce one JSON document for this schema:\n{schema}"
OUTCOMES = ("valid", "invalid", "cut", "violation", "refused_budget", "refused_compile", "error", "unjudged")


def load_corpus(folder: Path) -> list[tuple[str, dict[str, Any]]]:
    """(file name, entry) for every schema file in ``folder``, in name order."""
    out = []
    for path in sorted(folder.glob("*.json")):
        entry = json.loads(path.read_text())
        if isinstance(entry, dict) and "schema" in entry:
            out.append((path.name, entry))
    return out


def conformance(corpus: list[tuple[str, dict[str, Any]]], backend: str, tokenizer: Any, vocab_size: int,
                stop_token_id: int) -> dict[str, Any]:
    from radixgen.constraints import GrammarService, make_backend
    from radixgen.constraints.conformance import score_cases

    service = GrammarService(make_backend(backend, tokenizer, vocab_size, [stop_token_id]), timeout_s=60)
    cases = [(name, [{"description": entry.get("description", name), "schema": entry["schema"],
                      "tests": entry.get("tests", [])}]) for name, entry in corpus]
    score = score_cases(cases, service, tokenizer, stop_token_id)
    return {"backend": backend, "files": len(corpus), "instances": score.total, "right": score.right,
            "pct": 100 * score.right / max(score.total, 1), "invalid_accepted": score.invalid_accepted,
            "valid_rejected": score.counts["valid_rejected"], "refused_files": len(score.unsupported)}


def judge(schema: Any, text: str) -> tuple[str, str]:
    """("valid" | "invalid" | "unjudged", the validator's message) for a finished answer."""
    import jsonschema

    from radixgen.constraints.drafts import validator_class

    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        return "invalid", f"not JSON: {e}"
    if not isinstance(schema, dict):
        schema = {} if schema is True else {"not": {}}
    cls = validator_class(schema)
    try:
        error = next(iter(cls(schema, format_checker=cls.FORMAT_CHECKER).iter_errors(value)), None)
    except (jsonschema.exceptions._WrappedReferencingError, jsonschema.exceptions.RefResolutionError) as e:
        return "unjudged", f"the validator could not resolve a reference: {e}"
    if error is None:
        return "valid", ""
    where = "$" + "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in error.absolute_path)
    return "invalid", f"{where}: {error.message[:200]}"


def classify(out: Any, schema: Any) -> tuple[str, str]:
    reason = out.finish_reason.value
    if reason == "error":
        if not out.user_error:
            return "error", out.error or ""
        budget = "shortest output" in (out.error or "") or "max_tokens" in (out.error or "")
        return ("refused_budget" if budget else "refused_compile"), out.error or ""
    if reason == "length":
        return "cut", ""
    if reason == "constraint_violation":
        return "violation", out.error or ""
    return judge(schema, out.text)


def print_failure(row: dict[str, Any]) -> None:
    print(f"- {row['schema']}: {row['outcome']} after {row['tokens']} tokens"
          + (f" ({row['detail'][:240]})" if row["detail"] else "") + f"\n    tail: {row['tail']!r}", flush=True)


def generation(corpus: list[tuple[str, dict[str, Any]]], args: argparse.Namespace) -> list[dict[str, Any]]:
    from radixgen import Engine, EngineConfig, SamplingParams
    from radixgen.errors import RadixgenError

    engine = Engine(EngineConfig(model=args.model, grammar_backend=args.backend, dtype=args.dtype))  # type: ignore[arg-type]
    rows: list[dict[str, Any]] = []
    pending: list[tuple[str, Any, list[int], SamplingParams]] = []

    def run(batch: list[tuple[str, Any, list[int], SamplingParams]]) -> None:
        start = time.perf_counter()
        outs = engine.generate([p for _, _, p, _ in batch], [s for _, _, _, s in batch])
        elapsed = time.perf_counter() - start
        for (name, schema, _, _), out in zip(batch, outs, strict=True):
            outcome, detail = classify(out, schema)
            rows.append({"schema": name, "outcome": outcome, "detail": detail, "tokens": out.completion_tokens,
                         "shortened": out.shortened, "tail": out.text[-args.tail:]})
            if outcome != "valid":
                print_failure(rows[-1])
        done = Counter(r["outcome"] for r in rows)
        print(f"  {len(rows)} answered ({elapsed:.1f} s for the last {len(batch)}): "
              + ", ".join(f"{k} {done[k]}" for k in OUTCOMES if done[k]), flush=True)

    for name, entry in corpus:
        schema = entry["schema"]
        text = json.dumps(schema, ensure_ascii=False)
        if len(text) > args.prompt_schema_chars:
            text = text[: args.prompt_schema_chars] + " ..."
        prompt = engine.apply_chat_template([{"role": "user", "content": PROMPT.format(schema=text)}])
        try:
            params = SamplingParams(max_new_tokens=args.max_tokens, temperature=args.temperature, seed=args.seed,
                                    json_schema=schema)
        except (RadixgenError, ValueError, TypeError) as e:
            rows.append({"schema": name, "outcome": "refused_compile", "detail": str(e), "tokens": 0,
                         "shortened": False, "tail": ""})
            continue
        pending.append((name, schema, prompt, params))
        if len(pending) == args.batch:
            run(pending)
            pending = []
    if pending:
        run(pending)
    engine.shutdown()
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("folder", nargs="?", type=Path, default=PRACTICE)
    parser.add_argument("--gen", type=int, default=None, help="generate for the first N schemas (default: all)")
    parser.add_argument("--only", default="", help="only files whose name contains this")
    parser.add_argument("--max-tokens", type=int, default=512)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--backend", default="auto")
    parser.add_argument("--model", default=None, help="a model folder, GGUF or hub id (default: the bundled model)")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--batch", type=int, default=32, help="requests submitted together")
    parser.add_argument("--prompt-schema-chars", type=int, default=6000,
                        help="the schema's text in the prompt is cut at this many characters")
    parser.add_argument("--tail", type=int, default=160, help="characters of a failed output to print")
    parser.add_argument("--skip-conformance", action="store_true")
    parser.add_argument("--skip-generation", action="store_true")
    args = parser.parse_args()

    corpus = [(n, e) for n, e in load_corpus(args.folder) if args.only in n]
    print(f"{cpu_model()}; {len(corpus)} schemas from {args.folder}")
    results: dict[str, Any] = {"folder": str(args.folder), "cpu": cpu_model(), "args": {
        k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}}
    if not args.skip_conformance:
        from transformers import AutoTokenizer

        from radixgen.models.loader import resolve_model_dir

        tokenizer = AutoTokenizer.from_pretrained(resolve_model_dir(None))
        print("\n== mask conformance over the files' instances")
        results["conformance"] = [conformance(corpus, args.backend, tokenizer, 49152, tokenizer.eos_token_id)]
        print_table(results["conformance"], list(results["conformance"][0]))
    if not args.skip_generation:
        chosen = corpus[: args.gen] if args.gen is not None else corpus
        print(f"\n== generation: {len(chosen)} schemas, max_tokens {args.max_tokens}, temperature {args.temperature}, "
              f"backend {args.backend}")
        rows = generation(chosen, args)
        results["generation"] = rows
        counts = Counter(r["outcome"] for r in rows)
        results["summary"] = {k: counts[k] for k in OUTCOMES}
        print("\nfailures:")
        for r in rows:
            if r["outcome"] != "valid":
                print_failure(r)
        print()
        print_table([{"schemas": len(rows), **results["summary"]}], ["schemas", *OUTCOMES])
    print(f"wrote {write_json('eval_schemas', results)}")


if __name__ == "__main__":
    main()
