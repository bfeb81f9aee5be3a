"""Typed Python functions as tools, and the loop that lets a model call them.

``tool(fn)`` reads the function's annotations (or its single pydantic-model parameter) into a
pydantic model of its arguments and its docstring into a description. ``run_tools`` asks the
model a question with the tools described as ``radixgen serve`` describes them to models whose
chat template knows no tools (``tool_formats.GENERIC``, SmolLM2's documented format), then per
turn:

- decides whether the model calls a tool, as the server decides for ``tool_choice="auto"``
  (``api/tool_decision.py``): each tool's call opening is scored after the question and after a
  content-free one; the best tool's gain must reach the threshold (a call is required on the
  first turn with ``tool_choice="required"``; after a tool's result the model answers);
- picks the tool with ``select`` over the tool names (the model's scores);
- generates the arguments under the tool's JSON schema, with the pydantic validators running in
  the decode loop (an out-of-range value is rolled back and resampled, not returned), framed as
  the format writes a call;
- runs the function and appends its result the way the server shows a tool's result to such a
  model (a user message in ``<tool_response>`` tags); the model goes on until it answers or
  ``max_calls`` is reached (then it must answer).
"""

from __future__ import annotations

import inspect
import json
import sys
import typing
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from pydantic import BaseModel, create_model

from radixgen import tool_formats
from radixgen.lang.backends import Backend
from radixgen.lang.ir import gen, select
from radixgen.lang.program import function
from radixgen.lang.state import ProgramState


@dataclass(frozen=True)
class Tool:
    name: str
    description: str
    parameters: type[BaseModel]
    fn: Callable[..., Any]
    takes_model: bool = False
    """The function takes the arguments model itself rather than its fields as keywords."""

    def schema(self) -> dict[str, Any]:
        return self.parameters.model_json_schema()

    def openai(self) -> dict[str, Any]:
        """The tool in OpenAI's ``tools`` format (for the chat completions API)."""
        return {"type": "function", "function": {"name": self.name, "description": self.description,
                                                 "parameters": self.schema()}}

    def call(self, arguments: BaseModel | dict[str, Any]) -> Any:
        args = arguments if isinstance(arguments, BaseModel) else self.parameters.model_validate(arguments)
        if self.takes_model:
            return self.fn(args)
        return self.fn(**{name: getattr(args, name) for name in type(args).model_fields})


def tool(fn: Callable[..., Any] | None = None, *, name: str | None = None,
         description: str | None = None) -> Any:
    """``@tool`` or ``tool(fn, name=..., description=...)``: a Tool from a typed function."""
    # string annotations (``from __future__ import annotations``) may name classes local to
    # the caller, e.g. a pydantic model defined inside a function
    caller_locals = dict(sys._getframe(1).f_locals)
    if fn is None:
        return lambda f: _make_tool(f, name, description, caller_locals)
    return _make_tool(fn, name, description, caller_locals)


def _make_tool(fn: Callable[..., Any], name: str | None, description: str | None,
               caller_locals: dict[str, Any]) -> Tool:
    try:
        hints = typing.get_type_hints(fn, include_extras=True)
    except NameError:
        hints = typing.get_type_hints(fn, localns=caller_locals, include_extras=True)
    params = list(inspect.signature(fn).parameters.values())
    tool_name = name or fn.__name__
    doc = description if description is not None else inspect.getdoc(fn) or ""
    if len(params) == 1 and isinstance(hints.get(params[0].name), type) and issubclass(hints[params[0].name], BaseModel):
        return Tool(tool_name, doc, hints[params[0].name], fn, takes_model=True)
    fields: dict[str, Any] = {}
    for p in params:
        if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
            raise TypeError(f"tool {tool_name}: *args/**kwargs cannot be described as JSON; name each parameter")
        if p.name not in hints:
            raise TypeError(f"tool {tool_name}: annotate parameter {p.name!r} with its type")
        fields[p.name] = (hints[p.name], ... if p.default is p.empty else p.default)
    model = create_model(f"{tool_name}_arguments", **fields)
    return Tool(tool_name, doc, model, fn)


@dataclass
class ToolCallRecord:
    name: str
    arguments: BaseModel
    result: Any


@dataclass
class ToolRun:
    answer: str
    calls: list[ToolCallRecord] = field(default_factory=list)
    state: ProgramState | None = None


def _as_tools(tools: Sequence[Tool | Callable[..., Any]]) -> list[Tool]:
    made = [t if isinstance(t, Tool) else _make_tool(t, None, None, {}) for t in tools]
    names = [t.name for t in made]
    if not made or len(set(names)) != len(names):
        raise ValueError(f"run_tools needs tools with distinct names, got {names}")
    return made


def _wants_call(s: ProgramState, question: str, system: str, tools: list[Tool], threshold: float) -> bool:
    """The scored decision (see the module docstring), with this state's role markers."""
    fmt = tool_formats.GENERIC
    markers = s.backend.markers
    baseline = (markers.first_prefix["system"] + system + markers.suffix["system"] + markers.prefix["user"]
                + tool_formats.BASELINE_QUESTION + markers.suffix["user"] + markers.prefix["assistant"])
    openings = [tool_formats.call_opening(fmt, t.name) for t in tools]

    def sums(prefix: str) -> list[float]:
        return [float(sum(r.prompt_logprobs or ())) for r in s.backend.score_choices(prefix, openings)]

    _, _, wanted = tool_formats.best_call(sums(s.text()), sums(baseline), threshold)
    return wanted


@function
def _tool_loop(s: ProgramState, question: str, tools: list[Tool], system: str | None, tool_choice: str,
               max_calls: int, max_tokens: int, calls: list[ToolCallRecord], threshold: float) -> None:
    fmt = tool_formats.GENERIC
    by_name = {t.name: t for t in tools}
    described = (system + "\n\n" if system else "") + fmt.system_prompt([t.openai()["function"] for t in tools])
    with s.system():
        s += described
    with s.user():
        s += question
    for turn in range(max_calls + 1):
        with s.assistant():
            if turn > 0 or turn == max_calls or tool_choice == "none":
                wants_call = False  # after a tool's result the model answers
            elif tool_choice == "required":
                wants_call = True
            else:
                wants_call = _wants_call(s, question, described, tools, threshold)
            if not wants_call:
                s += gen("answer", max_tokens=max_tokens)
                return
            s += fmt.block_begin + '{"name": "' + select(f"tool_{turn}", [t.name for t in tools])
            s += '", "' + fmt.arguments_key + '": '
            chosen = by_name[s[f"tool_{turn}"]]
            s += gen(f"arguments_{turn}", json_schema=chosen.parameters, max_tokens=max_tokens)
            s += fmt.call_end + fmt.block_end
        arguments = s[f"arguments_{turn}"]
        result = chosen.call(arguments)
        calls.append(ToolCallRecord(chosen.name, arguments, result))
        with s.user():
            shown = result if isinstance(result, str) else json.dumps(result, default=str)
            s += f"<tool_response>\n{shown}\n</tool_response>"


def run_tools(question: str, tools: Sequence[Tool | Callable[..., Any]], *, backend: Backend | None = None,
              system: str | None = None, tool_choice: str = "auto", max_calls: int = 3, max_tokens: int = 128,
              seed: int | None = None, temperature: float = 0.0,
              threshold: float = tool_formats.DEFAULT_CALL_THRESHOLD) -> ToolRun:
    """Answer ``question`` letting the model call ``tools`` (functions or Tools) first.
    ``tool_choice``: "auto" (the model decides), "required" (the first turn calls a tool) or
    "none"."""
    if tool_choice not in ("auto", "required", "none"):
        raise ValueError(f"tool_choice must be 'auto', 'required' or 'none', got {tool_choice!r}")
    made = _as_tools(tools)
    calls: list[ToolCallRecord] = []
    state = _tool_loop.run(question, made, system, tool_choice, max_calls, max_tokens, calls, threshold,
                           backend=backend, seed=seed, temperature=temperature)
    return ToolRun(answer=state["answer"], calls=calls, state=state)
