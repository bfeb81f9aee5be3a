"""The scheduler with the radix cache: hits, chunked prefill, eviction, retraction, aborts."""

from __future__ import annotations

import json
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

from radixgen import Engine, FinishReason, SamplingParams

SYSTEM = "You are a careful assistant. Answer briefly and cite the rule you used. " * 6


def greedy(n: int) -> SamplingParams:
    return SamplingParams(max_new_tokens=n, temperature=0, ignore_eos=True)


def shared_prefix_prompts(engine: Engine, n: int) -> list[list[int]]:
    system = engine.tokenize(SYSTEM)
    return [system + engine.tokenize(f" Question {i}: what is {i} plus {i}?") for i in range(n)]


def test_shared_prefix_hits_and_same_outputs_as_without_cache(make_engine: Callable[..., Engine]) -> None:
    cached = make_engine()
    plain = make_engine(disable_radix_cache=True)
    prompts = shared_prefix_prompts(cached, 6)
    warm = cached.generate(prompts[0], greedy(8))
    assert warm.cached_tokens == 0
    outs = cached.generate(prompts[1:], greedy(12))
    system_len = len(cached.tokenize(SYSTEM))
    assert all(o.cached_tokens >= system_len - 1 for o in outs), [o.cached_tokens for o in outs]
    assert cached.scheduler.stats.cache_hit_rate > 0.5
    again = cached.generate(prompts[0], greedy(8))
    assert again.cached_tokens == len(prompts[0]) - 1, "a repeated prompt is cached except its last token"
    assert again.token_ids == warm.token_ids
    reference = plain.generate(prompts[1:], greedy(12))
    assert [o.token_ids for o in outs] == [o.token_ids for o in reference]
    assert all(o.cached_tokens == 0 for o in reference)
    assert plain.scheduler.stats.cache_hit_rate == 0.0


def test_multi_turn_resends_hit_the_previous_turn(make_engine: Callable[..., Engine]) -> None:
    engine = make_engine()
    history = engine.tokenize("User: tell me about tries.\nAssistant:")
    for _ in range(3):
        out = engine.generate(history, greedy(10))
        assert out.cached_tokens >= (len(history) - 20 if len(history) > 40 else 0)
        history = history + out.token_ids + engine.tokenize("\nUser: and then?\nAssistant:")
    assert engine.scheduler.stats.cache_hit_rate > 0.4


def test_chunked_prefill_gives_the_same_tokens(make_engine: Callable[..., Engine]) -> None:
    prompts = [[(i * 7 + 3) % 40000 + 100 for i in range(n)] for n in (300, 45, 520)]
    whole = make_engine(chunked_prefill_size=0, max_prefill_tokens=4096)
    chunked = make_engine(chunked_prefill_size=64, max_prefill_tokens=128)
    expected = [o.token_ids for o in whole.generate(prompts, greedy(10))]
    got = [o.token_ids for o in chunked.generate(prompts, greedy(10))]
    assert got == expected
    stats = chunked.scheduler.stats
    assert stats.num_prefill_steps >= 520 // 64, "the long prompt must have been chunked"


def test_chunks_interleave_with_decode(make_engine: Callable[..., Engine]) -> None:
    engine = make_engine(chunked_prefill_size=32, max_prefill_tokens=64)
    first_token = threading.Event()
    engine.add_request("short prompt", greedy(200), on_output=lambda o: first_token.set())
    assert first_token.wait(30)
    steps_before = engine.scheduler.stats.num_decode_steps
    long_out = engine.generate([101 + i for i in range(600)], greedy(2))
    assert long_out.completion_tokens == 2
    # ~19 chunks for the long prompt; decode steps ran between them
    assert engine.scheduler.stats.num_decode_steps - steps_before >= 15
    engine.run_on_loop(lambda: [engine.scheduler.abort(rid) for rid in list(engine.scheduler.requests)])


def test_small_pool_evicts_and_retracts_and_completes_correctly(make_engine: Callable[..., Engine]) -> None:
    roomy = make_engine()
    prompts = shared_prefix_prompts(roomy, 8)
    expected = [o.token_ids for o in roomy.generate(prompts, greedy(40))]
    tight = make_engine(kv_cache_tokens=300)
    first = tight.generate(prompts[:2], greedy(40))  # fills the tree
    outs = tight.generate(prompts, greedy(40))
    assert [o.token_ids for o in first] == expected[:2]
    assert [o.token_ids for o in outs] == expected
    stats = tight.scheduler.stats
    assert stats.evicted_tokens > 0 and stats.num_retractions > 0, stats.snapshot()


def test_abort_mid_prefill_and_mid_decode_leaks_nothing(make_engine: Callable[..., Engine]) -> None:
    engine = make_engine(chunked_prefill_size=16, max_prefill_tokens=16)
    decoding = threading.Event()
    done: list[Any] = []
    engine.add_request("a", greedy(500), request_id="decoder", on_output=lambda o: decoding.set() or (o.finished and done.append(o)))
    assert decoding.wait(30)
    engine.add_request([200 + i for i in range(900)], greedy(5), request_id="prefiller",
                       on_output=lambda o: o.finished and done.append(o))

    def mid_prefill() -> bool:
        sched = engine.scheduler
        return sched.chunked is not None and sched.chunked.request_id == "prefiller"

    for _ in range(2000):
        if engine.run_on_loop(mid_prefill):
            break
    engine.abort("prefiller")
    engine.abort("decoder")
    for _ in range(500):
        if len(done) == 2:
            break
        threading.Event().wait(0.01)
    assert {o.request_id: o.finish_reason for o in done} == {"prefiller": FinishReason.ABORT, "decoder": FinishReason.ABORT}


def test_lpm_serves_the_cached_prefix_first(make_engine: Callable[..., Engine]) -> None:
    engine = make_engine(schedule_policy="lpm", max_running_requests=1)
    cached_prompt = engine.tokenize(SYSTEM + " cached tail")
    engine.generate(cached_prompt, greedy(2))
    order: list[str] = []
    blocker = threading.Event()
    engine.add_request("x", greedy(30), request_id="blocker", on_output=lambda o: o.finished and blocker.set())
    for rid, prompt in (("cold", "completely different words here"), ("warm", cached_prompt)):
        engine.add_request(prompt, greedy(2), request_id=rid,
                           on_output=lambda o, rid=rid: o.finished and order.append(rid))
    assert blocker.wait(30)
    for _ in range(500):
        if len(order) == 2:
            break
        threading.Event().wait(0.01)
    assert order == ["warm", "cold"]


def test_event_log_has_one_record_per_step(make_engine: Callable[..., Engine], tmp_path: Path) -> None:
    log = tmp_path / "events.jsonl"
    engine = make_engine(event_log=str(log))
    engine.generate(["one prompt", "another prompt"], greedy(5))
    # the last step's record is written just after its outputs wake generate()
    engine.run_on_loop(lambda: None)
    records = [json.loads(line) for line in log.read_text().splitlines()]
    assert len(records) == engine.scheduler.stats.num_steps
    assert {"prefill", "decode"} <= {r["kind"] for r in records} <= {"prefill", "decode", "mixed"}
    for key in ("batch_size", "new_tokens", "cached_tokens", "evicted_tokens", "retracted", "schedule_s", "forward_s"):
        assert key in records[0]
    assert sum(r["new_tokens"] for r in records if r["kind"] == "decode") == sum(
        r["batch_size"] for r in records if r["kind"] == "decode"
    )
    assert all(r["decode_rows"] == (r["batch_size"] if r["kind"] == "decode" else 0)
               for r in records if r["kind"] != "mixed")


def test_request_queue_keeps_order_through_removals_and_requeues() -> None:
    from radixgen.engine.planner import RequestQueue

    reqs: list[Any] = [object() for _ in range(6)]
    queue = RequestQueue(reqs[:4])
    queue.append(reqs[4])
    queue.remove(reqs[1])
    queue.remove(reqs[1])  # an abort racing its own admission: a second removal is a no-op
    queue.appendleft(reqs[5])  # a retracted request goes first
    assert list(queue) == [reqs[5], reqs[0], reqs[2], reqs[3], reqs[4]] and len(queue) == 5
    assert queue.front() is reqs[5] and queue.popleft() is reqs[5] and reqs[5] not in queue
    assert reqs[0] in queue and bool(queue) and not RequestQueue()


def test_aborting_waiting_requests_leaves_the_others_in_order(make_engine: Callable[..., Engine]) -> None:
    engine = make_engine(max_running_requests=1)
    started: list[str] = []
    ended: dict[str, FinishReason] = {}
    lock = threading.Lock()

    def track(o: Any) -> None:
        with lock:
            if o.new_token_ids and o.request_id not in started:
                started.append(o.request_id)
            if o.finished:
                ended[o.request_id] = o.finish_reason

    ids = [f"r{i}" for i in range(24)]
    aborted = set(ids[1::2])
    for i, rid in enumerate(ids):  # the first runs long, so the rest wait behind it
        engine.add_request([100 + i, 7, 8], greedy(300 if i == 0 else 4), request_id=rid, on_output=track)
    for rid in sorted(aborted, reverse=True):  # out of queue order: removals from the middle
        engine.abort(rid)
    for _ in range(3000):
        if len(ended) == len(ids):
            break
        threading.Event().wait(0.01)
    assert {rid for rid, reason in ended.items() if reason is FinishReason.ABORT} == aborted, (ended, started)
    assert all(ended[rid] is FinishReason.LENGTH for rid in ids if rid not in aborted)
    kept = [rid for rid in started if rid not in aborted]
    assert kept == [rid for rid in ids if rid not in aborted], "the queue kept its order"


def test_reset_prefix_cache_drops_the_unheld_prefixes_and_keeps_the_answers(
        make_engine: Callable[..., Engine]) -> None:
    engine = make_engine()
    prompts = shared_prefix_prompts(engine, 3)
    first = engine.generate(prompts, greedy(6))
    held = engine.kv_accounting()["held_by_tree"]
    assert held > 0
    assert engine.reset_prefix_cache() == held
    accounting = engine.kv_accounting()
    assert accounting["held_by_tree"] == 0 and accounting["free"] == accounting["pool_size"]
    again = engine.generate(prompts[0], greedy(6))
    assert again.cached_tokens == 0, "a dropped prefix is computed again"
    assert again.token_ids == first[0].token_ids
    engine.run_on_loop(engine.scheduler.check_kv_invariant)
