"""What the backends compile: closed objects where closing cannot change a partner's meaning,
and the auto backend's routing between xgrammar and llguidance."""

from __future__ import annotations

import json
from typing import Any

import pytest

from radixgen import tool_formats
from radixgen.constraints import make_backend
from radixgen.constraints.auto_backend import AutoBackend
from radixgen.constraints.schema_rewrite import (
    GrammarOptions,
    close_objects,
    fold_required_branches,
    grammar_schema,
    limit_recursion,
    require_dependents,
    type_object_branches,
)
from radixgen.constraints.spec import regex_spec, schema_spec
from radixgen.constraints.structural import structural_spec
from radixgen.constraints.xgrammar_subset import within_xgrammar_subset
from radixgen.errors import InvalidConstraintError

PERSON = {"type": "object", "properties": {"name": {"type": "string"}}, "required": ["name"]}


def test_declared_properties_close_an_object_and_everything_else_is_left_alone() -> None:
    closed = close_objects({"type": "object", "properties": {
        "person": PERSON, "any": {"type": "object"}, "open": {**PERSON, "additionalProperties": True},
        "tuple": {"type": "array", "prefixItems": [{"type": "integer"}]},
        "pick": {"anyOf": [PERSON, {"type": "null"}]}}})
    props = closed["properties"]
    assert closed["additionalProperties"] is False and props["person"]["additionalProperties"] is False
    assert "additionalProperties" not in props["any"], '{"type": "object"} means any object'
    assert props["open"]["additionalProperties"] is True, "the caller's choice stands"
    assert props["tuple"]["items"] is False
    assert props["pick"]["anyOf"][0]["additionalProperties"] is False, "an alternative is a whole instance"
    assert "additionalProperties" not in PERSON, "the caller's schema is not touched"


@pytest.mark.parametrize("schema", [
    {"allOf": [PERSON, {"properties": {"age": {"type": "integer"}}}]},
    {"properties": {"a": {"type": "integer"}}, "anyOf": [PERSON, {"required": ["a"]}]},
    {"not": PERSON},
    {"$defs": {"p": PERSON}, "$ref": "#/$defs/p", "properties": {"age": {"type": "integer"}}},
    {**PERSON, "unevaluatedProperties": False, "allOf": [{"properties": {"x": {}}}]},
])
def test_schemas_read_together_with_partners_are_not_closed(schema: dict[str, Any]) -> None:
    assert close_objects(schema) == schema


def test_plain_references_are_closed_and_open_objects_are_a_choice() -> None:
    schema = {"$defs": {"p": PERSON}, "type": "object", "properties": {"who": {"$ref": "#/$defs/p",
                                                                               "description": "a person"}}}
    assert grammar_schema(schema)["$defs"]["p"]["additionalProperties"] is False
    assert "additionalProperties" not in grammar_schema(schema, GrammarOptions(open_objects=True))["$defs"]["p"]


@pytest.mark.parametrize(("schema", "inside"), [
    (PERSON, True),
    ({"type": "object", "properties": {"tags": {"type": "array", "items": {"enum": ["a", "b"]}}}}, True),
    ({"anyOf": [PERSON, {"type": "null"}]}, True),
    ({"properties": {"a": {"type": "integer"}}}, False),  # no type: xgrammar would allow only objects
    ({"type": "object", "properties": {"k": {"const": {"a": 1}}}}, False),
    ({"type": "object", "patternProperties": {"^x": {"type": "integer"}}}, False),
    ({"type": "array", "items": False, "prefixItems": [False]}, False),
    ({"type": "number", "enum": [1.5]}, False),
])
def test_the_xgrammar_subset(schema: dict[str, Any], inside: bool) -> None:
    assert within_xgrammar_subset(schema) is inside


def test_auto_routes_each_spec_and_falls_back_when_a_backend_refuses(tokenizer: Any) -> None:
    backend = make_backend("auto", tokenizer, 49152, [tokenizer.eos_token_id])
    assert isinstance(backend, AutoBackend)
    assert [b.name for b in backend.choose(schema_spec(PERSON))] == ["xgrammar", "llguidance"]
    assert [b.name for b in backend.choose(schema_spec({"properties": {}}))] == ["llguidance", "xgrammar"]
    assert backend.choose(regex_spec("[a-z]+"))[0].name == "xgrammar"
    # tool calls: to llguidance when any tool's arguments are outside xgrammar's subset
    calls = tool_formats.HERMES.structure([("a", PERSON), ("b", {"type": "object"})], free_text=True, min_calls=0,
                                          max_calls=None)
    assert backend.choose(structural_spec({"tool_calls": calls}))[0].name == "xgrammar"
    calls["calls"][1]["schema"] = {"properties": {}}
    assert backend.choose(structural_spec({"tool_calls": calls}))[0].name == "llguidance"
    assert backend.compile(structural_spec({"tool_calls": calls})).matcher() is not None
    # llguidance refuses overlapping patternProperties; xgrammar takes the schema, validators do the rest
    overlapping = {"type": "object", "patternProperties": {"a*": {"type": "integer"}, "aaa*": {"maximum": 20}}}
    with pytest.raises(Exception, match="disjoint"):
        backend.backends["llguidance"].compile(schema_spec(overlapping))
    assert backend.compile(schema_spec(overlapping)).matcher() is not None


TREE = {"$defs": {"node": {"type": "object", "properties": {
    "value": {"type": "integer"}, "children": {"type": "array", "items": {"$ref": "#/$defs/node"}}},
    "required": ["value"]}}, "$ref": "#/$defs/node"}


def test_recursion_is_unrolled_to_the_depth_cap_and_closed_after_it() -> None:
    import jsonschema

    limited = limit_recursion(TREE, 3)
    assert "node" not in limited["$defs"] and {"node@1", "node@2", "node@3"} <= limited["$defs"].keys()
    assert limited["$defs"]["node@3"]["properties"]["children"]["items"] is False, "the last level has no children"

    def tree(depth: int) -> dict[str, Any]:
        return {"value": depth, "children": [tree(depth - 1)] if depth > 1 else []}

    jsonschema.validate(tree(3), limited)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(tree(4), limited)
    jsonschema.validate(tree(9), TREE)  # the caller's schema (the validators' view) is untouched
    linked = {"type": "object", "properties": {"next": {"anyOf": [{"$ref": "#"}, {"type": "null"}]}}}
    cut = limit_recursion(linked, 2)
    jsonschema.validate({"next": {"next": None}}, cut)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate({"next": {"next": {"next": None}}}, cut)
    flat = {"$defs": {"a": {"type": "string"}}, "properties": {"x": {"$ref": "#/$defs/a"}}}
    assert limit_recursion(flat, 2) == flat, "definitions without a cycle are left alone"


def test_a_recursive_schema_generates_within_its_cap(tokenizer: Any) -> None:
    backend = make_backend("auto", tokenizer, 49152, [tokenizer.eos_token_id], options=GrammarOptions(max_recursion_depth=2))
    matcher = backend.compile(schema_spec(TREE)).matcher()
    deep = '{"value": 1, "children": [{"value": 2, "children": [{"value": 3'
    ids = tokenizer.encode(deep, add_special_tokens=False)
    assert not all(matcher.accept(t) for t in ids), "a third level is past the cap"


def _accepts(grammar: Any, tokenizer: Any, text: str) -> bool:
    matcher = grammar.matcher()
    ids = tokenizer.encode(text, add_special_tokens=False)
    return all(matcher.accept(i) for i in ids) and bool(matcher.accept(tokenizer.eos_token_id))


def test_required_properties_are_declared_where_nothing_reads_the_undeclared_ones() -> None:
    import jsonschema

    from radixgen.constraints.schema_rewrite import declare_required

    schema = {"type": "object", "properties": {"a": {"type": "string"}}, "required": ["a", "b"],
              "items": {"type": "object", "required": ["c"]}}
    rewritten = declare_required(schema)
    assert rewritten["properties"] == {"a": {"type": "string"}, "b": {}}
    assert rewritten["items"]["properties"] == {"c": {}}
    guarded = {"type": "object", "required": ["b"], "additionalProperties": {"type": "integer"}}
    assert declare_required(guarded) == guarded, "b's value is additionalProperties' to check"
    for instance in ({"a": "x", "b": 1}, {"a": "x"}, {"b": [1]}, {"a": 2, "b": None}, "text"):
        assert jsonschema.Draft202012Validator(schema).is_valid(instance) == \
            jsonschema.Draft202012Validator(rewritten).is_valid(instance), instance


@pytest.mark.parametrize("backend", ["xgrammar", "llguidance"])
def test_a_required_property_the_schema_does_not_declare_is_generated_and_required(tokenizer: Any,
                                                                                    backend: str) -> None:
    """Closing the object forbade it (xgrammar could not write the valid answer, llguidance
    refused the schema as unsatisfiable); and a grammar that did not require it let the model
    copy the schema back ({"type": "object"}) for the validators to reject."""
    engine = make_backend(backend, tokenizer, len(tokenizer), [tokenizer.eos_token_id])
    grammar = engine.compile(schema_spec({"type": "object", "properties": {"a": {"type": "string"}},
                                          "required": ["a", "b"]}))
    assert _accepts(grammar, tokenizer, '{"a": "x", "b": 1}')
    for copied in ('{"a": "x"}', '{"type": "object"}', "{}"):
        assert not _accepts(grammar, tokenizer, copied), copied
    bare = engine.compile(schema_spec({"type": "object", "required": ["name", "age"]}))
    assert _accepts(bare, tokenizer, '{"name": "Ann", "age": 3}')
    assert not _accepts(bare, tokenizer, '{"type": "object"}')


@pytest.mark.parametrize("schema", [
    {"allOf": [{"type": "object", "properties": {"a": {"type": "string"}}, "required": ["a"]},
               {"not": {"required": ["b"]}}]},
    {"type": "object", "allOf": [{"patternProperties": {"^p": {"type": "string"}}}, {"not": {"required": ["q"]}}]},
])
def test_xgrammar_keeps_the_root_type_of_a_schema_it_cannot_read_whole(tokenizer: Any, schema: dict[str, Any]) -> None:
    """A root allOf made xgrammar accept any JSON: a string or an array where an object was
    required, for the validators to reject five times. Folded and stripped of what it cannot
    read, the root stays an object; the validators check the rest."""
    grammar = make_backend("xgrammar", tokenizer, len(tokenizer), [tokenizer.eos_token_id]).compile(
        schema_spec(schema))
    assert not grammar.enforces_schema_exactly
    for not_an_object in ('"python: [https://x]"', '[{"type": "object"}]', "[]", "12"):
        assert not _accepts(grammar, tokenizer, not_an_object), not_an_object
    assert _accepts(grammar, tokenizer, '{"a": "x"}' if "a" in json.dumps(schema) else '{"p1": "x"}')


@pytest.mark.parametrize("backend", ["xgrammar", "llguidance"])
def test_a_recursive_root_is_closed_at_every_level_and_past_the_cap(tokenizer: Any, backend: str) -> None:
    """The root of a schema that references itself is a $ref beside its definitions; read as a
    $ref with partners it was left open, and the model wrote keys of its own at the top
    ('{"pi": 3}' for a schema declaring only "d2n"); at the recursion cap, where the recursive
    property drops out, the object read as any object."""
    options = GrammarOptions(max_recursion_depth=2)
    engine = make_backend(backend, tokenizer, len(tokenizer), [tokenizer.eos_token_id], options=options)
    grammar = engine.compile(schema_spec({"type": "object", "properties": {"d2n": {"$ref": "#"}}}))
    assert _accepts(grammar, tokenizer, '{"d2n": {}}') and _accepts(grammar, tokenizer, "{}")
    for loose in ('{"pi": 3}', '{"d2n": {"pi": 3}}', '{"d2n": {"d2n": {}}}'):  # two levels: the root and one more
        assert not _accepts(grammar, tokenizer, loose), loose


def test_a_schema_whose_required_recursion_never_ends_is_refused_saying_why(tokenizer: Any) -> None:
    from radixgen.errors import InvalidConstraintError

    engine = make_backend("llguidance", tokenizer, len(tokenizer), [tokenizer.eos_token_id])
    endless = {"type": "object", "properties": {"d2n": {"$ref": "#"}}, "required": ["d2n"]}
    with pytest.raises(InvalidConstraintError, match="make the recursive property optional or nullable"):
        engine.compile(schema_spec(endless))


def test_an_object_whose_dependent_schemas_name_only_its_own_properties_is_closed() -> None:
    """A dependent schema read with its object kept the object open, and the model filled it
    with keys of its own ('{", d2n": ...}'); closing is safe where every dependent schema only
    constrains properties the object declares."""
    plain = {"type": "object", "properties": {"card": {"type": "string"}, "cvv": {"type": "string"}},
             "dependentSchemas": {"card": {"required": ["cvv"]}}}
    assert grammar_schema(plain)["additionalProperties"] is False
    adds = {"type": "object", "properties": {"card": {"type": "string"}},
            "dependentSchemas": {"card": {"properties": {"billing": {"type": "string"}}, "required": ["billing"]}}}
    assert "additionalProperties" not in grammar_schema(adds), "closing would forbid what the dependent requires"
    branching = {"type": "object", "properties": {"a": {}}, "dependentSchemas": {"a": {"anyOf": [{"required": ["a"]}]}}}
    assert "additionalProperties" not in grammar_schema(branching)


MATERIAL = {"definitions": {
    "solid": {"properties": {"type": {"enum": ["solid"]}, "colour": {"type": "string"}}, "required": ["type", "colour"],
              "additionalProperties": False},
    "texture": {"properties": {"type": {"enum": ["texture"]}, "path": {"type": "string"}}, "required": ["type", "path"],
                "additionalProperties": False}},
    "type": "object", "properties": {"material": {"oneOf": [{"$ref": "#/definitions/solid"},
                                                            {"$ref": "#/definitions/texture"}]}},
    "required": ["material"]}


@pytest.mark.parametrize("backend", ["xgrammar", "llguidance"])
def test_oneof_branches_that_only_say_object_keywords_are_typed_object(tokenizer: Any, backend: str) -> None:
    """A string passes both untyped branches at once, so it fails the oneOf: the grammar (oneOf
    read as anyOf) must not offer it, and every object it offered before it still offers."""
    import jsonschema

    rewritten = type_object_branches(MATERIAL)
    assert [b["type"] for b in rewritten["properties"]["material"]["oneOf"]] == ["object", "object"]
    one_untyped = {"oneOf": [{"properties": {"a": {}}}, {"type": "string"}]}  # a string passes one branch
    assert type_object_branches(one_untyped) == one_untyped
    grammar = make_backend(backend, tokenizer, 49152, [tokenizer.eos_token_id]).compile(schema_spec(MATERIAL))

    def accepts(text: str) -> bool:
        matcher = grammar.matcher()
        return all(matcher.accept(t) for t in tokenizer.encode(text, add_special_tokens=False)) and matcher.accept(
            tokenizer.eos_token_id)

    for text, valid in (('{"material": ""}', False), ('{"material": 0}', False),
                        ('{"material": {"type": "solid", "colour": "red"}}', True)):
        assert valid == jsonschema.Draft7Validator(MATERIAL).is_valid(json.loads(text))
        assert accepts(text) == valid, text


def test_oneof_branches_of_one_other_types_keywords_are_typed_too() -> None:
    """The practice schema oneOf [items pattern a, items pattern b, items pattern a|b|c]: the model
    wrote a string, which passes all three branches (constraint_violation at temperature 0.7)."""
    import jsonschema

    patterns = {"oneOf": [{"items": {"pattern": "a"}}, {"items": {"pattern": "b"}}, {"items": {"pattern": "a|b|c"}}],
                "minItems": 2}
    assert [b["type"] for b in type_object_branches(patterns)["oneOf"]] == ["array"] * 3
    bounds = {"oneOf": [{"minimum": 5}, {"maximum": 3}, {"type": "string"}]}
    assert [b.get("type") for b in type_object_branches(bounds)["oneOf"]] == ["number", "number", "string"]
    mixed = {"oneOf": [{"items": {"type": "string"}}, {"properties": {"a": {}}}]}  # an object passes one branch
    assert type_object_branches(mixed) == mixed
    for schema in (patterns, bounds):  # no valid value is lost
        for value in ("x", 4, 7, ["c", "a"], ["a", "b"], ["a", "a"], {"a": 1}):
            if jsonschema.Draft7Validator(schema).is_valid(value):
                assert jsonschema.Draft7Validator(type_object_branches(schema)).is_valid(value), (schema, value)
    assert not jsonschema.Draft7Validator({"anyOf": type_object_branches(patterns)["oneOf"]}).is_valid("x")


def test_a_required_propertys_dependents_are_required_in_the_grammar(tokenizer: Any) -> None:
    from radixgen.errors import InvalidConstraintError

    schema = {"type": "object", "properties": {"x": {"type": "integer"}, "a": {"type": "string"}, "b": {}},
              "required": ["x"], "dependentRequired": {"x": ["a"]}, "dependentSchemas": {"a": {"required": ["b"]}}}
    assert require_dependents(schema)["required"] == ["x", "a", "b"]
    optional = {**schema, "required": []}
    assert require_dependents(optional) == optional, "an optional trigger is the validators' to check"
    # each level requires the next through a draft-07 dependency: no finite instance exists, and
    # the grammar now says so at compile instead of the answer ending in a violation
    endless = {"$schema": "http://json-schema.org/draft-07/schema#", "type": "object",
               "properties": {"a": {"$ref": "#"}, "x": {"type": "integer"}}, "required": ["x"],
               "dependencies": {"x": {"required": ["a"]}}}
    for backend in ("xgrammar", "llguidance", "auto"):
        with pytest.raises(InvalidConstraintError):
            make_backend(backend, tokenizer, 49152, [tokenizer.eos_token_id]).compile(schema_spec(endless))


WEBHOOK = {"type": "object", "additionalProperties": False,
           "properties": {"content": {"type": "string"}, "embeds": {"type": "array", "items": {"type": "string"}},
                          "tts": {"type": "boolean"}},
           "anyOf": [{"required": ["content"]}, {"required": ["embeds"]}]}


@pytest.mark.parametrize("backend", ["xgrammar", "llguidance"])
def test_required_only_branches_carry_the_objects_own_keywords(tokenizer: Any, backend: str) -> None:
    """"content or embeds" beside additionalProperties false: xgrammar read the bare
    {"required": ["content"]} branch as any object with that key and let a "description"
    through, which the validators then refused at every retry."""
    import jsonschema

    branches = fold_required_branches(WEBHOOK)["anyOf"]
    assert [b["required"] for b in branches] == [["content"], ["embeds"]]
    assert all(b["additionalProperties"] is False and b["properties"] == WEBHOOK["properties"] for b in branches)
    grammar = make_backend(backend, tokenizer, 49152, [tokenizer.eos_token_id]).compile(schema_spec(WEBHOOK))

    def accepts(text: str) -> bool:
        matcher = grammar.matcher()
        return matcher.accept_all(tokenizer.encode(text, add_special_tokens=False)) and matcher.is_completed()

    for text in ('{"content": "hi", "description": "x"}', '{"content": "hi", "tts": true}', '{"tts": true}',
                 '{"embeds": ["a"]}'):
        assert accepts(text) == jsonschema.Draft7Validator(WEBHOOK).is_valid(json.loads(text)), text


DATA_ELEMENT = {"type": "object", "oneOf": [
    {"required": ["code", "usages"]},
    {"allOf": [{"not": {"required": ["usages"]}}, {"required": ["code", "format"]}]}],
    "properties": {"code": {"type": "integer"}, "format": {"type": "string"}, "usages": {"type": "array"}},
    "additionalProperties": False}


def test_branches_that_only_say_which_properties_are_present_or_absent_are_folded() -> None:
    """The second branch of a real schema's oneOf (allOf of not-required and required) kept
    xgrammar from folding the object's keywords into the branches; it read that branch as any
    object and wrote "code": "custom" where code is an integer (constraint_violation at
    temperature 0.7). Such a branch folds too, without the property it requires absent."""
    import jsonschema

    branches = fold_required_branches(grammar_schema(DATA_ELEMENT))["oneOf"]
    assert [b["required"] for b in branches] == [["code", "usages"], ["code", "format"]]
    assert "usages" in branches[0]["properties"] and "usages" not in branches[1]["properties"]
    assert branches[1]["properties"]["code"]["type"] == "integer"
    for text in ('{"code": 1, "format": "x"}', '{"code": 1, "usages": []}', '{"code": 1, "format": "x", "usages": []}',
                 '{"code": "custom", "format": "x"}', '{"format": "x"}'):
        instance = json.loads(text)
        accepted = [jsonschema.Draft7Validator(b).is_valid(instance) for b in branches]
        assert any(accepted) == jsonschema.Draft7Validator(DATA_ELEMENT).is_valid(instance), text


TARGET_SIZE = {"type": "object", "properties": {"type": {"enum": ["fixed", "maxAvailable"]}}, "required": ["type"],
               "allOf": [{"if": {"properties": {"type": {"const": "fixed"}}}, "then": {"$ref": "#/$defs/fixed"}},
                         {"if": {"properties": {"type": {"const": "maxAvailable"}}}, "then": {"$ref": "#/$defs/most"}}],
               "$defs": {"fixed": {"type": "object", "properties": {"type": {}, "size": {"type": "integer"}},
                                   "required": ["size"], "additionalProperties": False},
                         "most": {"type": "object", "properties": {"type": {}}, "additionalProperties": False}}}


@pytest.mark.parametrize("backend", ["auto", "llguidance"])
def test_conditions_on_a_listed_property_become_branches_the_grammar_enforces(tokenizer: Any, backend: str) -> None:
    """if type is "fixed" then a size, if "maxAvailable" then nothing else: the backends leave
    if / then out, and the model wrote a "fixed" target with the schema's own keywords in it."""
    import jsonschema

    from radixgen.constraints.schema_rewrite import discriminated_conditions

    rewritten = discriminated_conditions(TARGET_SIZE)
    assert "allOf" not in rewritten and len(rewritten["anyOf"]) == 2
    assert discriminated_conditions({**TARGET_SIZE, "required": []}) == {**TARGET_SIZE, "required": []}  # not exhaustive
    grammar = make_backend(backend, tokenizer, 49152, [tokenizer.eos_token_id]).compile(schema_spec(TARGET_SIZE))

    def accepts(text: str) -> bool:
        matcher = grammar.matcher()
        return matcher.accept_all(tokenizer.encode(text, add_special_tokens=False)) and matcher.is_completed()

    for text in ('{"type": "fixed", "size": 256}', '{"type": "fixed", "description": "x"}', '{"type": "fixed"}',
                 '{"type": "maxAvailable"}', '{"type": "maxAvailable", "size": 1}'):
        assert accepts(text) == jsonschema.Draft202012Validator(TARGET_SIZE).is_valid(json.loads(text)), text


ELM = {"$schema": "http://json-schema.org/draft-07/schema#",
       "definitions": {"package": {"type": "object", "properties": {"type": {}, "name": {"type": "string"}},
                                   "required": ["name"], "additionalProperties": False},
                       "application": {"type": "object", "properties": {"type": {}, "elm": {"type": "integer"}},
                                       "required": ["elm"], "additionalProperties": False}},
       "properties": {"type": {"type": "string", "enum": ["application", "package"]}}, "required": ["type"],
       "if": {"properties": {"type": {"enum": ["package"]}}}, "then": {"$ref": "#/definitions/package"},
       "else": {"if": {"properties": {"type": {"enum": ["application"]}}},
                "then": {"$ref": "#/definitions/application"}, "else": {}}}


@pytest.mark.parametrize("backend", ["auto", "llguidance"])
def test_an_untyped_root_under_object_conditions_is_an_object_whose_chain_becomes_branches(
        tokenizer: Any, backend: str) -> None:
    """elm.json's root has no type, and its if / else-if chain picks an object schema by the
    required "type": a string passes the if and fails the then, so only objects are valid. The
    grammar, which leaves if / then out, offered "a string"; now it offers exactly the objects."""
    import jsonschema

    from radixgen.constraints.schema_rewrite import grammar_schema, type_by_conditions

    assert type_by_conditions(ELM)["type"] == "object"
    for left in ({**ELM, "then": {"type": "string"}}, {**ELM, "if": {"minLength": 2}}, {**ELM, "type": "array"}):
        assert type_by_conditions(left).get("type") == left.get("type"), "a then that is no object, an if a string can fail"
    rewritten = grammar_schema(ELM)
    assert rewritten["type"] == "object" and "if" not in rewritten and len(rewritten["anyOf"]) == 2
    unlisted = {**ELM, "properties": {"type": {"enum": ["application", "package", "other"]}}}
    assert "if" in grammar_schema(unlisted), "a value no condition tests: the chain's empty else is reachable"
    grammar = make_backend(backend, tokenizer, 49152, [tokenizer.eos_token_id]).compile(schema_spec(ELM))

    def accepts(text: str) -> bool:
        matcher = grammar.matcher()
        return matcher.accept_all(tokenizer.encode(text, add_special_tokens=False)) and matcher.is_completed()

    for text in ('"elm"', '{"type": "package", "name": "x"}', '{"type": "package", "elm": 1}',
                 '{"type": "application", "elm": 19}', '{"type": "application", "name": "x"}', '{"type": "other"}'):
        assert accepts(text) == jsonschema.Draft7Validator(ELM).is_valid(json.loads(text)), text


def test_a_negation_of_one_type_s_keywords_types_the_schema() -> None:
    """Every non-number passes {anyOf: [{multipleOf: 2}, {multipleOf: 5}]} and so fails its
    negation: the schema is typed number. A oneOf of two such branches, keywords of two types, or
    an empty negation tell nothing of the sort; each rewrite keeps exactly the valid instances."""
    import jsonschema

    from radixgen.constraints.schema_rewrite import type_by_negation

    odd = {"not": {"anyOf": [{"multipleOf": 2}, {"allOf": [{"multipleOf": 5}, {"maximum": 100}]}]}, "minimum": 1}
    assert type_by_negation(odd) == {**odd, "type": "number"}
    short = {"not": {"minLength": 3, "pattern": "^a"}}
    assert type_by_negation(short)["type"] == "string"
    for untouched in ({"not": {"oneOf": [{"multipleOf": 2}, {"multipleOf": 3}]}},
                      {"not": {"anyOf": [{"multipleOf": 2}, {"minLength": 3}]}},
                      {"not": {}}, {"not": {"type": "string"}}, {"type": "integer", "not": {"multipleOf": 2}}):
        assert type_by_negation(untouched) == untouched, untouched
    for schema in (odd, short):
        rewritten = type_by_negation(schema)
        for instance in (3, 4, 7.5, 120, -5, "abc", "xy", "zzzz", [], {}, None, True):
            assert jsonschema.Draft202012Validator(schema).is_valid(instance) == \
                jsonschema.Draft202012Validator(rewritten).is_valid(instance), (schema, instance)


def test_an_untyped_all_of_takes_the_type_of_a_member_of_one_type() -> None:
    """A value of another type fails that member: the rewrite keeps exactly the valid instances
    (string5's root: patterns, and an anyOf of negated patterns that only strings can pass)."""
    import jsonschema

    from radixgen.constraints.schema_rewrite import type_by_members, type_by_negation

    patterns = {"allOf": [{"$ref": "#/defs/p"}, {"multipleOf": 7},
                          {"anyOf": [{"not": {"pattern": "^a"}}, {"not": {"pattern": "b$"}}]}],
                "defs": {"p": {"pattern": "^[ab]+$"}}}
    assert type_by_members(type_by_negation(patterns))["type"] == "string"
    referenced = {"allOf": [{"$ref": "#/$defs/word"}, {"minProperties": 1}],
                  "$defs": {"word": {"type": "object", "properties": {"a": {"$ref": "#/$defs/word"}}}}}
    assert type_by_members(referenced)["type"] == "object"
    listed = {"allOf": [{"oneOf": [{"type": "integer", "minimum": 3}, {"type": ["integer"], "maximum": 0}]}]}
    assert type_by_members(listed)["type"] == "integer"
    for untouched in ({"allOf": [{"type": "string"}, {"type": "number"}]},  # nothing passes: left alone
                      {"allOf": [{"anyOf": [{"type": "string"}, {"type": "number"}]}]},
                      {"allOf": [{"pattern": "^a"}, {"minimum": 3}]},
                      {"type": "string", "allOf": [{"type": "string"}]}):
        assert type_by_members(untouched) == untouched, untouched
    for schema in (patterns, referenced, listed):
        rewritten = type_by_members(type_by_negation(schema))
        for instance in ("ab", "ba", "aab", "c", 7, 14, 0, -1, 3, [], {}, {"a": {}}, None, True):
            assert jsonschema.Draft202012Validator(schema).is_valid(instance) == \
                jsonschema.Draft202012Validator(rewritten).is_valid(instance), (schema, instance)


def test_a_required_property_named_by_patterns_is_declared_with_their_schemas() -> None:
    from radixgen.constraints.schema_rewrite import declare_required

    schema = {"type": "object", "required": ["ab1", "zz"],
              "patternProperties": {"a": {"type": "integer"}, "b": {"minimum": 0}, "[": {"type": "string"}}}
    assert declare_required(schema)["properties"] == {"ab1": {}, "zz": {}}, "an unreadable pattern: left undeclared"
    schema["patternProperties"].pop("[")
    assert declare_required(schema)["properties"] == {"ab1": {"allOf": [{"type": "integer"}, {"minimum": 0}]},
                                                      "zz": {}}


@pytest.mark.parametrize("backend", ["xgrammar", "llguidance"])
def test_literals_outside_their_type_are_never_written(tokenizer: Any, backend: str) -> None:
    """A real schema typed a property ``object`` beside string enum members: the backends wrote
    a member, the validator rejected it, and every retry wrote one again (constraint_violation at
    temperature 0.7). Members outside the type are dropped; a property left with none is not
    generated; a required one leaves the object with no answer."""
    engine = make_backend(backend, tokenizer, len(tokenizer), [tokenizer.eos_token_id])
    schema = {"type": "object", "properties": {
        "builtin": {"enum": ["MODIFIABLE", "DELETABLE"], "type": "object"},
        "mode": {"type": ["string", "null"], "enum": ["fast", 1, None, True]},
        "count": {"type": "integer"}}}
    grammar = engine.compile(schema_spec(schema))
    assert _accepts(grammar, tokenizer, '{"mode": null, "count": 1}')
    assert _accepts(grammar, tokenizer, '{"mode": "fast"}')
    for outside in ('{"builtin": "MODIFIABLE"}', '{"mode": 1}', '{"mode": true}'):
        assert not _accepts(grammar, tokenizer, outside), outside
    with pytest.raises(InvalidConstraintError, match="no value satisfies the json schema"):
        engine.compile(schema_spec({"type": "object", "properties": {"k": {"const": "X", "type": "object"}},
                                    "required": ["k"]}))


@pytest.mark.parametrize("backend", ["auto", "xgrammar", "llguidance"])
def test_a_root_pinned_to_literals_writes_those_its_other_keywords_accept(tokenizer: Any, backend: str) -> None:
    """The practice schema ``allOf: [{enum: [1e+308]}, {not: ...}]``: llguidance (which the not
    chose) wrote the literal as a 309-digit integer, unequal to the float, and every answer ended
    in constraint_violation. A root pinned by enum / const compiles as the literals the whole
    schema accepts, which auto sends to xgrammar; none accepted is refused at compile."""
    engine = make_backend(backend, tokenizer, len(tokenizer), [tokenizer.eos_token_id])
    letters = engine.compile(schema_spec({"enum": ["a", "b", "c"], "not": {"const": "b"}}))
    assert _accepts(letters, tokenizer, '"a"') and _accepts(letters, tokenizer, '"c"')
    assert not _accepts(letters, tokenizer, '"b"')
    huge = engine.compile(schema_spec({"allOf": [{"enum": [1e308]}, {"not": {"type": "string"}}]}))
    assert _accepts(huge, tokenizer, "1e+308") is (backend != "llguidance")
    with pytest.raises(InvalidConstraintError, match="no value satisfies"):
        engine.compile(schema_spec({"const": 3, "type": "string"}))


USAGE_TREE = {"type": "object", "properties": {"fields": {"type": "array", "items": {"$ref": "#/definitions/el"}}},
              "definitions": {
                  "el": {"type": "object", "properties": {
                      "code": {"type": "integer"}, "usages": {"type": "array", "items": {"$ref": "#/definitions/usage"}}},
                      "oneOf": [{"required": ["code", "usages"]},
                                {"allOf": [{"not": {"required": ["usages"]}}, {"required": ["code"]}]}],
                      "additionalProperties": False},
                  "usage": {"type": "object", "properties": {"field": {"$ref": "#/definitions/el"}}, "required": ["field"],
                            "additionalProperties": False}}}


def test_references_to_a_definition_cut_to_false_become_false(tokenizer: Any) -> None:
    """Past the depth cap a usage (which requires an element, which may hold usages) is false;
    a reference to it stayed a reference, and once the element's branches were folded xgrammar
    refused the whole schema ("Schema 'false' cannot accept any value"). References to a false
    definition are now false themselves (the usages there must be empty), to a fixed point."""
    compiled = grammar_schema(USAGE_TREE)
    false_defs = {f"#/definitions/{name}" for name, d in compiled["definitions"].items() if d is False}
    assert false_defs, "the cap cuts the recursion"
    assert not any(f'"$ref": "{ref}"' in json.dumps(compiled) for ref in false_defs)
    grammar = make_backend("xgrammar", tokenizer, len(tokenizer), [tokenizer.eos_token_id]).compile(
        schema_spec(USAGE_TREE))
    assert _accepts(grammar, tokenizer, '{"fields": [{"code": 1, "usages": [{"field": {"code": 2}}]}]}')


@pytest.mark.parametrize("backend", ["xgrammar", "llguidance"])
def test_a_pointer_into_an_unrolled_definition_follows_it(tokenizer: Any, backend: str) -> None:
    """Real schemas point below a recursive definition ("#/definitions/character/definitions/
    level"). Unrolling renamed the definition and left the pointer dangling: both backends
    refused the schema (o84111, o7515 and a JsonSchemaStore file in the practice corpus)."""
    character = {"type": "object", "definitions": {"level": {"type": "integer"}},
                 "properties": {"level": {"$ref": "#/definitions/character/definitions/level"},
                                "friend": {"$ref": "#/definitions/character"}}}
    schema = {"type": "object", "properties": {"hero": {"$ref": "#/definitions/character"}},
              "definitions": {"character": character}}
    grammar = make_backend(backend, tokenizer, len(tokenizer), [tokenizer.eos_token_id]).compile(schema_spec(schema))
    assert _accepts(grammar, tokenizer, '{"hero": {"level": 3, "friend": {"level": 4}}}')
    assert not _accepts(grammar, tokenizer, '{"hero": {"level": "x"}}')
