"""Schemas whose requirements no grammar backend enforces are refused before generation, by name."""

from __future__ import annotations

import re
from typing import Any

import pytest

from radixgen import SamplingParams
from radixgen.constraints.refusals import unenforceable
from radixgen.errors import InvalidConstraintError

# an object that must have a property named "0": the negation of "no name is 0"
SOME_NAME = {"type": "object", "not": {"propertyNames": {"not": {"const": "0"}}}}


@pytest.mark.parametrize(("schema", "where", "keyword"), [
    ({"type": "array", "contains": {"const": 3}}, "$.contains", "contains"),
    ({"type": "object", "properties": {"xs": {"type": "array", "items": {"type": "integer"},
                                              "allOf": [{"contains": {"minimum": 5}}]}}},
     "$.properties.xs.allOf[0].contains", "contains"),
    (SOME_NAME, "$.not", "propertyNames"),
    # reached through a $ref into a folder of definitions the spec does not name
    ({"type": "object", "allOf": [{"$ref": "#/ddd/npn"}], "ddd": {"npn": SOME_NAME}}, "#/ddd/npn.not", "propertyNames"),
    # some property matching "a" whose value is not a string
    ({"type": "object", "not": {"anyOf": [{"patternProperties": {"a": {"type": "string"}}}]}}, "$.not",
     "patternProperties"),
])
def test_requirements_no_backend_enforces_are_refused_naming_the_keyword(schema: Any, where: str, keyword: str) -> None:
    reason = unenforceable(schema)
    assert reason is not None and reason.startswith(f"{where}") and keyword in reason
    with pytest.raises(InvalidConstraintError, match=f"cannot generate for this json_schema: .*{keyword}"):
        SamplingParams(json_schema=schema)


@pytest.mark.parametrize("schema", [
    {"type": "object", "properties": {"contains": {"type": "string"}}},  # a property called "contains"
    {"type": "object", "$defs": {"unused": {"contains": {"const": 1}}}},  # a definition nothing refers to
    {"type": "object", "not": {"propertyNames": False}},  # only asks for a non-empty object
    {"type": "object", "not": {"required": ["a", "b"]}},  # forbids: writing less satisfies it
    {"allOf": [{"enum": [{"a": 1}]}, {"not": {"patternProperties": {"b": False}}}]},  # the grammar writes the literal
    {"const": [1, 2], "contains": {"const": 2}},
])
def test_what_the_grammar_or_the_model_satisfies_anyway_is_not_refused(schema: Any) -> None:
    assert unenforceable(schema) is None
    assert SamplingParams(json_schema=schema).constraint is not None


def test_a_ref_key_inside_a_literal_is_data_and_named_schemas_are_still_checked() -> None:
    # the practice corpus' draft2019 "nonvalid_ref" file: an enum whose value is {"$ref": "a"}
    assert SamplingParams(json_schema={"allOf": [{"enum": [{"$ref": "a"}]}]}).constraint is not None
    assert SamplingParams(json_schema={"type": "object", "default": {"$ref": "http://x/y"}}).constraint is not None
    for schema, where in [({"definitions": {"enum": {"$ref": "http://x/y#/a"}}}, "$.definitions.enum"),
                          ({"properties": {"const": {"$ref": "other.json"}}}, "$.properties.const")]:
        with pytest.raises(InvalidConstraintError, match=re.escape(f"at {where} points outside the schema")):
            SamplingParams(json_schema=schema)


UNION_OF_ALIASES = {"type": "object", "required": ["union"], "properties": {"union": {"$ref": "#/definitions/Union"}},
                    "definitions": {"Alias": {"title": "Alias", "type": "string"},
                                    "Union": {"type": "string", "oneOf": [{"$ref": "#/definitions/Alias"},
                                                                          {"type": "string"}, {"type": "number"}]}}}


def test_a_required_one_of_whose_members_are_twins_is_refused() -> None:
    """A generated union of a string alias and a string, under type string: every string matches
    both members, so no value is valid; every answer used to end in constraint_violation."""
    import jsonschema

    reason = unenforceable(UNION_OF_ALIASES)
    assert reason is not None and reason.startswith("$.properties.union.oneOf can never hold"), reason
    assert "members 0 and 1" in reason and "anyOf" in reason
    for value in ("a", "", 1, 2.5, None):  # the refusal is right: nothing passes
        assert not jsonschema.Draft7Validator(UNION_OF_ALIASES).is_valid({"union": value})


@pytest.mark.parametrize("schema", [
    # the number member matches a number alone
    {"oneOf": [{"type": "string"}, {"type": "string", "title": "x"}, {"type": "number"}]},
    # an optional property: leaving it out is valid
    {"type": "object", "properties": {"a": {"oneOf": [{"type": "string"}, {"type": "string"}]}}},
    # members that differ
    {"type": "string", "oneOf": [{"maxLength": 2}, {"minLength": 5}]},
])
def test_a_one_of_that_some_value_satisfies_is_not_refused(schema: Any) -> None:
    assert unenforceable(schema) is None


def test_a_one_of_over_required_sets_that_the_object_requires_already_is_refused() -> None:
    """A function-calling schema: oneOf [radius], [length, width], [base, height], beside a
    required list naming all five; every valid object would match all three members."""
    import jsonschema

    dims = {"type": "object", "properties": {k: {"type": "number"} for k in ("radius", "length", "width", "base", "height")},
            "required": ["radius", "length", "width", "base", "height"],
            "oneOf": [{"required": ["radius"]}, {"required": ["length", "width"]}, {"required": ["base", "height"]}]}
    schema = {"type": "object", "properties": {"dimensions": dims}, "required": ["dimensions"]}
    reason = unenforceable(schema)
    assert reason is not None and reason.startswith("$.properties.dimensions.oneOf can never hold"), reason
    full = {k: 1 for k in dims["properties"]}
    assert not jsonschema.Draft7Validator(schema).is_valid({"dimensions": full})
    # the usual form, without the blanket required list, is served
    assert unenforceable({**schema, "properties": {"dimensions": {**dims, "required": []}}}) is None
