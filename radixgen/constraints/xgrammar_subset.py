"""Which JSON schemas xgrammar reads faithfully, and which it enforces exactly.

Pure functions over a schema (no xgrammar import): the auto backend routes by the first, the
xgrammar backend marks its grammars with the second.
"""

from __future__ import annotations

import re
from typing import Any

from radixgen.constraints.spec import sre_parser

# Keywords xgrammar does not read the way JSON Schema does (it ignores or approximates them).
_OUTSIDE_XGRAMMAR = frozenset({
    "allOf", "not", "if", "then", "else", "dependentSchemas", "dependentRequired", "unevaluatedProperties",
    "unevaluatedItems", "patternProperties", "propertyNames", "contains", "minContains", "maxContains",
    "$dynamicRef", "$dynamicAnchor", "$anchor", "$id", "minProperties", "maxProperties",
})
# Keywords that only make sense for one type: without "type" xgrammar assumes an object, where
# JSON Schema lets every other type through.
_TYPE_SPECIFIC = frozenset({
    "properties", "required", "additionalProperties", "items", "prefixItems", "minItems", "maxItems",
    "uniqueItems", "minLength", "maxLength", "pattern", "format", "minimum", "maximum", "exclusiveMinimum",
    "exclusiveMaximum", "multipleOf",
})
_DATA = frozenset({"enum", "const", "default", "examples", "description", "title"})


def within_xgrammar_subset(schema: Any) -> bool:
    """True when xgrammar's automaton accepts exactly what ``schema`` does (up to the bounds we add)."""
    if schema is True:
        return True
    if not isinstance(schema, dict):
        return False  # false subschemas, malformed nodes: llguidance reports them precisely
    if _OUTSIDE_XGRAMMAR & schema.keys():
        return False
    pattern = schema.get("pattern")
    if isinstance(pattern, str) and ({"minLength", "maxLength"} & schema.keys() or _misread_pattern(pattern)):
        return False  # xgrammar drops the lengths beside a pattern, or its automaton for the pattern is loose
    if "type" not in schema and _TYPE_SPECIFIC & schema.keys() and not {"$ref", "anyOf", "oneOf"} & schema.keys():
        return False
    literals = schema.get("enum", []) if "enum" in schema else [schema["const"]] if "const" in schema else None
    if literals is not None and (not isinstance(literals, list) or not literals
                                 or any(isinstance(v, (dict, list, float)) for v in literals)):
        return False  # empty, composite or fractional literals: xgrammar's text for them is not ours
    return all(within_xgrammar_subset(sub) for sub in _subschemas(schema))


def length_beside_pattern(schema: Any, where: str = "$", depth: int = 0) -> str | None:
    """Where ``schema`` bounds a string's length beside its pattern (what xgrammar drops), or None."""
    if not isinstance(schema, dict) or depth > 64:
        return None
    if isinstance(schema.get("pattern"), str) and {"minLength", "maxLength"} & schema.keys():
        return where
    for key, value in schema.items():
        if key in _DATA:
            continue
        if key in ("properties", "$defs", "definitions", "patternProperties") and isinstance(value, dict):
            found = next((f for name, sub in value.items()
                          if (f := length_beside_pattern(sub, f"{where}.{key}.{name}", depth + 1))), None)
        elif isinstance(value, list):
            found = next((f for i, sub in enumerate(value)
                          if (f := length_beside_pattern(sub, f"{where}.{key}[{i}]", depth + 1))), None)
        else:
            found = length_beside_pattern(value, f"{where}.{key}", depth + 1)
        if found is not None:
            return found
    return None


def without_lengths_beside_patterns(schema: Any) -> Any:
    """A copy of ``schema`` without ``minLength`` / ``maxLength`` where a ``pattern`` stands beside them."""
    if isinstance(schema, list):
        return [without_lengths_beside_patterns(item) for item in schema]
    if not isinstance(schema, dict):
        return schema
    beside = isinstance(schema.get("pattern"), str)
    return {key: value if key in _DATA else without_lengths_beside_patterns(value) for key, value in schema.items()
            if not (beside and key in ("minLength", "maxLength"))}


def _subschemas(schema: dict[str, Any]) -> list[Any]:
    """The schemas nested directly in ``schema`` (boolean ones left out: both readers agree on them)."""
    found: list[Any] = []
    for key, value in schema.items():
        if key in _DATA:
            continue
        if key in ("properties", "$defs", "definitions") and isinstance(value, dict):
            found += value.values()
        elif key in ("anyOf", "oneOf", "prefixItems") and isinstance(value, list):
            found += value
        elif isinstance(value, dict):  # items, additionalProperties, ...
            found.append(value)
    return found


# Keywords xgrammar's automaton enforces exactly: an output it accepts under a schema built only
# from these can never fail that schema's validators (the rewrite that closes objects and bounds
# numbers only narrows the automaton further). format, uniqueItems, multipleOf, pattern (another
# regex dialect), oneOf (read as anyOf) and fractional bounds are left to the validators.
_EXACT_KEYWORDS = frozenset({
    "type", "properties", "required", "additionalProperties", "items", "prefixItems", "enum", "const", "anyOf",
    "$ref", "$defs", "definitions", "minItems", "maxItems", "minLength", "maxLength", "description", "title",
    "default", "examples", "$schema", "$comment",
})
_INTEGER_BOUNDS = frozenset({"minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum"})


def xgrammar_enforces_exactly(schema: Any) -> bool:
    """True when xgrammar's automaton for ``schema`` only accepts outputs that satisfy it, so
    validators have nothing left to reject and the output can stream as it is generated."""
    if not within_xgrammar_subset(schema):
        return False
    return _exact_keywords_only(schema)


def _exact_keywords_only(schema: Any) -> bool:
    if isinstance(schema, bool):
        return True
    if not isinstance(schema, dict):
        return False
    allowed = _EXACT_KEYWORDS | (_INTEGER_BOUNDS if schema.get("type") == "integer" else frozenset())
    if not schema.keys() <= allowed:
        return False
    if not set(schema.get("required", [])) <= set(schema.get("properties", {})):
        return False  # xgrammar requires only the properties it generates (the suite's items.json)
    return all(_exact_keywords_only(sub) for sub in _subschemas(schema))


# What xgrammar cannot read, dropped from the schema it compiles when the schema is outside its
# subset: left in, some of them make it accept any JSON at all (a root "allOf" did).
_DROPPED_FOR_XGRAMMAR = frozenset({
    "not", "if", "then", "else", "dependentSchemas", "dependentRequired", "unevaluatedProperties", "unevaluatedItems",
})


def readable_by_xgrammar(schema: Any, *, close_objects: bool = True) -> Any:
    """What xgrammar compiles for a schema outside its subset (validators check the whole schema):
    each ``allOf`` folded into its node where its members say so plainly (their type, properties
    and required merged in), and the keywords xgrammar cannot read dropped, so that it enforces
    what it can, the root's type first. A folded object is closed like any other (``close_objects``)
    unless a member lets undeclared properties in."""
    if isinstance(schema, list):
        return [readable_by_xgrammar(item, close_objects=close_objects) for item in schema]
    if not isinstance(schema, dict):
        return schema
    out = {key: value if key in _DATA else readable_by_xgrammar(value, close_objects=close_objects)
           for key, value in schema.items() if key not in _DROPPED_FOR_XGRAMMAR}
    members = out.pop("allOf", None)
    if not isinstance(members, list):
        return out
    opens = "additionalProperties" in out or "patternProperties" in out
    for member in members:
        if not isinstance(member, dict):
            continue
        if "type" in member and "type" not in out:
            out["type"] = member["type"]
        properties = member.get("properties")
        if isinstance(properties, dict):
            mine = out.setdefault("properties", {})
            for name, sub in properties.items():
                mine.setdefault(name, sub)
        if isinstance(member.get("required"), list):
            out["required"] = list(dict.fromkeys([*out.get("required", []), *member["required"]]))
        opens = opens or "additionalProperties" in member or "patternProperties" in member
    if close_objects and out.get("properties") and not opens:
        out["additionalProperties"] = False
    return out


def _misread_pattern(pattern: str) -> bool:
    """True for a pattern with an optional group that starts with a repeat ("^([0-9]+y)?$",
    "(a*b)?"): xgrammar 0.2's automaton for it accepts the repeat alone ("12" against the first),
    so a duration like "2018" closes unfinished. Unreadable patterns are left to the spec check."""
    try:
        parsed = sre_parser.parse(pattern)
    except (re.error, RecursionError, OverflowError):
        return False
    stack: list[Any] = [parsed]
    while stack:
        items = stack.pop()
        for op, arg in list(items):
            if op in (sre_parser.MAX_REPEAT, sre_parser.MIN_REPEAT):
                low, high, body = arg
                if low == 0 and high == 1 and _starts_with_repeat(body):
                    return True
                stack.append(body)
            elif op is sre_parser.SUBPATTERN:
                stack.append(arg[-1])
            elif op is sre_parser.BRANCH:
                stack.extend(arg[1])
    return False


def _starts_with_repeat(body: Any) -> bool:
    """Whether a group's body is a sequence of more than one item led by an unbounded repeat."""
    items = list(body)
    while len(items) == 1 and items[0][0] is sre_parser.SUBPATTERN:
        items = list(items[0][1][-1])
    return len(items) > 1 and items[0][0] in (sre_parser.MAX_REPEAT, sre_parser.MIN_REPEAT) and items[0][1][1] == sre_parser.MAXREPEAT
