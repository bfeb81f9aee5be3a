"""Scheduler CPU time per decode step (everything but the forward: planning, output
processing, detokenization, the streamed output to each request's callback) at 1/64/256/1024
running requests, driven like the trace simulator (no model), also without text (no tokenizer),
and its ratio to the real SmolLM2 forward of a decode batch of the same size.

    python benchmarks/bench_scheduler.py [--running 1,64,256,1024] [--skip-real]
"""

from __future__ import annotations

import argparse
import gc
import pickle
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.common import print_table, write_json  # noqa: E402
from radixgen import EngineConfig, SamplingParams  # noqa: E402
from radixgen.engine.detokenizer import ConsumerText  # noqa: E402
from radixgen.engine.kv_pool import KVPool  # noqa: E402
from radixgen.engine.output import DeltaReader, StepDeltas  # noqa: E402
from radixgen.engine.request import Request, RequestOutput  # noqa: E402
from radixgen.engine.sampler import SampleResult, SamplingBatchCache  # noqa: E402
from radixgen.engine.scheduler import Scheduler  # noqa: E402
from radixgen.ipc.messages import Outputs  # noqa: E402

PROMPT_LEN = 128
REAL_MAX_RUNNING = 256  # the real-model column stops here (memory, time)
SAMPLE_TEXT = ("The scheduler decides, at every step, which requests run: naïve schedulers copy queues, "
               "but this one — measured in µs — should not. 日本語のテキストも少し。 Emoji too: 🚀🔥. ") * 8


def scheduler_step_us(running: int, steps: int, tokenizer: Any = None, served: bool = False,
                      front_us: list[float] | None = None, step_us: list[float] | None = None) -> float:
    """With a tokenizer the step includes what a served step does per token: detokenization
    and a streamed output handed to each request's callback. ``served``: the outputs go as the
    engine process sends them to the HTTP front (deltas as columns, one pickled message per
    step, ipc/process.py), the message's serialization counted; the text of these plain
    requests is made by the front, whose work per step (unpickle, build the outputs, make the
    text: ipc/client.py) is appended to ``front_us``."""
    config = EngineConfig(max_running_requests=max(running, 1), kv_cache_tokens=running * (PROMPT_LEN + steps + 64) + 64,
                          max_context_len=4096, max_prefill_tokens=running * PROMPT_LEN + 1)
    pool = KVPool(num_slots=config.kv_cache_tokens or 0, num_layers=1, num_kv_heads=1, head_dim=1,
                  dtype=torch.float16, device="cpu", max_rows=config.max_running_requests, max_context_len=4096)
    sched = Scheduler(config, pool, tokenizer, eos_token_ids=())
    params = SamplingParams(max_new_tokens=steps + 16, temperature=0.7, top_p=0.9, ignore_eos=True)
    pending: list[RequestOutput] = []
    deltas = StepDeltas()
    reader = DeltaReader()
    messages: list[bytes] = []
    texts: dict[str, ConsumerText] = {}
    for i in range(running):
        prompt = [5 + (i * 31 + j) % 40000 for j in range(PROMPT_LEN)]
        if served and tokenizer is not None:
            texts[f"r{i}"] = ConsumerText(tokenizer, prompt, params.skip_special_tokens)
        sched.add_request(Request(f"r{i}", prompt, params, rng_seed=i,
                                  on_output=pending.append if served else lambda out: None, stream=True,
                                  delta_sink=deltas if served else None, detokenize=not served))
    # each request "samples" the tokens of a real text, from its own offset (real text decodes
    # as it would in serving: multi-byte characters, spaces merged into tokens)
    text_ids = np.asarray(tokenizer.encode(SAMPLE_TEXT, add_special_tokens=False) if tokenizer else [7], dtype=np.int64)
    offsets = np.arange(running) * 7
    plan = sched.schedule()
    assert plan is not None and plan.batch_size == running
    sched.process_results(plan, SampleResult(text_ids[offsets % len(text_ids)], None, None, None))
    batches = SamplingBatchCache(49152, torch.device("cpu"), sched.kv.row_params)
    total = 0.0
    for step in range(1, steps + 1):
        sampled = text_ids[(offsets + step) % len(text_ids)]
        start = time.perf_counter()
        plan = sched.schedule()
        assert plan is not None and plan.batch_size == running
        batches.get(plan)
        sched.process_results(plan, SampleResult(sampled, None, None, None))
        if served:
            message = pickle.dumps(Outputs(pending[:], deltas.take()), protocol=pickle.HIGHEST_PROTOCOL)
            pending.clear()
        elapsed = time.perf_counter() - start
        total += elapsed
        if step_us is not None:
            step_us.append(elapsed * 1e6)
        if served and front_us is not None:
            messages.append(message)
    # The front is another process (its own core's caches): its work replays the messages after
    # the engine's steps instead of running between them.
    for message in messages if front_us is not None else ():
        start = time.perf_counter()
        received = pickle.loads(message)
        blocks = received.blocks
        for out in [*received.outputs, *(reader.expand(blocks) if blocks is not None else ())]:
            if out.request_id in texts:
                texts[out.request_id].fill(out)
        front_us.append((time.perf_counter() - start) * 1e6)
    return total / steps * 1e6


def real_forward_ms(running: int, steps: int, engine: Any) -> float:
    """Median forward time of a decode step at this batch size on the real model."""
    from radixgen.engine.plan import StepKind

    sched = engine.scheduler
    params = SamplingParams(max_new_tokens=steps + 4, temperature=0, ignore_eos=True)
    for i in range(running):
        sched.add_request(Request(f"f{running}-{i}", [5 + (i * 31 + j) % 40000 for j in range(PROMPT_LEN)], params, rng_seed=i))
    times = []
    while sched.has_work():
        plan = sched.schedule()
        if plan is None:
            break
        start = time.perf_counter()
        logits = engine.runner.forward(plan)
        elapsed = time.perf_counter() - start
        if plan.kind is StepKind.DECODE and plan.batch_size == running:
            times.append(elapsed)
        ids = logits.argmax(-1).numpy()
        sched.process_results(plan, SampleResult(ids, None, None, None))
        if len(times) >= steps:
            for rid in list(sched.requests):
                sched.abort(rid)
    return float(np.median(times) * 1e3)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--running", default="1,64,256,1024")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--skip-real", action="store_true")
    args = parser.parse_args()
    engine = None
    if not args.skip_real:
        from radixgen import Engine

        # the measurement runs on the engine's loop thread (run_on_loop), where the model lives
        engine = Engine(EngineConfig(max_running_requests=REAL_MAX_RUNNING, kv_cache_gb=3.0))
    from transformers import AutoTokenizer

    from radixgen.models.loader import resolve_model_dir

    tokenizer = AutoTokenizer.from_pretrained(resolve_model_dir(None))
    rows = []
    for running in map(int, args.running.split(",")):
        bare_us = scheduler_step_us(running, args.steps)
        sched_us = scheduler_step_us(running, args.steps, tokenizer)
        front: list[float] = []
        served_steps: list[float] = []
        # as the engine process does after start-up (ipc/process.py): what lives on (torch,
        # the tokenizer, the earlier rows' leftovers) out of the collector's view
        gc.collect()
        gc.freeze()
        served_us = scheduler_step_us(running, args.steps, tokenizer, served=True, front_us=front,
                                      step_us=served_steps)
        fwd_ms = None
        if engine is not None and running <= REAL_MAX_RUNNING:
            fwd_ms = engine.run_on_loop(lambda running=running: real_forward_ms(running, 8, engine), timeout=1800)
        rows.append({"running": running, "scheduler_us_per_step": sched_us, "served_us": served_us,
                     "served_p50_us": float(np.median(served_steps)),
                     "front_us": float(np.mean(front)),
                     "without_text_us": bare_us,
                     "forward_ms": fwd_ms, "scheduler_share_pct": sched_us / 10 / fwd_ms if fwd_ms else None})
    if engine is not None:
        engine.shutdown()
    print_table(rows, ["running", "scheduler_us_per_step", "served_us", "served_p50_us", "front_us", "without_text_us", "forward_ms", "scheduler_share_pct"])
    print(f"wrote {write_json('bench_scheduler', {'rows': rows, 'prompt_len': PROMPT_LEN})}")


if __name__ == "__main__":
    main()
