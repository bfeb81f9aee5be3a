"""Structural constraints: an output made of parts, of which only some are constrained.

Two shapes, both backend-neutral dicts (``structural_spec`` checks and normalises them):

- **tool calls inside free text** (``{"tool_calls": {...}}``): text until the model writes the
  call format's trigger (``<tool_call>``, ``[TOOL_CALLS]``, ``{"name": ``), then a call block
  whose every call names one of the tools and whose arguments match that tool's schema; after
  the block the text goes on and another block may start (unless ``max_calls`` is 1). With
  ``free_text`` false the output is calls only (``tool_choice="required"`` or a named tool).
- **a call block or the JSON answer** (both ``tool_calls``, with ``free_text`` false, and
  ``json_schema``): ``tool_choice="auto"`` with a ``response_format`` — the model either calls
  tools or gives the final answer in the requested schema, as OpenAI's API allows.
- **a reasoning section first** (``"reasoning": {"begin": "<think>", "end": "</think>"}``):
  free text up to the end marker, then the rest (tool calls, or ``{"json_schema": ...}``) is
  constrained: a thinking model reasons unconstrained and answers under the constraint.

A tool-call block is ``block_begin`` + call (``separator`` + call)* + ``block_end`` when the
family lists several calls in one block (SmolLM2's and Mistral's JSON lists), or one call per
block (``separator`` None: Hermes' ``<tool_call>`` tags). Each call is ``begin`` (its name is in
it: ``{"name": "get_weather", "arguments": ``) + arguments JSON + ``end``.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from radixgen.constraints.schema_rewrite import GrammarOptions, grammar_schema
from radixgen.constraints.spec import ConstraintSpec, schema_spec
from radixgen.errors import InvalidConstraintError

_JSON_WHITESPACE = 1
"""Whitespace characters allowed in a row inside generated JSON: a model cannot pad a call's
arguments with newlines until max_tokens."""


@dataclass(frozen=True)
class CallSpec:
    """One tool's call: ``begin`` (its name is in it) + arguments matching ``schema`` + ``end``."""

    name: str
    begin: str
    end: str
    schema: Any


@dataclass(frozen=True)
class ToolCalls:
    trigger: str
    """What the model writes to start a call block (a prefix of ``block_begin``)."""
    block_begin: str
    block_end: str
    calls: tuple[CallSpec, ...]
    separator: str | None = None
    """Between the calls of one block (None: one call per block)."""
    min_calls: int = 0
    max_calls: int | None = None
    free_text: bool = True
    """Text may come before and between the blocks (False: calls only)."""


@dataclass(frozen=True)
class ReasoningSection:
    begin: str
    end: str


@dataclass(frozen=True)
class Structure:
    """A structural constraint, parsed once from its dict form (the module docstring)."""

    tool_calls: ToolCalls | None
    json_schema: Any | None
    """The JSON answer's schema (None: no JSON answer)."""
    reasoning: ReasoningSection | None


def structural_spec(structure: Any) -> ConstraintSpec:
    """Check a structure (see the module docstring) and key it by its canonical JSON."""
    parsed = parse_structure(structure)
    depth = schema_spec(parsed.json_schema).depth if parsed.json_schema is not None else 0
    for call in parsed.tool_calls.calls if parsed.tool_calls is not None else ():
        depth = max(depth, schema_spec(call.schema).depth)
    return ConstraintSpec("structural", json.dumps(structure, separators=(",", ":")), depth)


@functools.lru_cache(maxsize=256)
def _parsed(value: str) -> Structure:
    return parse_structure(json.loads(value))


def structure_of(spec: ConstraintSpec) -> Structure:
    """A structural spec's structure, parsed once per distinct spec."""
    assert spec.kind == "structural"
    return _parsed(spec.value)


def parse_structure(structure: Any) -> Structure:
    """The dict form checked, as a ``Structure``; a clear error naming the field otherwise."""
    if not isinstance(structure, dict):
        raise InvalidConstraintError(f"structural must be an object, got {type(structure).__name__}")
    unknown = set(structure) - {"reasoning", "tool_calls", "json_schema"}
    if unknown:
        raise InvalidConstraintError(f"structural has unknown parts {sorted(unknown)}; "
                                     "use reasoning, tool_calls or json_schema")
    if "tool_calls" not in structure and "json_schema" not in structure:
        raise InvalidConstraintError("structural needs tool_calls, json_schema, or both (a call block or the "
                                     "JSON answer)")
    reasoning = structure.get("reasoning")
    if reasoning is not None:
        _strings(reasoning, "structural.reasoning", ("begin", "end"))
        if not reasoning["end"]:
            raise InvalidConstraintError("structural.reasoning.end must be a non-empty marker")
    json_schema = structure.get("json_schema")
    if "json_schema" in structure and json_schema is None:
        raise InvalidConstraintError("structural.json_schema must be a schema, got null")
    tool_calls = _parse_tool_calls(structure["tool_calls"]) if "tool_calls" in structure else None
    if tool_calls is not None and json_schema is not None and tool_calls.free_text:
        raise InvalidConstraintError("structural.tool_calls.free_text must be false next to json_schema: "
                                     "the output is a call block or the JSON answer")
    return Structure(tool_calls, json_schema,
                     ReasoningSection(reasoning["begin"], reasoning["end"]) if reasoning is not None else None)


def _parse_tool_calls(calls: Any) -> ToolCalls:
    _strings(calls, "structural.tool_calls", ("trigger", "block_begin", "block_end"))
    begins_with_trigger = not calls["block_begin"] or calls["block_begin"].startswith(calls["trigger"])
    if not calls["trigger"] or not begins_with_trigger:
        raise InvalidConstraintError("structural.tool_calls.trigger must be a non-empty prefix of block_begin")
    if not isinstance(calls.get("calls"), list) or not calls["calls"]:
        raise InvalidConstraintError("structural.tool_calls.calls must be a non-empty list")
    formats = []
    for i, call in enumerate(calls["calls"]):
        _strings(call, f"structural.tool_calls.calls[{i}]", ("name", "begin", "end"))
        if not calls["block_begin"] and not call["begin"].startswith(calls["trigger"]):
            raise InvalidConstraintError(f"structural.tool_calls.calls[{i}].begin must start with the trigger")
        formats.append(CallSpec(call["name"], call["begin"], call["end"], call.get("schema", {})))
    if calls.get("min_calls", 0) not in (0, 1) or calls.get("max_calls") not in (None, 1):
        raise InvalidConstraintError("structural.tool_calls: min_calls is 0 or 1, max_calls 1 or null")
    return ToolCalls(calls["trigger"], calls["block_begin"], calls["block_end"], tuple(formats),
                     calls.get("separator"), calls.get("min_calls", 0), calls.get("max_calls"),
                     bool(calls.get("free_text", True)))


def structural_parts(structure: Structure) -> list[tuple[str | None, Any]]:
    """The JSON parts of a structure with their schemas: the answer (named None) and each tool's
    arguments (named by the tool)."""
    answer = [(None, structure.json_schema)] if structure.json_schema is not None else []
    calls = structure.tool_calls.calls if structure.tool_calls is not None else ()
    return answer + [(call.name, call.schema) for call in calls]


def _strings(part: Any, where: str, names: tuple[str, ...]) -> None:
    if not isinstance(part, dict) or not all(isinstance(part.get(n), str) for n in names):
        raise InvalidConstraintError(f"{where} must be an object with string fields {', '.join(names)}")


def xgrammar_structural_tag(structure: Structure, options: GrammarOptions) -> dict[str, Any]:
    """The structure as xgrammar's structural tag (its triggered tags express the free text
    that a trigger ends; tags_with_separator the calls of one block)."""

    def json_format(schema: Any) -> dict[str, Any]:
        return {"type": "json_schema", "json_schema": grammar_schema(schema, options),
                "max_whitespace_cnt": _JSON_WHITESPACE}

    answer = json_format(structure.json_schema) if structure.json_schema is not None else None
    body = answer
    spec = structure.tool_calls
    if spec is not None:
        single = spec.max_calls == 1

        def call_tag(call: CallSpec, before: str = "", after: str = "") -> dict[str, Any]:
            return {"type": "tag", "begin": before + call.begin, "content": json_format(call.schema),
                    "end": call.end + after}

        if spec.separator is not None:
            calls = {"type": "tags_with_separator", "tags": [call_tag(c) for c in spec.calls],
                     "separator": spec.separator, "at_least_one": True, "stop_after_first": single}
            blocks = [{"type": "tag", "begin": spec.block_begin, "content": calls, "end": spec.block_end}]
            one_block = True
        else:
            blocks = [call_tag(c, spec.block_begin, spec.block_end) for c in spec.calls]
            one_block = single
        body = {"type": "triggered_tags", "triggers": [spec.trigger], "tags": blocks,
                "at_least_one": bool(spec.min_calls) or not spec.free_text, "stop_after_first": one_block}
        if answer is not None:
            body = {"type": "or", "elements": [body, answer]}
    reasoning = structure.reasoning
    if reasoning is not None:
        body = {"type": "sequence", "elements": [
            # thinking models leave a blank line or two after the section
            {"type": "tag", "begin": reasoning.begin, "content": {"type": "any_text"},
             "end": [reasoning.end + "\n\n", reasoning.end + "\n", reasoning.end]},
            body]}
    return {"type": "structural_tag", "format": body}


def _free_text_lark(trigger: str, trigger_is_a_token: bool) -> tuple[list[str], str]:
    """The rules for free text (``TEXT``: text without the trigger ``trigger``, a Lark literal)
    and the expression for the text up to and including the trigger."""
    if trigger_is_a_token:  # text cannot spell a special token
        return ["TEXT: /(?s:.+)/"], f"TEXT? {trigger}"
    return [f"text_to_trigger[suffix={trigger}]: /(?s:.*)/",
            f"TEXT: /(?s:.+)/ & ~(/(?s:.*)/ {trigger} /(?s:.*)/)"], "text_to_trigger"


def llguidance_structural_lark(structure: Structure, options: GrammarOptions, json_options: dict[str, Any],
                               special_token_id: Callable[[str], int | None]) -> str:
    """The structure as an llguidance Lark grammar. Free text is a lazy lexeme that ends with
    the trigger (llguidance's lexer is greedy, so text and a call opener that could both go on
    must be one lexeme whose end is the trigger); the text after the last call is a lexeme that
    cannot contain the trigger. ``special_token_id`` names the markers that are one special
    token of the tokenizer (``[TOOL_CALLS]``, ``<|python_tag|>``): those are matched as tokens.

    With ``free_text`` false the output is calls only (xgrammar's triggered tags also let text
    follow the first call there)."""
    rules: list[str] = []

    def literal(text: str) -> str:
        if not text:
            return ""
        token = special_token_id(text)
        return f"<[{token}]>" if token is not None else json.dumps(text, ensure_ascii=False)

    def json_rule(name: str, schema: Any) -> str:
        compiled = grammar_schema(schema, options)
        if isinstance(compiled, dict):
            compiled = {**compiled, "x-guidance": json_options}
        rules.append(f"{name}: %json {json.dumps(compiled)}")
        return name

    def seq(*parts: str) -> str:
        return " ".join(p for p in parts if p)

    body = json_rule("answer", structure.json_schema) if structure.json_schema is not None else ""
    spec = structure.tool_calls
    if spec is not None:
        trigger, head = spec.trigger, spec.block_begin
        single = spec.max_calls == 1

        def calls_rule(name: str, strip_trigger: bool, before: str = "", after: str = "") -> str:
            alternatives = []
            for i, call in enumerate(spec.calls):
                opener = before + call.begin
                opener = opener[len(trigger):] if strip_trigger else opener
                alternatives.append(seq(literal(opener), json_rule(f"{name}_args_{i}", call.schema),
                                        literal(call.end + after)))
            rules.append(f"{name}: " + " | ".join(alternatives))
            return name

        # a block whose trigger has been written already
        if spec.separator is not None:
            call = calls_rule("call", False)
            first = call if head else calls_rule("first_call", True)
            more = "" if single else f"({seq(literal(spec.separator), call)})*"
            rules.append("block: " + seq(literal(head[len(trigger):]), first, more, literal(spec.block_end)))
            one_block = True
        else:
            calls_rule("block", True, head, spec.block_end)
            one_block = single
        text_rules, to_trigger = _free_text_lark(literal(trigger), special_token_id(trigger) is not None)
        rules += text_rules
        opened = f"{literal(trigger)} block"
        if not spec.free_text:
            calls = opened if one_block else f"{opened} (/[ \\n]/? {opened})*"
        else:
            rest = "" if one_block else f"({to_trigger} block)* TEXT?"
            if spec.min_calls:
                calls = seq(opened, rest)
            else:
                calls = f"TEXT? | {to_trigger} block" if one_block else rest
        rules.append(f"calls: {calls}")
        body = f"calls | {body}" if body else "calls"
    reasoning = structure.reasoning
    if reasoning is not None:
        rules.append(f"thinking[suffix={literal(reasoning.end)}]: /(?s:.*)/")
        # thinking models leave a blank line or two after the section
        rules.append(f"reasoning: {literal(reasoning.begin)} thinking /\\n\\n?/?")
        rules.append(f"after_reasoning: {body}")
        body = "reasoning after_reasoning"
    return "\n".join([f"start: {body}", *rules])
