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


# members that look at a property only by pattern: {"a..": 70} matches the second member alone,
# but {} (or any object without such a name) matches all three
BY_PATTERN = {"type": "object", "maxProperties": 1,
              "oneOf": [{"$ref": "#/definitions/x1"}, {"$ref": "#/definitions/x2"}, {"$ref": "#/definitions/x3"}],
              "definitions": {"x1": {"patternProperties": {"a": {"multipleOf": 10, "maximum": 20}}},
                              "x2": {"patternProperties": {"a": {"multipleOf": 5, "maximum": 80}}},
                              "x3": {"patternProperties": {"a": {"multipleOf": 5, "maximum": 60}}}}}
# some but not all of a, b, c: an untyped value, yet only an object can match exactly one member
BY_ABSENCE = {"oneOf": [{"not": {"required": ["a", "b", "c"]}},
                        {"allOf": [{"not": {"required": ["a"]}}, {"not": {"required": ["b"]}},
                                   {"not": {"required": ["c"]}}]}]}


@pytest.mark.parametrize(("schema", "valid", "vacuous"), [
    (BY_PATTERN, {"ab": 70}, {"type": "object"}),
    (BY_ABSENCE, {"a": 1}, {}),
])
def test_a_one_of_told_apart_only_by_a_property_the_grammar_never_asks_for_is_refused(
        schema: Any, valid: Any, vacuous: Any) -> None:
    """Every answer used to end in constraint_violation: the model writes an object without the
    telling property (the schema echoed back), which every member accepts."""
    import jsonschema

    reason = unenforceable(schema)
    assert reason is not None and reason.startswith("$.oneOf needs a property that tells its members apart"), reason
    assert "members 0 and 1" in reason and "properties and required" in reason
    assert jsonschema.Draft7Validator(schema).is_valid(valid)  # valid answers exist; the grammar does not lead there
    assert not jsonschema.Draft7Validator(schema).is_valid(vacuous)
    with pytest.raises(InvalidConstraintError, match="tells its members apart"):
        SamplingParams(json_schema=schema)


@pytest.mark.parametrize("schema", [
    # a discriminator the members name: the grammar offers each member's own kind
    {"type": "object", "oneOf": [{"properties": {"kind": {"const": "a"}}, "required": ["kind"]},
                                 {"properties": {"kind": {"const": "b"}}, "required": ["kind"]}]},
    # only one member accepts {}: an object without the pattern's names is valid
    {"type": "object", "oneOf": [{"patternProperties": {"a": {"type": "number"}}}, {"not": {"type": "object"}}]},
    # untyped: a string matches the second member alone
    {"oneOf": [{"patternProperties": {"a": {"type": "number"}}}, {"not": {"required": ["a"]}}]},
    # the parent names the property: the grammar writes it and its value is searched
    {"type": "object", "required": ["a"], "oneOf": BY_PATTERN["oneOf"], "definitions": BY_PATTERN["definitions"]},
])
def test_a_one_of_whose_members_the_grammar_can_tell_apart_is_not_refused(schema: Any) -> None:
    assert unenforceable(schema) is None
