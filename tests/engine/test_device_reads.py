"""A step uploads its inputs once and reads its results back once (radixgen/staging.py); between
the two it must not read the device: on a GPU each such read waits for every kernel queued
before it. Here (CPU) the reads are counted by patching torch's reading calls during a step."""

from __future__ import annotations

import dataclasses
import threading
import traceback
from collections.abc import Callable
from typing import Any

import pytest
import torch

import radixgen.engine.model_runner as model_runner
from radixgen import Engine, SamplingParams
from radixgen.staging import ReadBack

READS = ("item", "tolist", "cpu", "numpy", "__bool__", "__int__", "__float__", "__index__")


@pytest.fixture
def device_reads(monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    """Records each reading call the engine thread makes between a step's upload and its read-back."""
    state: dict[str, Any] = {"active": False, "steps": 0, "reads": []}
    upload = model_runner.upload

    def step_upload(*args: Any) -> list[torch.Tensor]:
        uploaded = upload(*args)
        state["active"] = threading.current_thread().name.startswith("radixgen-engine")
        return uploaded

    wait = ReadBack.wait

    def read_back(self: ReadBack) -> Any:
        if state["active"]:
            state["active"] = False
            state["steps"] += 1
        return wait(self)

    monkeypatch.setattr(model_runner, "upload", step_upload)
    monkeypatch.setattr(ReadBack, "wait", read_back)
    for name in READS:
        real = getattr(torch.Tensor, name)

        def guarded(self: torch.Tensor, *args: Any, _real: Any = real, _name: str = name, **kwargs: Any) -> Any:
            if state["active"] and threading.current_thread().name.startswith("radixgen-engine"):
                state["reads"].append(f"{_name}: {''.join(traceback.format_stack(limit=4)[:-1])}")
            return _real(self, *args, **kwargs)

        monkeypatch.setattr(torch.Tensor, name, guarded)
    return state


@pytest.mark.parametrize("backend", ["cpu", "torch"])  # (the interpreter behind triton on CPU copies to the host)
def test_steps_read_nothing_between_upload_and_read_back(make_engine: Callable[..., Engine],
                                                              device_reads: dict[str, Any], backend: str) -> None:
    engine = make_engine(attention_backend=backend)
    params = [
        SamplingParams(max_new_tokens=12, temperature=0, ignore_eos=True),
        SamplingParams(max_new_tokens=12, temperature=0.9, top_k=20, top_p=0.9, min_p=0.02, seed=3, ignore_eos=True),
        SamplingParams(max_new_tokens=12, temperature=0.7, seed=4, ignore_eos=True, logprobs=True, top_logprobs=3),
        SamplingParams(max_new_tokens=12, temperature=0.7, seed=5, ignore_eos=True, repetition_penalty=1.3,
                       frequency_penalty=0.5, presence_penalty=0.2),
        SamplingParams(max_new_tokens=12, temperature=0, ignore_eos=True, logit_bias={42: 5.0}, min_new_tokens=4),
        # a constrained row: its grammar mask goes up with the step's inputs
        SamplingParams(max_new_tokens=12, temperature=0.8, seed=6, regex=r"[a-z]{4,20}"),
    ]
    outs = engine.generate(["one", "two", "three", "four", "five", "six"], params)
    assert all(len(o.token_ids) == 12 for o in outs[:5])
    assert outs[5].text.isalpha() and outs[5].text.islower(), outs[5].text
    assert device_reads["steps"] >= 12, "every step should have uploaded and read back"
    assert not device_reads["reads"], "\n".join(device_reads["reads"][:3])


def test_the_guard_sees_a_read(make_engine: Callable[..., Engine], device_reads: dict[str, Any],
                               monkeypatch: pytest.MonkeyPatch) -> None:
    """The check above can fail: a forward that reads a tensor back is caught."""
    engine = make_engine()
    forward = engine.runner.model.forward

    def reading_forward(*args: Any, **kwargs: Any) -> torch.Tensor:
        logits = forward(*args, **kwargs)
        logits.max().item()
        return logits

    monkeypatch.setattr(engine.runner.model, "forward", reading_forward)
    engine.generate("one", SamplingParams(max_new_tokens=3, temperature=0, ignore_eos=True))
    assert any(read.startswith("item") for read in device_reads["reads"])


def test_verification_steps_read_nothing_before_their_one_read_back(make_engine: Callable[..., Engine],
                                                                   device_reads: dict[str, Any]) -> None:
    """Speculative steps (greedy, sampled, penalised, with log-probabilities, constrained) and
    jump-forward's forced tokens are verified from one read of every position's choice."""
    engine = make_engine(speculative="ngram")
    prompt = "one two three four one two three four one two three four one two"
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8},
                                               "count": {"type": "integer"}}, "required": ["name", "count"]}
    params = [
        SamplingParams(max_new_tokens=16, temperature=0, ignore_eos=True),
        SamplingParams(max_new_tokens=16, temperature=0.8, seed=1, ignore_eos=True, logprobs=True, top_logprobs=2),
        SamplingParams(max_new_tokens=16, temperature=0, ignore_eos=True, repetition_penalty=1.2),
        SamplingParams(max_new_tokens=40, temperature=0, json_schema=schema),
    ]
    outs = engine.generate([prompt] * 4, params)
    # a constrained request that does not draft takes the forced text by jump-forward
    engine.generate(prompt, dataclasses.replace(params[3], speculative=False))
    stats = engine.scheduler.stats
    assert stats.drafted_tokens > 0 and stats.num_jump_forwards > 0, "drafts and forced text should have run"
    assert all(len(o.token_ids) == 16 for o in outs[:3]) and outs[3].text.startswith("{")
    assert device_reads["steps"] > 0
    assert not device_reads["reads"], "\n".join(device_reads["reads"][:3])


def test_a_plain_step_uploads_once_with_the_sampling_parameters(
    make_engine: Callable[..., Engine], monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The sampler's per-row parameters go up in the step's one copy, also in steps where the
    batch changed (a request joined or left) and the sampler built new ones."""
    import radixgen.engine.sampler as sampler

    engine = make_engine()
    calls: list[str] = []
    for module in (model_runner, sampler):
        real = module.upload

        def counted(*args: Any, _real: Any = real, _name: str = module.__name__) -> list[torch.Tensor]:
            if threading.current_thread().name.startswith("radixgen-engine"):
                calls.append(_name)
            return _real(*args)

        monkeypatch.setattr(module, "upload", counted)
    steps_before = engine.stats_snapshot()["num_steps"]
    params = [SamplingParams(max_new_tokens=n, temperature=0.8, top_p=0.9, seed=n, ignore_eos=True,
                             repetition_penalty=1.1 if n % 2 else 1.0) for n in (3, 6, 9, 12)]
    outs = engine.generate([[5, 6, 7], [8, 9], [10, 11, 12, 13], [14]], params)
    assert [o.completion_tokens for o in outs] == [3, 6, 9, 12]
    steps = engine.stats_snapshot()["num_steps"] - steps_before
    assert calls == ["radixgen.engine.model_runner"] * steps, calls
