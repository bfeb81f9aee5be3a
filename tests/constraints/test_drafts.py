"""Older drafts' keywords rewritten into 2020-12 for the grammar, validators by the declared draft."""

from __future__ import annotations

import pytest

from radixgen.constraints.drafts import as_2020_12, draft_of, validator_class
from radixgen.constraints.events import SchemaValidators

D7 = "http://json-schema.org/draft-07/schema#"
D4 = "http://json-schema.org/draft-04/schema#"


@pytest.mark.parametrize(("schema", "expected"), [
    ({"$schema": D7, "dependencies": {"a": ["b"], "c": {"required": ["d"]}}},
     {"dependentRequired": {"a": ["b"]}, "dependentSchemas": {"c": {"required": ["d"]}}}),
    ({"$schema": D7, "items": [{"type": "string"}], "additionalItems": {"type": "integer"}},
     {"prefixItems": [{"type": "string"}], "items": {"type": "integer"}}),
    ({"$schema": D7, "items": {"type": "string"}, "additionalItems": False}, {"items": {"type": "string"}}),
    ({"$schema": D4, "id": "x", "minimum": 1, "exclusiveMinimum": True, "maximum": 5, "exclusiveMaximum": False},
     {"exclusiveMinimum": 1, "maximum": 5}),
    ({"$schema": D7, "properties": {"p": {"definitions": {}, "items": [True]}}},
     {"properties": {"p": {"definitions": {}, "prefixItems": [True]}}}),
])
def test_older_keywords_are_rewritten(schema: dict, expected: dict) -> None:
    rewritten = as_2020_12(schema)
    assert rewritten.pop("$schema") == "https://json-schema.org/draft/2020-12/schema"
    assert rewritten == expected


def test_2020_12_and_unnamed_schemas_are_left_alone() -> None:
    schema = {"items": [{"type": "string"}], "dependencies": {"a": ["b"]}}
    assert as_2020_12(schema) is schema and draft_of(schema) == "2020-12"
    assert validator_class(schema).__name__ == "Draft202012Validator"


def test_validators_follow_the_declared_draft() -> None:
    schema = {"$schema": D7, "type": "object", "properties": {"a": {"type": "string"}, "b": {"type": "integer"}},
              "dependencies": {"a": ["b"]}}
    validators = SchemaValidators(schema)
    assert validators.check((), {"a": "x"}) is not None, "draft-07 dependencies: a needs b"
    assert validators.check((), {"a": "x", "b": 1}) is None
    tuple_schema = {"$schema": D4, "type": "array", "items": [{"type": "string"}, {"type": "integer"}]}
    assert SchemaValidators(tuple_schema).check((1,), "not an integer") is not None, "array-form items by position"


@pytest.mark.parametrize(("fmt", "bad", "good"), [
    ("uri-reference", "://", "../a/b?c=1"), ("uri", "no scheme", "https://example.com/x"),
    ("date-time", "2024-13-01T00:00:00Z", "2024-01-01T00:00:00Z"),
])
def test_formats_are_checked_strictly(fmt: str, bad: str, good: str) -> None:
    validators = SchemaValidators({"$schema": D7, "type": "string", "format": fmt})
    assert validators.check((), bad) is not None
    assert validators.check((), good) is None
