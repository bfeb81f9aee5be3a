"""The DSL on an in-process Runtime over the tiny model: captures, roles, select, fork, stream,
batches, errors."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from radixgen import Engine
from radixgen.lang import ProgramError, Runtime, function, gen, select


@pytest.fixture
def runtime(make_engine: Callable[..., Engine]) -> Iterator[Runtime]:
    with Runtime(engine=make_engine()) as rt:
        yield rt


@function
def chat(s: Any, question: str) -> None:
    with s.system():
        s += "You answer in one word."
    with s.user():
        s += question
    with s.assistant():
        s += gen("answer", max_tokens=6)


def test_roles_render_with_the_chat_template_and_capture_the_answer(runtime: Runtime, tokenizer: Any) -> None:
    state = chat.run("What colour is the sky?", backend=runtime, seed=3, temperature=0)
    messages = state.messages()
    assert [m["role"] for m in messages] == ["system", "user", "assistant"]
    assert messages[1]["content"] == "What colour is the sky?"
    assert messages[2]["content"] == state["answer"] and state["answer"]
    assert state.text() == tokenizer.apply_chat_template(messages, tokenize=False)
    meta = state.meta("answer")
    assert meta["completion_tokens"] >= 1 and meta["finish_reason"] in ("stop", "length")


def test_a_user_block_first_gets_the_templates_default_system_prompt(runtime: Runtime, tokenizer: Any) -> None:
    @function
    def only_user(s: Any) -> None:
        with s.user():
            s += "Hi"

    state = only_user.run(backend=runtime)
    assert state.text() == tokenizer.apply_chat_template([{"role": "user", "content": "Hi"}], tokenize=False)


def test_constrained_captures_are_parsed(runtime: Runtime) -> None:
    from pydantic import BaseModel

    class Point(BaseModel):
        x: int
        y: int

    @function
    def shapes(s: Any) -> None:
        s += "Code: " + gen("code", regex=r"[A-Z]{2}-[0-9]{3}") + "\nPoint: "
        s += gen("point", json_schema=Point, max_tokens=40) + "\nRaw: "
        s += gen("raw", json_schema={"type": "object", "properties": {"ok": {"type": "boolean"}},
                                     "required": ["ok"], "additionalProperties": False}, max_tokens=20)

    state = shapes.run(backend=runtime, seed=5)
    assert len(state["code"]) == 6 and state["code"][2] == "-" and state["code"][:2].isupper()
    assert isinstance(state["point"], Point)
    assert isinstance(state["raw"], dict) and isinstance(state["raw"]["ok"], bool)
    assert state.constraint("code")["kind"] == "regex" and state.constraint("raw")["kind"] == "json_schema"
    assert f"Code: {state['code']}\nPoint: " in state.text()


def test_select_ranks_choices_by_the_models_own_scores(runtime: Runtime, tiny_model_dir: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    choices = ["red", "green apple", "blue"]

    @function
    def pick(s: Any) -> None:
        s += "My favourite colour is " + select("colour", choices)

    state = pick.run(backend=runtime)
    scores = state.meta("colour")["scores"]
    # reference: transformers' own forward, mean log-probability of each choice's tokens
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    prefix = tok.encode("My favourite colour is ", add_special_tokens=False)
    cached = state.meta("colour")["cached_tokens"]
    for choice in choices:
        ids = tok.encode("My favourite colour is " + choice, add_special_tokens=False)
        # the prefix's trailing space merges into the choice's first token: scoring starts there
        start = next((i for i, (a, b) in enumerate(zip(prefix, ids, strict=False)) if a != b), len(prefix))
        with torch.no_grad():
            logprobs = torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), -1)
        expected = sum(float(logprobs[p - 1, ids[p]]) for p in range(start, len(ids))) / (len(ids) - start)
        assert scores[choice] == pytest.approx(expected, abs=1e-3)
        # the prefix was prefilled once; each choice found all of it it could use in the cache
        assert cached[choice] == start - 1 > 0
    assert state["colour"] == max(choices, key=scores.__getitem__)
    assert state.text() == "My favourite colour is " + state["colour"]


def test_forks_share_the_prefix_so_far(runtime: Runtime) -> None:
    @function
    def branches(s: Any) -> None:
        s += "A long shared preamble about numbers, repeated so that it spans many tokens. " * 4
        s.branches = s.fork(3)
        for i, branch in enumerate(s.branches):
            branch += f"Branch {i}: " + gen("n", regex=r"[0-9]{4}")

    state = branches.run(backend=runtime, seed=11)
    shared = len(runtime.tokenize([state.text()])[0])
    values = [b["n"] for b in state.branches]
    assert all(len(v) == 4 and v.isdigit() for v in values)
    assert all(b.meta("n")["cached_tokens"] >= shared - 1 for b in state.branches), \
        "each fork's prefill is served from the cache"
    assert all(b.text().startswith(state.text()) for b in state.branches)
    assert "n" not in state, "a fork's variables stay in the fork"


def test_stream_yields_the_text_as_it_is_generated(runtime: Runtime) -> None:
    state = chat.run("Tell me about rivers.", backend=runtime, seed=2, stream=True, max_new_tokens=12, ignore_eos=True)
    chunks = list(state.text_iter())
    assert "".join(chunks) == state.text()
    # the fixed text arrives as 8 pieces: 3 role prefixes, system and user bodies, 3 suffixes
    answer_chunks = len(chunks) - 8
    assert state.meta("answer")["completion_tokens"] == 6, "gen's own max_tokens wins over the run's default"
    assert answer_chunks >= 3, f"the answer should arrive token by token, got {chunks}"


def test_a_streamed_json_gen_yields_its_partial_values(runtime: Runtime) -> None:
    from tests.constraints.test_partial import contained

    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 6},
                                               "tags": {"type": "array", "items": {"type": "string", "maxLength": 4},
                                                        "minItems": 2, "maxItems": 3}},
              "required": ["name", "tags"], "additionalProperties": False}

    @function
    def card(s: Any) -> None:
        s += "Card: " + gen("card", json_schema=schema, max_tokens=60, temperature=0.8)

    state = card.run(backend=runtime, seed=3, stream=True)
    values = list(state.partials("card"))
    assert values and values[-1] == state["card"]
    assert all(contained(a, b) for a, b in zip(values, values[1:], strict=False))
    assert [v for v in values if "tags" in v][0]["tags"] == state["card"]["tags"][:1], "the array grows item by item"
    assert list(state.partials("never")) == [], "a name no gen has ends with the program"


def test_run_batch_keeps_order_and_matches_single_runs_with_the_same_seed(runtime: Runtime) -> None:
    questions = [{"question": q} for q in ("One?", "Two?", "Three?", "Four?")]
    states = chat.run_batch(questions, backend=runtime, seed=100, progress_bar=True, temperature=0.8)
    assert [s.messages()[1]["content"] for s in states] == ["One?", "Two?", "Three?", "Four?"]
    again = chat.run("Three?", backend=runtime, seed=102, temperature=0.8)
    assert again["answer"] == states[2]["answer"]


def test_errors_name_the_failing_step(runtime: Runtime) -> None:
    @function
    def broken(s: Any) -> None:
        s += "x" + gen("fine", max_tokens=2)
        s += gen("bad", regex="[unclosed")
        s += gen("never", max_tokens=2)

    with pytest.raises(ProgramError, match=r"step 2 \(gen\('bad'\)\).*regex") as info:
        broken.run(backend=runtime)
    assert "never" not in str(info.value)


def test_runtime_validators_reject_in_the_decode_loop(runtime: Runtime) -> None:
    schema = {"type": "object", "properties": {"n": {"enum": [1, 2, 3, 4, 5, 6]}}, "required": ["n"],
              "additionalProperties": False}
    seen: list[int] = []

    def odd_only(n: int) -> bool:
        seen.append(n)
        return n % 2 == 1

    @function
    def numbers(s: Any) -> None:
        s += "Number: " + gen("value", json_schema=schema, validators={"$.n": odd_only}, max_tokens=30, temperature=1.0)

    state = numbers.run(backend=runtime, seed=7)
    assert state["value"]["n"] % 2 == 1 and seen[-1] == state["value"]["n"]
    assert all(n % 2 == 0 for n in seen[:-1]), "every value before the accepted one was rejected"
    # each named gen's report says what the validators did to it
    report = state.constraint("value")
    assert report is not None and report["valid"] and report["ended"] in ("complete", "budget_closed")
    assert report["validator_retries"] == len(seen) - 1


def test_a_budget_below_the_shortest_json_is_a_clear_error(runtime: Runtime) -> None:
    @function
    def too_short(s: Any) -> None:
        s += "List: " + gen("v", json_schema={"type": "array", "items": {"type": "string"}, "minItems": 5}, max_tokens=3)

    with pytest.raises(ProgramError, match=r"shortest output .* is \d+ tokens.*raise max_tokens .* to at least \d+"):
        too_short.run(backend=runtime)


def test_json_gen_finishes_within_its_budget(runtime: Runtime) -> None:
    """The random tiny model writes strings until max_tokens: budget steering closes them in time,
    so the program gets a complete, valid value and says it was shortened."""
    schema = {"type": "object", "properties": {"component": {"type": "string"},
                                               "severity": {"type": "integer", "minimum": 1, "maximum": 5}},
              "required": ["component", "severity"]}

    @function
    def triage(s: Any) -> None:
        s += "Bug: the server crashes.\nTriage: " + gen("triage", json_schema=schema, max_tokens=24, temperature=1.0)

    states = [triage.run(backend=runtime, seed=n) for n in range(4)]
    for state in states:
        assert set(state["triage"]) == {"component", "severity"} and 1 <= state["triage"]["severity"] <= 5
    assert any(state.meta("triage")["shortened"] for state in states)


def test_a_runtime_owning_its_engine_shuts_it_down(tiny_model_dir: Any) -> None:
    """``shutdown`` (SGLang's name) and ``close`` both stop the engine a Runtime started; an
    engine handed in is left running."""
    from radixgen import Engine, EngineConfig

    rt = Runtime(model=str(tiny_model_dir), kv_cache_tokens=2048, max_context_len=512)
    engine = rt.engine
    rt.shutdown()
    assert engine.dead_reason == "shut down"
    shared = Engine(EngineConfig(model=str(tiny_model_dir), kv_cache_tokens=2048, max_context_len=512))
    try:
        Runtime(engine=shared).shutdown()
        assert shared.dead_reason is None
    finally:
        shared.shutdown()
