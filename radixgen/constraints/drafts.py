"""Older JSON Schema drafts read as what they mean.

Real-world schemas are mostly draft-04 and draft-07, and some of their keywords changed name or
meaning in 2019-09 / 2020-12. The validators use the validator class of the draft a schema's
``$schema`` names (``validator_class``); the grammar backends read 2020-12, so the schema they
compile is first rewritten into it (``as_2020_12``):

- ``dependencies``: its array form is ``dependentRequired``, its schema form ``dependentSchemas``;
- array-form ``items`` is ``prefixItems``, and ``additionalItems`` is then ``items``;
- draft-04's boolean ``exclusiveMinimum`` / ``exclusiveMaximum`` turn ``minimum`` / ``maximum``
  into the numeric exclusive bounds of later drafts;
- ``id`` (draft-04's ``$id``) is dropped: only local references are followed anyway.

A schema without ``$schema`` is read as 2020-12; ``definitions`` needs no rewrite (a local
``$ref`` reaches it under either name).
"""

from __future__ import annotations

from typing import Any

_DRAFT4 = ("draft-04", "draft-03")
_BEFORE_2019 = ("draft-04", "draft-03", "draft-06", "draft-07")
# keywords whose value is a subschema, a list of them, or a map of them (in every draft)
_SUBSCHEMA = ("not", "if", "then", "else", "contains", "propertyNames", "additionalProperties",
              "unevaluatedItems", "unevaluatedProperties", "items", "additionalItems")
_SUBSCHEMA_LISTS = ("allOf", "anyOf", "oneOf", "prefixItems")
_SUBSCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")


def draft_of(schema: Any) -> str:
    """'draft-04', 'draft-06', 'draft-07', '2019-09' or '2020-12' (the default)."""
    uri = schema.get("$schema") if isinstance(schema, dict) else None
    if isinstance(uri, str):
        for name in ("draft-03", "draft-04", "draft-06", "draft-07", "2019-09"):
            if name in uri:
                return name
    return "2020-12"


def validator_class(schema: Any) -> Any:
    """The jsonschema validator class for the draft ``schema`` declares (2020-12 by default)."""
    from jsonschema import Draft202012Validator
    from jsonschema.validators import validator_for

    if not isinstance(schema, dict) or not isinstance(schema.get("$schema"), str):
        return Draft202012Validator
    return validator_for(schema, default=Draft202012Validator)


def as_2020_12(schema: Any) -> Any:
    """``schema`` with its draft's keywords rewritten into 2020-12 (the same object for 2020-12)."""
    draft = draft_of(schema)
    if draft == "2020-12":
        return schema
    rewritten = _rewrite(schema, draft)
    rewritten["$schema"] = "https://json-schema.org/draft/2020-12/schema"
    return rewritten


def _rewrite(node: Any, draft: str) -> Any:
    if isinstance(node, list):
        return [_rewrite(item, draft) for item in node]
    if not isinstance(node, dict):
        return node
    out: dict[str, Any] = {}
    for key, value in node.items():
        if key in _SUBSCHEMA:
            out[key] = _rewrite(value, draft)
        elif key in _SUBSCHEMA_LISTS and isinstance(value, list):
            out[key] = [_rewrite(v, draft) for v in value]
        elif key in _SUBSCHEMA_MAPS and isinstance(value, dict):
            out[key] = {name: _rewrite(v, draft) for name, v in value.items()}
        elif key == "id" and draft in _DRAFT4 and isinstance(value, str):
            continue
        else:
            out[key] = value
    if draft in _BEFORE_2019 and isinstance(out.get("dependencies"), dict):
        required = {k: v for k, v in out["dependencies"].items() if isinstance(v, list)}
        schemas = {k: _rewrite(v, draft) for k, v in out["dependencies"].items() if not isinstance(v, list)}
        del out["dependencies"]
        if required:
            out["dependentRequired"] = {**out.get("dependentRequired", {}), **required}
        if schemas:
            out["dependentSchemas"] = {**out.get("dependentSchemas", {}), **schemas}
    if isinstance(out.get("items"), list):  # the tuple form: positional schemas
        out["prefixItems"] = out.pop("items")
        if "additionalItems" in out:
            out["items"] = out.pop("additionalItems")
    else:
        out.pop("additionalItems", None)  # ignored next to a single items schema (every draft)
    if draft in _DRAFT4:
        for bound, exclusive in (("minimum", "exclusiveMinimum"), ("maximum", "exclusiveMaximum")):
            flag = out.get(exclusive)
            if isinstance(flag, bool):
                del out[exclusive]
                if flag and bound in out:
                    out[exclusive] = out.pop(bound)
    return out
