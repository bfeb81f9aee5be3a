"""The validators' number search reaches values far from 0 that the schema's own figures point at."""

from __future__ import annotations

import jsonschema

from radixgen.constraints.events import CompletedValue, SchemaValidators, Validation
from radixgen.constraints.number_search import anchored_numbers

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
