"""The cheapest way to finish a constrained output from where it stands.

A constrained answer is only useful complete, and ``max_new_tokens`` is a hard end. The engine
keeps, for each constrained request, the shortest text its automaton accepts from the current
state up to a state where the stop token is allowed (``Completer.complete``), and its length in
tokens; when the tokens left come close to that cost, the request is steered to close
(engine/steering.py). The completion is found by walking the request's own matcher, so every
character of it is accepted by the grammar: a string is closed where the automaton allows it,
a missing required property gets the shortest value the automaton offers (``minLength``,
``minimum``, ``enum`` / ``const``, ``pattern`` where the grammar encodes them), arrays are padded
to ``minItems``, and every open container is closed. The walk is greedy over single-character
tokens in a fixed preference order (closers first), taking each forced stretch whole; it is
exact for what the grammar enforces and short in practice, not provably shortest. Regexes and
choices are walked the same way (their automata are the same kind of matcher).
"""

from __future__ import annotations

import json
import string
import time
from collections import OrderedDict
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from radixgen.constraints.backend import Matcher
from radixgen.constraints.mask import allocate_bitmask, allowed_tokens
from radixgen.constraints.spec import MAX_REGEX_STATES, pattern_branches, state_budget
from radixgen.json_lexer import CLOSE, CONTENT, OPEN, OUTSIDE, JsonStrings

# Which character the walk tries first where several are allowed: closers (end a string, an
# object, an array), then the shortest values (digits), then letters and punctuation.
_PREFERENCE = '"}]' + "1234567890" + string.ascii_lowercase + ".-_@:/+" + string.ascii_uppercase + ", "
_PREFERENCE += "".join(c for c in string.printable if c not in _PREFERENCE and c not in "\t\n\r\x0b\x0c")
# a newline last: JSON never takes one between our tokens, but a tool-call block's framing does
# (SmolLM2's "\n]</tool_call>", Hermes' "\n</tool_call>")
_PREFERENCE += "\n"
_ALNUM = frozenset(string.ascii_letters + string.digits)
_CLOSERS = frozenset('"}],')
# After this many letters or digits in a row the walk tries punctuation first, the kinds it has
# not written lately first (an email pattern would otherwise be walked as "aaa.aaa.aaa..." or as
# letters forever).
_MAX_ALNUM_RUN = 3
_MAX_COMPLETION_CHARS = 2048
_MAX_WALK_STEPS = 1024
START_WALK_SCALE = 8
"""The walk from a request's start state may go this many times further: its result is cached
per constraint, and a schema with dozens of required nested objects (a units catalogue with 42
required properties) needs ~3,000 characters. Without a completion the request could be neither
refused for a budget it cannot fit nor steered to close."""
LONG_START_WALK_SCALE = 4 * START_WALK_SCALE
"""Where the start walk stopped at its bounds (not at a dead end), it is tried once more this
far: a real schema with hundreds of required properties has a shortest answer thousands of
tokens long, and without it the request ran unsteered until max_tokens cut it."""
_ENCODE_CACHE_SIZE = 4096
_PLAIN_STRING_PROBE = 8
_CHARACTER_ENDINGS = 16
"""Tokens tried at most to end a character a token left part-written."""
_PAD_LENGTHS = (8, 16, 32)
# The shortest values of the formats grammars enforce by pattern (date, date-time, time, email,
# hostname, URI, UUID, IPv4/6, semantic version, duration), tried whole at a string's start
_FORMAT_VALUES = ("1.0.0", "P1D", "::1", "0.0.0.0", "a@a.aa", "00:00:00Z", "2000-01-01", "http://a.aa",
                  "2000-01-01T00:00:00Z", "00000000-0000-0000-0000-000000000000")


@dataclass(frozen=True)
class Completion:
    """The shortest known way to finish: its text and that text's tokens."""

    text: str
    token_ids: tuple[int, ...]

    @property
    def cost(self) -> int:
        return len(self.token_ids)


class Completer:
    """Finds completions for the matchers of one tokenizer (one per engine; loop thread only)."""

    def __init__(self, tokenizer: Any, vocab_size: int) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self._encoded: OrderedDict[str, tuple[int, ...]] = OrderedDict()
        # the single-character tokens, in preference order; inside text (where a letter is
        # allowed) letters come before the closers, so a padded string reads "aaa", not "}}}"
        self._chars: list[tuple[str, int]] = []
        for ch in _PREFERENCE:
            ids = tokenizer.encode(ch, add_special_tokens=False)
            if len(ids) == 1 and ids[0] < vocab_size and tokenizer.decode(ids) == ch:
                self._chars.append((ch, int(ids[0])))
        first = [c for c in self._chars if c[0] == '"']
        words = sorted((c for c in self._chars if c[0] in _ALNUM), key=lambda c: c[0].isdigit())
        self._text_order = first + words + [c for c in self._chars if c not in first and c not in words]
        # between values, the separators come right after the closers: an array padded to
        # minItems reads [1, 1], not [111.111, 111]
        closers = [c for c in self._chars if c[0] in '}]"']
        closers.sort(key=lambda c: c[0] == '"')  # "[" then "]" is shorter than '["...'; a string that
        # is open and allows no letter (its pattern wants digits, say) is closed by the quote still
        separators = [c for c in self._chars if c[0] in ", "]
        self._chars = closers + separators + [c for c in self._chars if c not in closers and c not in separators]
        self._probe = next(t for ch, t in self._chars if ch == "a")
        self.ran_out_of_room = False
        """The last walk stopped at its bounds (its text's length or its steps), not at a dead
        end: a walk with larger bounds may still find the end."""
        self._newline = [c for c in self._chars if c[0] == "\n"]

    def encode(self, text: str) -> tuple[int, ...]:
        ids = self._encoded.get(text)
        if ids is None:
            ids = self._encoded[text] = tuple(self.tokenizer.encode(text, add_special_tokens=False))
            if len(self._encoded) > _ENCODE_CACHE_SIZE:
                self._encoded.popitem(last=False)
        else:
            self._encoded.move_to_end(text)
        return ids

    def complete(self, matcher: Matcher, *, scale: int = 1, strings: tuple[str, ...] = ()) -> Completion | None:
        """The completion from ``matcher``'s state (left unchanged), or None when the walk finds
        no end within its bounds, ``scale`` times the usual ones (the caller then cannot steer
        this request). ``strings``: texts to try whole where a string's content starts (the
        shortest matches of the schema's patterns), before the common formats' shortest values.

        Depth-first: forced stretches are taken whole, elsewhere the first allowed character
        in preference order; at a dead end (a bounded number whose digits ran out, say) the walk
        backs up to the last choice and takes the next allowed character there. Where the last
        token left a character part-written, a token that ends it comes first."""
        completion = self._walk(matcher, scale, strings)
        if completion is None and not self.ran_out_of_room and self._inside_character(matcher):
            completion = self._through_character(matcher, scale, strings)
        return completion

    def _inside_character(self, matcher: Matcher) -> bool:
        """The last token ended part-way through a multi-byte character (byte-level tokens split
        "Ｈ" in two): the automaton takes none of the walk's characters and forces nothing."""
        if matcher.forced_string() or matcher.is_completed():
            return False
        for _, token in self._chars:
            if matcher.accept(token):
                matcher.rollback(1)
                return False
        return True

    def _through_character(self, matcher: Matcher, scale: int, strings: tuple[str, ...]) -> Completion | None:
        """A token the automaton allows that ends the part-written character, then the walk from
        there. The walk writes whole characters, so without this no completion was found at every
        other token of a run of such characters, and a string of them ran to the budget's end."""
        row = allocate_bitmask(1, self.vocab_size)
        matcher.fill_bitmask(row, 0)
        for token in allowed_tokens(row[0])[:_CHARACTER_ENDINGS].tolist():
            if not matcher.accept(token):
                continue
            try:
                rest = None if self._inside_character(matcher) else self._walk(matcher, scale, strings)
            finally:
                matcher.rollback(1)
            if rest is not None:
                return Completion(self.tokenizer.decode([token]) + rest.text, (token, *rest.token_ids))
        return None

    def _walk(self, matcher: Matcher, scale: int, strings: tuple[str, ...]) -> Completion | None:
        # each step: (tokens accepted, text, the remaining alternatives of a choice or None)
        steps: list[tuple[int, str, Iterator[str] | None]] = []
        size = 0
        attempts = 0
        self.ran_out_of_room = False
        try:
            while size <= _MAX_COMPLETION_CHARS * scale and attempts <= _MAX_WALK_STEPS * scale:
                attempts += 1
                if matcher.is_completed():
                    text = "".join(piece for _, piece, _ in steps)
                    return Completion(text, self.encode(text))
                forced = matcher.forced_string()
                forced_ids = self.encode(forced) if forced else ()
                if forced_ids and matcher.accept_all(forced_ids):
                    steps.append((len(forced_ids), forced, None))
                    size += len(forced)
                    continue
                if not steps or steps[-1][1].endswith('"'):
                    written = self._string_value(matcher, strings)
                    if written is not None:
                        steps.append(written)
                        size += len(written[1])
                        continue
                run = 0
                for _, piece, _ in reversed(steps):
                    if not (len(piece) == 1 and piece in _ALNUM):
                        break
                    run += 1
                recent = "".join(piece for _, piece, _ in steps[-16:]) if run >= _MAX_ALNUM_RUN else None
                options = self._options(matcher, avoid=recent)
                ch = next(options, None)
                while ch is None:  # dead end: back up to the last choice that has another option
                    if not steps:
                        return None
                    count, piece, rest = steps.pop()
                    size -= len(piece)
                    matcher.rollback(count)
                    options = rest if rest is not None else iter(())
                    ch = next(options, None)
                steps.append((1, ch, options))
                size += 1
            self.ran_out_of_room = True
            return None
        finally:
            accepted = sum(count for count, _, _ in steps)
            if accepted:
                matcher.rollback(accepted)

    def _string_value(self, matcher: Matcher, strings: tuple[str, ...]) -> tuple[int, str, None] | None:
        """At a string's start, the first of ``strings`` and then of the common formats' values
        that the automaton takes whole with its closing quote (a step of the walk), or None.
        Letter by letter the walk cannot find what a pattern or format wants where the grammar
        lets any text in before it (an unanchored date pattern: "aaa_aaa@..." forever)."""
        if not matcher.accept(self._probe):
            return None  # not free text here: the walk's digits and marks find the way
        matcher.rollback(1)
        for letters in range(_PLAIN_STRING_PROBE + 1):  # a plain string (or a short minLength):
            ids = self.encode("a" * letters + '"')      # the walk's letters are shortest
            if matcher.accept_all(ids):
                matcher.rollback(len(ids))
                return None
        for text in (*strings, *_FORMAT_VALUES):
            # as it is, then lengthened in front for a minLength beside a pattern that lets
            # text in before its match ("1--1111" needs 35 characters: "aaa...1--1111")
            for pad in ("", *(filler * count for count in _PAD_LENGTHS for filler in "a1")):
                ids = self.encode(pad + text + '"')
                if matcher.accept_all(ids):
                    return (len(ids), pad + text + '"', None)
        return None

    @staticmethod
    def _alnum_after_run(order: list[tuple[str, int]], recent: str) -> list[tuple[str, int]]:
        """Letters and digits after a run of them: first the other kind than the run's last
        character, then the same kind not written lately, then the rest. A pattern that takes
        digits forever before a unit letter ("[0-9]+s") is walked "111s", not digits until the
        walk's bounds run out."""
        last_is_digit = recent[-1:].isdigit()
        fresh = [c for c in order if c[0] in _ALNUM and c[0] not in recent]
        fresh.sort(key=lambda c: c[0].isdigit() == last_is_digit)
        return fresh + [c for c in order if c[0] in _ALNUM and c[0] in recent]

    def _options(self, matcher: Matcher, *, avoid: str | None) -> Iterator[str]:
        """The allowed next characters in preference order, each yielded with ``matcher``
        advanced by it (the consumer rolls it back before asking for the next). Probing with
        accept is far cheaper than filling a vocabulary-wide mask per character."""
        in_text = matcher.accept(self._probe)
        if in_text:
            matcher.rollback(1)
        order = self._text_order if in_text else self._chars
        if avoid is not None:  # after a run of letters: punctuation not used lately, then the rest
            marks = [c for c in order if c[0] not in _ALNUM and c[0] not in _CLOSERS]
            # the marks written lately, least recently first: a pattern like \w+:\w+ gets its
            # ":" before another "_" ("aaa_aaa:a", not "aaa_aaa_aaa_aaa_aaa:a")
            used = sorted((c for c in marks if c[0] in avoid), key=lambda c: avoid.rfind(c[0]))
            order = ([c for c in order if c[0] == '"'] + [c for c in marks if c[0] not in avoid]
                     + used + [c for c in order if c[0] in _CLOSERS and c[0] != '"']
                     + self._alnum_after_run(order, avoid))
        finishing: set[str] = set()
        if not in_text:  # in a number or between values: first whatever ends the output at once,
            # then a newline whose forced stretch ends it (a tool-call block's closing
            # "\n]</tool_call>" rather than the ",\n" that opens another call; looking ahead
            # through every character made JSON walks 1.7x slower, and JSON takes no newline)
            for ch, t in order:
                if matcher.accept(t):
                    if matcher.is_completed():
                        finishing.add(ch)
                        yield ch
                    else:
                        matcher.rollback(1)
            for ch, t in self._newline:
                if ch in finishing or not matcher.accept(t):
                    continue
                forced = matcher.forced_string()
                forced_ids = self.encode(forced) if forced else ()
                ends = bool(forced_ids) and matcher.accept_all(forced_ids)
                if ends:
                    ends = matcher.is_completed()
                    matcher.rollback(len(forced_ids))
                if ends:
                    finishing.add(ch)
                    yield ch
                else:
                    matcher.rollback(1)
        for ch, t in order:
            if ch not in finishing and matcher.accept(t):
                yield ch


class RegexCompletions:
    """Exact shortest completions of a regex (or a choice list) from every state of its DFA.

    Built once per pattern with interegular (the spec already checked that it builds within
    bounds): a breadth-first search backwards from the accepting states gives each state its
    distance to acceptance and the character that makes progress; a request follows the DFA
    through its output text, and its completion reads off the table.
    """

    def __init__(self, pattern: str) -> None:
        import interegular
        from interegular.fsm import anything_else

        fsm = interegular.parse_pattern(pattern).to_fsm()
        self._initial = int(fsm.initial)
        self._map: dict[int, dict[int, int]] = {int(s): {int(k): int(v) for k, v in t.items()} for s, t in fsm.map.items()}
        self._keys: dict[Any, int] = {ch: key for ch, key in fsm.alphabet.items()}
        self._other = self._keys.get(anything_else)
        explicit = {ch for ch in self._keys if isinstance(ch, str)}
        # one character to write for each transition key (printable where possible)
        spelling: dict[int, str] = {}
        for ch, key in sorted(((c, k) for c, k in self._keys.items() if isinstance(c, str)),
                              key=lambda ck: (_PREFERENCE.find(ck[0]) if ck[0] in _PREFERENCE else len(_PREFERENCE), ck[0])):
            spelling.setdefault(key, ch)
        if self._other is not None:
            spelling[self._other] = next((c for c in _PREFERENCE if c not in explicit), "\u00a4")
        reverse: dict[int, list[tuple[int, int]]] = {}
        for state, moves in self._map.items():
            for key, target in moves.items():
                reverse.setdefault(target, []).append((state, key))
        self._next: dict[int, tuple[str, int]] = {}
        self._finals = frozenset(int(f) for f in fsm.finals)
        frontier = list(self._finals)
        seen: set[int] = set(frontier)
        while frontier:
            nxt: list[int] = []
            for target in frontier:
                for state, key in reverse.get(target, ()):
                    if state not in seen and key in spelling:
                        seen.add(state)
                        self._next[state] = (spelling[key], target)
                        nxt.append(state)
            frontier = nxt

    @property
    def initial(self) -> int:
        return self._initial

    def advance(self, state: int | None, text: str) -> int | None:
        """The state after ``text`` (None once the text has left the language)."""
        for ch in text:
            if state is None:
                return None
            key = self._keys.get(ch, self._other)
            state = self._map.get(state, {}).get(key) if key is not None else None
        return state

    def completion(self, state: int | None) -> str | None:
        """The shortest text that completes a match from ``state``."""
        if state is None:
            return None
        pieces = []
        while state not in self._finals:
            step = self._next.get(state)
            if step is None:
                return None
            pieces.append(step[0])
            state = step[1]
        return "".join(pieces)


class BudgetSnapshot(NamedTuple):
    """Where ``BudgetState`` stood in the text (taken before a token is followed, to go back)."""

    in_string: bool
    escape: bool
    string_chars: int
    in_key: bool
    containers: str
    key_expected: bool
    dfa_state: int | None


@dataclass
class BudgetState:
    """One request's view of its budget (updated token by token on the loop thread)."""

    is_json: bool
    dfa: RegexCompletions | None = None
    """A regex's or choice list's DFA, for exact shortest completions (None: walk the matcher)."""
    dfa_state: int | None = None
    strings: tuple[str, ...] = ()
    """The shortest matches of the schema's patterns, for walks to write whole (``Completer.complete``)."""
    completion: Completion | None = None
    """Cheapest completion from the current state (possibly from a few tokens back: see _FAR_TOKENS)."""
    stale: bool = False
    """Structure changed since ``completion`` was found (while far from the end)."""
    lexer: JsonStrings = field(default_factory=JsonStrings)
    """Where the text stands with respect to JSON strings (``radixgen/json_lexer.py``)."""
    string_chars: int = 0
    in_key: bool = False
    """The open string is an object key: its text picks the property, so it changes the completion."""
    containers: str = ""
    """The open objects and arrays, outermost first ("{[{")."""
    opened: bool = False
    """The last token scanned opened an object or an array, or started another item or property:
    the one kind of token that can make the completion much longer at once."""
    item_opened: bool = False
    """The last token scanned started another item of an array (its comma)."""
    key_expected: bool = False
    disabled: bool = False
    """The completion's tokens were refused by the automaton: this request is not steered."""
    retry_below: float = float("inf")
    """After a walk found no completion: steer again only once fewer tokens than this are left."""
    priced_at: float = float("inf")
    """The tokens left when the completion was last found by a walk."""
    priced_openings: dict[str, int] = field(default_factory=dict)
    """What a completion cost where an opening was first priced, by where it opens: a deeper
    nesting (``containers``), or another item of an array (``containers`` + ","). The same
    opening is priced again wherever the tokens left come within that cost."""
    pricing: str | None = None
    """The opening being priced now, whose cost is kept once the walk finds it."""
    steered_tokens: int = 0
    """Tokens appended by steering instead of the model's choice."""
    shortened: bool = False
    """Steering changed the output (appended tokens, or ended it where the model went on)."""

    @property
    def in_string(self) -> bool:
        return self.lexer.in_string

    def reset(self, text: str) -> None:
        """Follow ``text`` from the start (after a rollback took the output back to it)."""
        self.lexer, self.string_chars, self.in_key = JsonStrings(), 0, False
        self.containers, self.key_expected = "", False
        self.dfa_state = self.dfa.initial if self.dfa is not None else None
        self.completion = None
        self.scan(text)

    def snapshot(self) -> BudgetSnapshot:
        return BudgetSnapshot(self.lexer.in_string, self.lexer.escape, self.string_chars, self.in_key,
                              self.containers, self.key_expected, self.dfa_state)

    def restore(self, saved: BudgetSnapshot) -> None:
        self.lexer = JsonStrings(saved.in_string, saved.escape)
        self.string_chars, self.in_key, self.containers = saved.string_chars, saved.in_key, saved.containers
        self.key_expected, self.dfa_state = saved.key_expected, saved.dfa_state

    def scan(self, text: str) -> bool:
        """Follow the text of one token; True when the completion may have changed (for JSON,
        when the token touched structure: anything outside a string value, or a quote)."""
        if self.dfa is not None:
            self.dfa_state = self.dfa.advance(self.dfa_state, text)
            return True
        if not self.is_json:
            return True
        touched = False
        self.opened = self.item_opened = False
        lexer = self.lexer
        for ch in text:
            kind = lexer.step(ch)
            if kind in (OUTSIDE, OPEN):
                touched = True
                self.opened = self.opened or ch in "{[,"
                if kind == OPEN:
                    # a key opens right after "{" or after a comma inside an object
                    self.in_key = self.containers.endswith("{") and self.key_expected
                    self.string_chars = 0
                elif ch in "{[":
                    self.containers += ch
                    self.key_expected = ch == "{"
                elif ch in "}]":
                    self.containers = self.containers[:-1]
                elif ch == ",":
                    self.key_expected = True
                    self.item_opened = self.item_opened or self.containers.endswith("[")
                elif ch == ":":
                    self.key_expected = False
                continue
            touched = touched or self.in_key
            if kind == CONTENT:
                self.string_chars += 1
            elif kind == CLOSE:
                touched, self.key_expected = True, False
        return touched


MAX_PATTERN_EXAMPLES = 16
PATTERN_EXAMPLES_S = 0.1
"""At most this long for all of a schema's pattern examples: they are found on the engine's loop
thread when a schema is first attached (then cached with its shortest output)."""


def pattern_examples(schema: Any) -> tuple[str, ...]:
    """The shortest text each ``pattern`` in ``schema`` matches as a whole, shortest first, as
    JSON string content (escaped), for budget completions to write where a pattern wants one.
    Patterns interegular cannot read, or only with too many states, are left out."""
    found: set[str] = set()
    stack = [schema]
    patterns: list[str] = []
    while stack and len(patterns) < MAX_PATTERN_EXAMPLES:
        node = stack.pop()
        if isinstance(node, dict):
            if isinstance(node.get("pattern"), str):
                patterns.append(node["pattern"])
            stack.extend(v for k, v in node.items() if k not in ("enum", "const", "default", "examples"))
        elif isinstance(node, list):
            stack.extend(node)
    deadline = time.monotonic() + PATTERN_EXAMPLES_S
    # short patterns first: a huge character class (a 10,000-character unicode "letter" class)
    # must not use up the time the others need
    # each top-level alternative on its own: "(^Hpt_|^Int_|_Armour_)" has three shortest matches,
    # and interegular reads no anchor but the ones at a branch's ends
    branches = [branch for pattern in patterns for branch in pattern_branches(pattern)]
    for branch in sorted(branches, key=len):
        if time.monotonic() > deadline:
            break
        core = branch[1:] if branch.startswith("^") else branch
        core = core[:-1] if core.endswith("$") and not core.endswith("\\$") else core
        try:
            # backwards from the accepting states, linear in the automaton (enumerating its
            # strings breadth-first grows with the alphabet to the power of the length: a UUID
            # pattern took the engine to 24 GB)
            with state_budget(MAX_REGEX_STATES // 8, PATTERN_EXAMPLES_S):
                completions = RegexCompletions(core)
            text = completions.completion(completions.initial)
        except Exception:  # noqa: BLE001 - unreadable, unsupported or too large: no example
            continue
        if text is not None:
            found.add(json.dumps(text)[1:-1])
    return tuple(sorted(found, key=len))
