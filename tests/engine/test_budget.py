"""Budget steering: a constrained output is complete and valid within max_new_tokens, or refused
up front when the constraint's shortest output cannot fit."""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jsonschema
import pytest

from radixgen import Engine, FinishReason, SamplingParams
from tests.engine.test_constrained import API_SCHEMAS, REAL_REGEXES, REAL_SCHEMAS

# 'product' (an unbounded string array the model repeats) is the case steering exists for;
# the rest add unbounded strings in nested required objects and pattern strings
BUDGET_SCHEMAS = REAL_SCHEMAS + [a["schema"] for a in API_SCHEMAS if a["name"] == "product"] + [
    {"type": "object", "properties": {
        "component": {"type": "string"}, "severity": {"type": "integer", "minimum": 1, "maximum": 5}},
     "required": ["component", "severity"]},
    {"type": "object", "properties": {
        "summary": {"type": "string"},
        "reporter": {"type": "object", "properties": {"name": {"type": "string"}, "team": {"type": "string"}},
                     "required": ["name", "team"]},
        "steps": {"type": "array", "items": {"type": "string"}}},
     "required": ["summary", "reporter", "steps"]},
    {"type": "object", "properties": {
        "ticket": {"type": "string", "pattern": "^[A-Z]{2,4}-[0-9]{1,5}$"}, "title": {"type": "string"},
        "labels": {"type": "array", "items": {"enum": ["bug", "feature", "docs"]}, "minItems": 1}},
     "required": ["ticket", "title", "labels"]},
]
SHORTEST = re.compile(r"the shortest output the .* allows is (\d+) tokens")


def _refused_below(out: Any, budget: int) -> int | None:
    """The minimum budget a refusal names (None if ``out`` is no refusal)."""
    if out.finish_reason is not FinishReason.ERROR:
        return None
    assert out.user_error, out.error
    match = SHORTEST.search(out.error or "")
    assert match, out.error
    assert int(match.group(1)) > budget, "refused although the shortest output fits"
    assert f"at least {match.group(1)}" in (out.error or ""), "the error says what to raise max_tokens to"
    return int(match.group(1))


@pytest.mark.real_model
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_json_outputs_finish_valid_within_tight_budgets(real_engine: Engine, temperature: float) -> None:
    assert len(BUDGET_SCHEMAS) >= 20
    prompts = [real_engine.apply_chat_template([{"role": "user", "content": f"Reply with a detailed JSON record. Case {i}."}])
               for i in range(len(BUDGET_SCHEMAS))]
    shortened = refused = 0
    before = real_engine.stats_snapshot()
    budgets = (32, 64, 128)
    every = real_engine.generate(prompts * len(budgets), [  # one batch: the longest budget sets the steps
        SamplingParams(max_new_tokens=budget, temperature=temperature, seed=11, json_schema=s)
        for budget in budgets for s in BUDGET_SCHEMAS])
    for k, budget in enumerate(budgets):
        outs = every[k * len(BUDGET_SCHEMAS) : (k + 1) * len(BUDGET_SCHEMAS)]
        for out, schema in zip(outs, BUDGET_SCHEMAS, strict=True):
            if _refused_below(out, budget) is not None:
                refused += 1
                continue
            assert out.finish_reason is FinishReason.STOP, (budget, out.finish_reason, out.text, out.error)
            assert out.completion_tokens <= budget
            jsonschema.validate(json.loads(out.text), schema)
            shortened += out.shortened
        if budget == 32:
            assert sum(o.finish_reason is FinishReason.STOP for o in outs) >= 15, "most schemas fit 32 tokens"
    assert shortened > 0, "tight budgets steer some outputs to close"
    after = real_engine.stats_snapshot()
    assert after["num_shortened"] - before["num_shortened"] == shortened
    assert after["num_constraint_refusals"] - before["num_constraint_refusals"] == refused


@pytest.mark.real_model
def test_regexes_and_choices_match_in_full_at_every_budget(real_engine: Engine) -> None:
    prompt = real_engine.apply_chat_template([{"role": "user", "content": "Answer with something long."}])
    patterns = [*REAL_REGEXES, r"[a-z]+( [a-z]+)*\.", r"(ab)+c"]
    for pattern in patterns:
        budgets = range(1, 15)
        outs = real_engine.generate([prompt] * len(budgets), [
            SamplingParams(max_new_tokens=b, temperature=1.0, seed=b, regex=pattern) for b in budgets])
        named, first_fit = set(), None
        for budget, out in zip(budgets, outs, strict=True):
            refused = _refused_below(out, budget)
            if refused is not None:
                assert first_fit is None, "a larger budget was refused after a smaller one fitted"
                named.add(refused)
                continue
            first_fit = first_fit or budget
            assert out.finish_reason is FinishReason.STOP, (pattern, budget, out.text)
            assert re.fullmatch(pattern, out.text), (pattern, budget, out.text)
        assert first_fit is not None, pattern
        assert named <= {first_fit}, f"{pattern}: refusals named {named}, the smallest budget that fit was {first_fit}"
    choices = ["yes", "no", "it depends on the weather tomorrow"]
    for budget in (1, 2, 3):
        out = real_engine.generate(prompt, SamplingParams(max_new_tokens=budget, temperature=1.0, seed=budget,
                                                          choices=choices))
        assert out.finish_reason is FinishReason.STOP and out.text in choices, out


def test_refusal_names_the_minimum_budget(tiny_engine: Engine) -> None:
    schema = {"type": "object", "properties": {"first_name": {"type": "string", "minLength": 3},
                                               "last_name": {"type": "string"}},
              "required": ["first_name", "last_name"]}
    out = tiny_engine.generate("Person:", SamplingParams(max_new_tokens=4, json_schema=schema))
    minimum = _refused_below(out, 4)
    assert minimum is not None and out.token_ids == []
    at_minimum = tiny_engine.generate("Person:", SamplingParams(max_new_tokens=minimum, temperature=1.0, seed=1,
                                                                json_schema=schema))
    assert at_minimum.finish_reason is FinishReason.STOP and at_minimum.shortened
    jsonschema.validate(json.loads(at_minimum.text), schema)
    assert len(json.loads(at_minimum.text)["first_name"]) >= 3


def test_a_shortest_answer_longer_than_the_start_walks_bound_is_still_found_and_refused(tiny_engine: Engine) -> None:
    """A 90 kB real schema's shortest answer is 18,282 characters, past the start walk's bound:
    no completion was found, so the request was neither refused nor steered and max_tokens cut
    it. The walk is tried once more with a larger bound when it ran out of room."""
    names = [f"field_{i:03d}" for i in range(160)]
    schema = {"type": "object", "properties": {n: {"type": "object", "properties": {
        "code": {"type": "string", "minLength": 100}}, "required": ["code"]} for n in names}, "required": names}
    out = tiny_engine.generate("Record:", SamplingParams(max_new_tokens=512, json_schema=schema))
    minimum = _refused_below(out, 512)
    assert minimum is not None and minimum > 1000 and out.token_ids == []


def test_steering_off_cuts_at_length_and_on_finishes(make_engine: Callable[..., Engine]) -> None:
    """The tiny random model rambles inside strings: the budget-unaware run is cut, the steered
    run ends with a complete value of the same schema."""
    schema = {"type": "object", "properties": {"note": {"type": "string"}, "level": {"type": "integer"}},
              "required": ["note", "level"]}
    params = [SamplingParams(max_new_tokens=20, temperature=1.0, seed=s, json_schema=schema) for s in range(6)]
    plain = make_engine(budget_steering=False).generate(["Note:"] * 6, params)
    steered = make_engine().generate(["Note:"] * 6, params)
    assert any(o.finish_reason is FinishReason.LENGTH for o in plain), [o.text for o in plain]
    for out in steered:
        assert out.finish_reason is FinishReason.STOP, out.text
        jsonschema.validate(json.loads(out.text), schema)
    assert any(o.shortened for o in steered)


def test_a_broken_validator_fails_its_request_only(tiny_engine: Engine) -> None:
    schema = {"type": "object", "properties": {"kind": {"enum": ["cat", "dog"]}}, "required": ["kind"]}

    def broken(value: Any) -> bool:
        raise KeyError("no such field")

    outs = tiny_engine.generate(["Animal:", "Animal:"], [
        SamplingParams(max_new_tokens=30, json_schema=schema, validators={"$.kind": broken}),
        SamplingParams(max_new_tokens=30, json_schema=schema)])
    assert outs[0].finish_reason is FinishReason.CONSTRAINT_VIOLATION
    assert outs[0].error is not None and "KeyError" in outs[0].error and "$.kind" in outs[0].error
    assert outs[1].finish_reason is FinishReason.STOP
    again = tiny_engine.generate("Animal:", SamplingParams(max_new_tokens=30, json_schema=schema))
    assert again.finish_reason is FinishReason.STOP, "the engine keeps serving"


# the issue's schema: 385 = 5 * 7 * 11 is the smallest number that satisfies every branch
COMPOSED_ROOT = {"type": "number", "allOf": [{"minimum": 1}, {"$ref": "#/definitions/any1"},
                                             {"$ref": "#/definitions/any2"}, {"$ref": "#/definitions/any3"}],
                 "definitions": {"any1": {"oneOf": [{"multipleOf": 5}, {"multipleOf": 10}]},
                                 "any2": {"oneOf": [{"not": {"multipleOf": 5}}, {"multipleOf": 7}]},
                                 "any3": {"oneOf": [{"not": {"multipleOf": 7}}, {"multipleOf": 11}]}}}


@pytest.mark.real_model
def test_a_scalar_root_that_fails_its_schema_is_never_a_success(real_engine: Engine) -> None:
    prompt = real_engine.apply_chat_template([{"role": "user", "content": "Give me a number."}])
    outs = real_engine.generate([prompt] * 6, [SamplingParams(max_new_tokens=24, temperature=0.7, seed=s,
                                                              json_schema=COMPOSED_ROOT) for s in range(6)])
    for out in outs:
        assert out.finish_reason in (FinishReason.STOP, FinishReason.CONSTRAINT_VIOLATION), out
        if out.finish_reason is FinishReason.STOP:
            jsonschema.validate(json.loads(out.text), COMPOSED_ROOT)
    rejected = real_engine.generate(prompt, SamplingParams(max_new_tokens=24, temperature=0, json_schema={
        "type": "integer", "minimum": 0, "maximum": 99, "not": {"multipleOf": 1}}, max_validation_retries=2))
    assert rejected.finish_reason is FinishReason.CONSTRAINT_VIOLATION, "no integer is valid: never a stop"


def test_a_fault_applying_one_requests_result_fails_it_alone(make_engine: Callable[..., Engine]) -> None:
    engine = make_engine()
    append = engine.scheduler.appender.append_token

    def faulty(req: Any, *args: Any, **kwargs: Any) -> Any:
        if req.params.seed == 13:
            raise KeyError("boom")
        return append(req, *args, **kwargs)

    engine.scheduler.appender.append_token = faulty  # type: ignore[method-assign]
    outs = engine.generate(["a", "b"], [SamplingParams(max_new_tokens=5, seed=13), SamplingParams(max_new_tokens=5, seed=1)])
    assert outs[0].finish_reason is FinishReason.ERROR and "KeyError" in (outs[0].error or "")
    assert outs[1].finish_reason is FinishReason.LENGTH and len(outs[1].token_ids) == 5
    assert engine.generate("c", SamplingParams(max_new_tokens=3)).finish_reason is FinishReason.LENGTH


def test_budget_state_treats_key_text_as_structure_and_value_text_not() -> None:
    """Inside a value string the cheapest completion cannot change (the walk is skipped); inside a
    key it can (the key picks the property whose value must follow), and so can anything outside
    strings. A wrong reading here let an optional property's key pass unpriced."""
    from radixgen.constraints.budget import BudgetState

    state = BudgetState(is_json=True)
    steps = [('{"', True), ("name", True), ('": "', True), ("some words", False), (" more", False),
             ('", "', True), ("tags", True), ('": ["', True), ("a", False), ('", "', True), ("b", False), ('"]', True)]
    for text, touched in steps:
        assert state.scan(text) is touched, text
    assert state.containers == "{" and not state.in_string
    state.reset('{"a": [{"b": "x')
    assert state.containers == "{[{" and state.in_string and not state.in_key


@pytest.mark.real_model
@pytest.mark.parametrize("budget", [12, 16, 24])
def test_a_pattern_string_closes_within_the_budget(real_engine: Engine, budget: int) -> None:
    """Inside a string under a pattern the completion changes with every character ('"' after
    "-20", '20"' after "-"): steering that kept the one from the string's start let the model run
    past the point where the string could still close ("-20-20-20..." cut at max_tokens)."""
    prompt = real_engine.apply_chat_template([{"role": "user", "content": "Write the number pi with many digits."}])
    schemas = [{"type": "string", "pattern": "^(-20)+$"},
               {"type": "object", "properties": {"p": {"type": "string", "pattern": "^[0-9]+(-20)*$"}},
                "required": ["p"]}]
    outs = real_engine.generate([prompt] * len(schemas), [
        SamplingParams(max_new_tokens=budget, temperature=0, json_schema=s) for s in schemas])
    for out, schema in zip(outs, schemas, strict=True):
        assert out.finish_reason is FinishReason.STOP, (budget, out.text)
        assert out.completion_tokens <= budget
        jsonschema.validate(json.loads(out.text), schema)


PRACTICE = Path(__file__).resolve().parent.parent / "data" / "maskbench-practice"


def _practice_answer(engine: Engine, name: str, max_tokens: int = 512, prompt_chars: int = 6000) -> Any:
    """The practice corpus's generation as benchmarks/eval_schemas.py runs it (greedy)."""
    schema = json.loads((PRACTICE / name).read_text())["schema"]
    prompt = engine.apply_chat_template([{"role": "user", "content": "Produce one JSON document for this schema:\n"
                                                                      + json.dumps(schema, ensure_ascii=False)[:prompt_chars]}])
    return schema, engine.generate(prompt, SamplingParams(max_new_tokens=max_tokens, temperature=0, json_schema=schema))


@pytest.mark.real_model
def test_a_new_array_item_too_costly_to_finish_is_taken_back(real_engine: Engine) -> None:
    """The model repeats an action until late, closes the statement, then opens another one whose
    required fields cost ~60 tokens with ~60 left: steering takes that item back and closes."""
    schema, out = _practice_answer(real_engine, "Github_easy---o26627.json")
    assert out.finish_reason is FinishReason.STOP and out.shortened, (out.finish_reason, out.text[-200:])
    jsonschema.validate(json.loads(out.text), schema)


@pytest.mark.real_model
def test_a_schema_whose_shortest_answer_walks_past_the_usual_bound_is_refused_up_front(real_engine: Engine) -> None:
    """42 required nested objects and an unanchored date pattern: the shortest answer is found
    (it does not fit 512 tokens), so the request is refused before generation, not cut."""
    _, out = _practice_answer(real_engine, "Github_hard---o25886.json", prompt_chars=600)
    needed = _refused_below(out, 512)
    assert needed is not None and needed < 1200
    _, fits = _practice_answer(real_engine, "Github_hard---o25886.json", max_tokens=needed + 40, prompt_chars=600)
    assert fits.finish_reason is FinishReason.STOP, (fits.finish_reason, fits.text[-200:])


@pytest.mark.real_model
def test_a_pattern_with_a_min_length_beside_it_is_completed_and_steered(real_engine: Engine) -> None:
    """A trace id under an unanchored pattern and a minLength of 35: its shortest match alone is
    too short, lengthened in front it fits; before, no completion was found from the start and
    the answer ran to max_tokens unsteered."""
    schema, out = _practice_answer(real_engine, "Github_hard---o79409.json", prompt_chars=1500)
    assert out.finish_reason is FinishReason.STOP, (out.finish_reason, out.text[-200:])
    jsonschema.validate(json.loads(out.text), schema)


@pytest.mark.real_model
def test_a_completion_left_stale_far_from_the_end_is_brought_up_to_date_in_time(real_engine: Engine) -> None:
    """The model opens a test case early and writes one long digit string in it; the completion
    from the start ("{}") was kept until 26 tokens from the end, where closing the case's
    required properties needed 35: the answer was cut."""
    schema, out = _practice_answer(real_engine, "JsonSchemaStore---prometheus.rules.test.json", prompt_chars=2000)
    assert out.finish_reason is FinishReason.STOP and out.shortened, (out.finish_reason, out.text[-200:])
    jsonschema.validate(json.loads(out.text), schema)


@pytest.mark.real_model
def test_an_optional_object_opened_far_from_the_end_is_priced_when_opened(real_engine: Engine) -> None:
    """An optional "properties" object with ~60 required string properties, opened ~400 tokens
    from the end: nothing priced it until the window near the end, where its completion needed
    ~150 tokens with 94 left, and the answer was cut."""
    schema, out = _practice_answer(real_engine, "Github_hard---o56012.json", prompt_chars=2000)
    assert out.finish_reason is FinishReason.STOP, (out.finish_reason, out.text[-200:])
    jsonschema.validate(json.loads(out.text), schema)


@pytest.mark.real_model
@pytest.mark.parametrize("name", ["Handwritten---allany13.json", "Handwritten---string3.json"])
def test_a_string_under_patterns_combined_with_not_is_valid_or_an_error(real_engine: Engine, name: str) -> None:
    """The root string's patterns, combined under not, are one llguidance lexeme. Where its
    derivatives outgrow the lexer mid-answer, llguidance allows only a stop token: that was
    taken as a complete, valid, empty answer. It is an error that says why; otherwise the
    answer is valid (before the lexeme, the xgrammar grammar ignored the not and every answer
    was a violation)."""
    schema, out = _practice_answer(real_engine, name, prompt_chars=2000)
    if out.finish_reason is FinishReason.ERROR:
        assert "automaton failed" in (out.error or ""), out.error
        assert out.constraint is not None and not out.constraint.valid
    else:
        assert out.finish_reason is FinishReason.STOP, (out.finish_reason, out.text[-200:])
        jsonschema.validate(json.loads(out.text), schema)


@pytest.mark.real_model
def test_a_unique_list_the_model_keeps_repeating_is_closed_before_the_repeat(real_engine: Engine) -> None:
    """A uniqueItems list of tags: the model repeats an earlier tag whatever it is given; every
    retry went to the repeat and the answer ended in constraint_violation."""
    schema, out = _practice_answer(real_engine, "JsonSchemaStore---drupal-migration.json", prompt_chars=2000)
    assert out.finish_reason is FinishReason.STOP, (out.finish_reason, out.error, out.text[-200:])
    jsonschema.validate(json.loads(out.text), schema)
    assert out.constraint is not None and out.constraint.searched_values >= 1


@pytest.mark.real_model
@pytest.mark.parametrize("name", ["Handwritten---num4.json", "Handwritten---num5.json"])
def test_a_number_only_odd_multiples_satisfy_is_found_where_the_grammar_allowed_other_types(
        real_engine: Engine, name: str) -> None:
    """An untyped schema whose 'not' lists multipleOf values (num4), and a required property that
    five patternProperties name (num5): the grammar let a string or any value through, the
    validators kept rejecting, and the answer ended in constraint_violation. Typed number and
    checked where the value completes, the number search finds one (-26163)."""
    schema, out = _practice_answer(real_engine, name, prompt_chars=2000)
    assert out.finish_reason is FinishReason.STOP, (out.finish_reason, out.error, out.text[-200:])
    jsonschema.validate(json.loads(out.text), schema)
    assert out.constraint is not None and out.constraint.searched_values >= 1


@pytest.mark.real_model
def test_a_value_that_allof_members_pattern_names_becomes_a_number_where_the_model_wrote_an_array(
        real_engine: Engine) -> None:
    """test.NoType: allOf of two objects whose patternProperties (not disjoint) ask numbers;
    llguidance cannot merge them and xgrammar lets any value through. The model echoed the
    schema, "allOf": [...]; the value was only judged with the whole object and every retry
    wrote another array. Judged where it completes, against both members' patterns, it is
    replaced by the first number they accept."""
    schema, out = _practice_answer(real_engine, "Handwritten---test.NoType.json", prompt_chars=2000)
    assert out.finish_reason is FinishReason.STOP, (out.finish_reason, out.error, out.text[-200:])
    jsonschema.validate(json.loads(out.text), schema)
    assert out.constraint is not None and out.constraint.searched_values >= 1


@pytest.mark.real_model
def test_a_key_the_model_writes_twice_is_resampled_and_the_answer_closes_in_time(real_engine: Engine) -> None:
    """dep6: any value under five one-letter names, three of them at least. The model nests
    objects in a value until budget steering closes them, then reached three keys by writing
    "b" twice; the parsed object had two and the answer ended in constraint_violation."""
    schema, out = _practice_answer(real_engine, "Handwritten---dep6.json", prompt_chars=2000)
    assert out.finish_reason is FinishReason.STOP, (out.finish_reason, out.error, out.text[-200:])
    pairs = json.loads(out.text, object_pairs_hook=lambda kv: kv)
    assert len({k for k, _ in pairs}) == len(pairs), out.text[-200:]
    jsonschema.validate(json.loads(out.text), schema)


@pytest.mark.real_model
def test_an_untyped_string_under_patterns_and_negated_patterns_is_written_by_the_lexeme(
        real_engine: Engine) -> None:
    """string5: no type, four patterns in allOf and an anyOf of negated ones. llguidance's JSON
    compiler could not intersect them, xgrammar let any value through, and the answer ("AllOf")
    ended in constraint_violation. Only a string passes the negations, so the root is read as
    one llguidance lexeme, which solves the patterns."""
    schema, out = _practice_answer(real_engine, "Handwritten---string5.json", prompt_chars=2000)
    assert out.finish_reason is FinishReason.STOP, (out.finish_reason, out.error, out.text[-200:])
    jsonschema.validate(json.loads(out.text), schema)
    assert out.constraint is not None and out.constraint.backend == "llguidance"


@pytest.mark.real_model
def test_a_model_that_keeps_repeating_a_key_has_its_object_closed(real_engine: Engine) -> None:
    """o4249 (a real-world schema with open objects): the model listed "issues" twice in a map
    of names, then kept writing it again; each repeat was resampled until the retries ran out
    and the answer ended in constraint_violation. The second repeat closes the object."""
    schema, out = _practice_answer(real_engine, "Github_hard---o4249.json", prompt_chars=2000)
    assert out.finish_reason is FinishReason.STOP, (out.finish_reason, out.error, out.text[-200:])
    jsonschema.validate(json.loads(out.text), schema)
    pairs: list[list[str]] = []
    json.loads(out.text, object_pairs_hook=lambda kv: pairs.append([k for k, _ in kv]) or dict(kv))
    assert all(len(keys) == len(set(keys)) for keys in pairs), "no object holds a key twice"


@pytest.mark.real_model
def test_an_array_valid_under_two_one_of_branches_is_mended_at_its_last_item(real_engine: Engine) -> None:
    """oneof10_2: exactly one branch holds only where some item lacks "a" and some lacks "b".
    The model's items all held an "a"; the whole array was rolled back (at the root, its first
    token banned) until the retries ran out: constraint_violation. Its last item is now retried
    alone, then searched."""
    schema, out = _practice_answer(real_engine, "Handwritten---oneof10_2.json", prompt_chars=2000)
    assert out.finish_reason is FinishReason.STOP, (out.finish_reason, out.error, out.text[-200:])
    jsonschema.validate(json.loads(out.text), schema)


@pytest.mark.parametrize("backend", ["xgrammar", "llguidance"])
def test_another_item_as_costly_as_the_first_is_priced_at_its_comma(tokenizer: Any, backend: str) -> None:
    """sp_306 at temperature 0.7: array items of ~40 required strings cost ~200 tokens each. The
    first item was priced where it opened; the third opened ~120 tokens from the end, outside
    the window where every opening is priced, and by the time it was priced nothing could close
    it: cut at max_tokens. The comma that starts another item is priced once the tokens left
    come within what the first such comma's completion cost, and taken back there."""
    from types import SimpleNamespace

    from radixgen.constraints import GrammarService, make_backend
    from radixgen.constraints.budget import Completer
    from radixgen.constraints.spec import schema_spec
    from radixgen.constraints.state import ConstraintState
    from radixgen.engine.steering import BudgetSteering

    names = [f"p{i:02d}" for i in range(40)]
    schema = {"type": "array", "items": {"type": "object", "properties": {n: {"type": "string"} for n in names},
                                         "required": names, "additionalProperties": False}}
    item = "{" + ", ".join(f'"{n}": "v"' for n in names) + "}"
    written = tokenizer.encode("[" + item + ", " + item, add_special_tokens=False)
    model = written + tokenizer.encode(", " + item + "]", add_special_tokens=False)
    budget = len(written) + 120
    service = GrammarService(make_backend(backend, tokenizer, 49152, [tokenizer.eos_token_id]))
    spec = schema_spec(schema)
    steering = BudgetSteering(Completer(tokenizer, 49152), tokenizer, margin_tokens=8)
    state = ConstraintState(service.compile(spec).matcher())
    shortest = steering.shortest(state.matcher, None)
    assert shortest is not None
    steering.start(state, spec, shortest, None)
    request = SimpleNamespace(constraint=state)
    output: list[int] = []
    steer = None
    for token in model:
        assert state.matcher.accept(token)
        steer = steering.after_accept(request, token, budget - len(output))  # type: ignore[arg-type]
        if steer is not None:
            break
        output.append(token)
    assert steer is not None and steer.finishes, "the third item was let open"
    assert len(output) == len(written), "taken back at the comma that starts the third item"
    output += steer.token_ids
    assert len(output) <= budget and state.matcher.is_completed()
    answer = json.loads(tokenizer.decode(output))
    assert len(answer) == 2
    jsonschema.validate(answer, schema)
