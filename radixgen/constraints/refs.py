"""Local ``$ref`` resolution over a schema (JSON pointers into the schema itself)."""

from __future__ import annotations

from typing import Any


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
