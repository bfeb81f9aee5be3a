"""Call formats by family: detection from small templates written in each family's format, the
prompt renders the tools, the trigger starts the constraint, a multi-call answer parses, and
pieces fed one token at a time give exactly the arguments of the whole answer."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import pytest

from radixgen import reasoning, tool_formats
from radixgen.api.chat import ChatFormat, chat_prompt_ids
from radixgen.api.protocol import ChatCompletionRequest
from radixgen.constraints import make_backend
from radixgen.constraints.structural import structural_spec
from radixgen.errors import InvalidConstraintError
from radixgen.tool_formats import CallFormat

TEMPLATES = Path(__file__).parent / "data" / "chat_templates"
WEATHER = {"type": "object", "properties": {"city": {"type": "string"}, "unit": {"enum": ["c", "f"]}},
           "required": ["city"]}
CONVERT = {"type": "object", "properties": {"amount": {"type": "number"}}, "required": ["amount"]}
TOOLS = [("get_weather", WEATHER), ("convert", CONVERT)]
OPENAI_TOOLS = [{"type": "function", "function": {"name": n, "description": f"the {n} tool", "parameters": s}}
                for n, s in TOOLS]


def with_template(tokenizer: Any, name: str | None) -> Any:
    tok = copy.copy(tokenizer)
    if name is not None:
        tok.chat_template = (TEMPLATES / f"{name}.jinja").read_text()
    return tok


@pytest.fixture(scope="module", params=["xgrammar", "llguidance"])
def backend(tokenizer: Any, request: pytest.FixtureRequest) -> Any:
    return make_backend(request.param, tokenizer, 49152, [2])


FAMILIES = [(None, "smollm2", False, "<tool_call>"), ("hermes", "hermes", True, "<tool_call>"),
            ("llama3", "llama3", True, '{"name": '), ("llama3_python_tag", "llama3", True, "<|python_tag|>"),
            ("mistral", "mistral", True, "[TOOL_CALLS]")]


@pytest.mark.parametrize(("template", "family", "native", "trigger"), FAMILIES)
def test_detect_render_constrain_parse(tokenizer: Any, backend: Any, template: str | None, family: str,
                                       native: bool, trigger: str) -> None:
    tok = with_template(tokenizer, template)
    fmt = tool_formats.detect(tok)
    assert (fmt.name, fmt.template_renders_tools, fmt.trigger) == (family, native, trigger)
    req = ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "Weather in Oslo?"}],
                                                "tools": OPENAI_TOOLS})
    prompt = tok.decode(chat_prompt_ids(tok, req, "auto", ChatFormat(fmt)))
    assert "the convert tool" in prompt and "get_weather" in prompt  # the tools are described either way

    answer = "Let me check. " + fmt.render_calls([("get_weather", '{"city": "Oslo", "unit": "c"}'),
                                                  ("convert", '{"amount": 2.5}')])
    grammar = backend.compile(structural_spec({"tool_calls": fmt.structure(
        TOOLS, free_text=True, min_calls=0, max_calls=None)}))
    matcher = grammar.matcher()
    ids = tok.encode(answer, add_special_tokens=False)
    assert all(matcher.accept(t) for t in ids) and matcher.accept(2)

    # after the trigger only the tools' calls may follow: an unknown name is refused
    wrong = grammar.matcher()
    bad = tok.encode(fmt.block_begin + '{"name": "delete_everything"', add_special_tokens=False)
    assert not all(wrong.accept(t) for t in bad)

    content, calls = tool_formats.parse(fmt, answer)
    assert content.strip() == "Let me check."
    assert [(c.name, json.loads(c.arguments), c.complete) for c in calls] == [
        ("get_weather", {"city": "Oslo", "unit": "c"}, True), ("convert", {"amount": 2.5}, True)]
    parser = fmt.parser()
    streamed: dict[int, str] = {}
    for t in ids:
        for index, piece in parser.feed(tok.decode([t])).arguments:
            streamed[index] = streamed.get(index, "") + piece
    assert streamed == {i: c.arguments for i, c in enumerate(calls)}


def test_one_call_at_most_and_calls_only(tokenizer: Any, backend: Any) -> None:
    fmt = tool_formats.HERMES
    two = fmt.render_calls([("convert", '{"amount": 1}'), ("convert", '{"amount": 2}')])
    ids = tokenizer.encode(two, add_special_tokens=False)
    single = backend.compile(structural_spec({"tool_calls": fmt.structure(TOOLS, free_text=True, min_calls=0,
                                                                           max_calls=1)})).matcher()
    assert not all(single.accept(t) for t in ids)
    required = backend.compile(structural_spec({"tool_calls": fmt.structure(TOOLS, free_text=False, min_calls=1,
                                                                             max_calls=None)})).matcher()
    assert not required.accept(tokenizer.encode("Sure", add_special_tokens=False)[0])
    assert required.forced_string().startswith("<tool_call>")


ANSWER = {"type": "object", "properties": {"summary": {"type": "string"}, "celsius": {"type": "integer"}},
          "required": ["summary", "celsius"], "additionalProperties": False}


@pytest.mark.parametrize("fmt", [tool_formats.SMOLLM2, tool_formats.HERMES], ids=lambda f: f.name)
def test_auto_with_a_response_format_is_a_call_block_or_the_answer(tokenizer: Any, backend: Any,
                                                                   fmt: CallFormat) -> None:
    grammar = backend.compile(structural_spec({
        "tool_calls": fmt.structure(TOOLS, free_text=False, min_calls=1, max_calls=None), "json_schema": ANSWER}))

    def accepts(text: str) -> bool:
        matcher = grammar.matcher()
        return all(matcher.accept(t) for t in tokenizer.encode(text, add_special_tokens=False)) and matcher.accept(2)

    assert accepts(fmt.render_calls([("get_weather", '{"city": "Oslo"}')]))
    assert accepts('{"summary": "mild", "celsius": 12}')
    assert not accepts("It is mild in Oslo.")  # neither a call nor the answer
    assert not accepts('{"summary": "mild", "celsius": "12"}')  # an answer off its schema
    assert not accepts('Let me check. ' + fmt.render_calls([("get_weather", '{"city": "Oslo"}')]))
    with pytest.raises(InvalidConstraintError, match="free_text must be false"):
        structural_spec({"tool_calls": fmt.structure(TOOLS, free_text=True, min_calls=0, max_calls=None),
                         "json_schema": ANSWER})


def test_a_text_answer_that_mentions_the_trigger_stays_content() -> None:
    content, calls = tool_formats.parse(tool_formats.HERMES, "Use a <tool_cal tag, or <tool_call>x")
    assert calls == [] and content == "Use a <tool_cal tag, or <tool_call>x"


def test_thinking_template_reasoning_then_valid_json(tokenizer: Any, backend: Any) -> None:
    tok = with_template(tokenizer, "thinking")
    markers = reasoning.detect(tok)
    assert markers == reasoning.ReasoningMarkers("<think>", "</think>")
    assert reasoning.detect(tokenizer) is None
    grammar = backend.compile(structural_spec({"reasoning": markers.structure(), "json_schema": WEATHER}))
    text = '<think>\nThe user asks for {weather} in "Oslo".\n</think>\n{"city": "Oslo"}'
    matcher = grammar.matcher()
    assert all(matcher.accept(t) for t in tok.encode(text, add_special_tokens=False)) and matcher.accept(2)
    bad = grammar.matcher()
    assert not all(bad.accept(t) for t in tok.encode('<think>ok</think>\n{"town": 1}', add_special_tokens=False))
    splitter = reasoning.ReasoningSplitter(markers)
    pieces = [splitter.feed(tok.decode([t])) for t in tok.encode(text, add_special_tokens=False)]
    assert "".join(p[0] for p in pieces).strip() == 'The user asks for {weather} in "Oslo".'
    assert json.loads("".join(p[1] for p in pieces)) == {"city": "Oslo"}


def test_structural_specs_are_checked() -> None:
    fmt: CallFormat = tool_formats.SMOLLM2
    good = {"tool_calls": fmt.structure(TOOLS, free_text=True, min_calls=0, max_calls=None)}
    assert structural_spec(good).kind == "structural"
    with pytest.raises(InvalidConstraintError, match="tool_calls, json_schema, or both"):
        structural_spec({"reasoning": {"begin": "<think>", "end": "</think>"}})
    broken = copy.deepcopy(good)
    broken["tool_calls"]["trigger"] = "<call>"
    with pytest.raises(InvalidConstraintError, match="prefix of block_begin"):
        structural_spec(broken)
    deep = copy.deepcopy(good)
    deep["tool_calls"]["calls"][0]["schema"] = {"type": "object", "properties": {"a": {"type": "nope"}}}
    with pytest.raises(InvalidConstraintError, match="not a JSON type"):
        structural_spec(deep)
