"""The validators' number search reaches values far from 0 that the schema's own figures point at."""

from __future__ import annotations

import jsonschema

from radixgen.constraints.events import CompletedValue, SchemaValidators, Validation
from radixgen.constraints.value_search import anchored_numbers, listed_literals

# valid: multiples of 7 * 44 * 13 = 4004 below -100000 that are not multiples of 429 (the
# nearest is -100100): no integer within 2,000 of 0 and no tenth fits
FAR = {"type": "number", "allOf": [
    {"anyOf": [{"multipleOf": 33}, {"multipleOf": 12}, {"multipleOf": 77}]},
    {"anyOf": [{"allOf": [{"not": {"multipleOf": 6}}, {"not": {"multipleOf": 7}}]}, {"multipleOf": 44}]},
    {"anyOf": [{"not": {"multipleOf": 11}}, {"multipleOf": 13}]},
    {"not": {"multipleOf": 429}}, {"exclusiveMaximum": -100000}]}


def test_a_value_far_from_zero_is_found_through_the_schemas_multiples_and_bounds() -> None:
    validation = Validation(schema=SchemaValidators(FAR))
    found = validation.search_number(CompletedValue((), 0, 1, 5))
    assert found == -100100
    jsonschema.validate(found, FAR)


def test_fractional_steps_combine_exactly() -> None:
    # the least multiple of 6.75, 9.5 and 2.125 together: lcm(27/4, 19/2, 17/8) = lcm(54, 76, 17) / 8 = 4360.5
    schema = {"allOf": [{"multipleOf": 6.75}, {"multipleOf": 9.5}, {"multipleOf": 2.125}], "minimum": 1}
    candidates = anchored_numbers(schema, 10_000)
    valid = [c for c in candidates if jsonschema.Draft202012Validator(schema).is_valid(c)]
    assert valid and valid[0] == 4360.5
    assert anchored_numbers({"type": "number"}, 100) == [], "nothing to anchor on"
    assert len(anchored_numbers(schema, 50)) == 50, "the limit holds"


# one of the listed arrays, and (an if / then the grammar leaves out) at least two items of 3 or more
LISTED = {"type": "array", "allOf": [{"$ref": "#/definitions/x"}, {"enum": [[1], [1, 2], [3, 4], [5]]}],
          "if": {"minItems": 1}, "then": {"minItems": 2, "items": {"minimum": 3}},
          "definitions": {"x": {"enum": [[1], [1, 2], [3, 4], [5], [7, 8, 9]]}}}


def test_a_value_the_schema_lists_is_searched_among_its_literals() -> None:
    validation = Validation(schema=SchemaValidators(LISTED))
    first = validation.feed("[1]", final=True)
    assert first is not None and first.replacement is None, "the model's own next try first"
    validation.reset("")
    second = validation.feed("[5]", final=True)
    assert second is not None and second.replacement == "[3, 4]"
    assert listed_literals({"type": "string"}, {}) == [], "nothing listed: nothing to search"
    assert listed_literals({"anyOf": [{"const": None}, {"enum": [None, "a"]}]}, {}) == [None, "a"]
