"""Tool-call formats by model family, shared by the server and the DSL.

A model calls tools in the format it was trained on. Each family's format is one ``CallFormat``:
its trigger (what starts a call inside free text), how calls are framed, the structural
constraint that makes every call name a tool and match its schema (``constraints.structural``),
how tools are described to it when its chat template cannot, and a streaming parser that turns
the constrained output back into content and calls. ``detect`` picks the format of a tokenizer's
chat template by rendering a probe conversation (a probe tool and an assistant call to it) and
reading how the template lays the call out; a template that renders no calls (the bundled
SmolLM2's ChatML) gets SmolLM2's documented format, with the tools described in a system message.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field, replace
from typing import Any

from radixgen.json_lexer import OUTSIDE, JsonStrings

_PROBE_NAME = "radixgen_probe_tool"
_PROBE_DESCRIPTION = "radixgen probe description"
_PROBE_ARGUMENT = "radixgen_probe_argument"


@dataclass(frozen=True)
class CallFormat:
    name: str
    trigger: str
    """Text that starts a call block inside free text."""
    block_begin: str
    block_end: str
    separator: str | None
    """Between the calls of one block (a JSON list); None: one call per block."""
    arguments_key: str = "arguments"
    template_renders_tools: bool = False
    """The chat template describes the tools and renders earlier calls itself (else we do)."""

    def call_begin(self, name: str) -> str:
        return '{"name": ' + json.dumps(name) + ', "' + self.arguments_key + '": '

    call_end = "}"

    def structure(self, tools: list[tuple[str, dict[str, Any]]], *, free_text: bool, min_calls: int,
                  max_calls: int | None) -> dict[str, Any]:
        """The tool-call part of a structural constraint for ``tools`` ((name, parameters schema))."""
        return {"trigger": self.trigger, "block_begin": self.block_begin, "block_end": self.block_end,
                "separator": self.separator, "free_text": free_text, "min_calls": min_calls, "max_calls": max_calls,
                "calls": [{"name": name, "begin": self.call_begin(name), "schema": schema, "end": self.call_end}
                          for name, schema in tools]}

    def render_calls(self, calls: list[tuple[str, str]]) -> str:
        """Earlier calls ((name, arguments JSON)) as the model writes them, for templates that
        do not render tool calls."""
        rendered = [self.call_begin(name) + (arguments or "{}") + self.call_end for name, arguments in calls]
        if self.separator is not None:
            return self.block_begin + self.separator.join(rendered) + self.block_end
        return "\n".join(self.block_begin + r + self.block_end for r in rendered)

    def system_prompt(self, tools: list[dict[str, Any]]) -> str:
        """The tools described in the words of the family's own tool prompt (SmolLM2's
        instructions_function_calling.md lays out this one: the tools as JSON inside <tools>,
        the calls as a JSON list inside <tool_call>)."""
        listed = json.dumps(tools)
        example = self.render_calls([("tool_name", '{"argument": "value"}'),
                                     ("tool_name", '{"argument": "another value"}')])
        return ("You can call functions to answer. These are the functions you may call:\n"
                f"<tools>{listed}</tools>\n"
                "When a function call helps, reply with the calls and nothing else, one call for each thing "
                f"asked, in this format:\n{example}\n"
                "Give each argument the type its parameter declares. "
                "When no function fits the question, answer it in plain text.")

    def parser(self) -> CallParser:
        return CallParser(self)


# ---- the scored call decision (the server's tool_decision and the DSL's run_tools) ---------

BASELINE_QUESTION = "Hello."
"""The content-free question a call's score is measured against."""
DEFAULT_CALL_THRESHOLD = -1.0
"""Nats by which a call's opening must be likelier after the question than after the baseline.
Measured on SmolLM2-135M-Instruct with three tools (tests/api/test_tools_real.py's questions):
questions a tool answers scored -4.9 to 7.1 (eight of ten at -1 or more), others -13.3 to -2.2."""


def call_opening(fmt: CallFormat, name: str) -> str:
    """The text that commits the model to calling ``name``, scored by the decision."""
    return fmt.block_begin + '{"name": ' + json.dumps(name)


def best_call(question: list[float], baseline: list[float], threshold: float) -> tuple[int, float, bool]:
    """(the best tool's index, its gain, whether the gain reaches ``threshold``) from each tool's
    call-opening log-probability after the question and after the baseline question."""
    # a score that could not be taken (-inf) says nothing: its tool gains nothing
    gains = [q - b if math.isfinite(q) and math.isfinite(b) else -math.inf
             for q, b in zip(question, baseline, strict=True)]
    gain, best = max((g, i) for i, g in enumerate(gains))
    return best, gain, gain >= threshold and math.isfinite(gain)


SMOLLM2 = CallFormat("smollm2", "<tool_call>", "<tool_call>[\n", "\n]</tool_call>", ",\n")
HERMES = CallFormat("hermes", "<tool_call>", "<tool_call>\n", "\n</tool_call>", None)
LLAMA3 = CallFormat("llama3", '{"name": ', "", "", None, arguments_key="parameters")
LLAMA3_PYTHON_TAG = CallFormat("llama3", "<|python_tag|>", "<|python_tag|>", "", None, arguments_key="parameters")
MISTRAL = CallFormat("mistral", "[TOOL_CALLS]", "[TOOL_CALLS][", "]", ", ")

GENERIC = SMOLLM2
"""For templates that render no tool calls: the bundled model's own documented format."""


def detect(tokenizer: Any) -> CallFormat:
    """The call format of ``tokenizer``'s chat template (see the module docstring)."""
    template = getattr(tokenizer, "chat_template", None)
    if not template:
        return GENERIC
    probe_tool = {"type": "function", "function": {"name": _PROBE_NAME, "description": _PROBE_DESCRIPTION,
                                                   "parameters": {"type": "object", "properties": {
                                                       _PROBE_ARGUMENT: {"type": "string"}}}}}
    question = {"role": "user", "content": "radixgen probe question"}
    call = {"role": "assistant", "content": "", "tool_calls": [
        {"id": "call0radixgen", "type": "function",
         "function": {"name": _PROBE_NAME, "arguments": {_PROBE_ARGUMENT: "v"}}}]}
    try:
        with_tools = tokenizer.apply_chat_template([question], tools=[probe_tool], tokenize=False,
                                                   add_generation_prompt=True)
        answered = tokenizer.apply_chat_template([question, call], tokenize=False)
    except Exception:  # noqa: BLE001 - a template that refuses the probe renders no tools
        return GENERIC
    renders_tools = _PROBE_DESCRIPTION in with_tools
    at = answered.find(_PROBE_NAME, answered.find(question["content"]))
    if at < 0:
        return GENERIC
    before = answered[max(0, at - 64):at]
    around = answered[max(0, at - 64):at + 160]
    if "[TOOL_CALLS]" in before:
        found = MISTRAL
    elif "<tool_call>" in before:
        found = SMOLLM2 if re.search(r"<tool_call>\s*\[", before) else HERMES
    elif '"parameters"' in around:
        found = LLAMA3_PYTHON_TAG if "<|python_tag|>" in before else LLAMA3
    else:  # a layout we do not know: describe the tools ourselves, in the generic format
        return GENERIC
    return replace(found, template_renders_tools=renders_tools)


# ---- parsing ------------------------------------------------------------------------------


@dataclass
class ParsedCall:
    name: str
    arguments: str = ""
    """The arguments JSON exactly as generated (streamed deltas concatenate to it)."""
    complete: bool = False


@dataclass
class CallEvents:
    """What one piece of output added: content text, started calls (index, name), argument text."""

    content: str = ""
    started: list[tuple[int, str]] = field(default_factory=list)
    arguments: list[tuple[int, str]] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.content or self.started or self.arguments)


_NAME = r'"(?:[^"\\]|\\.)*"'


class CallParser:
    """Content and calls from a format's output, piece by piece as it streams.

    The structural constraint makes the output exact (the framing strings are forced), so the
    parser reads the framing literally; an answer cut inside a call (max_tokens) keeps the call
    it was writing, incomplete. Text that opens like a trigger but does not go on as one stays
    content."""

    _TEXT, _BLOCK, _HEAD, _ARGS, _TAIL = range(5)

    def __init__(self, fmt: CallFormat) -> None:
        self.fmt = fmt
        # the constraint forces call_begin literally: read it so, whichever piece it arrives in
        self._head = re.compile(re.escape('{"name": ') + f"({_NAME})" + re.escape(f', "{fmt.arguments_key}": '))
        self.content = ""
        self.calls: list[ParsedCall] = []
        self._buf = ""
        self._state = self._TEXT
        self._depth = 0
        self._strings = JsonStrings()

    def feed(self, text: str) -> CallEvents:
        events = CallEvents()
        self._buf += text
        progressed = True
        while progressed and self._buf:
            progressed = self._step(events)
        return events

    def finish(self) -> CallEvents:
        """The end of the output: text held back as a possible trigger is content after all."""
        events = CallEvents()
        held = self._state in (self._TEXT, self._BLOCK, self._HEAD) and self._buf
        if held and (self._state == self._TEXT or not self.calls or self.calls[-1].complete):
            events.content, self._buf = self._buf, ""
            self.content += events.content
        return events

    def _step(self, events: CallEvents) -> bool:
        fmt, buf = self.fmt, self._buf
        if self._state == self._TEXT:
            at = buf.find(fmt.trigger)
            if at < 0:
                keep = _partial_suffix(buf, fmt.trigger)
                self._emit_content(events, buf[: len(buf) - keep])
                self._buf = buf[len(buf) - keep:]
                return False
            self._emit_content(events, buf[:at])
            self._buf, self._state = buf[at:], self._BLOCK
            return True
        if self._state == self._BLOCK:
            if buf.startswith(fmt.block_begin):
                self._buf, self._state = buf[len(fmt.block_begin):], self._HEAD
                return True
            if fmt.block_begin.startswith(buf):
                return False  # more to come
            self._emit_content(events, buf[: len(fmt.trigger)])  # not a call after all
            self._buf, self._state = buf[len(fmt.trigger):], self._TEXT
            return True
        if self._state == self._HEAD:
            head = self._head.match(buf)
            if head is None:
                return False
            self.calls.append(ParsedCall(json.loads(head.group(1))))
            events.started.append((len(self.calls) - 1, self.calls[-1].name))
            self._buf, self._state = buf[head.end():], self._ARGS
            self._depth, self._strings = 0, JsonStrings()
            return True
        if self._state == self._ARGS:
            end = self._scan_value(buf)
            taken = buf if end is None else buf[:end]
            if taken:
                self.calls[-1].arguments += taken
                events.arguments.append((len(self.calls) - 1, taken))
            self._buf = "" if end is None else buf[end:]
            if end is None:
                return False
            self._state = self._TAIL
            return True
        # _TAIL: the call's end, then another call of the block, or the block's end
        stripped = buf.lstrip(" ")
        if not stripped.startswith(fmt.call_end):
            return False
        rest = stripped[len(fmt.call_end):]
        if fmt.separator is not None and rest.startswith(fmt.separator):
            self.calls[-1].complete = True
            self._buf, self._state = rest[len(fmt.separator):], self._HEAD
            return True
        if rest.startswith(fmt.block_end):
            self.calls[-1].complete = True
            self._buf, self._state = rest[len(fmt.block_end):], self._TEXT
            return True
        return False

    def _scan_value(self, text: str) -> int | None:
        """Where the arguments value ends in ``text`` (None: not yet)."""
        strings = self._strings
        for i, ch in enumerate(text):
            if strings.step(ch) != OUTSIDE:
                continue
            if ch in "{[":
                self._depth += 1
            elif ch in "}]":
                self._depth -= 1
                if self._depth == 0:
                    return i + 1
        return None

    def _emit_content(self, events: CallEvents, text: str) -> None:
        if text:
            events.content += text
            self.content += text


def _partial_suffix(text: str, marker: str) -> int:
    """Length of the longest end of ``text`` that begins ``marker`` (held back: it may be one)."""
    for n in range(min(len(text), len(marker) - 1), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0


def parse(fmt: CallFormat, text: str) -> tuple[str, list[ParsedCall]]:
    """Content and calls of a finished output."""
    parser = fmt.parser()
    parser.feed(text)
    parser.finish()
    return parser.content, parser.calls
