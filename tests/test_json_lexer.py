"""JSON's string lexing, shared by every reader of generated JSON (radixgen/json_lexer.py): the
kinds of a text's characters, and the three readers agreeing on a text whose strings hold the
characters that are structure outside them (braces, brackets, commas, colons, escaped quotes)."""

from __future__ import annotations

import json

from radixgen.constraints.budget import BudgetState
from radixgen.constraints.events import JsonScanner
from radixgen.json_lexer import CLOSE, CONTENT, ESCAPE, OPEN, OUTSIDE, JsonStrings
from radixgen.tool_formats import HERMES, parse

TRICKY = {"a}": "x\"],{:", "b": ["\\", "]}"], "c": {"d": "\\\"}"}}


def test_the_kinds_of_a_strings_characters() -> None:
    lexer = JsonStrings()
    kinds = [lexer.step(ch) for ch in '{"a\\"b\\\\": 1}']
    assert kinds == [OUTSIDE, OPEN, CONTENT, ESCAPE, CONTENT, CONTENT, ESCAPE, CONTENT, CLOSE, OUTSIDE, OUTSIDE,
                     OUTSIDE, OUTSIDE]
    assert not lexer.in_string and not lexer.escape


def test_the_three_readers_agree_on_strings_that_hold_structure() -> None:
    text = json.dumps(TRICKY)
    scanner = JsonScanner()
    completed = [v for i in range(0, len(text), 3) for v in scanner.feed(text[i:i + 3])]  # token-sized pieces
    assert scanner.done and completed[-1].value == TRICKY and completed[-1].path == ()
    assert {v.path for v in completed} >= {("a}",), ("b", 0), ("b", 1), ("c", "d")}

    budget = BudgetState(is_json=True)
    for i in range(0, len(text) - 1, 3):  # everything but the closing brace
        budget.scan(text[i:min(i + 3, len(text) - 1)])
    assert budget.containers == "{" and not budget.in_string

    content, calls = parse(HERMES, f'<tool_call>\n{{"name": "f", "arguments": {text}}}\n</tool_call>')
    assert content == "" and len(calls) == 1 and json.loads(calls[0].arguments) == TRICKY
