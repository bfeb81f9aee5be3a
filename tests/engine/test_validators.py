"""Validators in the decode loop: a rejected value is rolled back and resampled."""

from __future__ import annotations

import json
from collections.abc import Callable

import jsonschema
import pytest

from radixgen import Engine, FinishReason, SamplingParams
from radixgen.engine.output import RequestOutput

SCHEMA = {"type": "object", "properties": {"kind": {"enum": ["cat", "dog", "eel", "fox"]}, "legs": {"enum": [0, 2, 4]}},
          "required": ["kind", "legs"], "additionalProperties": False}


def generate_rejecting_the_first_kind(engine: Engine) -> tuple[RequestOutput, list[str]]:
    """An answer to SCHEMA whose validator rejects the first kind the model writes; the kinds seen."""
    seen: list[str] = []

    def not_the_first_choice(kind: str) -> bool:
        seen.append(kind)
        return kind != seen[0]

    out = engine.generate("Animal:", SamplingParams(max_new_tokens=60, temperature=0, json_schema=SCHEMA,
                                                    validators={"$.kind": not_the_first_choice}))
    return out, seen


@pytest.mark.parametrize("backend", ["xgrammar", "llguidance", "outlines"])
def test_user_validator_rejection_resamples_a_valid_value(make_engine: Callable[..., Engine], backend: str) -> None:
    engine = make_engine(grammar_backend=backend)
    out, seen = generate_rejecting_the_first_kind(engine)
    assert out.finish_reason is FinishReason.STOP, out
    value = json.loads(out.text)
    jsonschema.validate(value, SCHEMA)
    assert value["kind"] != seen[0] and len(seen) >= 2
    assert engine.scheduler.stats.num_rollbacks >= 1


@pytest.mark.parametrize("backend", ["xgrammar", "llguidance", "outlines"])
def test_schema_keywords_the_automaton_skips_are_enforced(make_engine: Callable[..., Engine], backend: str) -> None:
    engine = make_engine(grammar_backend=backend)
    loose = {"type": "object", "properties": {"legs": {"enum": [0, 2, 4, 6, 8]}}, "required": ["legs"],
             "additionalProperties": False}
    first = json.loads(engine.generate("Legs:", SamplingParams(max_new_tokens=30, temperature=0, json_schema=loose)).text)
    # "not" is enforced by the validator layer (rollback and resample), not by the grammar
    strict = {**loose, "properties": {"legs": {"enum": [0, 2, 4, 6, 8], "not": {"const": first["legs"]}}}}
    out = engine.generate("Legs:", SamplingParams(max_new_tokens=30, temperature=0, json_schema=strict))
    assert out.finish_reason is FinishReason.STOP
    jsonschema.validate(json.loads(out.text), strict)
    assert engine.scheduler.stats.num_rollbacks >= 1, "the greedy value was rejected and resampled"


@pytest.mark.parametrize("backend", ["xgrammar", "llguidance", "outlines"])
def test_retries_exhausted_gives_constraint_violation(make_engine: Callable[..., Engine], backend: str) -> None:
    engine = make_engine(grammar_backend=backend)
    out = engine.generate("Animal:", SamplingParams(max_new_tokens=60, temperature=0, json_schema=SCHEMA,
                                                    validators={"$.legs": lambda n: False}, max_validation_retries=2))
    assert out.finish_reason is FinishReason.CONSTRAINT_VIOLATION
    assert out.error is not None and "$.legs" in out.error
    assert engine.scheduler.stats.num_rollbacks == 2, "two retries, then the request ends"
    counted = engine.stats_snapshot()
    assert counted["num_constraint_violations"] == 1 and counted["num_constraint_refusals"] == 0


def test_a_bare_root_number_is_validated_when_the_output_ends(make_engine: Callable[..., Engine]) -> None:
    """A root number completes only at the end of the output, where the validators must see it:
    only 7 satisfies this schema (the automaton allows every digit), so any other sample is rolled
    back and resampled, and a request out of retries ends with constraint_violation, never stop."""
    engine = make_engine()
    schema = {"type": "integer", "minimum": 0, "maximum": 9, "not": {"enum": [0, 1, 2, 3, 4, 5, 6, 8, 9]}}
    outs = engine.generate(["Digit:"] * 6, [SamplingParams(max_new_tokens=4, temperature=1.0, seed=s, json_schema=schema,
                                                          max_validation_retries=20) for s in range(6)])
    for out in outs:
        assert out.finish_reason in (FinishReason.STOP, FinishReason.CONSTRAINT_VIOLATION), out
        if out.finish_reason is FinishReason.STOP:
            assert json.loads(out.text) == 7
    assert engine.scheduler.stats.num_rollbacks > 0


@pytest.mark.parametrize("backend", ["xgrammar", "llguidance"])
def test_tool_call_arguments_the_automaton_skips_are_enforced(make_engine: Callable[..., Engine], backend: str) -> None:
    """A call's arguments inside a structural output get the same validators as a json_schema
    output: the greedy call's value is refused by "not" (neither automaton enforces it), rolled
    back and resampled, and the call that comes back satisfies its schema."""
    from radixgen import tool_formats

    engine = make_engine(grammar_backend=backend)
    loose = {"type": "object", "properties": {"legs": {"enum": [0, 2, 4, 6, 8]}}, "required": ["legs"],
             "additionalProperties": False}

    def structure(schema: dict) -> dict:
        return {"tool_calls": tool_formats.HERMES.structure([("count_legs", schema)], free_text=False, min_calls=1,
                                                            max_calls=1)}

    def call(text: str) -> dict:
        _, calls = tool_formats.parse(tool_formats.HERMES, text)
        assert len(calls) == 1 and calls[0].name == "count_legs", text
        return json.loads(calls[0].arguments)

    first = call(engine.generate("Legs:", SamplingParams(max_new_tokens=60, temperature=0,
                                                         structural=structure(loose))).text)
    assert engine.scheduler.stats.num_rollbacks == 0
    strict = {**loose, "properties": {"legs": {"enum": [0, 2, 4, 6, 8], "not": {"const": first["legs"]}}}}
    params = SamplingParams(max_new_tokens=60, temperature=0, structural=structure(strict))
    out = engine.generate("Legs:", params)
    assert out.finish_reason is FinishReason.STOP, out
    jsonschema.validate(call(out.text), strict)
    assert engine.scheduler.stats.num_rollbacks >= 1, "the greedy value was rejected and resampled"

    # streamed, the call's opening goes out before its arguments are settled, and nothing sent
    # is taken back by the rollback: the deltas add up to the same output
    deltas = list(engine.iter_outputs("Legs:", params))
    first = next(d for d in deltas if d.new_text)
    assert not first.finished and first.new_text.startswith("<tool_call>") and '"legs"' not in first.new_text
    assert "".join(d.new_text for d in deltas) == out.text
    assert [t for d in deltas for t in d.new_token_ids] == out.token_ids


# valid answers: positive multiples of 5, 7 and 11 (385, 770, ...), through ``not`` and ``anyOf``,
# which no grammar backend enforces: the grammar lets any integer through
CHAINED = {"type": "object", "properties": {"n": {
    "type": "integer", "minimum": 1,
    "not": {"anyOf": [{"not": {"multipleOf": 5}}, {"not": {"multipleOf": 7}}, {"not": {"multipleOf": 11}}]}}},
    "required": ["n"], "additionalProperties": False}


def test_search_finds_the_smallest_number_the_validators_accept() -> None:
    from radixgen.constraints.events import SchemaValidators, Validation

    validation = Validation(schema=SchemaValidators(CHAINED))
    first = validation.feed('{"n": 12}')  # the number completes at the "}" after it
    assert first is not None and first.path == ("n",) and first.replacement is None, "the model's own next try first"
    validation.reset("")
    second = validation.feed('{"n": 7}')
    assert second is not None and second.replacement == "385" and second.end == len('{"n": 7')
    # the user's validators count too, and tenths follow where no integer fits
    picky = Validation(user={"$.x": lambda v: v > 0 and v < 1})
    assert picky.feed('{"x": 3}') is not None
    picky.reset("")
    assert picky.feed('{"x": 5}').replacement == "0.1"
    nothing = Validation(user={"$.x": lambda v: False})
    nothing.feed('{"x": 1}')
    nothing.reset("")
    assert nothing.feed('{"x": 2}').replacement is None


@pytest.mark.parametrize("backend", ["xgrammar", "llguidance"])
def test_a_number_the_grammar_cannot_constrain_is_searched_not_resampled_blindly(
    make_engine: Callable[..., Engine], backend: str,
) -> None:
    engine = make_engine(grammar_backend=backend)
    out = engine.generate("Number:", SamplingParams(max_new_tokens=40, temperature=0, json_schema=CHAINED))
    assert out.finish_reason is FinishReason.STOP, (out.finish_reason, out.text, out.error)
    value = json.loads(out.text)
    jsonschema.validate(value, CHAINED)
    assert value["n"] == 385, "the smallest valid value"
    stats = engine.stats_snapshot()
    assert stats["num_searched_values"] == 1 and stats["num_rollbacks"] == 2


@pytest.mark.parametrize("backend", ["xgrammar", "llguidance"])
def test_a_searched_root_number_ends_the_output(make_engine: Callable[..., Engine], backend: str) -> None:
    # a bare root number is followed by nothing: once the searched value is written the output
    # must end there, or the model appends digits to it ("385" + "2222...")
    engine = make_engine(grammar_backend=backend)
    root = CHAINED["properties"]["n"]
    out = engine.generate("Number:", SamplingParams(max_new_tokens=40, temperature=0, json_schema=root))
    assert out.finish_reason is FinishReason.STOP, (out.finish_reason, out.text, out.error)
    assert json.loads(out.text) == 385 and out.constraint is not None and out.constraint.valid
    assert out.constraint.searched_values == 1


def test_a_listed_value_the_grammar_cannot_check_is_searched_among_the_literals(
    make_engine: Callable[..., Engine],
) -> None:
    # the grammar writes one of the listed arrays; the if / then it leaves out allows only [3, 4]
    engine = make_engine(grammar_backend="llguidance")
    schema = {"type": "array", "enum": [[1], [1, 2], [3, 4], [5]], "if": {"minItems": 1},
              "then": {"minItems": 2, "items": {"minimum": 3}}}
    out = engine.generate("List:", SamplingParams(max_new_tokens=40, temperature=0, json_schema=schema))
    assert out.finish_reason is FinishReason.STOP, (out.finish_reason, out.text, out.error)
    assert json.loads(out.text) == [3, 4] and out.constraint is not None and out.constraint.valid


def test_what_a_lenient_grammar_leaves_out_is_reported(make_engine: Callable[..., Engine]) -> None:
    engine = make_engine(grammar_backend="llguidance")
    out = engine.generate("Number:", SamplingParams(max_new_tokens=40, temperature=0, json_schema=CHAINED))
    assert out.constraint_warnings and any('"not"' in w for w in out.constraint_warnings), out.constraint_warnings
    plain = engine.generate("Animal:", SamplingParams(max_new_tokens=40, temperature=0, json_schema=SCHEMA))
    assert plain.constraint_warnings is None


@pytest.mark.real_model
def test_a_repeated_key_closes_its_object_unless_the_automaton_needs_more_keys(real_engine: Engine) -> None:
    """Under patternProperties the grammar lets a key be written twice. A bias towards "," makes
    the model start over with "a": the first repeat closes the object where the separator stood,
    in one rollback; where minProperties makes the automaton refuse that "}", the key is
    resampled instead (closing there would ban the separator and dead-end the object)."""
    tokenizer = real_engine.scheduler.appender.tokenizer
    assert tokenizer is not None
    (comma,), (brace,) = (tokenizer.encode(t, add_special_tokens=False) for t in (",", "}"))
    prompt = 'Repeat exactly: {"a": 1, "a": 2, "a": 3, "a": 4, "a": 5}\n'
    keys = {"type": "object", "additionalProperties": False}
    cases = [({**keys, "patternProperties": {"^a$": {"type": "integer"}}}, 1),
             ({**keys, "patternProperties": {"^[ab]$": {"type": "integer"}}, "minProperties": 2}, 2)]
    for schema, distinct in cases:
        before = real_engine.scheduler.stats.num_rollbacks
        out = real_engine.generate(prompt, SamplingParams(max_new_tokens=40, temperature=0, json_schema=schema,
                                                          logit_bias={comma: 30.0, brace: -30.0}))
        assert out.finish_reason is FinishReason.STOP, (schema, out.text, out.error)
        pairs = json.loads(out.text, object_pairs_hook=lambda kv: kv)
        assert len(pairs) == len({k for k, _ in pairs}) == distinct, out.text
        jsonschema.validate(json.loads(out.text), schema)
        if distinct == 1:
            assert real_engine.scheduler.stats.num_rollbacks - before == 1, "closed at the first repeat"
