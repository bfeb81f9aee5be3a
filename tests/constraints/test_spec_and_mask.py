"""Constraint specs fail early and clearly; the bitmask masks exactly; random walks through the
compiled automaton only ever produce valid text."""

from __future__ import annotations

import json
import random
import re
from typing import Any

import jsonschema
import numpy as np
import pytest
import torch

from radixgen import SamplingParams
from radixgen.constraints import GrammarService, allocate_bitmask, make_backend
from radixgen.constraints.spec import choices_spec, regex_spec, schema_spec
from radixgen.errors import InvalidConstraintError, InvalidParamsError
from radixgen.kernels.ops import apply_bitmask


@pytest.mark.parametrize(
    ("kwargs", "error", "needle"),
    [
        ({"regex": "(abc"}, InvalidConstraintError, "not valid"),
        ({"regex": r"[^\s\S]"}, InvalidConstraintError, "matches no string"),
        ({"regex": ""}, InvalidConstraintError, "non-empty"),
        ({"json_schema": {"type": "strnig"}}, InvalidConstraintError, "not a JSON type"),
        ({"json_schema": {"properties": {"a": {"type": "intger"}}}}, InvalidConstraintError, r"\$\.properties\.a"),
        ({"json_schema": "{not json"}, InvalidConstraintError, "not valid JSON"),
        ({"json_schema": [1, 2]}, InvalidConstraintError, "must be an object"),
        ({"choices": []}, InvalidConstraintError, "non-empty list"),
        ({"choices": ["a", ""]}, InvalidConstraintError, "non-empty strings"),
        ({"regex": "a", "json_object": True}, InvalidParamsError, "at most one constraint"),
    ],
)
def test_bad_specs_raise_clear_errors(kwargs: dict[str, Any], error: type[Exception], needle: str) -> None:
    with pytest.raises(error, match=needle):
        SamplingParams(**kwargs)


def test_pydantic_model_becomes_its_schema() -> None:
    from pydantic import BaseModel

    class Item(BaseModel):
        name: str
        qty: int

    spec = SamplingParams(json_schema=Item).constraint
    assert spec is not None and spec.schema()["properties"].keys() == {"name", "qty"}
    assert list(spec.schema()["properties"]) == ["name", "qty"], "property order is kept"
    assert SamplingParams(pydantic_model=Item).constraint == spec
    with pytest.raises(InvalidParamsError, match="at most one constraint"):
        SamplingParams(pydantic_model=Item, json_schema={"type": "object"})
    with pytest.raises(InvalidParamsError, match="pydantic_model must be a pydantic model class"):
        SamplingParams(pydantic_model={"type": "object"})


def test_apply_bitmask_matches_a_reference() -> None:
    rng = np.random.default_rng(0)
    vocab = 100
    mask = allocate_bitmask(3, vocab)
    allowed = rng.random((3, vocab)) < 0.3
    mask[:] = 0
    for r in range(3):
        for t in np.flatnonzero(allowed[r]):
            mask[r, t // 32] |= np.int32(1 << (t % 32)) if t % 32 != 31 else np.int32(-(2**31))
    logits = torch.randn(3, vocab)
    masked = logits.clone()
    apply_bitmask(masked, torch.from_numpy(mask))
    assert torch.equal(torch.isfinite(masked), torch.from_numpy(allowed))
    assert torch.equal(masked[torch.from_numpy(allowed)], logits[torch.from_numpy(allowed)])


@pytest.fixture(scope="module", params=["auto", "xgrammar", "llguidance", "outlines"])
def service(tokenizer: Any, request: pytest.FixtureRequest) -> GrammarService:
    """Every backend keeps the matcher contract the engine relies on (the tests below run on each)."""
    return GrammarService(make_backend(request.param, tokenizer, 49152, [tokenizer.eos_token_id]))


def random_walk(service: GrammarService, tokenizer: Any, spec: Any, seed: int, max_tokens: int = 120) -> tuple[str, bool]:
    """Sample uniformly among allowed tokens until the automaton terminates."""
    rng = random.Random(seed)
    matcher = service.compile(spec).matcher()
    mask = allocate_bitmask(1, 49152)
    ids: list[int] = []
    eos = tokenizer.eos_token_id
    for _ in range(max_tokens):
        matcher.fill_bitmask(mask, 0)
        bits = np.unpackbits(mask[0].view(np.uint8), bitorder="little")[:49152]
        choices = np.flatnonzero(bits)
        # prefer ending once possible so walks stay short
        token = eos if eos in choices and rng.random() < 0.3 else int(rng.choice(choices))
        assert matcher.accept(token)
        if matcher.is_terminated():
            return tokenizer.decode(ids), True
        ids.append(token)
    return tokenizer.decode(ids), False


SCHEMAS = [
    {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12}, "age": {"type": "integer"}},
     "required": ["name", "age"], "additionalProperties": False},
    {"type": "object", "properties": {"tags": {"type": "array", "items": {"type": "string", "enum": ["a", "b", "c"]},
                                               "maxItems": 3}}, "required": ["tags"]},
    {"type": "object", "properties": {"point": {"type": "object", "properties": {"x": {"type": "number"}, "y": {"type": "number"}},
                                                "required": ["x", "y"]}, "ok": {"type": "boolean"}}, "required": ["point", "ok"]},
    {"type": "object", "properties": {"id": {"type": "string", "pattern": "^[A-Z]{2}-[0-9]{3}$"}}, "required": ["id"]},
    # outside xgrammar's faithful subset: auto routes it to llguidance
    {"type": "object", "properties": {"kind": {"enum": ["a", {"b": 1}]}}, "required": ["kind"],
     "patternProperties": {"^x[0-9]$": {"type": "boolean"}}, "additionalProperties": False, "maxProperties": 2},
]


# JSON Schema without "type": every JSON type is allowed (xgrammar alone would allow only objects)
TYPELESS = {"properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9}}, "required": ["n"]}


@pytest.mark.parametrize("schema_index", range(len(SCHEMAS) + 1))
def test_random_walks_through_schema_automata_are_valid_json(service: GrammarService, tokenizer: Any, schema_index: int) -> None:
    schema = [*SCHEMAS, TYPELESS][schema_index]
    finished = 0
    for seed in range(8):
        text, done = random_walk(service, tokenizer, schema_spec(schema), seed, max_tokens=200)
        if done:
            finished += 1
            errors = list(jsonschema.Draft202012Validator(schema).iter_errors(json.loads(text)))
            # outlines' regexes do not bound integers; the engine's validators do (rollback and resample)
            left_to_validators = {"minimum", "maximum"} if service.backend.name == "outlines" else set()
            assert all(e.validator in left_to_validators for e in errors), (text, errors)
    assert finished >= 1


@pytest.mark.parametrize("pattern", [r"[0-9]{3}-[0-9]{4}", r"(cat|dog)s?", r"[a-z]+@[a-z]+\.(com|org)", r"-?\d+(\.\d+)?"])
def test_random_walks_through_regex_automata_match(service: GrammarService, tokenizer: Any, pattern: str) -> None:
    for seed in range(8):
        text, done = random_walk(service, tokenizer, regex_spec(pattern), seed)
        if done:
            assert re.fullmatch(pattern, text), (pattern, text)


def test_choices_only_allow_the_choices(service: GrammarService, tokenizer: Any) -> None:
    options = ["red", "green", "light blue"]
    for seed in range(10):
        text, done = random_walk(service, tokenizer, choices_spec(options), seed)
        assert done and text in options


def test_compiles_are_cached(service: GrammarService) -> None:
    spec = regex_spec(r"x[0-9]{2,5}y")
    first = service.compile(spec)
    misses = service.misses
    assert service.compile(spec) is first and service.misses == misses


def test_unbounded_numbers_get_bounds_in_the_grammar_only(service: GrammarService, tokenizer: Any) -> None:
    from radixgen.constraints.schema_rewrite import bound_numbers

    schema = {"type": "object", "properties": {
        "n": {"type": "integer"}, "x": {"type": ["number", "null"], "minimum": 0},
        "k": {"type": "integer", "enum": [10**20]}, "d": {"const": {"type": "integer"}}}}
    bounded = bound_numbers(schema)
    props = bounded["properties"]
    assert props["n"]["minimum"] == -(10**15 - 1) and props["n"]["maximum"] == 10**15 - 1
    assert props["x"]["minimum"] == 0 and props["x"]["maximum"] == 1e15, "a given bound is kept"
    assert "minimum" not in props["k"] and props["d"] == {"const": {"type": "integer"}}, "data is not a schema"
    assert schema["properties"]["n"] == {"type": "integer"}, "the caller's schema is not touched"

    if service.backend.name == "outlines":
        pytest.skip("outlines' schema regexes ignore numeric bounds (a documented limit of that backend)")
    matcher = service.compile(schema_spec({"type": "integer"})).matcher()
    digits = [tokenizer.encode(d, add_special_tokens=False)[0] for d in "1234567890123456"]
    accepted = 0
    for token in digits:
        if not matcher.accept(token):
            break
        accepted += 1
    assert accepted == 15, "at most 15 digits: a sampling model cannot write digits until max_tokens"


@pytest.mark.parametrize("pattern", [r".+\s{1000}", r"(a|b)*a(a|b){20}", "a{99999}"])
def test_regexes_whose_check_would_not_end_are_refused_quickly(pattern: str) -> None:
    import time

    start = time.monotonic()
    with pytest.raises(InvalidConstraintError, match="states to check|positions"):
        regex_spec(pattern)
    assert time.monotonic() - start < 5, "the check is bounded in work (interegular alone took minutes)"
    assert regex_spec(r"[a-z]+@[a-z]+\.com").kind == "regex", "the budget is per call: ordinary regexes still pass"


def test_rollback_restores_the_state_and_the_stop_token_ends(service: GrammarService, tokenizer: Any) -> None:
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}
    matcher = service.compile(schema_spec(schema)).matcher()
    ids = tokenizer.encode('{"ok": true}', add_special_tokens=False)
    before, after = allocate_bitmask(1, 49152), allocate_bitmask(1, 49152)
    assert all(matcher.accept(t) for t in ids[:3])
    matcher.fill_bitmask(before, 0)
    assert all(matcher.accept(t) for t in ids[3:])
    matcher.rollback(len(ids) - 3)
    matcher.fill_bitmask(after, 0)
    assert np.array_equal(before, after), "rollback returns to the same mask"
    assert not matcher.accept(tokenizer.encode("}", add_special_tokens=False)[0]), "a refused token is refused"
    assert not matcher.is_completed(), "the object is still open"
    assert all(matcher.accept(t) for t in ids[3:]) and not matcher.is_terminated()
    assert matcher.is_completed() and matcher.is_completed(), "asking leaves the state as it was"
    assert not matcher.is_terminated()
    assert matcher.accept(tokenizer.eos_token_id) and matcher.is_terminated()
    matcher.rollback(1)
    assert not matcher.is_terminated(), "rolling back the stop token reopens the output"


def test_forced_string_is_what_the_schema_fixes(service: GrammarService) -> None:
    if service.backend.name == "outlines":
        pytest.skip("outlines' index has no forced-text query: jump-forward does nothing with that backend")
    schema = {"type": "object", "properties": {"name": {"type": "string"}}, "required": ["name"]}
    assert service.compile(schema_spec(schema)).matcher().forced_string() == '{"name": "'


def test_filling_many_rows_at_once_equals_filling_each(service: GrammarService, tokenizer: Any) -> None:
    """The batch fill (xgrammar's batch matcher; a loop for the other backends) gives every row
    what its own matcher gives, whatever state each is in, and leaves other rows alone."""
    grammar = service.compile(schema_spec({"type": "object", "properties": {
        "name": {"type": "string"}, "tags": {"type": "array", "items": {"enum": ["a", "bb"]}}},
        "required": ["name", "tags"]}))
    prefixes = ['{"', '{"name": "x', '{"name": "x", "tags": [', '{"name": "x", "tags": ["a"', "", '{"name"']
    matchers = [grammar.matcher() for _ in prefixes]
    for matcher, prefix in zip(matchers, prefixes, strict=True):
        for token in tokenizer.encode(prefix, add_special_tokens=False):
            assert matcher.accept(token)
    rows = [1, 2, 4, 5, 6, 7]
    batched = allocate_bitmask(8, 49152)
    type(matchers[0]).fill_bitmasks(matchers, batched, rows)
    each = allocate_bitmask(8, 49152)
    for matcher, row in zip(matchers, rows, strict=True):
        matcher.fill_bitmask(each, row)
    assert np.array_equal(batched, each)
    assert len({batched[r].tobytes() for r in rows}) > 3, "the states differ, so must their masks"
    assert (batched[[0, 3]] == allocate_bitmask(2, 49152)).all(), "rows not asked for are untouched"


@pytest.mark.parametrize(("allowed", "expected"), [([5], 5), ([31], 31), ([32 * 7 + 31], 32 * 7 + 31), ([49151], 49151),
                                                   ([], None), ([3, 4], None), ([3, 40], None)])
def test_lone_token_reads_the_one_allowed_token(allowed: list[int], expected: int | None) -> None:
    from radixgen.constraints.mask import lone_token

    row = np.zeros((49152 + 31) // 32, dtype=np.int32)
    for t in allowed:
        row[t // 32] |= np.int32(-(1 << 31)) if t % 32 == 31 else np.int32(1 << (t % 32))
    assert lone_token(row) == expected


def test_allowed_tokens_reads_every_bit_of_a_row() -> None:
    from radixgen.constraints.mask import allowed_tokens, ban_tokens

    row = np.zeros((49152 + 31) // 32, dtype=np.int32)
    wanted = [0, 5, 31, 32, 32 * 7 + 31, 40000, 49151]
    for t in wanted:
        row[t // 32] |= np.int32(-(1 << 31)) if t % 32 == 31 else np.int32(1 << (t % 32))
    assert allowed_tokens(row).tolist() == wanted
    ban_tokens(row, {31, 40000})
    assert allowed_tokens(row).tolist() == [0, 5, 32, 32 * 7 + 31, 49151], "the layout ban_tokens writes"
    assert allowed_tokens(np.zeros(4, dtype=np.int32)).tolist() == []
