"""Schemas refused before generation because no grammar backend enforces what they require.

Validators repair a value the grammar lets through by rolling it back and resampling, which works
for a leaf (a number is searched, a string resampled). Some keywords instead require a container
to hold something the model has no reason to write, and neither xgrammar nor llguidance enforces
them while generating: an array that must ``contains`` a matching item, an object whose property
names must include one (``not`` over ``propertyNames``). The finished container is rejected whole,
every retry writes a similar one, and the request used to end in ``constraint_violation`` after
spending its retries. Such a schema is refused up front, naming the keyword, where it is and
what to write instead.

So is a schema no answer can satisfy because of a ``oneOf`` it must meet (at the root, or under
required properties) that every value matches twice: members that come in identical pairs for
the value's type (a generated union of a string alias and a string, under ``type: string``), or
members that only require properties the object requires already (``oneOf`` over ``required``
sets beside a ``required`` that lists them all).

And so is a ``oneOf`` over objects whose members only look at properties by pattern or through
``not`` (``patternProperties``, ``not: {required}``), where two members or more accept an object
that holds none of those properties: only an object holding a property that tells the members
apart is valid, the grammar (which reads ``oneOf`` as ``anyOf``) does not ask for one, and the
finished object cannot be repaired value by value.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Iterator
from typing import Any

from radixgen.constraints.drafts import validator_class
from radixgen.constraints.refs import deref, resolve_ref
from radixgen.constraints.schema_rewrite import ANNOTATIONS, listed_literals
from radixgen.constraints.spec import ConstraintSpec

_SCHEMA_MAPS = ("properties", "patternProperties", "dependentSchemas")
_SCHEMA_LISTS = ("allOf", "anyOf", "oneOf", "prefixItems")
_SCHEMA_VALUES = ("items", "additionalItems", "additionalProperties", "not", "contains", "if", "then", "else",
                  "propertyNames", "unevaluatedProperties", "unevaluatedItems")


def refusal_for(spec: ConstraintSpec) -> str | None:
    """``unenforceable`` for a JSON-schema spec, worked out once per distinct schema (every
    request and choice with the same schema shares the answer)."""
    return _refusal_of(spec.value)


@functools.lru_cache(maxsize=256)
def _refusal_of(schema_text: str) -> str | None:
    return unenforceable(json.loads(schema_text))


def unenforceable(schema: Any) -> str | None:
    """Why generation for ``schema`` is refused up front, or None when it is not."""
    if not isinstance(schema, dict) or listed_literals(schema) is not None:
        return None  # the grammar writes one of the literals: nothing is left to require
    for where, node in reachable(schema):
        if "contains" in node:
            return (f"{where}.contains requires the array to include a matching item, which the grammar "
                    "backends do not enforce while generating, and a finished array without one cannot be "
                    "repaired item by item; put the required item in prefixItems, or drop contains")
        keyword = _existential(schema, node.get("not"))
        if keyword is not None:
            return (f"{where}.not over {keyword} requires the object to have a property of a given kind, which "
                    "the grammar backends do not enforce while generating, and a finished object without one "
                    "cannot be repaired value by value; list that property in properties and required instead")
    for where, node in _mandatory(schema):
        implied = _implied_members(schema, node)
        if len(implied) >= 2:
            return (f"{where}.oneOf can never hold: a value must match exactly one of its members, and every "
                    f"value the schema allows here matches members {implied[0]} and {implied[1]} (their "
                    "required properties are required here already); use anyOf, or drop those properties "
                    "from required")
        twins = _one_of_without_a_single_match(schema, node)
        if twins is not None:
            return (f"{where}.oneOf can never hold: a value must match exactly one of its members, and members "
                    f"{twins[0]} and {twins[1]} accept the same values{_types_note(node)}; use anyOf, or make "
                    "the members differ")
        vacuous = _members_matched_without_a_property(schema, node)
        if vacuous is not None:
            return (f"{where}.oneOf needs a property that tells its members apart: members {vacuous[0]} and "
                    f"{vacuous[1]} both accept an object without the properties they look at (such as {{}}), "
                    "so a valid object must hold a property only some members accept, which the grammar "
                    "backends do not enforce while generating; list that property in properties and "
                    "required, or use anyOf")
    return None


def _implied_members(root: dict[str, Any], node: dict[str, Any]) -> list[int]:
    """The members of ``node``'s oneOf that every value of ``node`` matches: empty ones, and
    ones that only list required properties ``node`` requires already."""
    members = node.get("oneOf")
    if not isinstance(members, list) or node.get("type") not in ("object", None):
        return []
    required = set(node.get("required") or []) if isinstance(node.get("required"), list) else set()
    implied = []
    for i, member in enumerate(members):
        member = deref(root, member)
        if member is True or (isinstance(member, dict) and set(member) <= ANNOTATIONS | {"required"}
                              and isinstance(member.get("required", []), list)
                              and set(member.get("required", [])) <= required):
            implied.append(i)
    return implied



def _mandatory(root: dict[str, Any]) -> Iterator[tuple[str, dict[str, Any]]]:
    """The schemas every answer must satisfy at a value it must contain: the root, and through
    ``$ref`` and ``allOf`` the required properties of those (each schema once)."""
    pending: list[tuple[str, Any]] = [("$", root)]
    seen: set[int] = set()
    while pending:
        where, node = pending.pop()
        node = deref(root, node)
        if not isinstance(node, dict) or id(node) in seen:
            continue
        seen.add(id(node))
        yield where, node
        pending += [(f"{where}.allOf[{i}]", m) for i, m in enumerate(node.get("allOf") or []) if isinstance(m, dict)]
        properties = node.get("properties")
        if isinstance(properties, dict):
            pending += [(f"{where}.properties.{name}", properties[name]) for name in node.get("required") or []
                        if isinstance(name, str) and name in properties]


def _one_of_without_a_single_match(root: dict[str, Any], node: dict[str, Any]) -> tuple[int, int] | None:
    """Two members of ``node``'s oneOf that accept the same values, where every member a value
    of ``node``'s types can match has such a twin (so no value matches exactly one), or None."""
    members = node.get("oneOf")
    if not isinstance(members, list) or not members:
        return None
    allowed = _types(node)
    keys: list[str | None] = []
    for member in members:
        member = deref(root, member)
        if not isinstance(member, dict):
            return None
        kinds = _types(member)
        overlaps = allowed is None or kinds is None or bool(allowed & kinds) or (
            "number" in allowed and "integer" in kinds) or ("integer" in allowed and "number" in kinds)
        keys.append(json.dumps({k: v for k, v in member.items() if k not in ANNOTATIONS}, sort_keys=True)
                    if overlaps else None)
    live = [i for i, key in enumerate(keys) if key is not None]
    twins = [next((j for j in live if j != i and keys[j] == keys[i]), -1) for i in live]
    if not live or -1 in twins:
        return None
    return live[0], twins[0]


# What a member may say and still tell objects apart only by properties it does not name: by
# pattern, or by properties it asks to be absent (``not`` over these, ``required`` included).
_NAMELESS = ANNOTATIONS | {"type", "patternProperties", "not", "allOf", "anyOf"}
_PROBES: tuple[Any, ...] = (0, 0.5, "", [], None, True)


def _members_matched_without_a_property(root: dict[str, Any], node: dict[str, Any]) -> tuple[int, int] | None:
    """Two members of ``node``'s oneOf that both accept ``{}`` where every member names no
    property (``_NAMELESS``), and no value of another type matches exactly one member; or None."""
    members = node.get("oneOf")
    if (not isinstance(members, list) or len(members) < 2 or "properties" in node or "required" in node
            or node.get("type") not in ("object", None)):
        return None
    resolved = [deref(root, m) for m in members]
    if not all(_names_no_property(root, m) for m in resolved):
        return None
    try:
        validator = validator_class(root)(root)
        accepts = [validator.evolve(schema=m) for m in resolved]
        accepting = [i for i, member in enumerate(accepts) if member.is_valid({})]
        if len(accepting) < 2:
            return None
        if node.get("type") is None:  # an untyped value: a scalar or an array may match one member alone
            rest = validator.evolve(schema={k: v for k, v in node.items() if k != "oneOf"})
            if any(rest.is_valid(p) and sum(m.is_valid(p) for m in accepts) == 1 for p in _PROBES):
                return None
    except Exception:  # noqa: BLE001 - a reference the validator cannot follow offline: not judged here
        return None
    return accepting[0], accepting[1]


def _names_no_property(root: dict[str, Any], member: Any, negated: bool = False, depth: int = 0) -> bool:
    member = deref(root, member)
    if isinstance(member, bool):
        return True
    if not isinstance(member, dict) or depth > 8:
        return False
    allowed = _NAMELESS | {"required"} if negated else _NAMELESS
    if set(member) - allowed or member.get("type", "object") != "object":
        return False
    return (all(_names_no_property(root, m, negated, depth + 1)
                for key in ("allOf", "anyOf") for m in member.get(key) or [])
            and ("not" not in member or _names_no_property(root, member["not"], True, depth + 1)))


def _types(node: dict[str, Any]) -> set[str] | None:
    kind = node.get("type")
    if isinstance(kind, str):
        return {kind}
    if isinstance(kind, list) and all(isinstance(k, str) for k in kind):
        return set(kind)
    return None


def _types_note(node: dict[str, Any]) -> str:
    kinds = _types(node)
    return f" (of the type {' or '.join(sorted(kinds))} the schema allows here)" if kinds else ""


def _existential(root: dict[str, Any], negated: Any, depth: int = 0) -> str | None:
    """The keyword by which ``not: negated`` asks for a property of some kind to exist: negated
    ``propertyNames`` (any but ``false``, which only asks for a non-empty object, what a model
    writes anyway) or ``patternProperties``, directly or in a member of its anyOf / oneOf / allOf."""
    negated = deref(root, negated)
    if not isinstance(negated, dict):
        return None
    names = negated.get("propertyNames")
    if names is not None and names is not False:
        return "propertyNames"
    if isinstance(negated.get("patternProperties"), dict):
        return "patternProperties"
    for key in ("anyOf", "oneOf", "allOf"):
        for member in negated.get(key) or [] if depth < 8 else []:
            found = _existential(root, member, depth + 1)
            if found is not None:
                return found
    return None


def intersected_recursions(root: Any) -> tuple[str, list[str]] | None:
    """Where an ``allOf`` intersects two or more recursive definitions (``$ref`` targets that
    lead back to themselves), and those references; None when no allOf does. llguidance
    intersects them by unrolling each recursion a fixed depth, which can leave nothing to
    generate, and xgrammar does not intersect at all."""
    if not isinstance(root, dict):
        return None
    for where, node in reachable(root):
        members = node.get("allOf")
        refs = [m["$ref"] for m in members if isinstance(m, dict) and isinstance(m.get("$ref"), str)] \
            if isinstance(members, list) else []
        recursive = [ref for ref in refs if _refers_back(root, ref)]
        if len(recursive) >= 2:
            return where, recursive
    return None


def _refers_back(root: dict[str, Any], ref: str) -> bool:
    """Whether the local reference ``ref`` reaches itself again through its target's references."""
    pending, followed = [resolve_ref(root, ref)], set()
    while pending:
        for _, sub in _keyword_subschemas(pending.pop(), ""):
            inner = sub.get("$ref")
            if not (isinstance(inner, str) and inner.startswith("#")):
                continue
            if inner == ref:
                return True
            if inner not in followed:
                followed.add(inner)
                pending.append(resolve_ref(root, inner))
    return False


def reachable(root: dict[str, Any]) -> Iterator[tuple[str, dict[str, Any]]]:
    """Every schema object a value can be checked against: ``root``, the subschemas in its
    keyword positions (a property called "contains" is not the keyword) and the local
    definitions its ``$ref`` keywords lead to (each once; unused definitions are not visited)."""
    pending: list[tuple[str, Any]] = [("$", root)]
    followed: set[str] = set()
    while pending:
        where, node = pending.pop()
        for location, sub in _keyword_subschemas(node, where):
            yield location, sub
            ref = sub.get("$ref")
            if isinstance(ref, str) and ref.startswith("#") and ref not in followed:
                followed.add(ref)
                pending.append((ref, resolve_ref(root, ref)))


def _keyword_subschemas(node: Any, where: str) -> Iterator[tuple[str, dict[str, Any]]]:
    stack = [(where, node)]  # iterative: a schema may nest as deep as the spec allows
    while stack:
        where, node = stack.pop()
        if not isinstance(node, dict):
            continue
        yield where, node
        found: list[tuple[str, Any]] = []
        for key in _SCHEMA_MAPS:
            members = node.get(key)
            if isinstance(members, dict):
                found += [(f"{where}.{key}.{name}", sub) for name, sub in members.items()]
        for key in (*_SCHEMA_LISTS, "items"):  # a list under items: the tuple form of older drafts
            members = node.get(key)
            if isinstance(members, list):
                found += [(f"{where}.{key}[{i}]", sub) for i, sub in enumerate(members)]
        found += [(f"{where}.{key}", node.get(key)) for key in _SCHEMA_VALUES]
        stack.extend(reversed(found))
