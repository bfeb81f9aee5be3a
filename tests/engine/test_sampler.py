from __future__ import annotations

import math
from typing import Any

import numpy as np
import pytest
import torch

from radixgen.engine.params import SamplingParams
from radixgen.engine.request import Request
from radixgen.engine.sampler import Sampler, SamplingBatch, uniform_from_counter
from radixgen.errors import InvalidParamsError

VOCAB = 1000


def _requests(params: list[SamplingParams], seeds: list[int] | None = None, outputs: int = 0) -> list[Request]:
    reqs = []
    for i, p in enumerate(params):
        r = Request(f"r{i}", [1, 2, 3], p, rng_seed=(seeds or list(range(len(params))))[i])
        r.output_ids = list(range(10, 10 + outputs))
        r.pool_row = i
        reqs.append(r)
    return reqs


def _sample(logits: torch.Tensor, reqs: list[Request], sampler: Sampler | None = None) -> Any:
    sampler = sampler or Sampler(VOCAB, 16, torch.device("cpu"))
    return sampler(logits.clone(), SamplingBatch.from_requests(reqs, VOCAB, torch.device("cpu")))


def test_uniform_from_counter_matches_python_reference_and_is_uniform() -> None:
    def mix(x: int) -> int:
        x ^= x >> 16
        x = (x * 0x85EBCA6B) & 0xFFFFFFFF
        x ^= x >> 13
        x = (x * 0xC2B2AE35) & 0xFFFFFFFF
        return x ^ (x >> 16)

    seeds = [0, 1, 2**40 + 7, 2**63 - 1]
    counters = [0, 5, 123456, 2**31]
    got = uniform_from_counter(torch.tensor(seeds), torch.tensor(counters)).tolist()
    for s, c, u in zip(seeds, counters, got, strict=True):
        h1 = mix((s & 0xFFFFFFFF) ^ mix(((s >> 32) & 0xFFFFFFFF) ^ mix((c & 0xFFFFFFFF) ^ 0x9E3779B9)))
        h2 = mix(h1 ^ 0x68E31DA4)
        assert u == (((h1 & 0xFFFFFF) << 24) | (h2 & 0xFFFFFF)) / 2**48
    many = uniform_from_counter(torch.full((20000,), 42), torch.arange(20000))
    hist = torch.histc(many.float(), bins=10, min=0, max=1)
    assert (hist > 1700).all() and (hist < 2300).all(), hist


def test_top_k_1_equals_greedy_even_at_high_temperature() -> None:
    logits = torch.randn(8, VOCAB)
    greedy = _sample(logits, _requests([SamplingParams(temperature=0)] * 8)).token_ids
    topk1 = _sample(logits, _requests([SamplingParams(temperature=5.0, top_k=1)] * 8)).token_ids
    assert np.array_equal(greedy, topk1)
    assert np.array_equal(greedy, logits.argmax(-1).numpy())


@pytest.mark.parametrize("k", [2, 5, 40])
def test_top_k_never_leaves_the_top_k(k: int) -> None:
    logits = torch.randn(4, VOCAB) * 0.1  # flat: without the filter, picks would spread widely
    allowed = [set(torch.topk(logits[i], k).indices.tolist()) for i in range(4)]
    picks = set()
    for seed in range(60):
        ids = _sample(logits, _requests([SamplingParams(top_k=k)] * 4, seeds=[seed * 4 + i for i in range(4)])).token_ids
        for i, t in enumerate(ids):
            assert int(t) in allowed[i]
            picks.add((i, int(t)))
    assert len(picks) > 4, "sampling should vary across seeds"


def test_top_p_and_min_p_keep_only_the_head() -> None:
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05] + [0.0] * (VOCAB - 4))
    logits = torch.log(probs.clamp_min(1e-12)).repeat(2, 1)
    for seed in range(80):
        ids = _sample(logits, _requests([SamplingParams(top_p=0.7), SamplingParams(min_p=0.4)], seeds=[seed, seed + 1000])).token_ids
        assert ids[0] in (0, 1), "top_p=0.7 keeps tokens until 0.8 of the mass: ids 0 and 1"
        assert ids[1] in (0, 1), "min_p=0.4 keeps probs >= 0.2: ids 0 and 1"


def test_sampling_follows_the_distribution() -> None:
    probs = torch.tensor([0.6, 0.3, 0.1] + [0.0] * (VOCAB - 3))
    logits = torch.log(probs.clamp_min(1e-12)).repeat(64, 1)
    counts = np.zeros(3)
    for rnd in range(20):
        ids = _sample(logits, _requests([SamplingParams()] * 64, seeds=[rnd * 64 + i for i in range(64)])).token_ids
        counts += np.bincount(ids, minlength=3)[:3]
    freq = counts / counts.sum()
    assert abs(freq[0] - 0.6) < 0.05 and abs(freq[1] - 0.3) < 0.05 and abs(freq[2] - 0.1) < 0.04, freq


def test_same_seed_same_token_alone_or_batched() -> None:
    logits = torch.randn(5, VOCAB)
    params = [SamplingParams(temperature=0.9, top_p=0.95)] * 5
    batched = _sample(logits, _requests(params, seeds=[7, 8, 9, 10, 11])).token_ids
    for i in range(5):
        alone = _sample(logits[i : i + 1], _requests([params[i]], seeds=[7 + i])).token_ids
        assert alone[0] == batched[i]


def test_penalties_change_logits_as_specified() -> None:
    sampler = Sampler(VOCAB, 4, torch.device("cpu"))
    params = SamplingParams(repetition_penalty=2.0, frequency_penalty=0.5, presence_penalty=0.25)
    req = _requests([params])[0]
    req.output_ids = [10, 10, 11]
    sampler.penalties.reset_row(0, req.prompt_ids, req.output_ids)  # prompt: 1, 2, 3
    logits = torch.zeros(1, VOCAB)
    logits[0, 1], logits[0, 2], logits[0, 10], logits[0, 11], logits[0, 12] = 4.0, -4.0, 3.0, 1.0, 2.0
    batch = SamplingBatch.from_requests([req], VOCAB, torch.device("cpu"))
    sampler.penalties.apply(logits, batch)
    assert logits[0, 1] == 2.0  # prompt token, positive: divided by 2
    assert logits[0, 2] == -8.0  # prompt token, negative: multiplied by 2
    assert logits[0, 10] == pytest.approx(3.0 / 2 - 0.5 * 2 - 0.25)
    assert logits[0, 11] == pytest.approx(1.0 / 2 - 0.5 * 1 - 0.25)
    assert logits[0, 12] == 2.0  # never seen: untouched
    sampler.penalties.record(batch, torch.tensor([12]))
    assert sampler.penalties.output_counts is not None and sampler.penalties.output_counts[0, 12] == 1


def test_penalties_at_speculative_positions_equal_one_decode_step_after_another() -> None:
    """Position j of a speculative step is penalised as the decode step after the first j
    drafts would be: the drafts count as output before it (here 2 is a prompt token only and
    12 a new one, so presence and frequency both change along the draft)."""
    params = SamplingParams(repetition_penalty=1.5, frequency_penalty=0.5, presence_penalty=0.25)
    req = _requests([params, SamplingParams()])[0]
    req.output_ids = [10, 10, 11]
    draft = [2, 12, 12, 10]
    positions = torch.randn(len(draft) + 1, VOCAB)
    sampler = Sampler(VOCAB, 4, torch.device("cpu"))
    sampler.penalties.reset_row(0, req.prompt_ids, req.output_ids)
    other = _requests([SamplingParams(), params])[1]  # the penalised request is batch row 1
    other.output_ids, other.pool_row = list(req.output_ids), 0
    batch = SamplingBatch.from_requests([_requests([SamplingParams()])[0], other], VOCAB, torch.device("cpu"))
    got = sampler.penalties.apply_positions(positions, batch, 1, draft)
    step_by_step = Sampler(VOCAB, 4, torch.device("cpu"))
    for j in range(len(draft) + 1):
        step_by_step.penalties.reset_row(0, req.prompt_ids, req.output_ids + draft[:j])
        one = positions[j : j + 1].clone()
        step_by_step.penalties.apply(one, SamplingBatch.from_requests([req], VOCAB, torch.device("cpu")))
        torch.testing.assert_close(got[j], one[0])


def test_logprobs_are_of_the_model_distribution() -> None:
    logits = torch.randn(3, VOCAB)
    res = _sample(logits, _requests([SamplingParams(temperature=0, logprobs=True, top_logprobs=3)] * 3))
    expected = torch.log_softmax(logits, -1)
    for i in range(3):
        assert res.logprobs[i] == pytest.approx(expected[i].max().item(), abs=1e-5)
        assert res.top_ids[i, 0] == res.token_ids[i]
        assert list(res.top_logprobs[i]) == sorted(res.top_logprobs[i], reverse=True)


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"temperature": -0.1}, "temperature"),
        ({"temperature": math.nan}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_k": -5}, "top_k"),
        ({"min_p": 2.0}, "min_p"),
        ({"max_new_tokens": 0}, "max_new_tokens"),
        ({"repetition_penalty": 0.0}, "repetition_penalty"),
        ({"frequency_penalty": 3.0}, "frequency_penalty"),
        ({"presence_penalty": -2.5}, "presence_penalty"),
        ({"seed": -1}, "seed"),
        ({"stop": [""]}, "stop"),
        ({"top_logprobs": 50}, "top_logprobs"),
        ({"stop_token_ids": [-3]}, "stop_token_ids"),
    ],
)
def test_invalid_params_raise_naming_the_field(kwargs: dict[str, Any], field: str) -> None:
    with pytest.raises(InvalidParamsError, match=rf"^{field} must be"):
        SamplingParams(**kwargs)
    assert issubclass(InvalidParamsError, ValueError)
