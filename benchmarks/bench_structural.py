"""Tool calls inside free text (structural constraints): xgrammar's triggered structural tags
against llguidance's lazy Lark grammar, on the SmolLM2 tokenizer, in one run.

For each call format (SmolLM2's JSON list, Hermes' tags) and the three agent tools
(tests/data/agent_tools.json): the compile time, cache off (median of 5), and the per-token
constraint cost (mask fill + accept) while the output is free text and while it is inside a
call, walking the same answers: a paragraph of text, text then a call, and a block of two calls.
Both backends must accept every answer (they are checked); the figures decide which backend
``grammar_backend=auto`` sends structural constraints to.

    python benchmarks/bench_structural.py
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.common import _PARAGRAPH, print_table, write_json  # noqa: E402
from radixgen import tool_formats  # noqa: E402
from radixgen.constraints import allocate_bitmask, make_backend  # noqa: E402
from radixgen.constraints.structural import structural_spec  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
TOOLS = [(t["function"]["name"], t["function"]["parameters"])
         for t in json.loads((ROOT / "tests" / "data" / "agent_tools.json").read_text())]
CALLS = [("get_weather", '{"city": "Lisbon", "unit": "celsius"}'),
         ("create_event", '{"title": "Dentist", "date": "2026-12-03", "duration_minutes": 30}')]


def answers(fmt: tool_formats.CallFormat) -> list[tuple[str, str]]:
    return [("text", _PARAGRAPH * 2), ("text, then a call", "Let me check that. " + fmt.render_calls(CALLS[:1])),
            ("two calls", fmt.render_calls(CALLS))]


def measure(tokenizer: Any, backend_name: str, fmt: tool_formats.CallFormat) -> list[dict[str, Any]]:
    backend = make_backend(backend_name, tokenizer, 49152, [tokenizer.eos_token_id])
    spec = structural_spec({"tool_calls": fmt.structure(TOOLS, free_text=True, min_calls=0, max_calls=None)})
    compile_ms = []
    for _ in range(5):
        start = time.perf_counter()
        grammar = backend.compile(spec)
        compile_ms.append((time.perf_counter() - start) * 1e3)
    mask = allocate_bitmask(1, 49152)
    rows = []
    # llguidance builds its lexer states lazily and keeps them with the grammar: the first walk
    # pays for them, later requests with the same tools do not
    for walk in ("first", "repeat"):
        in_text: list[float] = []
        in_call: list[float] = []
        for _, answer in answers(fmt):
            matcher = grammar.matcher()
            text = ""
            for token in tokenizer.encode(answer, add_special_tokens=False):
                start = time.perf_counter()
                matcher.fill_bitmask(mask, 0)
                if not matcher.accept(token):
                    raise AssertionError(f"{backend_name} refused {answer!r} at {text!r}")
                spent = time.perf_counter() - start
                (in_call if fmt.trigger in text else in_text).append(spent)
                text += tokenizer.decode([token])
            assert matcher.accept(tokenizer.eos_token_id), f"{backend_name} would not end {answer!r}"
        row: dict[str, Any] = {"format": fmt.name, "backend": backend_name, "walk": walk,
                               "compile_ms": statistics.median(compile_ms)}
        for label, times in (("text", in_text), ("call", in_call)):
            row[f"{label}_p50_us"] = float(np.percentile(times, 50)) * 1e6
            row[f"{label}_p95_us"] = float(np.percentile(times, 95)) * 1e6
        row["tokens"] = len(in_text) + len(in_call)
        rows.append(row)
    return rows


def main() -> None:
    from transformers import AutoTokenizer

    from radixgen.models.loader import resolve_model_dir

    tokenizer = AutoTokenizer.from_pretrained(resolve_model_dir(None))
    rows = [row for fmt in (tool_formats.SMOLLM2, tool_formats.HERMES) for backend in ("xgrammar", "llguidance")
            for row in measure(tokenizer, backend, fmt)]
    print("== tool calls in free text: compile (cache off) and per-token mask fill + accept")
    print_table(rows, list(rows[0]))
    print(f"wrote {write_json('bench_structural', {'rows': rows})}")


if __name__ == "__main__":
    main()
