"""What a decode batch keeps while it stands (engine/decode_batch.py): its parts are made for
the planner's batch version and reused by the next decode step of the same batch; a request
leaving makes the next step gather afresh, and rows dropped under a plan drop every part."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from radixgen import EngineConfig, SamplingParams
from radixgen.engine.kv_pool import KVPool
from radixgen.engine.plan import StepKind
from radixgen.engine.request import Request
from radixgen.engine.sampler import SampleResult, SamplingBatchCache
from radixgen.engine.scheduler import Scheduler


def _step(sched: Scheduler, sampling: SamplingBatchCache) -> Any:
    plan = sched.schedule()
    assert plan is not None
    sampling.get(plan)
    tokens = np.full(plan.batch_size, 7, dtype=np.int64)
    sched.process_results(plan, SampleResult(tokens, None, None, None))
    return plan


def test_a_batchs_parts_are_reused_while_it_stands_and_dropped_with_its_rows(tokenizer: Any) -> None:
    config = EngineConfig(max_running_requests=8, kv_cache_tokens=512, max_context_len=256)
    pool = KVPool(num_slots=512, num_layers=1, num_kv_heads=1, head_dim=1, dtype=torch.float16, device="cpu",
                  max_rows=8, max_context_len=256)
    sched = Scheduler(config, pool, tokenizer, eos_token_ids=(2,))
    cache = sched.planner.decode_batch
    sampling = SamplingBatchCache(49152, torch.device("cpu"), sched.kv.row_params, decode_batch=cache)
    for n, length in enumerate((6, 3, 9)):
        sched.add_request(Request(f"r{n}", [10 + n] * 5, SamplingParams(max_new_tokens=length, ignore_eos=True),
                                  rng_seed=n, detokenize=False))
    first = _step(sched, sampling)
    assert first.kind is StepKind.PREFILL
    decode = _step(sched, sampling)
    assert decode.kind is StepKind.DECODE
    arrays, made = cache.arrays, cache.sampling
    assert arrays is not None and made is not None and arrays.version == made.version == decode.batch_version
    again = _step(sched, sampling)
    assert again.batch_version == decode.batch_version
    assert cache.sampling is made, "the sampling tensors were reused, not gathered again"
    assert cache.arrays is not None and cache.arrays.value.requests is arrays.value.requests
    assert (again.positions == decode.positions + 1).all() and (again.input_ids == 7).all()
    while sched.planner.running_version == decode.batch_version:  # until r1 (3 tokens) leaves the batch
        _step(sched, sampling)
    after = _step(sched, sampling)
    assert after.batch_version != decode.batch_version and cache.sampling is not made
    assert [r.request_id for r in after.requests] == ["r0", "r2"]

    plan = sched.schedule()
    assert plan is not None and plan.kind is StepKind.DECODE
    sched.drop_rows(plan, np.ones(plan.batch_size, dtype=bool))
    assert cache.arrays is not None, "nothing dropped: the batch's parts stand"
    sched.drop_rows(plan, np.array([True, False]))
    assert cache.arrays is None and cache.next_inputs is None and cache.sampling is None and cache.steady is None
