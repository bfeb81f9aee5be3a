"""Structured output with the defaults (drafting on for constrained requests) against
``speculative="off"``: six extraction documents (invoice, patient visit, shipment, order, flight
claim, lease) and one schema (an id, names, dates, a one-sentence summary), greedy, at batch 1, 4,
16 and 64 (below six, batches take turns until all six are answered; above, the documents
repeated); the free-text rate of the same model on the same documents
for reference (summaries, drafting off, each row as many tokens as its constrained answer).

    python benchmarks/bench_drafting.py [--model bundled|real|PATH] [--batch-sizes 1,4,16,64] [--rounds 2]

Reported per batch: output tok/s with the defaults and with drafting off, the ratio, whether the
outputs are identical, the acceptance (accepted / drafted), accepted tokens per verified draft,
and the accepted tokens' sources (forced text, spans copied from the prompt, n-grams of the
output). Both engines live in one process and alternate, round by round (the median of the rounds
is shown, the free-text rate's rounds among theirs); the radix cache is off, so every round
computes its prompts.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.common import print_table, write_json  # noqa: E402

DOCUMENTS = [
    "Invoice INV-20931 dated 2024-03-04 from Nordlicht Bakery GmbH to Carla Mendes for 40 sourdough loaves "
    "and 12 rye breads, due on 2024-04-03.",
    "Patient visit V-5520 on 2024-01-19: Tomasz Kowalczyk saw Dr. Amira Haddad at the Riverside Clinic for a "
    "sprained left ankle and was told to rest for two weeks.",
    "Shipment SHP-77812 left the Rotterdam depot on 2024-06-02 for Helena Svensson in Uppsala, carrying three "
    "pallets of ceramic tiles, expected on 2024-06-07.",
    "Order ORD-4410-B placed on 2024-02-11 by Kenji Watanabe for a walnut desk and two oak chairs from "
    "Hollis & Vane Furniture, to be delivered on 2024-02-25.",
    "Flight claim FC-30017 filed on 2024-08-09 by Priya Raghunathan for flight LX 1623 from Zurich to Lisbon on "
    "2024-07-30, delayed by five hours.",
    "Lease L-2024-118 between Fairmont Properties Ltd and Oliver Brandt for the flat at 14 Cedar Row, starting "
    "on 2024-09-01 and ending on 2025-08-31.",
]

SCHEMA = {
    "type": "object",
    "properties": {
        "id": {"type": "string", "maxLength": 24},
        "people": {"type": "array", "items": {"type": "string", "maxLength": 40}, "maxItems": 3},
        "organisation": {"type": "string", "maxLength": 40},
        "dates": {"type": "array", "items": {"type": "string", "format": "date"}, "maxItems": 3},
        "summary": {"type": "string", "maxLength": 160},
    },
    "required": ["id", "people", "organisation", "dates", "summary"],
    "additionalProperties": False,
}


def prompts(engine: Any, task: str) -> list[list[int]]:
    return [engine.apply_chat_template([{"role": "user", "content": f"{task}\n\n{doc}"}]) for doc in DOCUMENTS]


def model_path(name: str) -> str | None:
    if name == "bundled":
        return None
    if name == "real":
        from radixgen.models.packaged_models import real_model_gguf

        return str(real_model_gguf())
    return name


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="bundled", help="bundled, real (the packaged 0.5B Q4_K_M) or a path")
    parser.add_argument("--batch-sizes", default="1,4,16,64")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--max-tokens", type=int, default=160)
    parser.add_argument("--max-draft", type=int, default=None, help="speculative_max_draft (default: the engine's)")
    parser.add_argument("--max-batch", type=int, default=None, help="speculative_max_batch (default: the engine's)")
    args = parser.parse_args()

    from radixgen import Engine, EngineConfig, SamplingParams

    model = model_path(args.model)
    draft: dict[str, int] = {} if args.max_draft is None else {"speculative_max_draft": args.max_draft}
    if args.max_batch is not None:
        draft["speculative_max_batch"] = args.max_batch
    engines = {mode: Engine(EngineConfig(model=model, speculative=mode, kv_cache_tokens=32768, max_context_len=2048,
                                         disable_radix_cache=True, **draft)) for mode in ("auto", "off")}
    extract = prompts(engines["off"], "Extract the record below as JSON: its id, the people, the organisation, "
                                      "the dates (YYYY-MM-DD) and a one-sentence summary.")
    summarise = prompts(engines["off"], "Summarise the record below in a few sentences.")
    constrained = SamplingParams(temperature=0, max_new_tokens=args.max_tokens, json_schema=SCHEMA)
    rows: list[dict[str, Any]] = []
    for batch in map(int, args.batch_sizes.split(",")):
        # below six, the batches take turns over the documents, so every batch size answers all six
        groups = [[extract[(g * batch + i) % len(extract)] for i in range(batch)]
                  for g in range(-(-len(extract) // batch))]
        jobs = [job for group in groups for job in group]
        times: dict[str, list[float]] = {"auto": [], "off": []}
        outs: dict[str, list[list[int]]] = {}
        counts: dict[str, dict[str, int]] = {}
        for engine in engines.values():  # compile the grammar, warm the kernels at this batch
            engine.generate(groups[0], constrained)
        free_groups: list[list[tuple[list[int], Any]]] = []
        free_times: list[float] = []
        for round_index in range(args.rounds):
            for mode, engine in engines.items():
                stats, drafter = engine.scheduler.stats, engine.scheduler.planner.drafter
                before = (stats.drafted_tokens, stats.accepted_tokens, stats.verified_drafts,
                          dict(drafter.accepted_by_source))
                start = time.perf_counter()
                results = [out for group in groups for out in engine.generate(group, constrained)]
                times[mode].append(time.perf_counter() - start)
                outs[mode] = [o.token_ids for o in results]
                counts[mode] = {"drafted": stats.drafted_tokens - before[0], "accepted": stats.accepted_tokens - before[1],
                                "verified": stats.verified_drafts - before[2],
                                **{k: v - before[3][k] for k, v in drafter.accepted_by_source.items()}}
            if round_index == 0:
                # each free-text row as long as its constrained counterpart: the same batch occupancy
                # over time, so the ratio compares per-token cost, not the tail of uneven lengths
                free = [SamplingParams(temperature=0, max_new_tokens=max(1, len(o)), ignore_eos=True)
                        for o in outs["off"]]
                pairs = [(summarise[extract.index(job)], params) for job, params in zip(jobs, free, strict=True)]
                free_groups = [pairs[g : g + batch] for g in range(0, len(pairs), batch)]
                warm = free_groups[0]
                engines["off"].generate([p for p, _ in warm], [s for _, s in warm])
            start = time.perf_counter()
            for part in free_groups:
                engines["off"].generate([p for p, _ in part], [s for _, s in part])
            free_times.append(time.perf_counter() - start)
        tokens = sum(len(o) for o in outs["off"])
        free_tok_s = tokens / statistics.median(free_times)
        c = counts["auto"]
        accepted = max(c["accepted"], 1)
        auto_tok_s = tokens / statistics.median(times["auto"])
        rows.append({
            "batch": batch, "tokens": tokens, "defaults tok/s": auto_tok_s,
            "off tok/s": tokens / statistics.median(times["off"]),
            "speed-up": statistics.median(times["off"]) / statistics.median(times["auto"]),
            "free text tok/s": free_tok_s, "vs free": auto_tok_s / free_tok_s,
            "identical": outs["auto"] == outs["off"],
            "acceptance": c["accepted"] / c["drafted"] if c["drafted"] else 0.0,
            "per verify": c["accepted"] / c["verified"] if c["verified"] else 0.0,
            "forced": c["forced"] / accepted, "copied": c["copied"] / accepted, "ngram": c["ngram"] / accepted,
        })
    for engine in engines.values():
        engine.shutdown()
    print(f"model: {args.model}")
    print_table(rows, ["batch", "tokens", "defaults tok/s", "off tok/s", "speed-up", "free text tok/s", "vs free",
                       "identical", "acceptance", "per verify", "forced", "copied", "ngram"])
    print("wrote", write_json(f"bench_drafting_{Path(args.model).stem}", {"model": args.model, "rounds": args.rounds,
                                                                          "rows": rows}))


if __name__ == "__main__":
    main()
