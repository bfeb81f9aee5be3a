"""Which schemas xgrammar enforces exactly (they stream without holding text back for the
validators), and the control-character mask that makes its JSON strings exact."""

from __future__ import annotations

import json
from typing import Any

import numpy as np
import pytest


@pytest.mark.parametrize(("schema", "exact"), [
    ({"type": "object", "properties": {"n": {"type": "integer", "minimum": 1}, "tags": {"type": "array", "items": {
        "enum": ["a", "b"]}, "maxItems": 3}}, "required": ["n"], "additionalProperties": False}, True),
    ({"type": "string", "format": "date"}, False),  # format: a validator's job
    ({"type": "array", "items": {"type": "integer"}, "uniqueItems": True}, False),
    ({"oneOf": [{"type": "integer"}, {"type": "number"}]}, False),  # read as anyOf by xgrammar
    ({"type": "number", "minimum": 0.5}, False),  # fractional bounds
    ({"type": "string", "pattern": "^a+$"}, False),
    ({"type": "object", "required": ["foo"]}, False),  # required but never generated
    ({"type": "object", "properties": {"x": {"type": "string", "format": "email"}}}, False),  # nested
])
def test_which_schemas_xgrammar_enforces_exactly(schema: dict[str, Any], exact: bool) -> None:
    from radixgen.constraints.xgrammar_subset import xgrammar_enforces_exactly

    assert xgrammar_enforces_exactly(schema) is exact


def test_xgrammar_json_never_allows_control_characters(tokenizer: Any) -> None:
    """xgrammar's length-bounded JSON strings take raw control characters, which JSON forbids;
    our backend masks the tokens that carry them."""
    from radixgen.constraints import make_backend
    from radixgen.constraints.spec import ConstraintSpec

    backend = make_backend("xgrammar", tokenizer, 49152, [tokenizer.eos_token_id])
    grammar = backend.compile(ConstraintSpec("json_schema", json.dumps({"type": "string", "maxLength": 8})))
    matcher = grammar.matcher()
    assert matcher.accept(tokenizer.encode('"', add_special_tokens=False)[0])
    mask = np.full((1, 49152 // 32), -1, dtype=np.int32)
    matcher.fill_bitmask(mask, 0)
    allowed = np.unpackbits(mask.view(np.uint8), bitorder="little").astype(bool)
    # byte-level tokens: U+0100 + b stands for the control byte b
    controls = tokenizer.convert_tokens_to_ids([chr(0x100 + b) for b in (0x01, 0x1F)] + ["Ċ", "ĉ"])
    letter = tokenizer.encode("a", add_special_tokens=False)[0]
    assert allowed[letter] and not allowed[controls].any()


@pytest.mark.parametrize(("schema", "within"), [
    ({"type": "string", "pattern": "^[a-z]+$"}, True),
    ({"type": "string", "pattern": "^[a-z]+$", "maxLength": 8}, False),  # xgrammar drops the length
    ({"type": "string", "pattern": "^([0-9]+y)?([0-9]+s)?$"}, False),  # an optional group led by a repeat
    ({"type": "string", "pattern": "^x(a*b)?$"}, False),
    ({"type": "string", "pattern": "^[0-9]+(-[a-z]+)?$"}, True),  # the group's repeat is not first
    ({"type": "string", "pattern": "^(a{1,3}b)?$"}, True),  # a bounded repeat is read right
    ({"type": "string", "pattern": "^(a+b|c)?$"}, True),
])
def test_patterns_xgrammar_reads_loosely_go_elsewhere(schema: dict[str, Any], within: bool) -> None:
    from radixgen.constraints.xgrammar_subset import within_xgrammar_subset

    assert within_xgrammar_subset(schema) is within


@pytest.mark.parametrize("backend_name", ["xgrammar", "auto"])
def test_a_duration_closed_before_its_unit(tokenizer: Any, backend_name: str) -> None:
    """xgrammar's automaton for "^([0-9]+y)?$" takes "12" alone; the auto backend routes the
    pattern to llguidance, which does not (the xgrammar case pins the looseness that routing
    works around: when it is fixed upstream, the route can be dropped)."""
    from radixgen.constraints import make_backend
    from radixgen.constraints.spec import ConstraintSpec

    backend = make_backend(backend_name, tokenizer, 49152, [tokenizer.eos_token_id])
    grammar = backend.compile(ConstraintSpec("json_schema", json.dumps({"type": "string", "pattern": "^([0-9]+y)?$"})))
    matcher = grammar.matcher()
    closed = matcher.accept_all(tokenizer.encode('"12"', add_special_tokens=False))
    assert closed is (backend_name == "xgrammar")


def test_a_length_beside_a_pattern_llguidance_cannot_combine_is_refused_not_loosened(tokenizer: Any) -> None:
    """llguidance cannot intersect this pattern with a 10,000-character minimum; xgrammar, which
    would take it next, drops lengths beside a pattern, and every answer was a short string
    ending in constraint_violation. The schema is refused at compile, naming where and why; a
    length llguidance can combine is still served by it."""
    from radixgen.constraints import make_backend
    from radixgen.constraints.spec import ConstraintSpec
    from radixgen.errors import UnenforceableConstraintError

    backend = make_backend("auto", tokenizer, 49152, [tokenizer.eos_token_id])
    long_pairs = {"type": "object", "properties": {"code": {"type": "string", "pattern": "^([a-z][0-9])+$",
                                                            "minLength": 10000}}}
    with pytest.raises(UnenforceableConstraintError, match=r"\$\.properties\.code bounds a string's length beside"):
        backend.compile(ConstraintSpec("json_schema", json.dumps(long_pairs)))
    short_pairs = {"type": "string", "pattern": "^([a-z][0-9])+$", "minLength": 12}
    assert backend.compile(ConstraintSpec("json_schema", json.dumps(short_pairs))).compiled_by == "llguidance"


def _ref(name: str) -> dict[str, str]:
    return {"$ref": f"#/definitions/{name}"}


def test_an_intersection_of_recursions_llguidance_cannot_unroll_is_refused_not_loosened(tokenizer: Any) -> None:
    """An allOf over recursive definitions whose only answers nest 10 deep (a depth divisible by
    2 and by 5): llguidance, unrolling 8 levels, finds nothing to generate, and xgrammar, next,
    ignored the allOf (the answer was ``{"allOf": []}``, ending in constraint_violation). It is
    refused at compile, naming the allOf and the definitions; an allOf over one recursive
    definition and a plain schema is still served."""
    from radixgen.constraints import make_backend
    from radixgen.constraints.spec import ConstraintSpec
    from radixgen.errors import UnenforceableConstraintError

    backend = make_backend("auto", tokenizer, 49152, [tokenizer.eos_token_id])
    cycle_of = {2: ["x0", "x1"], 5: ["y0", "y1", "y2", "y3", "y4"]}
    definitions: dict[str, Any] = {
        "word": {"type": "object", "properties": {"a": _ref("word")}, "additionalProperties": False}}
    for names in cycle_of.values():
        for i, name in enumerate(names):
            definitions[name] = {"additionalProperties": _ref(names[(i + 1) % len(names)])}
            if i < len(names) - 1:
                definitions[name]["minProperties"] = 1
    puzzle = {"allOf": [_ref("word"), _ref("x0"), _ref("y0")], "definitions": definitions}
    with pytest.raises(UnenforceableConstraintError,
                       match=r"\$\.allOf intersects the recursive definitions #/definitions/word and #/definitions/x0"):
        backend.compile(ConstraintSpec("json_schema", json.dumps(puzzle)))
    tree = {"allOf": [_ref("node"), {"required": ["name"]}], "definitions": {"node": {
        "type": "object", "properties": {"name": {"type": "string"}, "kids": {"type": "array", "items": _ref("node")}}}}}
    assert backend.compile(ConstraintSpec("json_schema", json.dumps(tree))).compiled_by == "llguidance"
