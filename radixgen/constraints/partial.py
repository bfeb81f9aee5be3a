"""A streamed JSON answer as the object it has become so far, built from complete values only.

Clients that stream structured output (instructor's partial models, UI previews) re-parse the
incomplete JSON text on every chunk and guess at the half-written value. ``PartialJson`` follows
the streamed text with the same scanner the validators use and places each value as it
completes: a string appears once it is closed, a number once the character after it ends it,
an array grows item by item, an object key by key. Each snapshot contains the previous one
(same values for the keys it has, arrays as prefixes), and the last, at the end of the answer,
is the answer parsed. The text it follows has passed the automaton (and, with validators, is
only sent once no rollback can take it back), so each value in a snapshot is one the engine has
checked.
"""

from __future__ import annotations

import copy
from typing import Any

from radixgen.constraints.events import CompletedValue, JsonScanner

_NOTHING = object()


class PartialJson:
    def __init__(self) -> None:
        self._scanner = JsonScanner()
        self._value: Any = _NOTHING

    def feed(self, text: str, *, final: bool = False) -> Any:
        """Follow ``text`` (the next piece of the answer); a snapshot of the value so far when a
        value completed in it, else None. ``final`` marks the answer's end (a bare number at the
        root completes only there)."""
        done = self._scanner.feed(text)
        if final:
            done += self._scanner.finish()
        if not done:
            return None
        for value in done:
            self._place(value)
        return copy.deepcopy(self._value)

    @property
    def value(self) -> Any:
        """The value so far (None before any value completed)."""
        return None if self._value is _NOTHING else self._value

    def _place(self, completed: CompletedValue) -> None:
        path = completed.path
        if not path:
            self._value = completed.value
            return
        if self._value is _NOTHING:
            self._value = {} if isinstance(path[0], str) else []
        node = self._value
        for key, inner in zip(path[:-1], path[1:], strict=True):
            child = _get(node, key)
            if child is _NOTHING:
                child = {} if isinstance(inner, str) else []
                _set(node, key, child)
            node = child
        _set(node, path[-1], copy.deepcopy(completed.value) if isinstance(completed.value, dict | list)
             else completed.value)


def _get(node: Any, key: str | int) -> Any:
    if isinstance(node, dict):
        return node.get(key, _NOTHING)
    assert isinstance(key, int)
    return node[key] if key < len(node) else _NOTHING


def _set(node: Any, key: str | int, value: Any) -> None:
    if isinstance(node, dict):
        node[key] = value
        return
    assert isinstance(key, int)
    if key < len(node):
        node[key] = value
    else:  # items complete in order: the next one is appended
        node.append(value)
