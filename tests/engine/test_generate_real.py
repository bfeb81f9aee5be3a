"""Greedy generation of the real SmolLM2 equals transformers' generate, alone and batched.

Both run the file's dequantized float weights (``weights="float"``): the default 4-bit run
rounds its activations to 16 bits inside the kernel, so near-ties may break the other way; its
agreement with this float run is tested in tests/models/test_quantized.py."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch

from radixgen import Engine, EngineConfig, FinishReason, SamplingParams
from tests.conftest import _live_engines, _track

pytestmark = pytest.mark.real_model

QUESTIONS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain what a KV cache is in one sentence.",
    "List three prime numbers.",
    "How do I reverse a list in Python?",
]
NEW_TOKENS = 32


@pytest.fixture(scope="module")
def hf_model(default_model_dir: Any) -> Any:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(default_model_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def float_engine() -> Iterator[Engine]:
    # tracked like the shared engines, so the KV check after every test covers it too
    engine = _track(Engine(EngineConfig(kv_cache_tokens=16384, max_context_len=2048, weights="float")))
    yield engine
    _live_engines.remove(engine)
    engine.shutdown()


@pytest.fixture(scope="module")
def reference(hf_model: Any, float_engine: Engine) -> list[tuple[list[int], list[int]]]:
    """(prompt ids, transformers' greedy continuation) per question, EOS included if reached."""
    cases = []
    for q in QUESTIONS:
        ids = float_engine.apply_chat_template([{"role": "user", "content": q}])
        with torch.no_grad():
            out = hf_model.generate(
                torch.tensor([ids]), max_new_tokens=NEW_TOKENS, do_sample=False,
                attention_mask=torch.ones(1, len(ids), dtype=torch.long),
            )
        cases.append((ids, out[0, len(ids):].tolist()))
    return cases


def _check(out: Any, expected: list[int]) -> None:
    assert out.token_ids == expected
    assert out.finish_reason is (FinishReason.LENGTH if len(expected) == NEW_TOKENS else FinishReason.STOP)


def test_greedy_alone_equals_transformers(float_engine: Engine, reference: list[tuple[list[int], list[int]]]) -> None:
    params = SamplingParams(max_new_tokens=NEW_TOKENS, temperature=0)
    for ids, expected in reference:
        _check(float_engine.generate(ids, params), expected)


def test_greedy_batched_with_other_lengths_equals_transformers(
    float_engine: Engine, reference: list[tuple[list[int], list[int]]]
) -> None:
    params = SamplingParams(max_new_tokens=NEW_TOKENS, temperature=0)
    fillers = [float_engine.apply_chat_template([{"role": "user", "content": "word " * n}]) for n in (3, 60, 150)]
    prompts = [ids for ids, _ in reference] + fillers
    outs = float_engine.generate(prompts, params)
    for out, (_, expected) in zip(outs, reference, strict=False):
        _check(out, expected)
    assert float_engine.scheduler.stats.batch_size_sum > float_engine.scheduler.stats.num_steps


def test_text_is_the_decoded_tokens(real_engine: Engine) -> None:
    ids = real_engine.apply_chat_template([{"role": "user", "content": "Say hello in French and Japanese."}])
    out = real_engine.generate(ids, SamplingParams(max_new_tokens=24, temperature=0))
    eos = set(real_engine.model_config.eos_token_ids)
    body = [t for t in out.token_ids if t not in eos]
    assert out.text == real_engine.tokenizer.decode(body, skip_special_tokens=True)
    assert out.text.strip()
