"""Validators over the JSON parts of a structural output: each call's arguments and the answer
checked against their own schema, with rejections located in the whole output's text, and the
settled prefix (what may stream) never reaching into the part being checked."""

from __future__ import annotations

import pytest

from radixgen import tool_formats
from radixgen.constraints.call_validation import StructuralValidation
from radixgen.constraints.events import SchemaValidators
from radixgen.constraints.structural import Structure, parse_structure
from radixgen.tool_formats import CallFormat

DAYS = {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer", "multipleOf": 5}},
        "required": ["city"]}
ANSWER = {"type": "object", "properties": {"celsius": {"type": "integer", "multipleOf": 2}}, "required": ["celsius"]}
FORMATS = [tool_formats.SMOLLM2, tool_formats.HERMES, tool_formats.LLAMA3, tool_formats.LLAMA3_PYTHON_TAG,
           tool_formats.MISTRAL]


def calls_structure(fmt: CallFormat, **extra: object) -> Structure:
    return parse_structure({"tool_calls": fmt.structure([("forecast", DAYS), ("note", {})], free_text=True,
                                                        min_calls=0, max_calls=None), **extra})


def first_rejection(validation: StructuralValidation, text: str):  # noqa: ANN201 - Rejection | None
    for ch in text:
        rejection = validation.feed(ch)
        if rejection is not None:
            return rejection
    return validation.feed("", final=True)


@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f.name + ("_tag" if f.trigger.startswith("<|") else ""))
def test_each_call_is_checked_against_its_own_schema(fmt: CallFormat) -> None:
    good = "Checking. " + fmt.render_calls([("forecast", '{"city": "Oslo", "days": 10}'), ("note", '{"days": 7}')])
    validation = StructuralValidation(calls_structure(fmt), {"forecast": SchemaValidators(DAYS)})
    assert first_rejection(validation, good) is None  # the note's 7 is not the forecast's
    bad = "Checking. " + fmt.render_calls([("note", '{"x": 1}'), ("forecast", '{"city": "Oslo", "days": 7}')])
    rejection = first_rejection(StructuralValidation(calls_structure(fmt), {"forecast": SchemaValidators(DAYS)}), bad)
    assert rejection is not None and rejection.path == ("days",) and "multiple of 5" in rejection.reason
    assert bad[rejection.start:].startswith("7}")


def test_settled_text_stops_at_the_part_being_checked() -> None:
    fmt = tool_formats.HERMES
    validation = StructuralValidation(calls_structure(fmt), {"forecast": SchemaValidators(DAYS)})
    opening = "Sure. " + fmt.block_begin + fmt.call_begin("forecast")
    validation.feed(opening + '{"city": "Os')
    assert validation.settled == len(opening)  # the arguments may still be rolled back
    whole = opening + '{"city": "Oslo", "days": 5}' + fmt.call_end + fmt.block_end + " Done"
    validation.feed(whole[len(validation.text):])
    assert validation.settled == len(whole)


def test_reset_after_a_rollback_rescans_without_verdicts() -> None:
    fmt = tool_formats.SMOLLM2
    text = fmt.render_calls([("forecast", '{"city": "Oslo", "days": 7}')])
    fresh = first_rejection(StructuralValidation(calls_structure(fmt), {"forecast": SchemaValidators(DAYS)}), text)
    assert fresh is not None
    validation = StructuralValidation(calls_structure(fmt), {"forecast": SchemaValidators(DAYS)})
    validation.reset(text[:fresh.start])  # the kept text, up to the refused value
    assert validation.settled == text.index('{"city"')
    assert first_rejection(validation, "10}}\n]</tool_call>") is None


def test_the_answer_after_a_reasoning_section_is_checked() -> None:
    structure = parse_structure({"reasoning": {"begin": "<think>", "end": "</think>"}, "json_schema": ANSWER})
    text = '<think>maybe {"celsius": 3}</think>\n\n{"celsius": 3}'
    rejection = first_rejection(StructuralValidation(structure, {None: SchemaValidators(ANSWER)}), text)
    assert rejection is not None and rejection.start == text.rindex("3")  # the answer's, not the thought's
    assert first_rejection(StructuralValidation(structure, {None: SchemaValidators(ANSWER)}),
                           text.replace("3}", "4}")) is None


@pytest.mark.parametrize("fmt", [tool_formats.LLAMA3, tool_formats.HERMES], ids=lambda f: f.name)
def test_a_call_block_or_the_answer_each_by_its_schema(fmt: CallFormat) -> None:
    """With a trigger that starts like JSON ({"name": ), the answer is told apart once it differs."""
    structure = parse_structure({"tool_calls": fmt.structure([("forecast", DAYS)], free_text=False, min_calls=1,
                                                             max_calls=None), "json_schema": ANSWER})
    validators = {None: SchemaValidators(ANSWER), "forecast": SchemaValidators(DAYS)}
    answer = first_rejection(StructuralValidation(structure, validators), '{"celsius": 3}')
    assert answer is not None and answer.path == ("celsius",)
    call = first_rejection(StructuralValidation(structure, validators),
                           fmt.render_calls([("forecast", '{"city": "Oslo", "days": 3}')]))
    assert call is not None and call.path == ("days",)
