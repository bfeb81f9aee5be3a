"""Candidate values for the validators' search (``Validation.search_number`` / ``search_literal``).

A value whose validators the grammar cannot enforce, rejected more than once at one path, is
replaced by the first candidate its validators accept. For a number (``multipleOf`` chains under
``not`` / ``anyOf`` / ``oneOf``, bounds combined with them) the candidates are small numbers
around 0 (the shortest answers), then numbers anchored on the schema's own figures: multiples of
the least common multiples of its ``multipleOf`` values, taken near 0 and near each of its
bounds, so that "an odd multiple of 385 below -100000" is among them although it is far from 0.
For any other value they are the literals the schema lists for it (``enum`` / ``const`` in its
subschema and its combinators: an array that must be one of a few listed arrays and also pass
an ``if`` / ``then`` the grammar leaves out). For the last item of an array refused as a whole,
they are that item's listed literals and then the shortest values of each JSON type.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from fractions import Fraction
from itertools import combinations
from typing import Any

from radixgen.constraints.refs import resolve_ref

_BOUND_KEYS = ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum")
MAX_STEPS = 12
"""Distinct multipleOf values combined at most (the first found): subsets of up to three of
them give at most 298 least common multiples."""
MAX_MAGNITUDE = 10**15
"""Candidates beyond this are left out: their digits are beyond what a JSON number in a
double keeps exactly."""


def small_numbers(limit: int, *, tenths: bool) -> Iterator[int | float]:
    """0, 1, -1, 2, -2, ... (or 0.1, -0.1, 0.2, ... skipping whole numbers), ``limit`` of them."""
    if not tenths:
        yield 0
    emitted, k = 0 if tenths else 1, 1
    while emitted < limit:
        if tenths and k % 10 == 0:
            k += 1
            continue
        magnitude: int | float = round(k / 10, 1) if tenths else k
        yield magnitude
        yield -magnitude
        emitted += 2
        k += 1


def member_candidates(listed: list[Any]) -> Iterator[Any]:
    """Values to try in place of an array's last item when the array as a whole is refused: the
    literals its schema lists first, then the shortest strings (empty, one letter or digit), small
    integers and the JSON literals. What such an array lacks is usually one item of a kind (a
    string without some letter, a listed value it must contain), not a particular long one."""
    yield from listed
    yield ""
    yield from "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789"
    yield from small_numbers(20, tenths=False)
    yield from (True, False, None)


def anchored_numbers(schema: Any, limit: int) -> list[int | float]:
    """Up to ``limit`` numbers built from ``schema``'s multipleOf values and bounds (anywhere in
    it), smallest magnitude first: multiples of each subset's least common multiple near 0 and
    near every bound, and the integers next to every bound."""
    steps, bounds = _numeric_keywords(schema)
    if not steps and not bounds:
        return []
    found: set[Fraction] = set()
    anchors = [Fraction(0), *bounds]
    for step in _common_multiples(steps):
        for anchor in anchors:
            base = math.floor(anchor / step)
            found.update((base + j) * step for j in range(-3, 5))
    for bound in bounds:
        found.update(bound + d for d in range(-20, 21))
    ordered = sorted((f for f in found if abs(f) <= MAX_MAGNITUDE), key=lambda f: (abs(f), f < 0))
    return [_as_json_number(f) for f in ordered[:limit]]


MAX_LITERALS = 256
"""Listed literals tried at most."""


def listed_literals(node: Any, root: Any) -> list[Any]:
    """The ``const`` and ``enum`` values that ``node`` (a subschema of ``root``) lists for its own
    value, through its allOf / anyOf / oneOf members and local references (not into properties or
    items: those list their children's values), each once, in the order met."""
    found: list[Any] = []
    seen: set[str] = set()
    stack, visited = [node], 0
    while stack and visited < 1_000 and len(found) < MAX_LITERALS:
        current = stack.pop()
        visited += 1
        if not isinstance(current, dict):
            continue
        ref = current.get("$ref")
        if isinstance(ref, str) and ref.startswith("#"):
            stack.append(resolve_ref(root, ref))
        listed = ([current["const"]] if "const" in current else []) + (
            current["enum"] if isinstance(current.get("enum"), list) else [])
        for value in listed:
            key = json.dumps(value, sort_keys=True)
            if key not in seen:
                seen.add(key)
                found.append(value)
        for keyword in ("allOf", "anyOf", "oneOf"):
            members = current.get(keyword)
            if isinstance(members, list):
                stack.extend(reversed(members))
    return found[:MAX_LITERALS]


def _numeric_keywords(schema: Any) -> tuple[list[Fraction], list[Fraction]]:
    """(positive multipleOf values, bound values) found in ``schema``, each once, in the order met."""
    steps: dict[Fraction, None] = {}
    bounds: dict[Fraction, None] = {}
    stack, seen = [schema], 0
    while stack and seen < 10_000:  # bounded: a schema is data, possibly huge
        node = stack.pop()
        seen += 1
        if isinstance(node, list):
            stack.extend(reversed(node))
            continue
        if not isinstance(node, dict):
            continue
        step = _fraction(node.get("multipleOf"))
        if step is not None and step > 0:
            steps.setdefault(step)
        for key in _BOUND_KEYS:
            bound = _fraction(node.get(key))
            if bound is not None:
                bounds.setdefault(bound)
        stack.extend(reversed([v for k, v in node.items() if k not in ("enum", "const", "default", "examples")]))
    return list(steps)[:MAX_STEPS], list(bounds)


def _common_multiples(steps: list[Fraction]) -> list[Fraction]:
    """The least common multiple of every subset of one to three of ``steps``, smallest first."""
    out: set[Fraction] = set()
    for size in (1, 2, 3):
        for subset in combinations(steps, size):
            out.add(_lcm(subset))
    return sorted(f for f in out if f <= MAX_MAGNITUDE)


def _lcm(values: tuple[Fraction, ...]) -> Fraction:
    """The least positive number every value divides a whole number of times."""
    denominator = math.lcm(*(v.denominator for v in values))
    return Fraction(math.lcm(*(int(v * denominator) for v in values)), denominator)


def _fraction(value: Any) -> Fraction | None:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        return None
    return Fraction(value).limit_denominator(10**6) if isinstance(value, float) else Fraction(value)


def _as_json_number(value: Fraction) -> int | float:
    return int(value) if value.denominator == 1 else float(value)
