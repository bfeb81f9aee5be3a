"""Partial objects of a streamed JSON answer: complete values only, each snapshot contained in the
next, the last equal to the parsed answer."""

from __future__ import annotations

import json
import random
from collections.abc import Callable
from typing import Any

import pytest

from radixgen import Engine, SamplingParams
from radixgen.constraints.partial import PartialJson

NESTED = ('{"id": 7, "owner": {"name": "Ada \\"A\\" L.", "tags": ["x", "y,z"]}, '
          '"items": [{"sku": "a1", "qty": 2}, {"sku": "b}2", "qty": [1, 2.5, -3e2]}], "ok": true, "none": null}')


def contained(small: Any, big: Any) -> bool:
    """``small`` is ``big`` so far: the same scalars, objects with a subset of keys (each
    contained), arrays as prefixes (items contained; only the last may still be growing)."""
    if isinstance(small, dict):
        return isinstance(big, dict) and all(k in big and contained(v, big[k]) for k, v in small.items())
    if isinstance(small, list):
        return (isinstance(big, list) and len(small) <= len(big)
                and all(contained(a, b) for a, b in zip(small, big, strict=False)))
    return small == big and type(small) is type(big)


def snapshots(text: str, pieces: list[str]) -> list[Any]:
    partials = PartialJson()
    out = [partials.feed(p, final=n == len(pieces) - 1) for n, p in enumerate(pieces)]
    assert "".join(pieces) == text
    return [s for s in out if s is not None]


def split_randomly(text: str, seed: int) -> list[str]:
    rng = random.Random(seed)
    cuts = sorted(rng.sample(range(1, len(text)), k=min(len(text) - 1, 25)))
    return [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)]


@pytest.mark.parametrize("seed", range(5))
def test_snapshots_only_grow_and_end_at_the_answer(seed: int) -> None:
    shots = snapshots(NESTED, split_randomly(NESTED, seed))
    assert shots[-1] == json.loads(NESTED)
    for before, after in zip(shots, shots[1:], strict=False):
        assert contained(before, after), (before, after)


def test_values_appear_only_once_complete() -> None:
    shots = snapshots(NESTED, list(NESTED))  # one character at a time
    text_so_far = ""
    partials = PartialJson()
    for ch in NESTED:
        text_so_far += ch
        shot = partials.feed(ch)
        if shot is None:
            continue
        if text_so_far.endswith('"Ada \\"A\\" L."'):
            assert shot == {"id": 7, "owner": {"name": 'Ada "A" L.'}}, "a string once closed, its escapes read"
        if text_so_far.endswith('"y,z"'):
            assert shot["owner"]["tags"] == ["x", "y,z"], "an array grows item by item"
    # a number completes at the character that ends it, not at each digit
    assert {"id": 7} in shots and not any(s == {"id": 0} for s in shots)
    assert shots[0] == {"id": 7}
    items = [s["items"] for s in shots if "items" in s]
    assert items[0] == [{"sku": "a1"}] and [{"sku": "a1", "qty": 2}, {"sku": "b}2"}] in items
    assert items[-1][1]["qty"] == [1, 2.5, -300.0]


def test_a_bare_number_at_the_root_completes_at_the_end() -> None:
    partials = PartialJson()
    assert partials.feed("12") is None and partials.feed("5") is None
    assert partials.feed("", final=True) == 125
    # "1" ends at the "," after it, in the next piece
    top_array = snapshots("[[1, 2], [3]]", ["[[1", ", 2]", ", [3", "]]"])
    assert top_array == [[[1, 2]], [[1, 2], [3]]]


def test_engine_stream_carries_partials_to_the_final_object(make_engine: Callable[..., Engine]) -> None:
    schema = {"type": "object", "properties": {
        "title": {"type": "string", "maxLength": 6}, "year": {"type": "integer", "minimum": 1900, "maximum": 2100},
        "cast": {"type": "array", "items": {"type": "string", "maxLength": 5}, "minItems": 2, "maxItems": 3}},
        "required": ["title", "year", "cast"], "additionalProperties": False}
    engine = make_engine()
    params = SamplingParams(max_new_tokens=120, temperature=0.7, seed=5, json_schema=schema)
    deltas = list(engine.iter_outputs("Movie:", params, include_partial=True))
    text = "".join(d.new_text for d in deltas)
    shots = [d.partial for d in deltas if d.partial is not None]
    assert shots[-1] == json.loads(text)
    assert all(contained(a, b) for a, b in zip(shots, shots[1:], strict=False))
    for member in schema["properties"]:  # at least one partial per top-level member
        assert any(isinstance(s, dict) and list(s)[-1] == member for s in shots), (member, shots)
    plain = list(engine.iter_outputs("Movie:", params))
    assert all(d.partial is None for d in plain)
