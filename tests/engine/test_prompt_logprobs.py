"""Prompt scoring (``prompt_logprob_start``) against transformers' own forward, through the paths
that could get it wrong: a prefix already in the radix cache, and chunked prefill."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from radixgen import SamplingParams
from radixgen.errors import InvalidParamsError

PROMPT = "The quick brown fox jumps over the lazy dog while the cat watches from the warm windowsill."


@pytest.fixture(scope="module")
def reference(tiny_model_dir: Path) -> Any:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()

    def prompt_logprobs(ids: list[int], start: int) -> list[float]:
        with torch.no_grad():
            logits = model(torch.tensor([ids])).logits[0].float()
        logprobs = torch.log_softmax(logits, dim=-1)
        return [float(logprobs[p - 1, ids[p]]) for p in range(start, len(ids))]

    return prompt_logprobs


@pytest.mark.parametrize("chunk", [None, 5])
def test_prompt_logprobs_match_transformers_with_a_cached_prefix(make_engine: Any, reference: Any, chunk: int | None) -> None:
    engine = make_engine(chunked_prefill_size=chunk or 2048)
    ids = engine.tokenize(PROMPT)
    start = 8
    # the whole prompt is cached first: scoring must still compute every scored position
    engine.generate(ids, SamplingParams(max_new_tokens=1))
    out = engine.generate(ids, SamplingParams(max_new_tokens=1, prompt_logprob_start=start))
    assert out.cached_tokens == start - 1
    assert out.prompt_logprobs is not None and len(out.prompt_logprobs) == len(ids) - start
    assert out.prompt_logprobs == pytest.approx(reference(ids, start), abs=2e-4)


def test_prompt_scoring_in_a_batch_with_others(make_engine: Any, reference: Any) -> None:
    engine = make_engine()
    ids = engine.tokenize(PROMPT)
    other = engine.tokenize("An unrelated prompt that is scored from its second token.")
    outs = engine.generate([ids, other, ids], [
        SamplingParams(max_new_tokens=4, prompt_logprob_start=3),
        SamplingParams(max_new_tokens=4, prompt_logprob_start=1),
        SamplingParams(max_new_tokens=4),
    ])
    assert outs[0].prompt_logprobs == pytest.approx(reference(ids, 3), abs=2e-4)
    assert outs[1].prompt_logprobs == pytest.approx(reference(other, 1), abs=2e-4)
    assert outs[2].prompt_logprobs is None


def test_prompt_logprob_start_past_the_prompt_is_rejected(tiny_engine: Any) -> None:
    with pytest.raises(InvalidParamsError, match="prompt_logprob_start"):
        tiny_engine.generate("short", SamplingParams(max_new_tokens=1, prompt_logprob_start=50))
    with pytest.raises(InvalidParamsError, match="prompt_logprob_start"):
        SamplingParams(prompt_logprob_start=0)
