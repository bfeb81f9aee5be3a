"""The report on every constrained answer: each way an answer can end, driven for real, and its
flags checked against an independent reading of the returned text."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import jsonschema
import pytest

from radixgen import Engine, SamplingParams
from radixgen.engine.output import FinishReason
from tests.engine.test_validators import CHAINED

PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8},
                                          "age": {"type": "integer", "minimum": 0, "maximum": 99}},
          "required": ["name", "age"], "additionalProperties": False}
STORY = {"type": "object", "properties": {"story": {"type": "string"}}, "required": ["story"],
         "additionalProperties": False}


def independently_valid(text: str, schema: dict[str, Any]) -> bool:
    try:
        jsonschema.validate(json.loads(text), schema)
    except (json.JSONDecodeError, jsonschema.ValidationError):
        return False
    return True


def test_a_complete_answer_is_reported_valid_with_what_was_forced_and_drafted(
        make_engine: Callable[..., Engine]) -> None:
    # a fixed cap: whether drafting pays for this random-weight model is the machine's to measure
    engine = make_engine(speculative_max_batch=8)
    out = engine.generate("Person:", SamplingParams(max_new_tokens=200, temperature=0, json_schema=PERSON))
    report = out.constraint
    assert report is not None and out.finish_reason is FinishReason.STOP
    assert (report.kind, report.ended, report.valid) == ("json_schema", "complete", True)
    assert report.backend == "xgrammar" and report.valid == independently_valid(out.text, PERSON)
    # greedy and constrained: drafted by default, the forced keys among the accepted drafts
    assert report.drafted_tokens >= report.accepted_tokens >= report.forced_tokens > 0
    assert report.rollbacks == report.validator_retries == report.steered_tokens == report.searched_values == 0


def test_jump_forward_is_counted_for_a_sampled_answer(make_engine: Callable[..., Engine]) -> None:
    engine = make_engine(speculative="off")
    out = engine.generate("Person:", SamplingParams(max_new_tokens=200, temperature=0.8, seed=3, json_schema=PERSON))
    report = out.constraint
    assert report is not None and report.valid == independently_valid(out.text, PERSON)
    assert report.forced_tokens > 0 and report.drafted_tokens == report.accepted_tokens == 0
    assert engine.stats_snapshot()["num_jump_forwards"] > 0


def test_budget_steering_is_reported_as_closed_early_and_still_valid(make_engine: Callable[..., Engine]) -> None:
    engine = make_engine()
    out = engine.generate("Story:", SamplingParams(max_new_tokens=12, temperature=0.9, seed=1, json_schema=STORY))
    report = out.constraint
    assert report is not None and out.shortened
    assert (report.ended, report.valid) == ("budget_closed", True) and report.steered_tokens > 0
    assert independently_valid(out.text, STORY), out.text


def test_an_answer_cut_at_max_tokens_is_reported_invalid(make_engine: Callable[..., Engine]) -> None:
    engine = make_engine(budget_steering=False)
    out = engine.generate("Story:", SamplingParams(max_new_tokens=12, temperature=0.9, seed=1, json_schema=STORY))
    report = out.constraint
    assert out.finish_reason is FinishReason.LENGTH and report is not None
    assert (report.ended, report.valid) == ("max_tokens", False)
    assert not independently_valid(out.text, STORY)


def test_a_too_small_budget_is_refused_never_reported_complete(make_engine: Callable[..., Engine]) -> None:
    engine = make_engine()
    out = engine.generate("Person:", SamplingParams(max_new_tokens=3, temperature=0, json_schema=PERSON))
    report = out.constraint
    assert out.finish_reason is FinishReason.ERROR and out.user_error and report is not None
    assert (report.ended, report.valid, report.backend) == ("refused", False, "")


def test_validators_that_keep_rejecting_end_as_a_violation(make_engine: Callable[..., Engine]) -> None:
    engine = make_engine()
    params = SamplingParams(max_new_tokens=60, temperature=0, json_schema=PERSON, max_validation_retries=2,
                            validators={"$.age": lambda v: False})
    out = engine.generate("Person:", params)
    report = out.constraint
    assert out.finish_reason is FinishReason.CONSTRAINT_VIOLATION and report is not None
    assert (report.ended, report.valid) == ("violation", False)
    assert report.validator_retries == 3 and report.rollbacks >= 3


def test_a_searched_value_is_counted(make_engine: Callable[..., Engine]) -> None:
    engine = make_engine()
    out = engine.generate("Number:", SamplingParams(max_new_tokens=40, temperature=0, json_schema=CHAINED))
    report = out.constraint
    assert report is not None and (report.ended, report.valid) == ("complete", True)
    # rejected twice: the model wrote the value again once, then the search wrote it (no retry)
    assert report.searched_values == 1 and report.validator_retries == 1 and report.rollbacks == 2
    assert independently_valid(out.text, CHAINED)


def test_a_value_the_validators_write_uses_no_retry(make_engine: Callable[..., Engine]) -> None:
    """One retry allowed: the model rewrites the rejected number once, then the search writes a
    valid one. That repair used to count as the second retry and end the answer a violation (a
    long document with several lists closed after repeats ran out of retries the same way)."""
    engine = make_engine()
    params = SamplingParams(max_new_tokens=40, temperature=0, json_schema=CHAINED, max_validation_retries=1)
    out = engine.generate("Number:", params)
    report = out.constraint
    assert report is not None and (report.ended, report.valid) == ("complete", True), out.error
    assert report.searched_values == 1 and report.validator_retries == 1
    strict = engine.generate("Number:", SamplingParams(max_new_tokens=40, temperature=0, json_schema=CHAINED,
                                                       max_validation_retries=0))
    assert strict.finish_reason is FinishReason.CONSTRAINT_VIOLATION


def test_a_stop_string_before_the_end_is_reported_stopped(make_engine: Callable[..., Engine]) -> None:
    engine = make_engine()
    out = engine.generate("Person:", SamplingParams(max_new_tokens=60, temperature=0, json_schema=PERSON,
                                                    stop=[":"]))
    report = out.constraint
    assert out.finish_reason is FinishReason.STOP and report is not None
    assert (report.ended, report.valid) == ("stopped", False)
    assert not independently_valid(out.text, PERSON)


@pytest.mark.parametrize(("params", "kind"), [
    ({"regex": "[0-9]{3}"}, "regex"), ({"choices": ["left", "right"]}, "choice"), ({"json_object": True}, "json_object"),
])
def test_each_kind_is_named_and_free_text_has_no_report(make_engine: Callable[..., Engine], params: dict[str, Any],
                                                        kind: str) -> None:
    engine = make_engine()
    out = engine.generate("Pick:", SamplingParams(max_new_tokens=40, temperature=0, **params))
    report = out.constraint
    assert report is not None and report.kind == kind and report.valid
    assert report.ended == ("budget_closed" if out.shortened else "complete")
    assert engine.generate("Pick:", SamplingParams(max_new_tokens=4, temperature=0)).constraint is None


def test_an_aborted_request_is_reported_aborted(make_engine: Callable[..., Engine]) -> None:
    engine = make_engine()
    outputs = engine.iter_outputs("Story:", SamplingParams(max_new_tokens=400, temperature=0.9, seed=2,
                                                           json_schema=STORY, ignore_eos=False))
    first = next(outputs)
    engine.abort(first.request_id)
    final = next(o for o in outputs if o.finished)
    assert final.finish_reason is FinishReason.ABORT and final.constraint is not None
    assert (final.constraint.ended, final.constraint.valid) == ("aborted", False)


def test_a_forced_tool_call_is_reported_as_one(make_engine: Callable[..., Engine]) -> None:
    from radixgen import tool_formats

    schema = {"type": "object", "properties": {"legs": {"enum": [0, 2, 4]}}, "required": ["legs"],
              "additionalProperties": False}
    structure = {"tool_calls": tool_formats.HERMES.structure([("count_legs", schema)], free_text=False, min_calls=1,
                                                             max_calls=1)}
    engine = make_engine()
    out = engine.generate("Legs:", SamplingParams(max_new_tokens=60, temperature=0, structural=structure))
    report = out.constraint
    _, calls = tool_formats.parse(tool_formats.HERMES, out.text)
    assert report is not None and report.kind == "tool_call" and report.backend in ("xgrammar", "llguidance")
    assert report.valid == (len(calls) == 1 and independently_valid(calls[0].arguments, schema)), out.text
