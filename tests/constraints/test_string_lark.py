"""A root string whose patterns combine under not / oneOf, enforced as one llguidance lexeme."""

from __future__ import annotations

import json
from typing import Any

import jsonschema
import pytest

from radixgen.constraints.string_lark import root_string_lark

STARTS_AND_AVOIDS = {"type": "string", "allOf": [
    {"pattern": "^[ab]"}, {"not": {"pattern": "z$"}}, {"minLength": 3}, {"maxLength": 6}]}
EXACTLY_ONE = {"type": "string", "maxLength": 4, "oneOf": [{"pattern": "^a"}, {"pattern": "b$"}]}
DEFINED = {"type": "string", "allOf": [{"$ref": "#/definitions/digits"}, {"not": {"enum": ["000", "111"]}}],
           "definitions": {"digits": {"pattern": "^[0-9]{3}$"}}}
# a negated length range that no length fits: it excludes nothing
CROSSED = {"type": "string", "minLength": 2, "not": {"minLength": 5, "maxLength": 3}}
# no type, but only a string passes the negated patterns; "defs" is a folder, not a keyword
UNTYPED = {"allOf": [{"$ref": "#/defs/ab"}, {"multipleOf": 7}, {"anyOf": [{"not": {"pattern": "^a"}},
                                                                        {"not": {"pattern": "b$"}}]}],
           "defs": {"ab": {"pattern": "^[ab]+$"}}}


@pytest.mark.parametrize("schema", [
    {"type": "string", "pattern": "^a"},  # the JSON compiler takes it as it is
    {"type": "object", "not": {"required": ["a"]}},
    {"type": "string", "not": {"format": "email"}},  # a keyword outside the string set
    {"anyOf": [{"not": {"pattern": "a"}}, {"type": "number"}]},  # a root that may be a number too
])
def test_other_schemas_keep_the_json_compiler(schema: dict[str, Any]) -> None:
    assert root_string_lark(schema) is None


@pytest.fixture(scope="module")
def llguidance_backend(tokenizer: Any) -> Any:
    from radixgen.constraints import make_backend

    return make_backend("llguidance", tokenizer, 49152, [tokenizer.eos_token_id])


@pytest.mark.parametrize(("schema", "text"), [
    (STARTS_AND_AVOIDS, "abc"), (STARTS_AND_AVOIDS, "abz"), (STARTS_AND_AVOIDS, "ca1"), (STARTS_AND_AVOIDS, "ab"),
    (STARTS_AND_AVOIDS, "bbbbbbb"), (EXACTLY_ONE, "ax"), (EXACTLY_ONE, "xb"), (EXACTLY_ONE, "ab"),
    (EXACTLY_ONE, "xx"), (DEFINED, "123"), (DEFINED, "111"), (DEFINED, "12a"), (UNTYPED, "ab"), (UNTYPED, "ba"),
    (UNTYPED, "aa"), (UNTYPED, "c"), (CROSSED, "ab"), (CROSSED, "abcd"), (CROSSED, "a"),
])
def test_the_lexeme_accepts_exactly_the_schemas_strings(llguidance_backend: Any, tokenizer: Any,
                                                        schema: dict[str, Any], text: str) -> None:
    from radixgen.constraints.spec import ConstraintSpec

    assert root_string_lark(schema) is not None
    matcher = llguidance_backend.compile(ConstraintSpec("json_schema", json.dumps(schema))).matcher()
    accepted = matcher.accept_all(tokenizer.encode(json.dumps(text), add_special_tokens=False)) and matcher.is_completed()
    assert accepted is jsonschema.Draft7Validator(schema).is_valid(text), text


def test_the_auto_backend_sends_such_a_root_to_llguidance(tokenizer: Any) -> None:
    """oneOf alone is inside xgrammar's subset (read as anyOf): the root string goes to llguidance."""
    from radixgen.constraints import make_backend
    from radixgen.constraints.spec import ConstraintSpec

    backend = make_backend("auto", tokenizer, 49152, [tokenizer.eos_token_id])
    assert backend.compile(ConstraintSpec("json_schema", json.dumps(EXACTLY_ONE))).compiled_by == "llguidance"


def test_a_lexeme_too_large_for_the_lexer_is_refused_not_handed_on(tokenizer: Any) -> None:
    """Three negated groups of nine patterns: llguidance's lexer gives up after a few tokens.
    xgrammar, which would take it next, ignores the not entirely (every answer was a
    violation): the schema is refused at compile, naming why."""
    from pathlib import Path

    from radixgen.constraints import make_backend
    from radixgen.constraints.spec import ConstraintSpec
    from radixgen.errors import UnenforceableConstraintError

    path = Path(__file__).resolve().parent.parent / "data" / "maskbench-practice" / "Handwritten---allany17.json"
    schema = json.loads(path.read_text())["schema"]
    backend = make_backend("auto", tokenizer, 49152, [tokenizer.eos_token_id])
    with pytest.raises(UnenforceableConstraintError, match="combined under not / oneOf, are too large to enforce"):
        backend.compile(ConstraintSpec("json_schema", json.dumps(schema)))
