"""Validators over the JSON parts of a structural output (constraints/structural.py): each tool
call's arguments and the JSON answer are checked against their own schema as they are generated,
as a json_schema output is (constraints/events.py), where the grammar does not enforce the
schema itself (uniqueItems, multipleOf, a pattern in another dialect...).

The grammar guarantees the layout, so finding the parts is a walk over markers: the reasoning
section's end, then the trigger (a block of calls starts there) or the answer's first
character; inside a block each call's opener, after which its arguments are one JSON document
whose end the scanner reports. A rejection's offset is in the whole output's text.
"""

from __future__ import annotations

from dataclasses import replace

from radixgen.constraints.events import Rejection, RepeatedItems, SchemaValidators, Validation
from radixgen.constraints.structural import Structure


class StructuralValidation:
    """One request's validators over a structural output (the ``Validation`` interface)."""

    def __init__(self, structure: Structure, validators: dict[str | None, SchemaValidators],
                 repeated_items: RepeatedItems = "unique") -> None:
        """``validators`` maps a tool's name (None: the JSON answer) to its schema's validators;
        parts without an entry are not checked."""
        self._structure, self._validators, self._repeats = structure, validators, repeated_items
        calls = structure.tool_calls
        self._trigger: str | None = calls.trigger if calls else None
        self._openers = [(c.begin, c.name) for c in calls.calls] if calls else []
        self._ends = {c.name: c.end for c in calls.calls} if calls else {}
        self._separator: str | None = calls.separator if calls else None
        self._block_end: str = calls.block_end if calls else ""
        self.reset("")

    def reset(self, text: str) -> None:
        """Re-scan from scratch (after a rollback); verdicts on this text are dropped: it was
        accepted before."""
        self.text = ""
        self._pos = 0  # where the search for the next marker resumes
        self._state = "reasoning" if self._structure.reasoning is not None else "start"
        self._part: Validation | None = None
        self._part_start = 0
        self._part_name: str | None = None
        self._advance(text, check=False)

    @property
    def settled(self) -> int:
        """Chars of the output no rejection can reach back into: all of it but the part being
        checked (a rejection lands inside the part whose value it refuses)."""
        return self._part_start if self._part is not None else len(self.text)

    def feed(self, text: str, *, final: bool = False) -> Rejection | None:
        return self._advance(text, check=True, final=final)

    def _advance(self, new: str, *, check: bool, final: bool = False) -> Rejection | None:
        self.text += new
        while self._part is not None or self._find_next_part():
            rejection = self._feed_part(check, final)
            if rejection is not None or self._part is not None:
                return rejection
        return None

    def _feed_part(self, check: bool, final: bool) -> Rejection | None:
        """Feed the open part the text it has not seen, closing it where its document ends
        (the rest is markers or text). Rescanning after a rollback feeds the same way and drops
        the verdicts: that text was accepted before."""
        part = self._part
        assert part is not None
        for ch in self.text[self._part_start + len(part.scanner.text):]:
            rejection = part.feed(ch)
            if rejection is not None and check:
                return replace(rejection, start=rejection.start + self._part_start,
                           end=rejection.end + self._part_start if rejection.end >= 0 else -1)
            if part.scanner.done:
                self._pos = self._part_start + len(part.scanner.text)
                self._part = None
                self._state = "after_call" if self._state == "call" else "done"
                return None
        rejection = part.feed("", final=True) if final else None
        if rejection is not None and check:
            return replace(rejection, start=rejection.start + self._part_start,
                           end=rejection.end + self._part_start if rejection.end >= 0 else -1)
        return None

    def _find_next_part(self) -> bool:
        """Move past markers to the next JSON part; True when one opened."""
        text = self.text
        if self._state == "reasoning":
            assert self._structure.reasoning is not None
            end_marker = self._structure.reasoning.end
            end = text.find(end_marker, self._pos)
            if end < 0:
                return False
            self._pos, self._state = end + len(end_marker), "start"
        if self._state == "start":
            rest = text[self._pos:].lstrip()
            if not rest:
                return False
            trigger = self._trigger
            if trigger is not None and trigger.startswith(rest[:len(trigger)]):
                if len(rest) < len(trigger):
                    return False  # maybe the trigger: wait for more
                self._state = "text"
            elif self._structure.json_schema is not None:
                self._state = "answer"
                self._open(len(text) - len(rest), None)
                return True
            else:
                self._state = "text"
        if self._state == "after_call":
            # the call's end, then another call of the block or the block's end (text may follow)
            rest = text[self._pos:]
            call_end = self._ends[self._part_name or ""]
            if self._separator is not None and rest.startswith(call_end + self._separator):
                self._pos, self._state = self._pos + len(call_end + self._separator), "block"
            elif rest.startswith(call_end + self._block_end):
                self._pos, self._state = self._pos + len(call_end + self._block_end), "text"
            else:
                return False  # not all written yet
        if self._state == "text":
            assert self._trigger is not None
            found = text.find(self._trigger, self._pos)
            if found < 0:
                return False
            self._pos, self._state = found, "block"
        if self._state == "block":
            openings = [(at, opener, name) for opener, name in self._openers
                        if (at := text.find(opener, self._pos)) >= 0]
            if not openings:
                return False
            at, opener, name = min(openings)
            self._state = "call"
            self._open(at + len(opener), name)
            return True
        return False

    def _open(self, start: int, name: str | None) -> None:
        self._part_start = start
        self._part = Validation(schema=self._validators.get(name), repeated_items=self._repeats)
        self._part_name = name
