"""The whole engine through each attention backend: greedy outputs are the cpu backend's
(prefills over cached prefixes, mixed steps, decode batches, speculative drafts, a constrained
request); the Triton kernels run in Triton's interpreter here."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from radixgen import Engine, EngineConfig, SamplingParams

SYSTEM = "You are a careful assistant who answers in one short sentence. " * 3
PROMPTS = [SYSTEM + "Name a colour.", SYSTEM + "Name a fruit.", "A different prompt altogether", SYSTEM]


def _greedy(n: int, **kw: object) -> SamplingParams:
    return SamplingParams(max_new_tokens=n, temperature=0, ignore_eos=True, **kw)  # type: ignore[arg-type]


def _run(engine: Engine) -> list[list[int]]:
    # a shared system prompt (cached after the first request), a batch arriving together
    # (prefills, then decode steps), a constrained request
    first = engine.generate(PROMPTS[0], _greedy(6)).token_ids
    batch = [o.token_ids for o in engine.generate(PROMPTS[1:], [_greedy(10), _greedy(14), _greedy(8)])]
    constrained = engine.generate(PROMPTS[2], _greedy(12, regex=r"[a-z]{3,8} [0-9]{2}")).token_ids
    return [first, *batch, constrained]


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_greedy_outputs_equal_the_cpu_backend(make_engine: Callable[..., Engine], backend: str) -> None:
    want = _run(make_engine(attention_backend="cpu"))
    engine = make_engine(attention_backend=backend)
    assert engine.runner.attention.name == backend
    assert _run(engine) == want
    assert engine.scheduler.stats.num_decode_steps > 0


def test_speculative_steps_through_triton_equal_the_cpu_backend(make_engine: Callable[..., Engine]) -> None:
    """Drafted tokens are queries at their own positions over K/V already in the pool."""
    prompt = "one two three four one two three four one two three four one two"
    want = make_engine(attention_backend="cpu").generate(prompt, _greedy(16)).token_ids
    engine = make_engine(attention_backend="triton", speculative="ngram")
    assert engine.generate(prompt, _greedy(16)).token_ids == want
    assert engine.scheduler.stats.drafted_tokens > 0, "the prompt should have drafted"


@pytest.mark.parametrize(("field", "value"), [
    ("attention_backend", "sdpa"), ("dtype", "fp16"), ("weights", "q4"), ("grammar_backend", "outline"),
    ("schedule_policy", "lifo"), ("speculative", "eagle"), ("json_repeated_items", "some"), ("log_level", "loud"),
    ("device", "gpu"), ("device", "cuda:x"),
])
def test_unknown_config_values_are_refused_naming_the_field(field: str, value: str) -> None:
    with pytest.raises(ValueError, match=f"^{field} must be one of .*; got '{value}'$|^{field} must be cpu"):
        EngineConfig(**{field: value})


def test_a_server_config_checks_its_own_choices_too() -> None:
    from radixgen.config import ServerConfig

    with pytest.raises(ValueError, match=r"^routing must be one of 'prefix-affinity', 'round-robin'; got 'random'$"):
        ServerConfig(routing="random")  # type: ignore[arg-type]
    assert ServerConfig(device="cuda:1").device == "cuda:1"


def test_the_cli_lists_the_choices() -> None:
    import argparse

    from radixgen.cli import add_config_flags

    parser = argparse.ArgumentParser()
    add_config_flags(parser)
    text = parser.format_help()
    assert "{auto,cpu,torch,triton}" in text and "{auto,xgrammar,llguidance,outlines}" in text
