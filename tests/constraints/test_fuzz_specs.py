"""Random regexes, JSON schemas and sampling parameters: each is accepted or refused with a clear
ValueError, compiles (or fails) within the compile timeout, and never takes the engine down.

The examples are derandomized: the same inputs in every run, so CI cannot fail by luck; change a
strategy (or max_examples) to explore new ones."""

from __future__ import annotations

import json
import math
import time
from collections.abc import Iterator
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from radixgen import Engine, FinishReason, SamplingParams
from radixgen.api.protocol import ChatCompletionRequest, CompletionRequest
from radixgen.constraints import GrammarService, make_backend
from radixgen.constraints.spec import regex_spec, schema_spec

COMPILE_TIMEOUT_S = 10.0
FUZZ = settings(max_examples=60, deadline=None, database=None, derandomize=True, suppress_health_check=list(HealthCheck))

# ---- strategies -----------------------------------------------------------------------

_atoms = st.sampled_from([
    "a", "b", "xyz", ".", r"\d", r"\w", r"\s", "[a-c]", "[^0-9]", "[", "]", "(", ")", r"\\", "\\", "é", "😀",
    r"\b", "^", "$", "(?=a)", r"\1", "(?P<n>a)", "[z-a]", "{", "}",
])
_quantifiers = st.sampled_from(["", "", "*", "+", "?", "{2}", "{1,3}", "{3,1}", "{0,}", "*?", "{1000}", "{99999}"])


@st.composite
def regexes(draw: Any) -> str:
    def piece() -> str:
        return draw(_atoms) + draw(_quantifiers)

    alternatives = [
        "".join(piece() for _ in range(draw(st.integers(1, 4))))
        for _ in range(draw(st.integers(1, 3)))
    ]
    body = "|".join(alternatives)
    return f"({body})" + draw(_quantifiers) if draw(st.booleans()) else body


_scalar_schemas = st.one_of(
    st.fixed_dictionaries({"type": st.sampled_from(["string", "integer", "number", "boolean", "null", "strung"])}),
    st.fixed_dictionaries({"type": st.just("string")}, optional={
        "minLength": st.integers(-1, 20), "maxLength": st.integers(-1, 20),
        "pattern": regexes(), "format": st.sampled_from(["date", "email", "uuid", "date-time", "nope"]),
    }),
    st.fixed_dictionaries({"type": st.sampled_from(["integer", "number"])}, optional={
        "minimum": st.integers(-1000, 1000), "maximum": st.integers(-1000, 1000),
        "exclusiveMinimum": st.integers(-5, 5), "multipleOf": st.sampled_from([0, 1, 2, 0.5, -3]),
    }),
    st.fixed_dictionaries({"enum": st.lists(st.one_of(st.integers(), st.text(max_size=5), st.none()), max_size=4)}),
    st.fixed_dictionaries({"const": st.one_of(st.integers(), st.text(max_size=5))}),
    st.just({"$ref": "#/$defs/missing"}),
    st.just({"not": {}}),
    st.booleans(),
)


def _compound(children: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    names = st.text(st.characters(codec="utf-8", exclude_categories=["Cs"]), min_size=1, max_size=6)
    return st.one_of(
        st.fixed_dictionaries({"type": st.just("object"), "properties": st.dictionaries(names, children, max_size=3)},
                              optional={"required": st.lists(names, max_size=3),
                                        "additionalProperties": st.one_of(st.booleans(), children),
                                        "minProperties": st.integers(0, 3)}),
        st.fixed_dictionaries({"type": st.just("array"), "items": children},
                              optional={"minItems": st.integers(-1, 5), "maxItems": st.integers(-1, 5),
                                        "uniqueItems": st.booleans(), "prefixItems": st.lists(children, max_size=2)}),
        st.fixed_dictionaries({"anyOf": st.lists(children, min_size=0, max_size=3)}),
        st.fixed_dictionaries({"allOf": st.lists(children, min_size=1, max_size=2)}),
        st.fixed_dictionaries({"oneOf": st.lists(children, min_size=1, max_size=2)}),
        st.fixed_dictionaries({"$defs": st.fixed_dictionaries({"node": children}), "$ref": st.just("#/$defs/node")}),
    )


schemas = st.recursive(_scalar_schemas, _compound, max_leaves=8)

_odd_values = st.one_of(st.none(), st.booleans(), st.integers(-(2**70), 2**70),
                        st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=8),
                        st.lists(st.integers(-3, 3), max_size=3), st.dictionaries(st.text(max_size=3), st.integers(), max_size=2))
_param_names = ["max_new_tokens", "temperature", "top_p", "top_k", "min_p", "repetition_penalty", "frequency_penalty",
                "presence_penalty", "seed", "stop", "stop_token_ids", "ignore_eos", "logprobs", "top_logprobs",
                "regex", "choices", "json_object", "max_validation_retries", "prompt_logprob_start", "validators"]


# ---- tests ----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def grammars(tokenizer: Any) -> Iterator[GrammarService]:
    service = GrammarService(make_backend("auto", tokenizer, 49152, [tokenizer.eos_token_id]), timeout_s=COMPILE_TIMEOUT_S)
    yield service
    service.shutdown()


def _compile_or_clear_error(grammars: GrammarService, build: Any, value: Any) -> str:
    """'compiled' or 'refused'; anything else (another exception, a hang) fails the test."""
    try:
        spec = build(value)
    except ValueError as e:
        assert str(e), "a refusal says why"
        return "refused"
    start = time.monotonic()
    try:
        grammars.compile(spec)
    except ValueError as e:
        assert str(e)
        return "refused"
    except TimeoutError:
        pytest.fail(f"compile of {value!r} ran past its {COMPILE_TIMEOUT_S} s timeout without an error")
    finally:
        assert time.monotonic() - start < COMPILE_TIMEOUT_S + 5
    return "compiled"


@FUZZ
@given(pattern=regexes())
def test_random_regexes_compile_or_are_refused_clearly(grammars: GrammarService, pattern: str) -> None:
    _compile_or_clear_error(grammars, regex_spec, pattern)


@FUZZ
@given(schema=schemas)
def test_random_schemas_compile_or_are_refused_clearly(grammars: GrammarService, schema: Any) -> None:
    _compile_or_clear_error(grammars, schema_spec, schema)
    _compile_or_clear_error(grammars, schema_spec, json.dumps(schema))


@settings(max_examples=300, deadline=None, database=None, derandomize=True)
@given(values=st.dictionaries(st.sampled_from(_param_names), _odd_values, max_size=4))
def test_sampling_params_accept_or_raise_a_value_error(values: dict[str, Any]) -> None:
    try:
        params = SamplingParams(**values)
    except ValueError as e:
        assert str(e)
        return
    assert params.max_new_tokens >= 1 and math.isfinite(params.temperature)


@settings(max_examples=200, deadline=None, database=None, derandomize=True)
@given(body=st.dictionaries(st.sampled_from(["model", "messages", "prompt", "max_tokens", "n", "temperature", "stop",
                                             "response_format", "tools", "tool_choice", "stream", "logprobs", "seed"]),
                            _odd_values, max_size=5))
def test_protocol_models_accept_or_raise_a_validation_error(body: dict[str, Any]) -> None:
    for model in (ChatCompletionRequest, CompletionRequest):
        try:
            model.model_validate(body)
        except ValueError as e:  # pydantic's ValidationError is one
            assert str(e)


@pytest.fixture(scope="module")
def fuzz_engine(tiny_model_dir: Any) -> Iterator[Engine]:
    engine = Engine(model=str(tiny_model_dir), kv_cache_tokens=4096, max_context_len=512,
                    grammar_compile_timeout_s=COMPILE_TIMEOUT_S)
    yield engine
    engine.shutdown()


@settings(max_examples=25, deadline=None, database=None, derandomize=True, suppress_health_check=list(HealthCheck))
@given(pattern=regexes(), schema=schemas)
def test_random_constraints_never_take_the_engine_down(fuzz_engine: Engine, pattern: str, schema: Any) -> None:
    for constraint in ({"regex": pattern}, {"json_schema": schema}):
        try:
            params = SamplingParams(max_new_tokens=8, **constraint)
        except ValueError:
            continue
        out = fuzz_engine.generate("Value:", params)
        assert out.finish_reason is not FinishReason.ERROR or out.user_error, out.error
    assert fuzz_engine.generate("still alive", SamplingParams(max_new_tokens=2)).completion_tokens == 2
    accounting = fuzz_engine.kv_accounting()
    assert accounting["held_by_requests"] == 0
