"""vLLM's offline API on the cases compare_offline.py writes: runs in vLLM's own virtualenv.

    <vllm venv>/bin/python benchmarks/peers/vllm_offline.py CASES.json --model DIR --dtype bfloat16

CASES.json is a list of {"name", "prompts" (token id lists), "new_tokens", "prefix_cache",
"repeats"}. One ``LLM`` per prefix-cache setting (vLLM fixes it at construction); each case is
warmed with a short run and timed over ``repeats`` runs; one JSON line per case on stdout, with
the median wall time and the tokens generated. Imports nothing of radixgen, whose dependencies
are not in vLLM's virtualenv.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("cases")
    parser.add_argument("--model", required=True)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--kv-gb", type=int, default=4)
    args = parser.parse_args()
    import os

    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(args.kv_gb))
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    cases = json.loads(Path(args.cases).read_text())
    for prefix_cache in sorted({c["prefix_cache"] for c in cases}):
        llm = LLM(model=args.model, dtype=args.dtype, max_model_len=4096, enable_prefix_caching=prefix_cache,
                  seed=0)
        warm = [TokensPrompt(prompt_token_ids=cases[0]["prompts"][0][:32])]
        llm.generate(warm, SamplingParams(max_tokens=8, temperature=0), use_tqdm=False)
        for case in (c for c in cases if c["prefix_cache"] == prefix_cache):
            prompts = [TokensPrompt(prompt_token_ids=p) for p in case["prompts"]]
            params = SamplingParams(max_tokens=case["new_tokens"], min_tokens=case["new_tokens"], temperature=0,
                                    ignore_eos=True)
            walls = []
            for _ in range(case["repeats"]):
                if prefix_cache:
                    llm.reset_prefix_cache()
                start = time.perf_counter()
                outs = llm.generate(prompts, params, use_tqdm=False)
                walls.append(time.perf_counter() - start)
                generated = sum(len(o.outputs[0].token_ids) for o in outs)
                assert generated == len(prompts) * case["new_tokens"], generated
            print(json.dumps({"name": case["name"], "prefix_cache": prefix_cache, "wall_s": statistics.median(walls),
                              "generated": generated}), flush=True)
        del llm


if __name__ == "__main__":
    main()
