"""The schema a grammar backend compiles: the caller's schema rewritten so that generation stays
bounded and every backend reads it the same way. Validators keep the caller's own schema."""

from __future__ import annotations

from typing import Any


def grammar_schema(schema: Any, *, open_objects: bool = False) -> Any:
    """What the backends compile for ``schema``. Objects are closed unless ``open_objects``: only
    the properties a schema declares are generated (SGLang's and vLLM's default; JSON Schema
    itself allows undeclared ones, which a small model at temperature 1 pads its output with)."""
    schema = integral_counts(bound_numbers(schema))
    return schema if open_objects else close_objects(schema)


_COUNT_KEYWORDS = frozenset({"minItems", "maxItems", "minLength", "maxLength", "minProperties", "maxProperties",
                             "minContains", "maxContains"})


def integral_counts(schema: Any) -> Any:
    """``"maxLength": 2.0`` is 2 to JSON Schema; the compilers want an integer there."""
    if isinstance(schema, list):
        return [integral_counts(item) for item in schema]
    if not isinstance(schema, dict):
        return schema
    return {key: int(value) if key in _COUNT_KEYWORDS and isinstance(value, float) and value.is_integer()
            else value if key in _DATA_KEYWORDS else integral_counts(value) for key, value in schema.items()}


# Keywords that bring properties or items from elsewhere into the same instance: a schema that
# has one of them, or is one of their branches, cannot be closed on its own without rejecting
# what its partners allow.
_CONJUNCTIVE = ("allOf", "$ref", "$dynamicRef", "if", "then", "else", "dependentSchemas", "not",
                "unevaluatedProperties", "unevaluatedItems")
# Where a subschema describes a whole instance of its own (a property's value, an item, a
# definition) and so may be closed: keyword -> how its value holds subschemas.
_NESTED = {"properties": "map", "patternProperties": "map", "$defs": "map", "definitions": "map",
           "items": "one", "additionalProperties": "one", "prefixItems": "list"}


def close_objects(schema: Any) -> Any:
    """A copy of ``schema`` where every object schema that declares properties but says nothing about undeclared
    properties forbids them, and every tuple (``prefixItems``) that says nothing about further
    items forbids them — where that cannot change what its sibling or parent schemas allow."""
    if not isinstance(schema, dict):
        return schema
    shared: set[str] = set()
    _refs_read_with_partners(schema, partnered=False, found=shared)
    return _close(schema, closable=True, keep_open=frozenset(shared))


def _refs_read_with_partners(node: Any, *, partnered: bool, found: set[str]) -> None:
    """Collect the definitions ($ref targets) that some reference reads together with sibling or
    enclosing keywords: closing such a definition would reject what the partners add."""
    if isinstance(node, list):
        for item in node:
            _refs_read_with_partners(item, partnered=partnered, found=found)
        return
    if not isinstance(node, dict):
        return
    ref = node.get("$ref")
    if isinstance(ref, str) and (partnered or set(node) - {"$ref"} - _ANNOTATIONS):
        found.add(ref)
    adds_to_branches = bool(_SHAPE & node.keys())
    for key, value in node.items():
        if key in _DATA_KEYWORDS:
            continue
        if key in ("$defs", "definitions"):  # read where they are referenced, not here
            below = False
        else:
            below = partnered or key in _CONJUNCTIVE or (key in ("anyOf", "oneOf") and adds_to_branches)
        _refs_read_with_partners(value, partnered=below, found=found)


_SHAPE = frozenset({"properties", "patternProperties", "prefixItems", "items"})
_ANNOTATIONS = frozenset({"description", "title", "default", "examples", "deprecated", "readOnly", "writeOnly",
                          "$comment"})


def _close(node: Any, *, closable: bool, keep_open: frozenset[str], at: str = "#") -> Any:
    if not isinstance(node, dict):
        return node
    out = dict(node)
    # a node whose alternatives add properties to its own is read together with them, too
    with_alternatives = bool({"anyOf", "oneOf"} & node.keys() and _SHAPE & node.keys())
    mine = closable and at not in keep_open and not with_alternatives and not any(k in node for k in _CONJUNCTIVE)
    for key, value in node.items():
        if key in _DATA_KEYWORDS:
            continue
        how = _NESTED.get(key)
        if how == "map" and isinstance(value, dict):
            out[key] = {name: _close(sub, closable=True, keep_open=keep_open, at=f"{at}/{key}/{_escape(name)}")
                        for name, sub in value.items()}
        elif how == "list" and isinstance(value, list):
            out[key] = [_close(sub, closable=True, keep_open=keep_open, at=f"{at}/{key}/{i}")
                        for i, sub in enumerate(value)]
        elif how == "one":
            out[key] = _close(value, closable=True, keep_open=keep_open, at=f"{at}/{key}")
        elif key in ("anyOf", "oneOf") and isinstance(value, list):
            # alternatives are whole instances of their own unless the parent adds to each of them
            out[key] = [_close(sub, closable=mine, keep_open=keep_open, at=f"{at}/{key}/{i}")
                        for i, sub in enumerate(value)]
        # allOf, if/then/else, not, dependentSchemas: a subtree read together with its partners
        # (or negated) is left as the caller wrote it
    # an object schema without properties ({"type": "object"}) means any object and stays open
    if mine and node.get("properties") and not {"additionalProperties", "patternProperties"} & node.keys():
        out["additionalProperties"] = False
    if mine and isinstance(node.get("prefixItems"), list) and "items" not in node:
        out["items"] = False
    return out


def _escape(name: str) -> str:
    return name.replace("~", "~0").replace("/", "~1")


# Numbers without bounds are generated within +-10^15 (at most 15 integer digits; a range also
# makes xgrammar bound the fraction to 6 digits): a small model sampling at temperature 1 would
# otherwise write digits until max_tokens. Validators still see the caller's own schema.
_INTEGER_BOUND = 10**15 - 1
_NUMBER_BOUND = 1e15
_DATA_KEYWORDS = frozenset({"enum", "const", "default", "examples"})


def bound_numbers(schema: Any) -> Any:
    """A copy of ``schema`` whose integer and number schemas without a lower or upper bound get one."""
    if isinstance(schema, list):
        return [bound_numbers(item) for item in schema]
    if not isinstance(schema, dict):
        return schema
    out = {key: value if key in _DATA_KEYWORDS else bound_numbers(value) for key, value in schema.items()}
    types = out.get("type")
    types = types if isinstance(types, list) else [types]
    if ("integer" in types or "number" in types) and not {"enum", "const"} & out.keys():
        bound = _INTEGER_BOUND if "number" not in types else _NUMBER_BOUND
        if "minimum" not in out and "exclusiveMinimum" not in out:
            out["minimum"] = -bound
        if "maximum" not in out and "exclusiveMaximum" not in out:
            out["maximum"] = bound
    return out
