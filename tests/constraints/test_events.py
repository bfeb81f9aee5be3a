from __future__ import annotations

import json
import random
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from radixgen.constraints.events import JsonScanner, SchemaValidators, Validation, format_path

json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-10**6, 10**6) | st.floats(allow_nan=False, allow_infinity=False, width=32)
    | st.text(max_size=8),
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=5), children, max_size=4),
    max_leaves=20,
)


def _expected(value: Any, path: tuple[Any, ...] = ()) -> list[tuple[tuple[Any, ...], Any]]:
    out: list[tuple[tuple[Any, ...], Any]] = []
    if isinstance(value, dict):
        for k, v in value.items():
            out += _expected(v, path + (k,))
    elif isinstance(value, list):
        for i, v in enumerate(value):
            out += _expected(v, path + (i,))
    return out + [(path, value)]


@settings(max_examples=200, deadline=None)
@given(json_values, st.integers(0, 2**32), st.sampled_from([(", ", ": "), (",", ":")]))
def test_scanner_reports_every_value_with_its_path_in_any_chunking(value: Any, seed: int, seps: tuple[str, str]) -> None:
    text = json.dumps(value, separators=seps, ensure_ascii=False)
    rng = random.Random(seed)
    scanner = JsonScanner()
    events = []
    i = 0
    while i < len(text):
        n = rng.randint(1, 6)
        events += scanner.feed(text[i : i + n])
        i += n
    events += scanner.finish()
    assert [(e.path, e.value) for e in events] == _expected(value)
    assert all(json.loads(text[e.start : e.end]) == e.value for e in events)


def test_schema_validators_follow_refs_items_and_additional_properties() -> None:
    schema = {
        "$defs": {"price": {"type": "number", "minimum": 0, "maximum": 100}},
        "type": "object",
        "properties": {"items": {"type": "array", "items": {"type": "object", "properties": {"price": {"$ref": "#/$defs/price"}}}},
                       "pair": {"prefixItems": [{"type": "integer"}, {"enum": ["a", "b"]}]},
                       "when": {"type": "string", "format": "date"}},
        "additionalProperties": {"type": "string", "maxLength": 3},
    }
    v = SchemaValidators(schema)
    assert v.check(("items", 3, "price"), 5) is None
    reason = v.check(("items", 3, "price"), 150)
    assert reason is not None and reason.startswith("$.items[3].price") and "maximum" in reason
    assert v.check(("pair", 1), "c") is not None and v.check(("pair", 1), "a") is None
    assert v.check(("extra",), "long") is not None
    assert v.check(("when",), "2024-02-30") is not None, "formats are checked semantically"
    assert v.check(("when",), "2024-02-28") is None


def test_validation_reports_the_first_rejected_value_and_its_start() -> None:
    text = '{"order": "A-1", "lines": [{"qty": 2}, {"qty": -1}], "total": 3}'
    validation = Validation(user={"$.lines[*].qty": lambda q: q > 0})
    rejection = None
    for ch in text:
        rejection = rejection or validation.feed(ch)
    assert rejection is not None
    assert format_path(rejection.path) == "$.lines[1].qty"
    assert text[rejection.start :].startswith("-1")
    raising = Validation(user={"$.order": lambda o: (_ for _ in ()).throw(ValueError("bad order id"))})
    r = raising.feed(text)
    assert r is not None and "bad order id" in r.reason and r.is_string


def test_pydantic_field_validators_reject_the_field_as_it_completes() -> None:
    from pydantic import BaseModel, field_validator, model_validator

    class Booking(BaseModel):
        city: str
        nights: int
        guests: int

        @field_validator("city")
        @classmethod
        def capitalised(cls, city: str) -> str:
            if not city[:1].isupper():
                raise ValueError("city must be capitalised")
            return city

        @model_validator(mode="after")
        def fewer_guests_than_nights(self) -> Booking:
            if self.guests > self.nights:
                raise ValueError("more guests than nights")
            return self

    validation = Validation(model=Booking)
    text = '{"city": "paris", "nights": 2, "guests": 3}'
    rejection = validation.feed(text[: text.index(",") + 1])
    assert rejection is not None and rejection.path == ("city",) and "capitalised" in rejection.reason
    # the model validator needs every field: it runs on the whole object, not on a field
    ok = Validation(model=Booking)
    assert ok.feed('{"city": "Paris", "nights": 2,') is None
    whole = ok.feed(' "guests": 3}', final=True)
    assert whole is not None and whole.path == () and "more guests than nights" in whole.reason


@pytest.mark.parametrize(("mode", "unique_items", "refused"), [
    ("unique", True, True), ("unique", False, False), ("all", False, True), ("off", True, False),
])
def test_repeated_array_items(mode: str, unique_items: bool, refused: bool) -> None:
    from radixgen.constraints.events import SchemaValidators, Validation

    schema = {"type": "object", "properties": {"tags": {"type": "array", "items": {"type": "string"},
                                                        **({"uniqueItems": True} if unique_items else {})}}}
    validation = Validation(schema=SchemaValidators(schema), repeated_items=mode)  # type: ignore[arg-type]
    assert validation.feed('{"tags": ["a", "b", ') is None
    rejection = validation.feed('"a"')
    assert (rejection is not None) is refused
    if rejection is not None:
        assert rejection.path == ("tags", 2) and rejection.start == len('{"tags": ["a", "b", ') and "repeats" in rejection.reason
        validation.reset('{"tags": ["a", "b", ')  # the rollback: the kept items are remembered again
        assert validation.feed('"b"') is not None
        validation.reset('{"tags": ["a", "b", ')
        assert validation.feed('"c"]}') is None


def test_a_list_that_keeps_repeating_itself_is_closed_before_the_repeat() -> None:
    """The first repeat is resampled; from the second, the array is closed where the repeat
    began: the rollback reaches back to its separator and "]" is written there."""
    from radixgen.constraints.events import SchemaValidators, Validation

    schema = {"type": "object", "properties": {"tags": {"type": "array", "items": {"type": "string"},
                                                        "uniqueItems": True}}}
    validation = Validation(schema=SchemaValidators(schema))
    kept = '{"tags": ["a", "b"'
    assert validation.feed(kept + ', ') is None
    first = validation.feed('"a"')
    assert first is not None and first.replacement is None and first.start == len(kept) + 2
    validation.reset(kept + ', ')
    second = validation.feed('"b"')
    assert second is not None and second.replacement == "]" and second.start == len(kept), second
    assert not second.is_string  # the ban falls on the separator's token, not inside a string


def test_a_property_that_patterns_name_is_checked_against_each_of_their_schemas() -> None:
    """Its value is judged where it completes (the number search needs that), against the
    allOf of its own schema and every matching pattern's, the same object each time."""
    from radixgen.constraints.events import resolve_subschema

    root = {"type": "object", "properties": {"ab": {"maximum": 10}},
            "patternProperties": {"a": {"type": "integer"}, "b": {"minimum": 0}, "^z": {"type": "string"}}}
    combined: dict[tuple[int, str], Any] = {}
    sub = resolve_subschema(root, ("ab",), combined)
    assert sub == {"allOf": [{"maximum": 10}, {"type": "integer"}, {"minimum": 0}]}
    assert resolve_subschema(root, ("ab",), combined) is sub
    assert resolve_subschema(root, ("zed",)) == {"type": "string"}
    assert resolve_subschema(root, ("other",)) is None
    unreadable = {"type": "object", "patternProperties": {"[": {"type": "integer"}}, "properties": {"x": {"type": "string"}}}
    assert resolve_subschema(unreadable, ("x",)) is None, "a pattern re cannot read may match: the parent decides"


def test_a_property_is_checked_against_what_every_allof_member_asks_of_it() -> None:
    """allOf members check the same object: a property's value is judged where it completes
    against each member's schema for its name (an object member's additionalProperties where
    it names it no other way). What a branch (anyOf / oneOf) adds is left to the whole object:
    what is read holds whichever branch is taken."""
    from radixgen.constraints.events import resolve_subschema

    root = {"type": "object", "properties": {"ab": {"maximum": 10}}, "allOf": [
        {"$ref": "#/$defs/a"}, {"patternProperties": {"b": {"minimum": 0}}}, {"additionalProperties": {"type": "integer"}}],
        "$defs": {"a": {"patternProperties": {"a": {"type": "number"}}}}}
    assert resolve_subschema(root, ("ab",)) == {"allOf": [{"maximum": 10}, {"type": "number"}, {"minimum": 0},
                                                          {"type": "integer"}]}
    assert resolve_subschema(root, ("zed",)) == {"type": "integer"}
    branching = {**root, "oneOf": [{"properties": {"ab": {"type": "string"}}}, {"required": ["y"]}],
                 "allOf": [*root["allOf"], {"anyOf": [{"properties": {"ab": {"minimum": 5}}}, {"required": ["y"]}]}]}
    assert resolve_subschema(branching, ("ab",)) == resolve_subschema(root, ("ab",))
    assert resolve_subschema(root, ("ab", "x")) is None, "nothing is asked of the maximum's inside"


def test_a_container_where_the_path_wants_a_number_is_replaced_by_one() -> None:
    """The grammar let an array through where both members' patterns ask a number: after the
    retries the search writes the first number the path's validators accept."""
    from radixgen.constraints.events import SchemaValidators, Validation

    schema = {"type": "object", "allOf": [{"patternProperties": {"a": {"type": "number", "minimum": 10}}},
                                          {"patternProperties": {"l": {"type": "number", "minimum": 3}}}]}
    validation = Validation(schema=SchemaValidators(schema))
    rejection = None
    for _ in range(Validation.SEARCH_AFTER):
        validation.reset('{"all": ')
        rejection = validation.feed('["x"]')
        assert rejection is not None
    assert rejection is not None and rejection.replacement == "10", rejection


def test_a_key_written_twice_in_one_object_closes_it_or_is_resampled() -> None:
    """Under patternProperties or additionalProperties the grammar cannot keep keys apart: dep6's
    answer reached minProperties 3 with "b" twice, and the parsed object (two keys) failed. A
    repeated key closes its object where the separator before it stands ("}" written there);
    where the automaton refuses the closer (dep6's minProperties), the fallback resamples the
    key: rejected where its text starts, the ban on the token after its quote."""
    from radixgen.constraints.events import SchemaValidators, Validation

    schema = {"type": "object", "patternProperties": {"^[a-e]$": True}, "minProperties": 3}
    validation = Validation(schema=SchemaValidators(schema))
    kept = '{"a": {"b": 1}, "b": ""'
    assert validation.feed(kept) is None, "the same name in another object is no repeat"
    rejection = validation.feed(', "b"')
    assert rejection is not None and rejection.path == ("b",)
    assert rejection.replacement == "}" and rejection.start == len(kept) and not rejection.is_string, rejection
    assert "has this key already" in rejection.reason
    resample = rejection.fallback
    assert resample is not None and resample.replacement is None and resample.fallback is None
    assert resample.start == len(kept) + 2 and resample.is_string
    validation.reset(kept + ", ")
    assert validation.feed('"c": 2}', final=True) is None
    # a repeat inside a nested object closes that object at its own separator
    validation = Validation(schema=SchemaValidators(schema))
    assert validation.feed('{"a": {"a"') is None
    nested = validation.feed(': 1, "a"')
    assert nested is not None and nested.replacement == "}" and nested.start == len('{"a": {"a": 1')
    validation.reset('{"a": {')
    assert validation.feed('"a": 1, "b": 2}, "a"') is not None, "the outer object's repeat"


def test_a_key_written_without_the_keys_it_depends_on_is_taken_back_alone() -> None:
    """o79613: a service with memswap_limit but no mem_limit failed as a whole object, and the
    model wrote its 465 tokens again each time. Where missing dependencies are all that is
    wrong, the rejection falls on the dependent key (resampled after its quote); any other
    fault in the object still takes the whole object back."""
    from radixgen.constraints.events import SchemaValidators, Validation

    service = {"type": "object", "properties": {"mem_limit": {"type": "integer"}, "memswap_limit": {"type": "integer"},
                                                "image": {"type": "string"}},
               "dependencies": {"memswap_limit": ["mem_limit"]}, "additionalProperties": False}
    draft4 = {"$schema": "http://json-schema.org/draft-04/schema#"}
    for schema, prefix, path in [({**draft4, **service}, "", ()),
                                 ({**draft4, "type": "object", "additionalProperties": service}, '{"web": ', ("web",))]:
        validation = Validation(schema=SchemaValidators(schema))
        kept = prefix + '{"image": "x", '
        rejection = validation.feed(kept + '"memswap_limit": 2}')
        assert rejection is not None and rejection.path == (*path, "memswap_limit"), (schema, rejection)
        assert rejection.start == len(kept) and rejection.is_string and "dependency" in rejection.reason
        validation = Validation(schema=SchemaValidators(schema))
        whole = validation.feed(prefix + '{"image": 5, "memswap_limit": 2}')
        assert whole is not None and whole.start == len(prefix) + len('{"image": '), whole  # the type fault first
        validation = Validation(schema=SchemaValidators(schema))
        assert validation.feed(prefix + '{"mem_limit": 1, "memswap_limit": 2}') is None


def test_an_array_refused_as_a_whole_has_its_last_item_resampled_then_searched() -> None:
    """oneof10_2: items must match "a|b|c", and exactly one of three branches holds only when
    some item lacks "a" and some item lacks "b". Each item passes on its own, so the array fails
    at its close: its last item is resampled first, then replaced by the first short value that
    mends the array, and only then is the whole array taken back."""
    schema = {"oneOf": [{"items": {"pattern": "a"}}, {"items": {"pattern": "b"}}, {"items": {"pattern": "a|b|c"}}],
              "minItems": 2}
    validation = Validation(schema=SchemaValidators(schema))
    kept = '["schema", '
    first = validation.feed(kept + '"a"]', final=True)
    assert first is not None and first.path == (1,) and first.start == len(kept) and first.is_string
    assert first.replacement is None and "valid under each" in first.reason
    validation.reset(kept)
    second = validation.feed('"pa"]', final=True)
    assert second is not None and second.path == (1,) and second.start == len(kept)
    assert second.replacement == '"b"' and second.end == len(kept) + len('"pa"'), second
    assert second.fallback is not None and second.fallback.replacement is None
    checked = Validation(schema=SchemaValidators(schema))
    assert checked.feed(kept + second.replacement + "]", final=True) is None, "the searched item mends the array"
    validation.reset(kept)
    whole = validation.feed('"a"]', final=True)
    assert whole is not None and whole.path == () and whole.start == 0, "past the member retries: the whole array"


def test_an_array_without_what_it_must_contain_gets_it_in_its_last_place() -> None:
    schema = {"type": "array", "items": {"type": "integer"}, "contains": {"const": 7}}
    validation = Validation(schema=SchemaValidators(schema))
    assert validation.feed("[1, 2]", final=True) is not None
    validation.reset("[1, ")
    searched = validation.feed("3]", final=True)
    assert searched is not None and searched.replacement == "7" and searched.path == (1,)


def test_an_object_or_an_array_of_objects_refused_as_a_whole_is_taken_back_whole() -> None:
    """A key, or an object item, usually starts with the one token the grammar allows there: a
    ban on it would leave no token at all, so only scalar items are retried alone."""
    keys = {"type": "object", "oneOf": [{"required": ["a"]}, {"required": ["b"]}]}
    rejection = Validation(schema=SchemaValidators(keys)).feed('{"a": 1, "b": 2}', final=True)
    assert rejection is not None and rejection.path == () and rejection.start == 0
    objects = {"type": "array", "contains": {"type": "object", "required": ["k"]}}
    rejection = Validation(schema=SchemaValidators(objects)).feed('[{"a": 1}, {"b": 2}]', final=True)
    assert rejection is not None and rejection.path == () and rejection.start == 0
