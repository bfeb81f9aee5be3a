"""The schema a grammar backend compiles: the caller's schema rewritten so that generation stays
bounded and every backend reads it the same way. Validators keep the caller's own schema."""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from radixgen.constraints.drafts import as_2020_12, validator_class
from radixgen.constraints.refs import deref, pattern_schemas
from radixgen.errors import InvalidConstraintError

ANNOTATIONS = frozenset({"description", "title", "default", "examples", "deprecated", "readOnly", "writeOnly",
                          "$comment"})
"""Keywords that say nothing about which values are valid."""


@dataclass(frozen=True)
class GrammarOptions:
    """How a schema becomes a grammar, the same for every backend (EngineConfig sets them)."""

    open_objects: bool = False
    """Generate undeclared properties where a schema allows them. Off: only the properties a
    schema declares are generated (SGLang's and vLLM's default; JSON Schema itself allows
    undeclared ones, which a small model at temperature 1 pads its output with)."""
    max_recursion_depth: int = 8
    """How deep a recursive definition ($ref to itself) may nest in generated output: a small
    model nests a tree until max_tokens otherwise (measured with SmolLM2-135M at temperature 0)."""


DEFAULT_OPTIONS = GrammarOptions()


def grammar_schema(schema: Any, options: GrammarOptions = DEFAULT_OPTIONS) -> Any:
    """What the backends compile for ``schema`` (read by its draft: ``drafts.as_2020_12``);
    InvalidConstraintError where its literals leave no value."""
    schema = literals_of_their_type(as_2020_12(pinned_literals(schema)))
    if schema is False:
        raise InvalidConstraintError(
            "no value satisfies the json schema: it is false, or an enum / const offers no value that meets the "
            "type and the other keywords beside it (there or in a required property); fix the literals or the type")
    schema = limit_recursion(integral_counts(bound_numbers(declare_required(require_dependents(
        discriminated_conditions(type_by_conditions(type_by_members(type_by_negation(type_object_branches(
            schema))))))))),
        options.max_recursion_depth)
    if schema is False:
        raise InvalidConstraintError(
            f"no value satisfies the json schema within its recursion: recursive definitions are unrolled "
            f"{options.max_recursion_depth} levels deep (json_max_recursion_depth), and one whose required properties "
            "refer back to itself has no instance that ends; make the recursive property optional or nullable")
    return schema if options.open_objects else close_objects(schema)


def pinned_literals(schema: Any) -> Any:
    """``{"enum": [...]}`` of the literals a schema pins its root to (``enum`` / ``const`` at the
    root or in a member of its ``allOf``) that the whole schema accepts, ``false`` when it accepts
    none of them; any other schema unchanged. The grammar then writes each literal as the schema
    spells it, whatever else the schema says: llguidance wrote ``1e+308`` as a 309-digit integer,
    which is not equal to the float, and keywords beside the literals (``not``) sent the schema
    to it."""
    literals = listed_literals(schema)
    if literals is None:
        return schema
    try:
        validator = validator_class(schema)(schema, format_checker=validator_class(schema).FORMAT_CHECKER)
        kept = [value for value in literals if validator.is_valid(value)]
    except Exception:  # noqa: BLE001 - a reference the validator cannot follow offline: left to the backends
        return schema
    return {"enum": kept} if kept else False


def listed_literals(schema: Any) -> list[Any] | None:
    """The literals ``schema`` pins its root to: its ``const`` / ``enum``, or those of a member
    of its ``allOf``; None when it lists none."""
    return _listed_literals(schema, schema)


def _listed_literals(root: Any, node: Any, depth: int = 0) -> list[Any] | None:
    node = deref(root, node)
    if not isinstance(node, dict) or depth > 8:  # bounded: allOf may refer back to the root
        return None
    if "const" in node:
        return [node["const"]]
    if isinstance(node.get("enum"), list):
        return list(node["enum"])
    for member in node.get("allOf") or [] if isinstance(node.get("allOf"), list) else []:
        found = _listed_literals(root, member, depth + 1)
        if found is not None:
            return found
    return None


def literals_of_their_type(schema: Any) -> Any:
    """A copy of ``schema`` whose ``enum`` lists keep only the members of the sibling ``type``;
    a node whose ``enum`` or ``const`` is left with none accepts nothing and becomes ``false``
    (an optional property that is false is dropped, a required one makes its object false).
    Backends write an enum's members whatever the type says, so ``"type": "object"`` beside
    string members gave an answer no retry could repair."""
    return _bottom_up(schema, _literals_of_their_type_here)


_JSON_TYPES: dict[str, Callable[[Any], bool]] = {
    "string": lambda v: isinstance(v, str),
    "integer": lambda v: (isinstance(v, int) and not isinstance(v, bool)) or (isinstance(v, float) and v.is_integer()),
    "number": lambda v: isinstance(v, (int, float)) and not isinstance(v, bool),
    "boolean": lambda v: isinstance(v, bool),
    "null": lambda v: v is None,
    "object": lambda v: isinstance(v, dict),
    "array": lambda v: isinstance(v, list),
}


def _literals_of_their_type_here(out: dict[str, Any]) -> Any:
    types = out.get("type")
    types = [types] if isinstance(types, str) else types
    if isinstance(types, list) and types and all(t in _JSON_TYPES for t in types):
        def typed(value: Any) -> bool:
            return any(_JSON_TYPES[t](value) for t in types)

        if "const" in out and not typed(out["const"]):
            return False
        if isinstance(out.get("enum"), list):
            kept = [member for member in out["enum"] if typed(member)]
            if not kept:
                return False
            if len(kept) < len(out["enum"]):
                out["enum"] = kept
    return _drop_false(out)


def require_dependents(schema: Any) -> Any:
    """A copy of ``schema`` where a required property's dependents (``dependentRequired``, and the
    ``required`` of a ``dependentSchemas`` entry) are required too, to a fixed point: the same
    instances are valid, but a grammar that ignores the dependency keywords now enforces them. A
    recursive schema whose required property requires its own recursion is thereby seen to
    have no finite instance (refused at compile instead of ending in a violation)."""
    return _bottom_up(schema, _require_dependents_here)


def _require_dependents_here(out: dict[str, Any]) -> dict[str, Any]:
    required = out.get("required")
    names = out.get("dependentRequired")
    schemas = out.get("dependentSchemas")
    if not isinstance(required, list) or not (isinstance(names, dict) or isinstance(schemas, dict)):
        return out
    closure = [r for r in required if isinstance(r, str)]
    for trigger in closure:  # grows while it is read: a fixed point
        more = (names or {}).get(trigger) if isinstance(names, dict) else None
        sub = (schemas or {}).get(trigger) if isinstance(schemas, dict) else None
        added = list(more) if isinstance(more, list) else []
        if isinstance(sub, dict) and isinstance(sub.get("required"), list):
            added += sub["required"]
        closure += [name for name in added if isinstance(name, str) and name not in closure]
    if len(closure) > len(required):
        out["required"] = [*required, *(name for name in closure if name not in required)]
    return out


def declare_required(schema: Any) -> Any:
    """A copy of ``schema`` where each required property that ``properties`` does not declare is
    declared with an empty schema, wherever no ``additionalProperties`` reads the undeclared ones:
    the same instances are valid, but a backend that generates (and requires) only declared
    properties now writes them, and closing the object no longer forbids them."""
    return _bottom_up(schema, _declare_required_here)


def _declare_required_here(out: dict[str, Any]) -> dict[str, Any]:
    required = out.get("required")
    properties = out.get("properties", {})
    if not isinstance(required, list) or not isinstance(properties, dict) or "additionalProperties" in out:
        return out
    patterns = out.get("patternProperties")
    undeclared = {name: _matching_patterns(patterns if isinstance(patterns, dict) else {}, name)
                  for name in required if isinstance(name, str) and name not in properties}
    if undeclared:
        out["properties"] = {**properties, **undeclared}
    return out


def _matching_patterns(patterns: dict[str, Any], name: str) -> Any:
    """What a property called ``name`` must satisfy under ``patternProperties``: every schema
    whose pattern it matches ({} where none does, or where a pattern cannot be read here)."""
    matching = pattern_schemas(patterns, name)
    if not matching:
        return {}
    return matching[0] if len(matching) == 1 else {"allOf": matching}


# Keywords that constrain only objects, and those that constrain only other types.
_OBJECT_ONLY = frozenset({"properties", "required", "additionalProperties", "patternProperties", "minProperties",
                          "maxProperties", "propertyNames", "dependentRequired", "dependentSchemas",
                          "unevaluatedProperties"})
_TYPED = frozenset({"type", "enum", "const", "$ref", "$dynamicRef", "allOf", "anyOf", "oneOf", "not", "if",
                    "items", "prefixItems", "minItems", "maxItems", "contains", "uniqueItems", "minContains",
                    "maxContains", "unevaluatedItems", "minLength", "maxLength", "pattern", "format", "minimum",
                    "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf", "contentEncoding",
                    "contentMediaType"})


def type_object_branches(schema: Any) -> Any:
    """A copy of ``schema`` where each ``oneOf`` with two or more branches that say nothing but
    object keywords (``properties``, ``required``, ... and no ``type``) has those branches typed
    ``object``. Such a branch lets every non-object through, so with two of them any string or
    number passes two branches and fails the ``oneOf``: no valid answer is lost, but a grammar
    (which reads ``oneOf`` as ``anyOf``) no longer offers "" for a material that must be one of
    three object shapes. The same for two or more branches of array keywords only (``items``:
    a string passed three of them), of string keywords, or of number keywords. Branches are
    read through local ``$ref``s."""
    if not isinstance(schema, dict):
        return schema
    return _bottom_up(schema, lambda node: _type_branches_here(schema, node))


def _type_branches_here(root: dict[str, Any], out: dict[str, Any]) -> dict[str, Any]:
    branches = out.get("oneOf")
    if not isinstance(branches, list):
        return out
    for kind in _ONE_TYPE_ONLY:
        untyped = [i for i, b in enumerate(branches) if _only_keywords_of(kind, _local_target(root, b))]
        if len(untyped) >= 2:
            branches = [{**b, "type": kind} if i in untyped and isinstance(b, dict) else b
                        for i, b in enumerate(branches)]
    out["oneOf"] = branches
    return out


def _only_keywords_of(kind: str, node: Any) -> bool:
    """A branch that says nothing but ``kind``'s keywords (and no ``type``): every value of
    another type passes it."""
    if kind == "object":
        return _only_object_keywords(node)
    keys = set(node) - ANNOTATIONS if isinstance(node, dict) else set()
    return bool(keys) and keys <= _ONE_TYPE_ONLY[kind]


# Keywords that constrain one type each (the others pass them).
_ONE_TYPE_ONLY = {
    "number": frozenset({"multipleOf", "minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum"}),
    "string": frozenset({"minLength", "maxLength", "pattern", "format", "contentEncoding", "contentMediaType"}),
    "array": frozenset({"items", "prefixItems", "minItems", "maxItems", "contains", "uniqueItems", "minContains",
                        "maxContains", "unevaluatedItems"}),
    "object": _OBJECT_ONLY,
}


def type_by_negation(schema: Any) -> Any:
    """A copy of ``schema`` where an untyped schema whose ``not`` constrains only one type (its
    keywords, and its ``anyOf`` / ``allOf`` branches', are all that type's: ``not: {anyOf:
    [{multipleOf: 2}, {multipleOf: 5}]}``) is typed with it. Every other instance passes that
    subschema and so fails the ``not``: no valid answer is lost, but a grammar (which cannot
    express ``not``) no longer offers a string where only an odd number can be valid."""
    return _bottom_up(schema, _type_by_negation_here)


def _type_by_negation_here(out: dict[str, Any]) -> dict[str, Any]:
    if "type" in out or "not" not in out:
        return out
    only = _constrains_only(out["not"])
    return out if only is None else {**out, "type": only}


def _constrains_only(node: Any) -> str | None:
    """The one type that ``node`` constrains (every instance of another type is valid under
    it); None where it constrains more than one type, or something else (a type, an enum, a
    reference), or nothing at all."""
    if not isinstance(node, dict):
        return None
    kinds: set[str | None] = set()
    for key in set(node) - ANNOTATIONS:
        branches = node[key]
        if key in ("anyOf", "allOf") and isinstance(branches, list) and branches:
            kinds.update(_constrains_only(branch) for branch in branches)
        else:
            kinds.add(next((kind for kind, words in _ONE_TYPE_ONLY.items() if key in words), None))
    return kinds.pop() if len(kinds) == 1 else None


def type_by_members(schema: Any) -> Any:
    """A copy of ``schema`` where an untyped schema with an ``allOf`` member of one type (typed
    itself, or an ``anyOf`` / ``oneOf`` whose members all are, or one reached by a local
    ``$ref``) is typed with it: a value of another type fails that member. No valid answer is
    lost, but a grammar that cannot intersect the members no longer offers any value where only a
    string under several patterns can be valid. Members of different types are left alone."""
    if not isinstance(schema, dict):
        return schema
    return _bottom_up(schema, lambda node: _type_by_members_here(schema, node))


def _type_by_members_here(root: dict[str, Any], out: dict[str, Any]) -> dict[str, Any]:
    members = out.get("allOf")
    if "type" in out or not isinstance(members, list):
        return out
    kinds = {kind for m in members if (kind := _single_type(root, m, 0)) is not None}
    return {**out, "type": kinds.pop()} if len(kinds) == 1 else out


def _single_type(root: dict[str, Any], node: Any, depth: int) -> str | None:
    """The one type every value ``node`` accepts has, where ``node`` says so; else None."""
    node = _local_target(root, node)
    if not isinstance(node, dict) or depth > 8:
        return None
    kind = node.get("type")
    if isinstance(kind, list) and len(kind) == 1:
        kind = kind[0]
    if isinstance(kind, str):
        return kind
    for key in ("anyOf", "oneOf"):
        branches = node.get(key)
        if isinstance(branches, list) and branches:
            kinds = {_single_type(root, b, depth + 1) for b in branches}
            if len(kinds) == 1 and None not in kinds:
                return kinds.pop()
    if "not" in node:
        return _constrains_only(node["not"])
    members = node.get("allOf")
    if isinstance(members, list):
        kinds = {kind for m in members if (kind := _single_type(root, m, depth + 1)) is not None}
        return kinds.pop() if len(kinds) == 1 else None
    return None


def type_by_conditions(schema: Any) -> Any:
    """A copy of ``schema`` where an untyped schema whose ``if`` says nothing but object keywords
    and whose ``then`` is an object is typed ``object``. Every other instance passes such an
    ``if`` and must then pass ``then``, which it cannot: no valid answer is lost, but a grammar
    (which leaves ``if`` / ``then`` out) no longer offers a string for a config file's root."""
    if not isinstance(schema, dict):
        return schema
    return _bottom_up(schema, lambda node: _type_by_condition_here(schema, node))


def _type_by_condition_here(root: dict[str, Any], out: dict[str, Any]) -> dict[str, Any]:
    condition, then = out.get("if"), _local_target(root, out.get("then"))
    if ("type" in out or not isinstance(condition, dict) or set(condition) - ANNOTATIONS - _OBJECT_ONLY
            or not isinstance(then, dict) or then.get("type") not in ("object", ["object"])):
        return out
    return {**out, "type": "object"}


def discriminated_conditions(schema: Any) -> Any:
    """A copy of ``schema`` where an object's ``allOf`` of ``if: {properties: {P: {const: X}}}`` /
    ``then: S_X`` pairs, one per value of a required property P whose ``enum`` lists exactly those
    values, becomes ``anyOf`` over "P is X and S_X". The same instances are valid (exactly one
    condition holds), but the grammar backends, which leave ``if`` / ``then`` out, now enforce each
    branch: a "fixed" target size could be written with any properties its ``then`` forbids."""
    return _bottom_up(schema, _discriminate_here)


def _discriminate_here(out: dict[str, Any]) -> dict[str, Any]:
    conditions = out.get("allOf")
    properties = out.get("properties")
    if "anyOf" in out or not isinstance(properties, dict):
        return out
    if isinstance(conditions, list) and conditions:
        pairs_of = [_condition_pair(member) for member in conditions]
        consumed = "allOf"
    else:  # if P = X1 then S1 else if P = X2 then S2 ... else {}
        pairs_of, consumed = _condition_chain(out), "if"
    if not pairs_of:
        return out
    branches: dict[str, list[Any]] = {}  # property -> [(value, then)]
    for pair in pairs_of:
        if pair is None:
            return out
        name, value, then = pair
        branches.setdefault(name, []).append((value, then))
    if len(branches) != 1:
        return out
    (name, pairs), = branches.items()
    listed = properties.get(name, {}).get("enum") if isinstance(properties.get(name), dict) else None
    values = [json.dumps(v, sort_keys=True) for v, _ in pairs]
    if (name not in (out.get("required") or []) or not isinstance(listed, list) or len(set(values)) != len(values)
            or sorted(values) != sorted(json.dumps(v, sort_keys=True) for v in listed)):
        return out
    rest = {k: v for k, v in out.items() if k not in (("if", "then", "else") if consumed == "if" else ("allOf",))}
    rest["anyOf"] = [{"allOf": [{"properties": {name: {"const": value}}, "required": [name]}, then]}
                     for value, then in pairs]
    return rest


def _condition_chain(node: dict[str, Any]) -> list[tuple[str, Any, Any] | None]:
    """The (P, X, S) of each ``if`` / ``then`` down an ``else`` chain that ends empty ([] when
    ``node`` has no ``if``; a None in the list where a link is not such a test)."""
    if "if" not in node:
        return []
    pairs: list[tuple[str, Any, Any] | None] = []
    link = node
    while True:
        pairs.append(_condition_pair({"if": link["if"], "then": link.get("then", True)}))
        rest = link.get("else", {})
        if not (isinstance(rest, dict) and "if" in rest):
            return pairs if rest in ({}, True) else [None]
        if set(rest) - ANNOTATIONS - {"if", "then", "else", "type"} or rest.get("type", "object") != "object":
            return [None]  # a link that says more than its condition (a type: type_by_conditions's)
        link = rest


def _condition_pair(member: Any) -> tuple[str, Any, Any] | None:
    """(P, X, S) for an ``{"if": {"properties": {P: {"const": X}}}, "then": S}`` member (or
    ``enum: [X]``), else None."""
    if not isinstance(member, dict) or set(member) - ANNOTATIONS - {"type"} != {"if", "then"} or member.get(
            "type", "object") != "object":  # a type: type_by_conditions's, for what its parent is already
        return None
    condition = member["if"]
    if not isinstance(condition, dict) or set(condition) - ANNOTATIONS - {"required"} != {"properties"}:
        return None
    tested = condition["properties"]
    if not isinstance(tested, dict) or len(tested) != 1:
        return None
    (name, test), = tested.items()
    if not isinstance(test, dict):
        return None
    if set(test) - ANNOTATIONS == {"enum"} and isinstance(test["enum"], list) and len(test["enum"]) == 1:
        return name, test["enum"][0], member["then"]
    if set(test) - ANNOTATIONS != {"const"}:
        return None
    return name, test["const"], member["then"]


def fold_required_branches(schema: Any) -> Any:
    """A copy of ``schema`` where an object whose ``anyOf`` / ``oneOf`` members only list
    ``required`` names ("content or embeds") has its own object keywords copied into each
    member. The same instances are valid, but each member is now a whole object schema: xgrammar
    read a bare ``{"required": ["content"]}`` member as any object with that key, and let
    properties the parent's ``additionalProperties: false`` forbids through. For xgrammar only
    (after ``grammar_schema``): llguidance reads such members right, and the copies of the
    object's references made it lose a nested required property."""
    return _bottom_up(schema, _fold_required_here)


def _fold_required_here(out: dict[str, Any]) -> dict[str, Any]:
    shared = {k: v for k, v in out.items() if k in _OBJECT_ONLY}
    if "properties" not in shared or out.get("type") not in ("object", None):
        return out
    base = [r for r in shared.get("required", []) if isinstance(r, str)] if isinstance(shared.get("required"), list) else []
    for keyword in ("anyOf", "oneOf"):
        members = out.get(keyword)
        presence = [_presence(m) for m in members] if isinstance(members, list) else []
        if not presence or None in presence:
            continue
        folded = []
        for required, absent in (p for p in presence if p is not None):
            branch = {**shared, "type": "object", "required": [*base, *(r for r in required if r not in base)]}
            if absent and shared.get("additionalProperties") is False:  # closed: absent = undeclared
                branch["properties"] = {k: v for k, v in shared["properties"].items() if k not in absent}
            folded.append(branch)
        if not any(set(branch["required"]) - branch["properties"].keys() for branch in folded):
            out[keyword] = folded
    return out


def _presence(member: Any, depth: int = 0) -> tuple[list[str], list[str]] | None:
    """(names required, names required absent) of a branch that only says which properties an
    object holds: ``required``, ``not: {required: [one name]}``, and ``allOf`` of those; None
    for any other branch."""
    if _only_requires(member):
        return [r for r in member["required"] if isinstance(r, str)], []
    if not isinstance(member, dict) or depth > 4:
        return None
    keys = set(member) - ANNOTATIONS - ({"type"} if member.get("type") == "object" else set())
    negated: Any = member.get("not")
    if keys == {"not"} and _only_requires(negated) and len(names := negated["required"]) == 1 and isinstance(
            names[0], str):
        return [], [names[0]]
    if keys == {"allOf"} and isinstance(member["allOf"], list):
        parts = [_presence(m, depth + 1) for m in member["allOf"]]
        if parts and None not in parts:
            return ([name for p in parts if p for name in p[0]], [name for p in parts if p for name in p[1]])
    return None


def _only_requires(member: Any) -> bool:
    """A branch that lists required names and nothing else (``declare_required`` may have
    declared those names with empty schemas)."""
    if not isinstance(member, dict) or not isinstance(member.get("required"), list):
        return False
    declared = member.get("properties", {})
    return set(member) - ANNOTATIONS <= {"required", "properties"} and isinstance(declared, dict) and all(
        sub in ({}, True) for sub in declared.values())


def _local_target(root: dict[str, Any], node: Any) -> Any:
    """A branch that is only a local ``$ref`` (and annotations) read as its target."""
    if isinstance(node, dict) and set(node) - ANNOTATIONS == {"$ref"}:
        return deref(root, node)
    return node


def _only_object_keywords(node: Any) -> bool:
    return isinstance(node, dict) and bool(_OBJECT_ONLY & node.keys()) and not _TYPED & node.keys()


_ROOT = "__root__"


def limit_recursion(schema: Any, depth: int) -> Any:
    """Unroll the definitions that reference themselves (directly or through others) ``depth``
    levels deep; past that, their references become ``false`` and drop out of anyOf/oneOf,
    optional properties and array items. Definitions without a cycle are left alone."""
    if not isinstance(schema, dict):
        return schema
    defs_key = "$defs" if "$defs" in schema else "definitions"
    defs = dict(schema.get(defs_key) or {})
    body = {k: v for k, v in schema.items() if k != defs_key}
    if _mentions(body, "#") or any(_mentions(d, "#") for d in defs.values()):
        defs[_ROOT], body = body, {"$ref": f"#/{defs_key}/{_ROOT}"}
    edges = {name: _refs_to(d, defs_key) & defs.keys() for name, d in defs.items()}
    cyclic = {name for name in defs if _reaches(edges, name, name)}
    if not cyclic:
        return schema

    def relink(node: Any, level: int) -> Any:
        if isinstance(node, list):
            return [relink(item, level) for item in node]
        if not isinstance(node, dict):
            return node
        target = _target(node.get("$ref"), defs_key)
        if target in cyclic:
            if level >= depth:
                return False
            node = {**node, "$ref": f"#/{defs_key}/{target}@{level + 1}"}
        elif (inside := _inside_definition(node.get("$ref"), defs_key, cyclic)) is not None:
            # a pointer into a definition that is now unrolled ("#/definitions/a/definitions/b"):
            # into the copy at the next level (the last one past the cap; it has no cycle left)
            head, tail = inside
            node = {**node, "$ref": f"#/{defs_key}/{head}@{min(level + 1, depth)}/{tail}"}
        out = {k: v if k in _DATA_KEYWORDS else relink(v, level) for k, v in node.items()}
        return _drop_false(out)

    new_defs = {name: relink(d, 0) for name, d in defs.items() if name not in cyclic}
    for name in cyclic:
        for level in range(1, depth + 1):
            new_defs[f"{name}@{level}"] = relink(defs[name], level)
    body = relink(body, 0)
    # a definition that ended false (its required recursion was cut) makes its references false,
    # to a fixed point: xgrammar refused a reference to false wherever a branch reached it
    false_refs: set[str] = set()
    while newly := {f"#/{defs_key}/{name}" for name, d in new_defs.items() if d is False} - false_refs:
        false_refs |= newly
        new_defs = {name: _without_refs_to(d, false_refs) for name, d in new_defs.items()}
        body = _without_refs_to(body, false_refs)
    return {**body, defs_key: new_defs} if isinstance(body, dict) else body


def _without_refs_to(node: Any, false_refs: set[str]) -> Any:
    if isinstance(node, list):
        return [_without_refs_to(item, false_refs) for item in node]
    if not isinstance(node, dict):
        return node
    ref = node.get("$ref")
    if isinstance(ref, str) and ref in false_refs:  # (a properties map may name a property "$ref")
        return False
    return _drop_false({k: v if k in _DATA_KEYWORDS else _without_refs_to(v, false_refs) for k, v in node.items()})


def _drop_false(node: dict[str, Any]) -> Any:
    """Simplify after a cut-off reference became false."""
    for key in ("anyOf", "oneOf"):
        if isinstance(node.get(key), list) and False in node[key]:
            kept = [branch for branch in node[key] if branch is not False]
            if not kept:
                return False
            node[key] = kept
    props = node.get("properties")
    if isinstance(props, dict) and False in props.values():
        required = set(node.get("required") or [])
        if any(props[name] is False for name in required if name in props):
            return False
        node["properties"] = {name: sub for name, sub in props.items() if sub is not False}
        if not node["properties"] and not {"additionalProperties", "patternProperties"} & node.keys():
            # past the cap the object ends: an empty properties would read as "any object"
            node["additionalProperties"] = False
    if node.get("items") is False and isinstance(node.get("minItems"), int) and node["minItems"] > 0:
        return False
    return node


def _target(ref: Any, defs_key: str) -> str | None:
    if ref == "#":
        return _ROOT
    prefix = f"#/{defs_key}/"
    return ref[len(prefix):].replace("~1", "/").replace("~0", "~") if isinstance(ref, str) and ref.startswith(prefix) else None


def _inside_definition(ref: Any, defs_key: str, unrolled: set[str]) -> tuple[str, str] | None:
    """(the definition's name as the pointer spells it, the rest of the pointer) for a pointer
    below one of the ``unrolled`` definitions; None for any other reference."""
    prefix = f"#/{defs_key}/"
    if not (isinstance(ref, str) and ref.startswith(prefix)):
        return None
    head, _, tail = ref[len(prefix):].partition("/")
    return (head, tail) if tail and head.replace("~1", "/").replace("~0", "~") in unrolled else None


def _refs_to(node: Any, defs_key: str) -> set[str]:
    found: set[str] = set()
    stack = [node]
    while stack:
        item = stack.pop()
        if isinstance(item, list):
            stack.extend(item)
        elif isinstance(item, dict):
            target = _target(item.get("$ref"), defs_key)
            if target is not None:
                found.add(target)
            stack.extend(v for k, v in item.items() if k not in _DATA_KEYWORDS)
    return found


def _mentions(node: Any, ref: str) -> bool:
    if isinstance(node, list):
        return any(_mentions(item, ref) for item in node)
    if isinstance(node, dict):
        return node.get("$ref") == ref or any(_mentions(v, ref) for k, v in node.items() if k not in _DATA_KEYWORDS)
    return False


def _reaches(edges: dict[str, set[str]], start: str, goal: str) -> bool:
    seen: set[str] = set()
    stack = list(edges.get(start, ()))
    while stack:
        name = stack.pop()
        if name == goal:
            return True
        if name not in seen:
            seen.add(name)
            stack.extend(edges.get(name, ()))
    return False


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
    if isinstance(ref, str) and (partnered or set(node) - {"$ref"} - ANNOTATIONS - _NOT_CONSTRAINTS):
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
# Beside a $ref these constrain nothing: a recursive schema's root is a $ref beside its definitions.
_NOT_CONSTRAINTS = frozenset({"$defs", "definitions", "$schema", "$id"})


def _close(node: Any, *, closable: bool, keep_open: frozenset[str], at: str = "#") -> Any:
    if not isinstance(node, dict):
        return node
    out = dict(node)
    # a node whose alternatives add properties to its own is read together with them, too
    with_alternatives = bool({"anyOf", "oneOf"} & node.keys() and _SHAPE & node.keys())
    partners = [k for k in _CONJUNCTIVE if k in node]
    mine = (closable and at not in keep_open and not with_alternatives
            and (not partners or (partners == ["dependentSchemas"] and _dependents_stay_declared(node))))
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


_PLAIN_DEPENDENT = frozenset({"properties", "required", "description", "title", "$comment"})


def _dependents_stay_declared(node: dict[str, Any]) -> bool:
    """Each dependent schema only constrains properties its object declares (their values, which
    of them are required): closing the object to its declared properties rejects nothing a
    dependent schema would allow."""
    declared = node.get("properties")
    dependents = node.get("dependentSchemas")
    if not isinstance(declared, dict) or not isinstance(dependents, dict):
        return False
    for sub in dependents.values():
        if sub is True:
            continue
        if not isinstance(sub, dict) or not sub.keys() <= _PLAIN_DEPENDENT:
            return False
        if not set(sub.get("properties", {})) <= declared.keys() or not set(sub.get("required", [])) <= declared.keys():
            return False
    return True


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
    return _bottom_up(schema, _bound_numbers_here)


def _bound_numbers_here(out: dict[str, Any]) -> dict[str, Any]:
    types = out.get("type")
    types = types if isinstance(types, list) else [types]
    if ("integer" in types or "number" in types) and not {"enum", "const"} & out.keys():
        bound = _INTEGER_BOUND if "number" not in types else _NUMBER_BOUND
        if "minimum" not in out and "exclusiveMinimum" not in out:
            out["minimum"] = -bound
        if "maximum" not in out and "exclusiveMaximum" not in out:
            out["maximum"] = bound
    return out


def _bottom_up(schema: Any, rewrite: Callable[[dict[str, Any]], dict[str, Any]]) -> Any:
    """A copy of ``schema`` with ``rewrite`` applied to every schema node, innermost first (the
    data of enum, const, default and examples left as it is)."""
    if isinstance(schema, list):
        return [_bottom_up(item, rewrite) for item in schema]
    if not isinstance(schema, dict):
        return schema
    return rewrite({key: value if key in _DATA_KEYWORDS else _bottom_up(value, rewrite)
                    for key, value in schema.items()})
