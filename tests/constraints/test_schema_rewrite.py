"""What the backends compile: closed objects where closing cannot change a partner's meaning,
and the auto backend's routing between xgrammar and llguidance."""

from __future__ import annotations

from typing import Any

import pytest

from radixgen.constraints import make_backend
from radixgen.constraints.auto_backend import AutoBackend, within_xgrammar_subset
from radixgen.constraints.schema_rewrite import close_objects, grammar_schema
from radixgen.constraints.spec import regex_spec, schema_spec

PERSON = {"type": "object", "properties": {"name": {"type": "string"}}, "required": ["name"]}


def test_declared_properties_close_an_object_and_everything_else_is_left_alone() -> None:
    closed = close_objects({"type": "object", "properties": {
        "person": PERSON, "any": {"type": "object"}, "open": {**PERSON, "additionalProperties": True},
        "tuple": {"type": "array", "prefixItems": [{"type": "integer"}]},
        "pick": {"anyOf": [PERSON, {"type": "null"}]}}})
    props = closed["properties"]
    assert closed["additionalProperties"] is False and props["person"]["additionalProperties"] is False
    assert "additionalProperties" not in props["any"], '{"type": "object"} means any object'
    assert props["open"]["additionalProperties"] is True, "the caller's choice stands"
    assert props["tuple"]["items"] is False
    assert props["pick"]["anyOf"][0]["additionalProperties"] is False, "an alternative is a whole instance"
    assert "additionalProperties" not in PERSON, "the caller's schema is not touched"


@pytest.mark.parametrize("schema", [
    {"allOf": [PERSON, {"properties": {"age": {"type": "integer"}}}]},
    {"properties": {"a": {"type": "integer"}}, "anyOf": [PERSON, {"required": ["a"]}]},
    {"not": PERSON},
    {"$defs": {"p": PERSON}, "$ref": "#/$defs/p", "properties": {"age": {"type": "integer"}}},
    {**PERSON, "unevaluatedProperties": False, "allOf": [{"properties": {"x": {}}}]},
])
def test_schemas_read_together_with_partners_are_not_closed(schema: dict[str, Any]) -> None:
    assert close_objects(schema) == schema


def test_plain_references_are_closed_and_open_objects_are_a_choice() -> None:
    schema = {"$defs": {"p": PERSON}, "type": "object", "properties": {"who": {"$ref": "#/$defs/p",
                                                                               "description": "a person"}}}
    assert grammar_schema(schema)["$defs"]["p"]["additionalProperties"] is False
    assert "additionalProperties" not in grammar_schema(schema, open_objects=True)["$defs"]["p"]


@pytest.mark.parametrize(("schema", "inside"), [
    (PERSON, True),
    ({"type": "object", "properties": {"tags": {"type": "array", "items": {"enum": ["a", "b"]}}}}, True),
    ({"anyOf": [PERSON, {"type": "null"}]}, True),
    ({"properties": {"a": {"type": "integer"}}}, False),  # no type: xgrammar would allow only objects
    ({"type": "object", "properties": {"k": {"const": {"a": 1}}}}, False),
    ({"type": "object", "patternProperties": {"^x": {"type": "integer"}}}, False),
    ({"type": "array", "items": False, "prefixItems": [False]}, False),
    ({"type": "number", "enum": [1.5]}, False),
])
def test_the_xgrammar_subset(schema: dict[str, Any], inside: bool) -> None:
    assert within_xgrammar_subset(schema) is inside


def test_auto_routes_each_spec_and_falls_back_when_a_backend_refuses(tokenizer: Any) -> None:
    backend = make_backend("auto", tokenizer, 49152, [tokenizer.eos_token_id])
    assert isinstance(backend, AutoBackend)
    assert [b.name for b in backend.choose(schema_spec(PERSON))] == ["xgrammar", "llguidance"]
    assert [b.name for b in backend.choose(schema_spec({"properties": {}}))] == ["llguidance", "xgrammar"]
    assert backend.choose(regex_spec("[a-z]+"))[0].name == "xgrammar"
    # llguidance refuses overlapping patternProperties; xgrammar takes the schema, validators do the rest
    overlapping = {"type": "object", "patternProperties": {"a*": {"type": "integer"}, "aaa*": {"maximum": 20}}}
    with pytest.raises(Exception, match="disjoint"):
        backend.backends["llguidance"].compile(schema_spec(overlapping))
    assert backend.compile(schema_spec(overlapping)).matcher() is not None
