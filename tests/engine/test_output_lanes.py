"""The batched lane of result processing (plain decode rows: gathers over the row table, deltas
as columns) against the per-request path, output for output; the row table's sampling state
against the requests it was written from."""

from __future__ import annotations

import pickle
from typing import Any

import numpy as np
import pytest
import torch

from radixgen import EngineConfig, FinishReason, SamplingParams
from radixgen.engine.apply import StepApplier
from radixgen.engine.detokenizer import ConsumerText
from radixgen.engine.kv_pool import KVPool
from radixgen.engine.output import DeltaReader, RequestOutput, StepDeltas
from radixgen.engine.plan import StepKind, StepPlan
from radixgen.engine.request import Request
from radixgen.engine.sampler import SampleResult, SamplingBatch, SamplingBatchCache
from radixgen.engine.scheduler import Scheduler

TEXT = ("Plain streams share the batched lane: naïve text, 日本語の文字, emoji 🚀🔥, and spaces   that merge. "
        "Stop strings and log-probabilities take the per-request path. ") * 6
EOS = 2


def _params(**overrides: Any) -> SamplingParams:
    return SamplingParams(**{"max_new_tokens": 40, "temperature": 0.7, "ignore_eos": True, **overrides})


# (name, params, stream, uses deltas columns, step at which it arrives)
REQUESTS = [
    ("plain", _params(), True, False, 0),
    ("plain-columns", _params(), True, True, 0),
    ("not-streamed", _params(), False, False, 0),
    ("short", _params(max_new_tokens=5), True, True, 0),
    ("eos", _params(ignore_eos=False), True, True, 0),
    ("eos-special-text", _params(ignore_eos=False, skip_special_tokens=False), True, False, 0),
    ("stop-string", _params(stop=(" Plain",)), True, False, 0),
    ("logprobs", _params(logprobs=True, top_logprobs=2), True, False, 0),
    ("stop-token", _params(stop_token_ids=(EOS,)), True, False, 0),
    ("late", _params(), True, True, 6),  # arrives mid-run: its prefill is a mixed step
    ("late-short", _params(max_new_tokens=3), True, False, 9),
]


gathered = [0]  # deltas of the last run that came as blocks gathered from the row table (no text)
by_key = [0]  # blocks of the last run whose columns came as the key of columns sent before


def _run(tokenizer: Any, *, lane: bool, monkeypatch: pytest.MonkeyPatch, kv_tokens: int = 4096,
         check: Any = None, consumer_text: bool = False,
         requests: list[tuple[str, SamplingParams, bool, bool, int]] = REQUESTS,
         ) -> tuple[dict[str, list[RequestOutput]], int]:
    """Outputs each request's consumer saw, in order, and how many came as columns. With
    ``consumer_text`` the requests whose text the engine does not need get it from the consumer
    (the HTTP front's way)."""
    with monkeypatch.context() as m:
        if not lane:
            m.setattr(StepApplier, "_plain_decode_rows", lambda self, plan, result, verdicts: None)
        # every prefill mixed while requests run: the tests follow rows through mixed steps too
        config = EngineConfig(max_running_requests=16, kv_cache_tokens=kv_tokens, max_context_len=1024,
                              chunked_prefill_size=64, max_prefill_tokens=256, prefill_alone_below_tokens=0)
        pool = KVPool(num_slots=kv_tokens, num_layers=1, num_kv_heads=1, head_dim=1, dtype=torch.float16,
                      device="cpu", max_rows=16, max_context_len=1024)
        sched = Scheduler(config, pool, tokenizer, eos_token_ids=(EOS,))
        text_ids = tokenizer.encode(TEXT, add_special_tokens=False)
        seen: dict[str, list[RequestOutput]] = {name: [] for name, *_ in requests}
        deltas = StepDeltas()
        reader = DeltaReader()
        columns_seen = 0
        gathered[0] = by_key[0] = 0
        texts: dict[str, ConsumerText] = {}

        def receive(out: RequestOutput) -> None:
            if out.request_id in texts:
                texts[out.request_id].fill(out)
            seen[out.request_id].append(out)

        order = {name: n for n, (name, *_) in enumerate(requests)}
        prompt = tokenizer.encode("Tell me something about lanes.", add_special_tokens=False)
        for step in range(200):
            for n, (name, params, stream, columns, arrives) in enumerate(requests):
                if arrives == step:
                    prompt_ids = prompt + [100 + n] * (n * 9)
                    if consumer_text and not params.engine_needs_text:
                        texts[name] = ConsumerText(tokenizer, prompt_ids, params.skip_special_tokens)
                    sched.add_request(Request(name, prompt_ids, params, rng_seed=n, on_output=receive, stream=stream,
                                              delta_sink=deltas if columns else None, detokenize=name not in texts))
            plan = sched.schedule()
            if plan is None:
                break
            if check is not None:
                check(sched, plan)
            # each request "samples" the text from its own offset; "eos" draws EOS at its 12th token
            tokens = np.array([EOS if r.request_id.startswith("eos") and len(r.output_ids) == 11
                               else text_ids[(len(r.output_ids) + 5 * order[r.request_id]) % len(text_ids)]
                               for r in plan.requests], dtype=np.int64)
            logprobs = -np.arange(plan.batch_size, dtype=np.float32) / 10
            top_ids = np.stack([tokens, tokens + 1], axis=1)
            sched.process_results(plan, SampleResult(tokens, logprobs, top_ids, np.stack([logprobs, logprobs - 1], 1)))
            taken = deltas.take()
            if taken is not None:
                taken = pickle.loads(pickle.dumps(taken))  # as the front gets them
                columns_seen += sum(len(block[1]) for block in taken)
                gathered[0] += sum(len(block[1]) for block in taken if block[2] is None)
                by_key[0] += sum(isinstance(block[0], int) for block in taken)
                for out in reader.expand(taken):
                    receive(out)
        assert not sched.has_work()
        sched.check_kv_invariant()
    return seen, columns_seen


def test_the_batched_lane_gives_every_consumer_the_outputs_of_the_per_request_path(
        tokenizer: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    batched, columns = _run(tokenizer, lane=True, monkeypatch=monkeypatch)
    reference, none = _run(tokenizer, lane=False, monkeypatch=monkeypatch)
    assert none == 0 and columns > 50, "the lane was not taken"
    for name, *_ in REQUESTS:
        assert batched[name] == reference[name], name
        final = batched[name][-1]
        assert final.finished and final.output_ids is not None
        assert "".join(o.new_text for o in batched[name]) == final.text, name
        assert [t for o in batched[name] for t in o.new_token_ids] == final.output_ids, name
    assert batched["eos"][-1].finish_reason is FinishReason.STOP and batched["eos"][-1].completion_tokens == 12
    assert batched["short"][-1].finish_reason is FinishReason.LENGTH
    assert batched["stop-string"][-1].text.endswith("path.") and batched["stop-string"][-1].finish_reason is FinishReason.STOP
    assert len(batched["not-streamed"]) == 1
    assert "<|im_end|>" not in batched["eos-special-text"][-1].text


def test_text_made_by_the_consumer_equals_the_engines(tokenizer: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    engine_text, _ = _run(tokenizer, lane=True, monkeypatch=monkeypatch)
    consumer_text, _ = _run(tokenizer, lane=True, monkeypatch=monkeypatch, consumer_text=True)
    assert engine_text == consumer_text
    assert gathered[0] > 50, "no deltas came as gathered blocks"
    assert all(o.new_text for o in consumer_text["plain-columns"][:3]), "the consumer made no text"


def test_the_row_table_counts_each_requests_tokens_in_every_kind_of_step(
        tokenizer: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """Sampling counters come from positions (a row's newest token is its step's first input)
    and the prefill rows' own counts; checked against the requests in prefill, mixed and decode
    steps, with a pool small enough to retract (resumed requests prefill their output again)."""
    kinds: set[str] = set()
    decode_plans = [0]

    def check(sched: Scheduler, plan: StepPlan) -> None:
        if plan.kind is StepKind.DECODE:  # inputs reused from the last step's tokens must be each newest token
            assert plan.input_ids.tolist() == [r.output_ids[-1] for r in plan.requests]
            decode_plans[0] += 1
        cache = SamplingBatchCache(49152, torch.device("cpu"), sched.kv.row_params)
        batch = cache.get(plan)
        reference = SamplingBatch.from_requests(plan.requests, 49152, torch.device("cpu"))
        expected = [len(r.output_ids) for r in plan.requests]
        assert batch.counters.tolist() == expected
        for name in ("temperatures", "top_p", "top_k", "seeds", "rows"):
            assert torch.equal(getattr(batch, name), getattr(reference, name)), name
        assert batch.max_top_logprobs == 2 * any(r.params.top_logprobs for r in plan.requests)
        kinds.add(plan.kind.value)
        kinds.update("resumed" for r in plan.requests[: plan.num_prefill] if r.num_retractions and r.output_ids)

    _run(tokenizer, lane=True, monkeypatch=monkeypatch, kv_tokens=420, check=check)
    assert kinds >= {"prefill", "mixed", "decode", "resumed"}, kinds
    plain = [r for r in REQUESTS if not r[1].engine_needs_text and not r[1].logprobs and not r[1].stop_token_ids]
    _run(tokenizer, lane=True, monkeypatch=monkeypatch, check=check, requests=plain)
    assert decode_plans[0] > 20


def test_a_batch_of_block_streams_steps_whole_and_gives_the_per_request_outputs(
        tokenizer: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """When every running row streams plain deltas into one sink (the engine process's steady
    state) a decode step is applied whole (``_steady_step``); the outputs are the per-request
    path's, through rows ending at EOS, at max tokens and joining mid-run."""
    blocks = [r for r in REQUESTS if r[3] and not r[1].engine_needs_text and not r[1].logprobs]
    assert {name for name, *_ in blocks} >= {"short", "eos", "late"}
    steady_steps = [0]
    original = StepApplier._steady_step

    def counted(self: StepApplier, plan: StepPlan, result: SampleResult) -> bool:
        took = original(self, plan, result)
        steady_steps[0] += took
        return took

    reference, _ = _run(tokenizer, lane=False, monkeypatch=monkeypatch, requests=blocks)
    monkeypatch.setattr(StepApplier, "_steady_step", counted)
    whole, _ = _run(tokenizer, lane=True, monkeypatch=monkeypatch, consumer_text=True, requests=blocks)
    assert whole == reference
    assert steady_steps[0] > 20, steady_steps
    assert by_key[0] > 10, "a steady batch sent its ids and lengths every step"


def test_keyed_columns_go_once_per_consumer_and_a_key_a_reader_never_got_names_no_request() -> None:
    deltas = StepDeltas()
    columns = (7, ["a", "b"], [3, 4], [0, 2])
    sent = []
    for step in range(4):
        deltas.blocks.append((columns, [10 + step, 20 + step], None, [step + 1, step + 1]))
        if step == 2:
            deltas.forget()  # a new consumer attached: it has never seen key 7
        taken = deltas.take()
        assert taken is not None
        sent.append(taken[0][0])
    assert sent == [columns, 7, columns, 7]  # whole at first and after forget(), a key otherwise
    reader = DeltaReader()
    assert list(reader.expand([(7, [1, 2], None, [1, 1])])) == []  # an earlier consumer's batch
    outs = list(reader.expand([(columns, [1, 2], None, [1, 1]), (7, [5, 6], ["x", "y"], [2, 2])]))
    assert [(o.request_id, o.new_token_ids, o.new_text, o.prompt_tokens, o.cached_tokens, o.completion_tokens)
            for o in outs] == [("a", [1], "", 3, 0, 1), ("b", [2], "", 4, 2, 1),
                               ("a", [5], "x", 3, 0, 2), ("b", [6], "y", 4, 2, 2)]
