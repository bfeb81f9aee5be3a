"""N-gram speculative decoding on the bundled model: the same greedy workloads with speculation
off and on, side by side in one run (rounds alternate), and whether the outputs are identical.

Workloads: copying (repeat a paragraph), extraction into a JSON schema, a regex answer that
copies from the text, and free chat (little to copy: what speculation costs when it misses);
each alone (batch 1) and as a batch of 4; and 16 extractions at once, where jump-forward is off
(past jump_forward_max_batch) and the keys the schema forces are drafted instead.

``--temperature T`` runs the same workloads sampled (seeded per job, so both modes draw the
same uniforms): a sampled request's drafts are checked against the token a decode step would
sample, so they are accepted about as often as the model gives the drafted token.

    python benchmarks/bench_speculative.py [--rounds 2] [--weights auto] [--temperature 0]
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import print_table, write_json  # noqa: E402
from radixgen import Engine, EngineConfig, SamplingParams  # noqa: E402

TEXT = ("Invoice 4471 from Harbour Supplies Ltd, 12 Quay Street, Bergen, dated 3 March 2026: 40 boxes of "
        "copper fittings at 12.50 EUR each, 15 rolls of marine cable at 89.00 EUR each, delivery to the "
        "workshop of Nordic Boats AS, Strandkaien 8, Stavanger, before 20 March 2026. Contact: Ingrid Solberg, "
        "ingrid.solberg@nordicboats.no, phone +47 51 23 45 67.")
SCHEMA = {"type": "object", "properties": {
    "invoice": {"type": "string"}, "seller": {"type": "string"}, "seller_address": {"type": "string"},
    "buyer": {"type": "string"}, "buyer_address": {"type": "string"}, "contact_email": {"type": "string"},
    "items": {"type": "array", "items": {"type": "object", "properties": {
        "what": {"type": "string"}, "quantity": {"type": "integer"}, "unit_price": {"type": "number"}},
        "required": ["what", "quantity", "unit_price"]}}},
    "required": ["invoice", "seller", "seller_address", "buyer", "buyer_address", "contact_email", "items"]}


def workloads(engine: Engine, temperature: float) -> dict[str, list[tuple[str, SamplingParams]]]:
    chat = engine.apply_chat_template
    sampling = {"temperature": temperature}
    copy = (chat([{"role": "user", "content": "Repeat this text exactly:\n" + TEXT}]),
            SamplingParams(max_new_tokens=160, seed=1, **sampling))
    extract = (chat([{"role": "user", "content": "Extract the invoice as JSON.\n" + TEXT}]),
               SamplingParams(max_new_tokens=256, json_schema=SCHEMA, seed=2, **sampling))
    regex = (chat([{"role": "user", "content": "Who is the contact and what is the email? Text: " + TEXT}]),
             SamplingParams(max_new_tokens=48, regex=r"[A-Z][a-z]+ [A-Z][a-z]+, [a-z.]+@[a-z.]+", seed=3, **sampling))
    free = (chat([{"role": "user", "content": "Write a short story about a lighthouse keeper."}]),
            SamplingParams(max_new_tokens=160, seed=4, **sampling))
    return {"copy": [copy], "extract": [extract], "regex": [regex], "free chat": [free],
            "batch of 4": [copy, extract, regex, free],
            # past jump_forward_max_batch: the schema's keys are decoded, or drafted with speculation
            "16 extractions": [(extract[0], dataclasses.replace(extract[1], seed=10 + i)) for i in range(16)]}


def run(engine: Engine, jobs: list[tuple[str, SamplingParams]]) -> tuple[float, int, list[list[int]]]:
    start = time.perf_counter()
    outs = engine.generate([p for p, _ in jobs], [q for _, q in jobs])
    seconds = time.perf_counter() - start
    return seconds, sum(len(o.token_ids) for o in outs), [o.token_ids for o in outs]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--weights", default="auto")
    parser.add_argument("--temperature", type=float, default=0.0)
    args = parser.parse_args()
    engines = {mode: Engine(EngineConfig(speculative=mode, weights=args.weights, kv_cache_tokens=32768,
                                         disable_radix_cache=True))  # every round computes its prompts
               for mode in ("off", "ngram")}
    loads = workloads(engines["off"], args.temperature)
    for engine in engines.values():  # compile the grammars, warm the kernels
        for jobs in loads.values():
            run(engine, jobs)
    times: dict[tuple[str, str], list[float]] = {}
    tokens: dict[tuple[str, str], int] = {}
    outputs: dict[tuple[str, str], list[list[int]]] = {}
    drafted: dict[tuple[str, str], tuple[int, int]] = {}
    for _ in range(args.rounds):
        for name, jobs in loads.items():
            for mode, engine in engines.items():
                stats = engine.scheduler.stats
                before = (stats.drafted_tokens, stats.accepted_tokens)
                seconds, n, outs = run(engine, jobs)
                times.setdefault((name, mode), []).append(seconds)
                tokens[(name, mode)], outputs[(name, mode)] = n, outs
                drafted[(name, mode)] = (stats.drafted_tokens - before[0], stats.accepted_tokens - before[1])
    rows: list[dict[str, Any]] = []
    for name in loads:
        off, on = statistics.median(times[(name, "off")]), statistics.median(times[(name, "ngram")])
        d, a = drafted[(name, "ngram")]
        rows.append({"workload": name, "tokens": tokens[(name, "off")], "off tok/s": tokens[(name, "off")] / off,
                     "ngram tok/s": tokens[(name, "ngram")] / on, "speed-up": off / on, "drafted": d,
                     "accepted": a, "acceptance": a / d if d else 0.0,
                     "identical": outputs[(name, "off")] == outputs[(name, "ngram")]})
    for engine in engines.values():
        engine.shutdown()
    print_table(rows, ["workload", "tokens", "off tok/s", "ngram tok/s", "speed-up", "drafted", "accepted",
                       "acceptance", "identical"])
    print("wrote", write_json("bench_speculative", {"rounds": args.rounds, "weights": args.weights,
                                                    "temperature": args.temperature, "rows": rows}))


if __name__ == "__main__":
    main()
