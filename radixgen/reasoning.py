"""Reasoning sections (``<think>...</think>``) of thinking models' chat templates.

Their text comes back apart from the answer (``reasoning_content``) and is never constrained:
a request's constraint (response_format, tool calls) starts where the section closes."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

_BEGIN, _END = "<think>", "</think>"


@dataclass(frozen=True)
class ReasoningMarkers:
    begin: str
    """What the model writes to open the section ('' when the generation prompt opened it)."""
    end: str

    def structure(self) -> dict[str, str]:
        return {"begin": self.begin, "end": self.end}


def detect(tokenizer: Any) -> ReasoningMarkers | None:
    """The template's reasoning markers, None when it has no thinking section."""
    template = getattr(tokenizer, "chat_template", None)
    if not isinstance(template, str) or _END not in template:
        return None
    try:
        prompt = tokenizer.apply_chat_template([{"role": "user", "content": "q"}], tokenize=False,
                                               add_generation_prompt=True)
    except Exception:  # noqa: BLE001 - a template that cannot render a question has no usable section
        return None
    opened = prompt.rstrip().endswith(_BEGIN)
    return ReasoningMarkers("" if opened else _BEGIN, _END)


class ReasoningSplitter:
    """Splits a streamed output into the reasoning section and the answer after it."""

    def __init__(self, markers: ReasoningMarkers) -> None:
        self.markers = markers
        self.reasoning = ""
        self._buf = ""
        self._opened = not markers.begin
        self._closed = False

    def feed(self, text: str) -> tuple[str, str]:
        """(reasoning text, answer text) this piece adds."""
        if self._closed:
            return "", text
        self._buf += text
        if not self._opened:
            head = self._buf.lstrip()
            if head.startswith(self.markers.begin):
                self._buf, self._opened = head[len(self.markers.begin):].lstrip("\n"), True
            elif self.markers.begin.startswith(head):
                return "", ""  # the opening marker may be on its way
            else:  # no section: an unconstrained model answered straight away
                rest, self._buf, self._closed = self._buf, "", True
                return "", rest
        at = self._buf.find(self.markers.end)
        if at >= 0:
            thought, rest = self._buf[:at], self._buf[at + len(self.markers.end):]
            self._buf, self._closed = "", True
            self.reasoning += thought
            return thought, rest.lstrip("\n")
        keep = next((n for n in range(min(len(self._buf), len(self.markers.end) - 1), 0, -1)
                     if self.markers.end.startswith(self._buf[-n:])), 0)
        thought, self._buf = self._buf[: len(self._buf) - keep], self._buf[len(self._buf) - keep:]
        if not self.reasoning:
            thought = thought.lstrip("\n")
        self.reasoning += thought
        return thought, ""

    def finish(self) -> str:
        """Reasoning held back at the end (an output cut inside its section)."""
        thought, self._buf = ("" if self._closed else self._buf), ""
        self.reasoning += thought
        return thought
