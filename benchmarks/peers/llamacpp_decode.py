"""llama.cpp (through llama-cpp-python, in its own virtualenv) on given prompt token ids: the
time to the first new token and the decode rate after it, one sequence at a time. Run by
``bench_quant.py`` with the peers' python; imports nothing of radixgen.

    python benchmarks/peers/llamacpp_decode.py --model FILE.gguf --prompts ids.json --new-tokens 64 --threads 2
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", required=True)
    parser.add_argument("--prompts", required=True, help="a JSON file: a list of token-id lists")
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()

    import llama_cpp

    prompts = json.loads(Path(args.prompts).read_text())
    llm = llama_cpp.Llama(model_path=args.model, n_ctx=1024, n_threads=args.threads, n_threads_batch=args.threads,
                          verbose=False)
    llm.reset()
    for _ in zip(range(8), llm.generate(prompts[0][:64], temp=0.0), strict=False):  # warm-up
        pass
    for prompt in prompts:
        llm.reset()
        start = time.perf_counter()
        first = None
        produced = 0
        for _token in llm.generate(prompt, temp=0.0, reset=True):
            produced += 1
            if first is None:
                first = time.perf_counter()
            if produced == args.new_tokens:
                break
        end = time.perf_counter()
        assert first is not None
        print(json.dumps({"first_token_s": first - start, "decode_tok_s": (produced - 1) / (end - first),
                          "tok_s": produced / (end - start)}), flush=True)


if __name__ == "__main__":
    main()
