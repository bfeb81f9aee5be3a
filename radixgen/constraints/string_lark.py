"""A root string schema whose patterns combine under ``not`` / ``oneOf``, as one llguidance lexeme.

llguidance's JSON Schema compiler leaves ``not`` out and reads ``oneOf`` as ``anyOf``, so a string
that must match some patterns and avoid others ("starts with a-e, ends with x-z, and not both
...") is generated under part of its schema and fails validation again and again. Its lexemes,
though, take intersection (``&``) and complement (``~``) as well as union: the schema's string
keywords map onto them one to one (``pattern`` as the strings containing a match, anchored
where it says so; ``minLength`` / ``maxLength`` as a length range; ``enum`` / ``const`` as their
strings; ``allOf`` / ``anyOf`` / ``oneOf`` / ``not`` as their set operations), and the
derivative-based lexer evaluates them lazily, token by token.

The string's content is kept to characters JSON writes unescaped, so the lexeme reads the
value itself, not its escaped spelling. Only a root whose type is string is taken this way (a
string inside an object would need the whole schema in lark); the validators still check the
output, as for every llguidance grammar. A root without a type is taken when its ``allOf``
members let only strings through (``schema_rewrite.type_by_members``: patterns, and negated
patterns that every other type fails).
"""

from __future__ import annotations

import json
import re
from typing import Any

from radixgen.constraints.refs import resolve_ref
from radixgen.constraints.schema_rewrite import type_by_members, type_by_negation
from radixgen.constraints.spec import pattern_branches

_UNMODELLED = frozenset({"format", "if", "then", "else", "$dynamicRef", "$recursiveRef", "contentEncoding",
                         "contentMediaType", "contentSchema", "dependentSchemas", "dependentRequired", "prefixItems",
                         "minContains", "maxContains", "unevaluatedItems", "unevaluatedProperties", "$anchor",
                         "$dynamicAnchor", "$vocabulary"})
"""JSON Schema keywords the lexeme does not express; any other unknown key is not a keyword (a
folder of definitions under a name of its own) and every validator ignores it."""
_ANY = "/(?s:.*)/"
_NOTHING = "~/(?s:.*)/"
_PLAIN_CONTENT = r'/[^"\\\x00-\x1f]*/'
MAX_DEPTH = 32


class _Unsupported(Exception):
    pass


def root_string_lark(schema: Any) -> str | None:
    """The lark grammar of ``schema`` when its root is a string whose constraints use ``not`` or
    ``oneOf`` (what the JSON compiler leaves out); None for every other schema."""
    if not isinstance(schema, dict) or not _uses_set_operations(schema):
        return None
    kind = schema["type"] if "type" in schema else type_by_members(type_by_negation(schema)).get("type")
    if not _is_string_type(kind):  # an untyped root typed by its members (only a string passes them all)
        return None
    try:
        content = _expression(schema, schema, 0)
    except (_Unsupported, RecursionError):
        return None
    return f'start: STRING\nSTRING: "\\"" (({content}) & {_PLAIN_CONTENT}) "\\""\n'


def _is_string_type(kind: Any) -> bool:
    return kind == "string" or (isinstance(kind, list) and kind == ["string"])


def _uses_set_operations(schema: Any) -> bool:
    text = json.dumps(schema)
    return '"not":' in text or '"oneOf":' in text


def _expression(node: Any, root: Any, depth: int) -> str:
    """The lexeme expression of the strings ``node`` accepts."""
    if depth > MAX_DEPTH:
        raise _Unsupported("nested too deep")
    if node is True or node == {}:
        return _ANY
    if node is False:
        return _NOTHING
    if not isinstance(node, dict):
        raise _Unsupported("not a schema")
    if _UNMODELLED & node.keys():
        raise _Unsupported("a keyword outside the string set")
    kind = node.get("type")
    if kind is not None and not (kind == "string" or (isinstance(kind, list) and "string" in kind)):
        return _NOTHING
    parts = []
    if isinstance(node.get("$ref"), str):
        target = resolve_ref(root, node["$ref"])
        if target is None:
            raise _Unsupported("a reference that points nowhere")
        parts.append(_expression(target, root, depth + 1))
    if "pattern" in node:
        parts.append(_searched(node["pattern"]))
    if "minLength" in node or "maxLength" in node:
        low, high = int(node.get("minLength", 0)), node.get("maxLength")
        if high is not None and int(high) < low:
            parts.append(_NOTHING)  # no length fits (a regex repeat {5,3} does not parse)
        else:
            parts.append(f"/(?s:.){{{low},{'' if high is None else int(high)}}}/")
    if "const" in node or "enum" in node:
        listed = ([node["const"]] if "const" in node else []) + list(node.get("enum") or [])
        strings = [json.dumps(v) for v in listed if isinstance(v, str)]
        parts.append("(" + " | ".join(strings) + ")" if strings else _NOTHING)
    parts.extend(_set_operations(node, root, depth))
    return " & ".join(f"({p})" for p in parts) if parts else _ANY


def _set_operations(node: dict[str, Any], root: Any, depth: int) -> list[str]:
    parts = []
    if isinstance(node.get("allOf"), list):
        parts += [_expression(m, root, depth + 1) for m in node["allOf"]]
    if isinstance(node.get("anyOf"), list):
        parts.append(" | ".join(f"({_expression(m, root, depth + 1)})" for m in node["anyOf"]) or _NOTHING)
    if isinstance(node.get("oneOf"), list):
        members = [_expression(m, root, depth + 1) for m in node["oneOf"]]
        exactly_one = []
        for i, member in enumerate(members):
            others = " | ".join(f"({m})" for j, m in enumerate(members) if j != i)
            exactly_one.append(f"({member}) & ~({others})" if others else f"({member})")
        parts.append(" | ".join(f"({e})" for e in exactly_one) or _NOTHING)
    if "not" in node:
        parts.append(f"~({_expression(node['not'], root, depth + 1)})")
    return parts


def _searched(pattern: Any) -> str:
    """The strings containing a match of ``pattern`` (JSON Schema patterns are not anchored),
    each top-level alternative anchored where it says so."""
    if not isinstance(pattern, str):
        raise _Unsupported("a pattern that is not a string")
    branches = []
    for branch in pattern_branches(pattern):
        starts = branch.startswith("^")
        core = branch[1:] if starts else branch
        ends = core.endswith("$") and not core.endswith("\\$")
        core = core[:-1] if ends else core
        if re.search(r"(?<!\\)[\^$]", re.sub(r"\[[^\]]*\]", "", core)):
            raise _Unsupported("an anchor inside the pattern")
        core = re.sub(r"(?<!\\)/", r"\\/", core)
        branches.append("/" + ("" if starts else "(?s:.*)") + f"(?:{core})" + ("" if ends else "(?s:.*)") + "/")
    return " | ".join(branches)
