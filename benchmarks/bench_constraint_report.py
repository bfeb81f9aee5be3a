"""What the constraint report and partial objects cost, in one run on the bundled model.

A batch of 64 constrained requests (the API schemas, greedy and at temperature 0.8): the time
spent building the reports (``engine.append.constraint_report``, timed around every call) as a
share of the batch's wall time and per decode step; and the partial objects of a streamed answer
(``PartialJson`` over each delta) against the same stream without them.

    python benchmarks/bench_constraint_report.py [--batch 64] [--max-tokens 128]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.common import print_table, write_json  # noqa: E402

API = json.loads((Path(__file__).resolve().parent.parent / "tests" / "data" / "api_schemas.json").read_text())


def report_share(engine: Any, batch: int, max_tokens: int, temperature: float) -> dict[str, Any]:
    from radixgen import SamplingParams
    from radixgen.engine import append

    spent = [0.0, 0]
    build = append.constraint_report

    def timed(req: Any) -> Any:
        start = time.perf_counter()
        try:
            return build(req)
        finally:
            spent[0] += time.perf_counter() - start
            spent[1] += 1

    specs = [API[i % len(API)] for i in range(batch)]
    prompts = [engine.apply_chat_template([{"role": "user", "content": f"Fill in a {s['name'].replace('_', ' ')} as JSON."}])
               for s in specs]
    params = [SamplingParams(max_new_tokens=max_tokens, temperature=temperature, seed=i, json_schema=s["schema"])
              for i, s in enumerate(specs)]
    engine.generate(prompts, params)  # compiled and cached, as in steady serving
    steps = engine.scheduler.stats.num_decode_steps
    append.constraint_report = timed  # type: ignore[assignment]
    try:
        start = time.perf_counter()
        outs = engine.generate(prompts, params)
        wall = time.perf_counter() - start
    finally:
        append.constraint_report = build  # type: ignore[assignment]
    decode_steps = engine.scheduler.stats.num_decode_steps - steps
    assert all(o.constraint is not None for o in outs)
    return {"batch": batch, "temperature": temperature, "reports": spent[1], "report_ms_total": spent[0] * 1e3,
            "batch_s": wall, "decode_steps": decode_steps, "step_ms": wall / max(decode_steps, 1) * 1e3,
            "report_pct_of_run": 100 * spent[0] / wall}


CATALOGUE = {"type": "object", "properties": {
    "store": {"type": "string", "maxLength": 20},
    "items": {"type": "array", "maxItems": 6, "items": {"type": "object", "properties": {
        "name": {"type": "string", "maxLength": 16}, "price": {"type": "integer", "minimum": 0, "maximum": 1000},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 8}, "maxItems": 3}},
        "required": ["name", "price", "tags"], "additionalProperties": False}}},
    "required": ["store", "items"], "additionalProperties": False}
"""A schema xgrammar enforces exactly: no validators, so its answer streams token by token."""


def partial_cost(engine: Any, max_tokens: int) -> dict[str, Any]:
    from radixgen import SamplingParams

    prompt = engine.apply_chat_template([{"role": "user", "content": "A shop's catalogue as JSON."}])
    params = SamplingParams(max_new_tokens=max_tokens, temperature=0, json_schema=CATALOGUE)
    times: dict[bool, list[float]] = {False: [], True: []}
    for with_partials in (False, True) * 3:
        start = time.perf_counter()
        deltas = list(engine.iter_outputs(prompt, params, include_partial=with_partials))
        times[with_partials].append(time.perf_counter() - start)
        assert deltas[-1].finish_reason is not None and deltas[-1].finish_reason.value == "stop", deltas[-1].error
    return {"stream": "catalogue, greedy", "deltas": len(deltas), "partials": sum(d.partial is not None for d in deltas),
            "without_s": min(times[False]), "with_partials_s": min(times[True]),
            "ratio": min(times[True]) / min(times[False])}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=128)
    args = parser.parse_args()
    from radixgen import Engine

    engine = Engine()
    results: dict[str, Any] = {"report": [report_share(engine, args.batch, args.max_tokens, t) for t in (0.0, 0.8)]}
    print_table(results["report"], list(results["report"][0]))
    results["partials"] = [partial_cost(engine, args.max_tokens)]
    print_table(results["partials"], list(results["partials"][0]))
    engine.shutdown()
    print(f"wrote {write_json('bench_constraint_report', results)}")


if __name__ == "__main__":
    main()
