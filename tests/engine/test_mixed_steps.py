"""Mixed steps: running requests decode their next token inside prefill steps.

What could break: a decode row reading the wrong positions after a step the decode-only fast
path did not see (a prefill chunk that finishes nothing), decode and prefill rows attending
each other's keys, tokens or logits assigned to the wrong request, slots leaked.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import pytest
import torch

from radixgen import Engine, SamplingParams
from radixgen.engine.output import RequestOutput


def _greedy(n: int) -> SamplingParams:
    # log-probabilities too: a greedy token of the tiny random model can survive a wrong
    # attention output, its log-probability cannot
    return SamplingParams(max_new_tokens=n, temperature=0, ignore_eos=True, logprobs=True)


def _run_staggered(
    engine: Engine, first: list[int], late: list[list[int]]
) -> tuple[list[list[int]], list[list[float]]]:
    """Start ``first`` alone; once it has decoded a few tokens, submit ``late``. Token ids and
    their log-probabilities, per request."""
    tokens: dict[int, list[int]] = {i: [] for i in range(len(late) + 1)}
    logprobs: dict[int, list[float]] = {i: [] for i in range(len(late) + 1)}
    done = threading.Semaphore(0)
    decoding = threading.Event()

    def collect(i: int) -> Callable[[RequestOutput], None]:
        def on_output(out: RequestOutput) -> None:
            tokens[i].extend(out.new_token_ids)
            logprobs[i].extend(out.new_logprobs or [])
            if i == 0 and len(tokens[0]) >= 3:
                decoding.set()
            if out.finished:
                assert out.error is None, out.error
                done.release()
        return on_output

    engine.add_request(first, _greedy(40), on_output=collect(0))
    assert decoding.wait(60)
    for i, prompt in enumerate(late, start=1):
        engine.add_request(prompt, _greedy(12), on_output=collect(i))
    for _ in range(len(late) + 1):
        assert done.acquire(timeout=120)
    return [tokens[i] for i in range(len(late) + 1)], [logprobs[i] for i in range(len(late) + 1)]


def _assert_same(got: tuple[list[list[int]], list[list[float]]], expected: list[Any]) -> None:
    assert got[0] == [e.token_ids for e in expected]
    for mine, theirs in zip(got[1], expected, strict=True):
        torch.testing.assert_close(torch.tensor(mine), torch.tensor(theirs.logprobs), atol=1e-4, rtol=0)


def test_mixed_steps_give_the_tokens_of_separate_steps(make_engine: Callable[..., Any]) -> None:
    # 64-token chunks: the 300-token prompt takes five prefill steps, four of which finish no
    # request, while the first request keeps decoding inside them.
    small_chunks = dict(chunked_prefill_size=64, max_prefill_tokens=64, prefill_alone_below_tokens=0)
    mixed = make_engine(**small_chunks)
    separate = make_engine(mixed_steps=False, **small_chunks)
    first = mixed.tokenize("The first request starts alone and keeps decoding while others arrive.")
    late = [list(range(1000, 1300)), list(range(2000, 2030)), mixed.tokenize("A short one.")]

    got = _run_staggered(mixed, first, late)

    stats = mixed.scheduler.stats
    mixed_steps = stats.num_prefill_steps + stats.num_decode_steps - stats.num_steps
    assert mixed_steps >= 4, "the late prompts' chunks should have carried the running request"
    assert [len(t) for t in got[0]] == [40, 12, 12, 12]
    _assert_same(got, [separate.generate(p, _greedy(n)) for p, n in zip([first, *late], [40, 12, 12, 12], strict=True)])
    sep_stats = separate.scheduler.stats
    assert sep_stats.num_prefill_steps + sep_stats.num_decode_steps == sep_stats.num_steps


def test_mixed_steps_with_the_reference_attention(make_engine: Callable[..., Any]) -> None:
    """The decode rows of a mixed step take the reference backend's per-request SDPA."""
    mixed = make_engine(attention_backend="torch", chunked_prefill_size=64, max_prefill_tokens=64,
                        prefill_alone_below_tokens=0)
    assert mixed.runner.attention.name == "torch"
    first = mixed.tokenize("Decoding alongside a long prompt, without the native kernel.")
    late = [list(range(3000, 3200))]
    got = _run_staggered(mixed, first, late)
    stats = mixed.scheduler.stats
    assert stats.num_prefill_steps + stats.num_decode_steps > stats.num_steps
    _assert_same(got, [mixed.generate(first, _greedy(40)), mixed.generate(late[0], _greedy(12))])


def test_decode_positions_after_a_mixed_step_whose_prefill_is_aborted() -> None:
    """Scheduler only (no model): a mixed step moves the running request on by one token
    without changing the running set; when the chunked request it carried is aborted, the next
    step is a plain decode step, which must not reuse the positions from before the mixed step."""
    import numpy as np

    from radixgen import EngineConfig
    from radixgen.engine.kv_pool import KVPool
    from radixgen.engine.request import Request
    from radixgen.engine.sampler import SampleResult
    from radixgen.engine.scheduler import Scheduler

    config = EngineConfig(kv_cache_tokens=512, max_context_len=256, chunked_prefill_size=16, max_prefill_tokens=16,
                          prefill_alone_below_tokens=0)
    pool = KVPool(num_slots=512, num_layers=1, num_kv_heads=1, head_dim=1, dtype=torch.float32, device="cpu",
                  max_rows=8, max_context_len=256)
    sched = Scheduler(config, pool, None, eos_token_ids=())

    def step() -> Any:
        plan = sched.schedule()
        tokens = np.full(plan.batch_size, 7, dtype=np.int64)
        sched.process_results(plan, SampleResult(tokens, None, None, None))
        return plan

    params = SamplingParams(max_new_tokens=50, temperature=0, ignore_eos=True)
    sched.add_request(Request("running", list(range(10, 20)), params, rng_seed=0))
    step()  # its prefill
    step()
    decode = step()
    assert decode.num_decode == 0 and decode.positions.tolist() == [11]
    sched.add_request(Request("long", list(range(100, 160)), params, rng_seed=0))
    mixed = step()  # the first 16-token chunk of "long", with "running" decoding inside it
    assert mixed.num_decode == 1 and mixed.positions[-1] == 12 and mixed.requests[-1].request_id == "running"
    sched.abort("long")
    after = step()
    assert after.num_decode == 0 and after.positions.tolist() == [13]
    assert pool.req_to_token_host[after.rows[0], 13] == after.out_cache_loc[0]
    sched.abort("running")
    assert pool.available() + sched.tree.cached_tokens() == 512


def test_a_step_that_decodes_takes_a_smaller_prefill_budget() -> None:
    """Running requests wait for each step: with them decoding, a step prefills at most
    max_mixed_prefill_tokens; with none, max_prefill_tokens."""
    import numpy as np

    from radixgen import EngineConfig
    from radixgen.engine.kv_pool import KVPool
    from radixgen.engine.request import Request
    from radixgen.engine.sampler import SampleResult
    from radixgen.engine.scheduler import Scheduler

    config = EngineConfig(kv_cache_tokens=2048, max_context_len=512, max_prefill_tokens=256,
                          max_mixed_prefill_tokens=64, chunked_prefill_size=128, prefill_alone_below_tokens=0)
    pool = KVPool(num_slots=2048, num_layers=1, num_kv_heads=1, head_dim=1, dtype=torch.float32, device="cpu",
                  max_rows=8, max_context_len=512)
    sched = Scheduler(config, pool, None, eos_token_ids=())
    params = SamplingParams(max_new_tokens=5, temperature=0, ignore_eos=True)
    sched.add_request(Request("a", list(range(10, 110)), params, rng_seed=0))
    sched.add_request(Request("b", list(range(200, 300)), params, rng_seed=0))
    first = sched.schedule()
    assert first.num_decode == 0 and first.num_tokens == 200  # nothing decoding: the full budget
    sched.process_results(first, SampleResult(np.full(2, 7), None, None, None))
    sched.add_request(Request("c", list(range(400, 600)), params, rng_seed=0))
    mixed = sched.schedule()
    assert mixed.num_decode == 2 and mixed.num_tokens - 2 == 64
    sched.process_results(mixed, SampleResult(np.full(3, 7), None, None, None))
    for rid in ("a", "b", "c"):
        sched.abort(rid)
    assert pool.available() + sched.tree.cached_tokens() == 2048
    with pytest.raises(ValueError, match="max_mixed_prefill_tokens"):
        EngineConfig(max_mixed_prefill_tokens=0)


def test_a_short_prefill_runs_alone_and_the_running_requests_decode_next() -> None:
    """A new prompt of fewer tokens than prefill_alone_below_tokens gets a step of its own (its
    first token without waiting for the decode batch's step), then a decode step follows for
    everyone, before any further prefill; a longer prompt, or a request with output already,
    still carries the running requests."""
    import numpy as np

    from radixgen import EngineConfig
    from radixgen.engine.kv_pool import KVPool
    from radixgen.engine.plan import StepKind
    from radixgen.engine.request import Request
    from radixgen.engine.sampler import SampleResult
    from radixgen.engine.scheduler import Scheduler

    config = EngineConfig(kv_cache_tokens=2048, max_context_len=512, prefill_alone_below_tokens=40)
    pool = KVPool(num_slots=2048, num_layers=1, num_kv_heads=1, head_dim=1, dtype=torch.float32, device="cpu",
                  max_rows=8, max_context_len=512)
    sched = Scheduler(config, pool, None, eos_token_ids=())
    params = SamplingParams(max_new_tokens=20, temperature=0, ignore_eos=True)

    def step() -> Any:
        plan = sched.schedule()
        sched.process_results(plan, SampleResult(np.full(plan.batch_size, 7), None, None, None))
        return plan

    sched.add_request(Request("running", list(range(10, 20)), params, rng_seed=0))
    step()
    sched.add_request(Request("short", list(range(100, 130)), params, rng_seed=0))
    alone = step()
    assert alone.num_decode == 0 and [r.request_id for r in alone.requests] == ["short"]
    sched.add_request(Request("another", list(range(200, 210)), params, rng_seed=0))
    decode = step()
    assert decode.kind is StepKind.DECODE and {r.request_id for r in decode.requests} == {"running", "short"}
    assert step().requests[0].request_id == "another", "the queue is served after that decode step"
    assert step().kind is StepKind.DECODE
    sched.add_request(Request("long", list(range(300, 360)), params, rng_seed=0))
    mixed = step()
    assert mixed.num_decode == 3 and mixed.requests[0].request_id == "long"
    # a request with output already (jump-forward requeues its forced tokens, a retracted one
    # resumes) stays mixed however short: alone, each of its few tokens would cost a forward
    resumed = Request("resumed", list(range(400, 410)), params, rng_seed=0)
    resumed.output_ids = [7, 7]
    sched.add_request(resumed)
    assert step().num_decode == 4
    for rid in ("running", "short", "another", "long", "resumed"):
        sched.abort(rid)
    assert pool.available() + sched.tree.cached_tokens() == 2048
    with pytest.raises(ValueError, match="prefill_alone_below_tokens"):
        EngineConfig(prefill_alone_below_tokens=-1)
