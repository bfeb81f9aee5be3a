"""Engine behaviour on the tiny random-weight model: stops, finish reasons, aborts, batching,
retraction, streaming, faults. The autouse fixture checks that no KV slot leaks after each test."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from radixgen import Engine, FinishReason, SamplingParams
from radixgen.errors import EngineDeadError, InvalidParamsError, PromptTooLongError
from tests.conftest import FinalOutputs

PROMPTS = ["The quick brown fox", "Once upon a time in a land far away", "1, 2, 3,", "Dear diary, today"]


def greedy(n: int, **kw: Any) -> SamplingParams:
    return SamplingParams(max_new_tokens=n, temperature=0, ignore_eos=True, **kw)


def test_length_finish_and_counts(tiny_engine: Engine) -> None:
    out = tiny_engine.generate(PROMPTS[0], greedy(7))
    assert out.finish_reason is FinishReason.LENGTH
    assert len(out.token_ids) == out.completion_tokens == 7
    assert out.prompt_tokens == len(tiny_engine.tokenize(PROMPTS[0]))


def test_stop_token_id_ends_generation_at_first_occurrence(tiny_engine: Engine) -> None:
    full = tiny_engine.generate(PROMPTS[1], greedy(24)).token_ids
    stop_id = full[6]
    first = full.index(stop_id)
    out = tiny_engine.generate(PROMPTS[1], greedy(24, stop_token_ids=[stop_id]))
    assert out.finish_reason is FinishReason.STOP
    assert out.token_ids == full[: first + 1]
    assert out.text == tiny_engine.tokenizer.decode(full[:first], skip_special_tokens=True)


def test_eos_stops_unless_ignored(tiny_engine: Engine) -> None:
    full = tiny_engine.generate(PROMPTS[2], greedy(16)).token_ids
    eos = full[4]
    old = tiny_engine.scheduler.appender.eos_token_ids
    tiny_engine.run_on_loop(lambda: setattr(tiny_engine.scheduler.appender, "eos_token_ids", frozenset({eos})))
    try:
        stopped = tiny_engine.generate(PROMPTS[2], SamplingParams(max_new_tokens=16, temperature=0))
        ignored = tiny_engine.generate(PROMPTS[2], greedy(16))
    finally:
        tiny_engine.run_on_loop(lambda: setattr(tiny_engine.scheduler.appender, "eos_token_ids", old))
    assert stopped.finish_reason is FinishReason.STOP
    assert stopped.token_ids == full[: full.index(eos) + 1]
    assert ignored.token_ids == full


def test_stop_string_trims_output_like_openai(tiny_engine: Engine) -> None:
    full = tiny_engine.generate(PROMPTS[3], greedy(40))
    text = full.text
    assert len(text) > 20
    stop = text[12:16]
    out = tiny_engine.generate(PROMPTS[3], greedy(40, stop=[stop, "never-appears-xyz"]))
    assert out.finish_reason is FinishReason.STOP
    assert out.text == text[: text.find(stop)]
    assert len(out.token_ids) < len(full.token_ids)


def test_abort_mid_decode_and_while_waiting(make_engine: Callable[..., Engine]) -> None:
    engine = make_engine(max_running_requests=1)
    outputs = FinalOutputs()
    started, finals = outputs.started, outputs.finals

    running = engine.add_request(PROMPTS[0], greedy(900), on_output=outputs)
    queued = engine.add_request(PROMPTS[1], greedy(900), on_output=outputs)
    assert started.wait(30)
    engine.abort(queued.request_id)
    engine.abort(running.request_id)
    outputs.wait_for(2)
    assert finals[running.request_id].finish_reason is FinishReason.ABORT
    assert finals[queued.request_id].finish_reason is FinishReason.ABORT
    assert 0 < finals[running.request_id].completion_tokens < 900
    assert finals[queued.request_id].completion_tokens == 0


def test_requests_join_a_running_batch(tiny_engine: Engine) -> None:
    """A request submitted while another decodes joins at the next step (continuous batching)."""
    first_done = threading.Event()
    tokens_seen = threading.Event()
    order: list[str] = []

    def long_cb(out: Any) -> None:
        if out.new_token_ids:
            tokens_seen.set()
        if out.finished:
            order.append("long")
            first_done.set()

    tiny_engine.add_request(PROMPTS[0], greedy(300), on_output=long_cb)
    assert tokens_seen.wait(30)
    short = tiny_engine.generate(PROMPTS[1], greedy(5))
    order.append("short")
    assert short.completion_tokens == 5
    assert first_done.wait(60)
    assert order == ["short", "long"], "the short request must not wait for the long one"


def test_retraction_under_a_small_pool_keeps_outputs_exact(make_engine: Callable[..., Engine]) -> None:
    prompts = [p + " and more" * i for i, p in enumerate(PROMPTS * 2)]
    roomy = make_engine()
    expected = [o.token_ids for o in roomy.generate(prompts, greedy(60))]
    tight = make_engine(kv_cache_tokens=320)
    outs = tight.generate(prompts, greedy(60))
    assert [o.token_ids for o in outs] == expected
    assert tight.scheduler.stats.num_retractions > 0, "the pool was meant to be too small"


def test_seeded_sampling_reproduces_alone_and_batched(tiny_engine: Engine) -> None:
    params = [SamplingParams(max_new_tokens=12, temperature=1.0, seed=s, ignore_eos=True) for s in (1, 2, 3)]
    batched = tiny_engine.generate([PROMPTS[0]] * 3, params)
    alone = [tiny_engine.generate(PROMPTS[0], p) for p in params]
    assert [o.token_ids for o in batched] == [o.token_ids for o in alone]
    assert len({tuple(o.token_ids) for o in batched}) == 3, "different seeds should differ"


def test_logprobs_come_back_per_token(tiny_engine: Engine) -> None:
    out = tiny_engine.generate(PROMPTS[0], greedy(6, logprobs=True, top_logprobs=2))
    assert out.logprobs is not None and len(out.logprobs) == 6
    assert out.top_logprobs is not None and all(len(t) == 2 for t in out.top_logprobs)
    assert all(top[0][0] == tok for top, tok in zip(out.top_logprobs, out.token_ids, strict=True))


def test_stream_deltas_add_up_and_early_exit_aborts(tiny_engine: Engine) -> None:
    whole = tiny_engine.generate(PROMPTS[1], greedy(20))

    async def collect(limit: int | None) -> list[Any]:
        deltas = []
        async for d in tiny_engine.generate_stream(PROMPTS[1], greedy(20)):
            deltas.append(d)
            if limit is not None and len(deltas) >= limit:
                break
        return deltas

    deltas = asyncio.run(collect(None))
    assert "".join(d.new_text for d in deltas) == whole.text
    assert [t for d in deltas for t in d.new_token_ids] == whole.token_ids
    assert deltas[-1].finished and deltas[-1].finish_reason is FinishReason.LENGTH
    partial = asyncio.run(collect(3))
    assert len(partial) == 3  # leaving early aborted the rest; the fixture checks nothing leaked


def test_bad_requests_fail_before_anything_is_allocated(tiny_engine: Engine) -> None:
    with pytest.raises(PromptTooLongError, match="lower max_new_tokens or shorten the prompt"):
        tiny_engine.generate([5] * 1000, SamplingParams(max_new_tokens=100))
    with pytest.raises(InvalidParamsError, match="token ids must be integers"):
        tiny_engine.generate([5, -1, 7])
    with pytest.raises(InvalidParamsError, match="empty"):
        tiny_engine.generate("")
    with pytest.raises(InvalidParamsError, match="one each"):
        tiny_engine.generate(["a", "b"], [SamplingParams()])
    assert tiny_engine.generate(PROMPTS[0], greedy(3)).completion_tokens == 3


def test_duplicate_request_id_is_refused(tiny_engine: Engine) -> None:
    tiny_engine.add_request(PROMPTS[0], greedy(200), request_id="dup")
    try:
        with pytest.raises(InvalidParamsError, match="already in use"):
            tiny_engine.add_request(PROMPTS[1], greedy(2), request_id="dup")
    finally:
        tiny_engine.abort("dup")


def test_internal_fault_fails_the_step_not_the_engine(make_engine: Callable[..., Engine]) -> None:
    engine = make_engine()
    real_forward = engine.runner.forward_with
    calls = {"n": 0}

    def flaky(plan: Any, extra: Any) -> Any:
        calls["n"] += 1
        if calls["n"] == 3:
            raise RuntimeError("injected fault")
        return real_forward(plan, extra)

    engine.runner.forward_with = flaky  # type: ignore[method-assign]
    out = engine.generate(PROMPTS[0], greedy(10))
    assert out.finish_reason is FinishReason.ERROR
    assert out.error is not None and "injected fault" in out.error
    assert engine.generate(PROMPTS[0], greedy(4)).finish_reason is FinishReason.LENGTH


def test_shutdown_engine_refuses_new_work(make_engine: Callable[..., Engine]) -> None:
    engine = make_engine()
    engine.shutdown()
    with pytest.raises(EngineDeadError, match="not running"):
        engine.generate(PROMPTS[0], greedy(2))


def test_the_shared_tokenizer_survives_many_threads_while_the_loop_detokenizes(tiny_engine: Engine) -> None:
    """The engine's one fast tokenizer: run_batch-style threads tokenize and render chats (some
    with truncation, which reconfigures the tokenizer) while the loop thread detokenizes
    streamed requests. HF tokenizers used to fail such sharing with "Already borrowed"."""
    text = "The quick brown fox — naïve, 日本語 — jumps over the lazy dog. " * 40
    errors: list[BaseException] = []
    stop = time.monotonic() + 2.0

    def tokenize() -> None:
        try:
            while time.monotonic() < stop:
                tiny_engine.tokenize(text)
                tiny_engine.apply_chat_template([{"role": "user", "content": text}])
                tiny_engine.tokenizer(text, truncation=True, max_length=8)
        except BaseException as e:  # noqa: BLE001 - reported by the assertion below
            errors.append(e)

    def stream(i: int) -> None:
        try:
            while time.monotonic() < stop:
                outs = list(tiny_engine.iter_outputs(f"request {i}", SamplingParams(max_new_tokens=24, ignore_eos=True)))
                assert outs[-1].finish_reason is FinishReason.LENGTH and outs[-1].completion_tokens == 24
        except BaseException as e:  # noqa: BLE001
            errors.append(e)

    threads = [threading.Thread(target=tokenize) for _ in range(16)] + [threading.Thread(target=stream, args=(i,))
                                                                        for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert not errors, errors[:3]


def test_glibc_takes_the_allocator_settings_the_cpu_engine_makes() -> None:
    """mallopt answers 0 for a parameter or value it refuses, and the engine would silently keep
    faulting fresh pages in for every intermediate."""
    import platform

    from radixgen.host_memory import keep_freed_memory_for_reuse

    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        pytest.skip("glibc only")
    assert keep_freed_memory_for_reuse()


def test_a_failure_after_the_model_is_built_is_raised_at_once(tiny_model_dir: Path,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """The model built, the engine's own set-up fails (here: the sampler): that error reaches the
    caller within seconds, and the loop thread ends instead of waiting for a start that never comes."""
    import threading
    import time

    from radixgen import Engine, EngineConfig
    from radixgen.engine import engine as engine_module

    def broken(*_args: object, **_kwargs: object) -> None:
        raise RuntimeError("sampler set-up failed")

    monkeypatch.setattr(engine_module, "Sampler", broken)
    running_before = {t for t in threading.enumerate() if t.name == "radixgen-engine"}
    start = time.monotonic()
    with pytest.raises(RuntimeError, match="sampler set-up failed"):
        Engine(EngineConfig(model=str(tiny_model_dir), kv_cache_tokens=1024, max_context_len=256, tune_kernels=False))
    assert time.monotonic() - start < 60
    deadline = time.monotonic() + 10
    while any(t.name == "radixgen-engine" and t.is_alive() and t not in running_before for t in threading.enumerate()):
        assert time.monotonic() < deadline, "the engine's loop thread is still waiting"
        time.sleep(0.05)


def test_an_engine_whose_front_fails_to_start_raises_that_error_and_stops(
        tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The loop thread is running the model when the front (constraints, scheduler, sampler) is
    built: a failure there is raised to the caller as it is, within seconds, and the loop
    thread ends (it once hid the error behind an AttributeError and waited forever)."""
    from radixgen import EngineConfig
    from radixgen.engine import engine as engine_module

    def broken(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("the scheduler could not be built")

    monkeypatch.setattr(engine_module, "Scheduler", broken)
    loops_before = {t for t in threading.enumerate() if t.name == "radixgen-engine"}
    outcome: dict[str, BaseException] = {}

    def start() -> None:
        try:
            Engine(EngineConfig(model=str(tiny_model_dir), kv_cache_tokens=1024, max_context_len=256))
        except BaseException as e:  # noqa: BLE001 - the test reads it
            outcome["error"] = e

    starter = threading.Thread(target=start, daemon=True)
    starter.start()
    starter.join(timeout=60)
    assert not starter.is_alive(), "the engine's start hung"
    error = outcome.get("error")
    assert isinstance(error, RuntimeError) and "could not be built" in str(error), error
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        loops = {t for t in threading.enumerate() if t.name == "radixgen-engine"} - loops_before
        if not any(t.is_alive() for t in loops):
            break
        time.sleep(0.05)
    assert not any(t.is_alive() for t in loops), "the loop thread kept running"
