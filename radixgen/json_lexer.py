"""The lexical layer of JSON that every reader of generated JSON text shares (the validators'
scanner, budget steering's view, tool-call argument framing): which characters are string
content, which open, escape or close a string, and which are outside every string (structure,
numbers, literals, whitespace). Each reader adds its own structure on top of these kinds.
"""

from __future__ import annotations

OUTSIDE, OPEN, CONTENT, ESCAPE, CLOSE = range(5)
"""The kinds ``JsonStrings.step`` gives: a character outside every string; the quote that opens
one; string content (an escaped character included); the backslash that starts an escape; the
quote that closes the string."""


class JsonStrings:
    """Where a JSON text read one character at a time stands with respect to strings."""

    __slots__ = ("escape", "in_string")

    def __init__(self, in_string: bool = False, escape: bool = False) -> None:
        self.in_string = in_string
        self.escape = escape

    def step(self, ch: str) -> int:
        """The kind of ``ch``, the next character of the text."""
        if not self.in_string:
            if ch == '"':
                self.in_string = True
                return OPEN
            return OUTSIDE
        if self.escape:
            self.escape = False
            return CONTENT
        if ch == "\\":
            self.escape = True
            return ESCAPE
        if ch == '"':
            self.in_string = False
            return CLOSE
        return CONTENT
