"""The cheapest completion budget steering closes an output with: shapes from real-world schemas
where the walk was long or found no end."""

from __future__ import annotations

import json
import re
from typing import Any

import jsonschema
import pytest

from radixgen.constraints import GrammarService, make_backend
from radixgen.constraints.budget import START_WALK_SCALE, Completer
from radixgen.constraints.spec import schema_spec

VOCAB = 49152

POLICY = {"type": "object", "properties": {"statements": {"type": "array", "items": {
    "type": "object", "properties": {
        "effect": {"type": "string", "pattern": "^allow|deny$"},
        "actions": {"type": "array", "items": {"type": "string", "pattern": "^[a-z]+:\\w+$"}},
        "resources": {"type": "array", "items": {"type": "string", "pattern": "^brn:(\\w+):(\\w+):(\\w*)$"}}},
    "required": ["effect", "actions", "resources"], "additionalProperties": False}}},
    "required": ["statements"], "additionalProperties": False}

# every property required, one of them a date under a pattern with no anchors (so any text may
# come before the date, and letter by letter the walk never writes one)
CATALOGUE = {"type": "object", "additionalProperties": False,
             "properties": {**{f"unit{i}": {"type": "object", "properties": {
                 "unit": {"enum": ["kg", "g"]}, "value": {"type": "number"}}, "required": ["unit", "value"],
                 "additionalProperties": False} for i in range(60)},
                 "date": {"type": "string", "pattern": "\\d{4}-\\d{2}-\\d{2}|\\d{4}-\\d{2}-\\d{2}T\\d{2}:\\d{2}"}},
             "required": [*(f"unit{i}" for i in range(60)), "date"]}


@pytest.fixture(scope="module", params=["xgrammar", "llguidance"])
def walk(request: pytest.FixtureRequest, tokenizer: Any) -> Any:
    service = GrammarService(make_backend(request.param, tokenizer, VOCAB, [tokenizer.eos_token_id]))
    completer = Completer(tokenizer, VOCAB)

    def complete(schema: dict[str, Any], prefix: str, *, scale: int = 1, strings: tuple[str, ...] = ()) -> str | None:
        matcher = service.compile(schema_spec(schema)).matcher()
        assert all(matcher.accept(t) for t in tokenizer.encode(prefix, add_special_tokens=False))
        found = completer.complete(matcher, scale=scale, strings=strings)
        return None if found is None else found.text

    return complete


def test_an_open_array_is_closed_empty_rather_than_given_an_item(walk: Any) -> None:
    prefix = '{"statements": [{"effect": "allow", "actions": ["deny:allow", "deny:al'
    text = walk(POLICY, prefix)
    assert text is not None and text.endswith('"], "resources": []}]}'), text
    jsonschema.validate(json.loads(prefix + text), POLICY)
    # a pattern's separator comes as soon as the letters before it: "aaa:a", not "aaa_aaa_aaa_aaa:a"
    item = walk(POLICY, '{"statements": [{"effect": "allow", "actions": ["')
    assert item is not None and len(item.split('"')[0]) <= 8, item


def test_a_date_under_an_unanchored_pattern_is_written_as_a_date(walk: Any) -> None:
    text = walk(CATALOGUE, "", scale=START_WALK_SCALE)
    assert text is not None and re.search(r'"date": "\d{4}-\d{2}-\d{2}"}$', text), text
    jsonschema.validate(json.loads(text), CATALOGUE)


def test_a_long_required_output_is_found_from_the_start(walk: Any) -> None:
    """Its ~2,600 characters pass the usual bound: the start walk, cached per constraint, goes
    further, so the request is refused or steered instead of neither."""
    assert walk(CATALOGUE, "") is None
    text = walk(CATALOGUE, "", scale=START_WALK_SCALE)
    assert text is not None and len(text) > 2048


def test_a_patterns_shortest_match_is_written_where_the_letters_cannot_find_it(walk: Any) -> None:
    """An unanchored pattern lets any text in before its match, so letter by letter the walk
    never ends the string; the schema's own pattern, read once, gives the text to write."""
    from radixgen.constraints.budget import pattern_examples

    schema = {"type": "object", "properties": {"ticket": {"type": "string", "pattern": "[A-Z]{2}-[0-9]{3}"}},
              "required": ["ticket"], "additionalProperties": False}
    strings = pattern_examples(schema)
    assert strings == ("AA-111",)
    text = walk(schema, "", strings=strings)
    assert text is not None and re.search("[A-Z]{2}-[0-9]{3}", json.loads(text)["ticket"]), text


def test_a_digit_run_under_a_unit_pattern_is_closed_with_a_unit(walk: Any) -> None:
    """A duration pattern takes digits forever before its unit letter: the walk, preferring
    digits, wrote digits until its bounds ran out, found no end, and the answer was cut."""
    schema = {"type": "object", "properties": {"interval": {
        "type": "string", "pattern": "^[0-9]+(ms|[ywdhms])$"}},
        "required": ["interval"], "additionalProperties": False}
    prefix = '{"interval": "2018010111111111'
    text = walk(schema, prefix)
    assert text is not None and len(text) <= 12, text
    jsonschema.validate(json.loads(prefix + text), schema)


def test_a_pattern_whose_alternatives_carry_their_own_anchors_is_completed(walk: Any) -> None:
    """"(^Hpt_|^Int_|_Armour_)": its anchors sit inside the group, which interegular cannot
    read, so the pattern gave no example, the walk wrote letters forever, no completion was
    found from the start and the answer ran to max_tokens unsteered."""
    from radixgen.constraints.budget import pattern_examples

    schema = {"type": "object", "properties": {"modules": {"type": "array", "minItems": 1, "items": {
        "type": "string", "minLength": 1, "pattern": "(^Hpt_|^Int_|_Armour_)"}}},
        "required": ["modules"], "additionalProperties": False}
    strings = pattern_examples(schema)
    assert set(strings) == {"Hpt_", "Int_", "_Armour_"}
    text = walk(schema, "", strings=strings)
    assert text is not None, "no completion"
    jsonschema.validate(json.loads(text), schema)


@pytest.mark.parametrize("backend", ["xgrammar", "llguidance"])
def test_a_character_a_token_left_part_written_is_ended_before_the_walk(tokenizer: Any, backend: str) -> None:
    """Byte-level tokens split "Ｈ" in two. oneof10_2 at temperature 0.7: a string item of such
    characters went on to max_tokens, since from every other token the walk (whole characters
    only) found no end, and its retries every 4 tokens all fell on those."""
    schema = {"type": "array", "items": {"type": "string", "minLength": 4}}
    service = GrammarService(make_backend(backend, tokenizer, VOCAB, [tokenizer.eos_token_id]))
    whole = tokenizer.encode('["xＨＨ', add_special_tokens=False)
    part_written = whole[:-1]
    assert tokenizer.decode(part_written).endswith("\ufffd"), "the tokenizer no longer splits the character"
    matcher = service.compile(schema_spec(schema)).matcher()
    assert matcher.accept_all(part_written)
    completion = Completer(tokenizer, VOCAB).complete(matcher)
    assert completion is not None
    assert matcher.accept_all(completion.token_ids) and matcher.is_completed()
    answer = json.loads(tokenizer.decode(part_written + list(completion.token_ids)))
    jsonschema.validate(answer, schema)
