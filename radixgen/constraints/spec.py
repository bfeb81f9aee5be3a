"""What a request asks its output to match, normalised into a hashable cache key."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any, Literal

from radixgen.errors import InvalidConstraintError

ConstraintKind = Literal["regex", "json_schema", "choices", "json_object"]

MAX_SCHEMA_DEPTH = 64
"""Deepest JSON nesting a schema may have: recursive walks (ours, the compilers', the
validators') stay far from Python's recursion limit. The engine may set a lower limit."""


@dataclass(frozen=True)
class ConstraintSpec:
    kind: ConstraintKind
    value: str
    """The regex, the schema as canonical JSON, the choices as a JSON list, or '' for json_object."""

    @property
    def key(self) -> tuple[str, str]:
        return (self.kind, self.value)

    def schema(self) -> dict[str, Any]:
        assert self.kind == "json_schema"
        return json.loads(self.value)

    def choices(self) -> list[str]:
        assert self.kind == "choices"
        return json.loads(self.value)


def regex_spec(pattern: str) -> ConstraintSpec:
    """Check a regex with interegular (syntax, non-empty language) before any backend sees it."""
    import interegular

    if not isinstance(pattern, str) or not pattern:
        raise InvalidConstraintError("regex must be a non-empty string")
    try:
        re.compile(pattern)
        fsm = interegular.parse_pattern(pattern).to_fsm()
    except (re.error, interegular.patterns.InvalidSyntax) as e:
        raise InvalidConstraintError(f"regex {pattern!r} is not valid: {e or 'syntax error'}") from None
    except interegular.patterns.Unsupported as e:
        raise InvalidConstraintError(f"regex {pattern!r} uses an unsupported feature: {e}") from None
    if fsm.empty():
        raise InvalidConstraintError(f"regex {pattern!r} matches no string at all; nothing could be generated")
    return ConstraintSpec("regex", pattern)


def schema_spec(schema: Any) -> ConstraintSpec:
    """A JSON schema given as a dict, a JSON string, or a pydantic model class."""
    if isinstance(schema, type) and hasattr(schema, "model_json_schema"):
        schema = schema.model_json_schema()
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except json.JSONDecodeError as e:
            raise InvalidConstraintError(f"json_schema is not valid JSON: {e}") from None
        except RecursionError:
            raise InvalidConstraintError(f"json_schema nests deeper than {MAX_SCHEMA_DEPTH} levels") from None
    if isinstance(schema, bool):
        schema = {} if schema else {"not": {}}
    if not isinstance(schema, dict):
        raise InvalidConstraintError(f"json_schema must be an object (dict), got {type(schema).__name__}")
    depth = json_depth(schema)
    if depth > MAX_SCHEMA_DEPTH:
        raise InvalidConstraintError(f"json_schema nests {depth} levels deep; the limit is {MAX_SCHEMA_DEPTH}")
    # key order is kept: property order is the order the fields are generated in
    text = json.dumps(schema, separators=(",", ":"))
    _check_schema_types(schema, "$")
    _check_refs_are_local(schema)
    return ConstraintSpec("json_schema", text)


def json_depth(value: Any) -> int:
    """Nesting depth of a JSON value (a scalar is 0), without recursion."""
    deepest, stack = 0, [(value, 0)]
    while stack:
        node, depth = stack.pop()
        children = node.values() if isinstance(node, dict) else node if isinstance(node, list) else None
        if children is not None:
            deepest = max(deepest, depth + 1)
            stack.extend((child, depth + 1) for child in children)
    return deepest


def _check_refs_are_local(schema: dict[str, Any]) -> None:
    """References must resolve inside the schema: nothing is fetched (no network at run time)."""
    ids: set[str] = set()
    refs: list[tuple[str, str, str]] = []
    stack: list[tuple[Any, str]] = [(schema, "$")]
    while stack:
        node, where = stack.pop()
        if isinstance(node, dict):
            if isinstance(node.get("$id"), str):
                ids.add(node["$id"].rstrip("#"))
            for key in ("$ref", "$dynamicRef"):
                if isinstance(node.get(key), str):
                    refs.append((key, node[key], where))
            stack.extend((v, f"{where}.{k}") for k, v in node.items() if isinstance(v, (dict, list)))
        elif isinstance(node, list):
            stack.extend((v, f"{where}[{i}]") for i, v in enumerate(node))
    for key, ref, where in refs:
        target = ref.split("#", 1)[0]
        if target and not any(i == target or i.endswith("/" + target) for i in ids):
            raise InvalidConstraintError(
                f"{key} {ref!r} at {where} points outside the schema; only references inside it are supported"
            )


def choices_spec(choices: Any) -> ConstraintSpec:
    if not isinstance(choices, (list, tuple)) or not choices:
        raise InvalidConstraintError("choices must be a non-empty list of strings")
    if not all(isinstance(c, str) and c for c in choices):
        raise InvalidConstraintError("choices must all be non-empty strings")
    return ConstraintSpec("choices", json.dumps(list(choices)))


JSON_OBJECT = ConstraintSpec("json_object", "")

_JSON_TYPES = {"string", "number", "integer", "boolean", "object", "array", "null"}


def _check_schema_types(schema: Any, path: str) -> None:
    """Catch the common mistakes early with a path: unknown 'type' names, non-object subschemas."""
    stack = [(schema, path)]
    while stack:
        node, where = stack.pop()
        if isinstance(node, bool):
            continue
        if not isinstance(node, dict):
            raise InvalidConstraintError(f"schema at {where} must be an object or a boolean, got {type(node).__name__}")
        kind = node.get("type")
        kinds = kind if isinstance(kind, list) else [kind] if kind is not None else []
        for k in kinds:
            if k not in _JSON_TYPES:
                raise InvalidConstraintError(f"schema at {where}: 'type' {k!r} is not a JSON type; use one of {sorted(_JSON_TYPES)}")
        for key in ("properties", "$defs", "definitions", "patternProperties"):
            sub = node.get(key)
            if sub is not None:
                if not isinstance(sub, dict):
                    raise InvalidConstraintError(f"schema at {where}.{key} must be an object")
                stack.extend((v, f"{where}.{key}.{k}") for k, v in sub.items())
        for key in ("items", "additionalProperties", "not", "contains", "propertyNames", "if", "then", "else"):
            sub = node.get(key)
            if isinstance(sub, (dict, bool)):
                stack.append((sub, f"{where}.{key}"))
        for key in ("anyOf", "oneOf", "allOf", "prefixItems"):
            sub = node.get(key)
            if sub is not None:
                if not isinstance(sub, list):
                    raise InvalidConstraintError(f"schema at {where}.{key} must be a list")
                stack.extend((v, f"{where}.{key}[{i}]") for i, v in enumerate(sub))
