"""Reading a schema's parts by name: local ``$ref`` resolution (JSON pointers into the schema
itself), and the ``patternProperties`` subschemas a property name falls under."""

from __future__ import annotations

import re
from typing import Any


def pattern_schemas(patterns: dict[str, Any], name: str) -> list[Any] | None:
    """The subschemas of ``patternProperties`` whose pattern matches (searches) in ``name``;
    None where a pattern is one Python's re cannot read (it may match or not)."""
    matched = []
    for pattern, sub in patterns.items():
        try:
            if re.search(pattern, name):
                matched.append(sub)
        except re.error:
            return None
    return matched


def resolve_ref(root: Any, ref: str) -> Any:
    """What the local reference ``ref`` (``#`` or ``#/a/b``) points at in ``root``; None when it
    points nowhere or is not local."""
    if ref == "#":
        return root
    if not ref.startswith("#/"):
        return None
    target = root
    for part in ref[2:].split("/"):
        part = part.replace("~1", "/").replace("~0", "~")
        if not isinstance(target, dict) or part not in target:
            return None
        target = target[part]
    return target


def deref(root: Any, node: Any) -> Any:
    """``node`` with its local ``$ref`` chain followed to a schema that is not a bare reference;
    None when the chain breaks or loops."""
    for _ in range(32):  # bounded: a $ref cycle must not hang
        ref = node.get("$ref") if isinstance(node, dict) else None
        if not (isinstance(ref, str) and (ref == "#" or ref.startswith("#/"))):
            return node
        node = resolve_ref(root, ref)
    return None
