"""Tool calling with the bundled model through the openai client, tool_choice auto: every call
the server returns validates against its tool's schema, most questions that need a tool get a
call, questions that need none get text, parallel calls follow parallel_tool_calls, and the
streamed call fragments concatenate to the non-streamed arguments."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jsonschema
import pytest

from tests.api.conftest import LiveServer

pytestmark = pytest.mark.real_model

TOOLS: list[Any] = json.loads((Path(__file__).resolve().parents[1] / "data" / "agent_tools.json").read_text())
"""Weather, currency conversion, calendar: three tools with different schemas (shared with
benchmarks/bench_tools.py)."""
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
NEEDS_TOOL = [
    "What's the weather in Lisbon right now, in celsius?", "Convert 100 US dollars to euros.",
    "Add a meeting called Design review on 2026-12-03 for 30 minutes to my calendar.", "Is it raining in Tokyo?",
    "How many yen is 50 pounds?", "Schedule dentist appointment on 2026-12-10.",
    "What's the temperature in Paris in fahrenheit?", "Convert 20 EUR to CHF please.",
    "Put lunch with Ana on 2026-12-05 in my calendar, 60 minutes.", "Weather in New York?",
]
NEEDS_NO_TOOL = ["Write a haiku about the sea.", "Who wrote Hamlet?"]


@pytest.fixture(scope="module")
def bundled() -> Iterator[LiveServer]:
    server = LiveServer(["--kv-cache-tokens", "16384", "--max-context-len", "2048"])
    yield server
    server.stop()


def _client(server: LiveServer) -> Any:
    import openai

    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


def _valid(calls: Any) -> None:
    for call in calls:
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name],
                            format_checker=jsonschema.FormatChecker())


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_auto_calls_validate_and_most_tool_questions_call(bundled: LiveServer, temperature: float) -> None:
    from concurrent.futures import ThreadPoolExecutor

    c = _client(bundled)

    def ask(seed_and_question: tuple[int, str]) -> Any:
        seed, question = seed_and_question
        return c.chat.completions.create(model="default", messages=[{"role": "user", "content": question}],
                                         tools=TOOLS, temperature=temperature, seed=seed, max_tokens=64).choices[0]

    # all at once, as an agent fleet sends them: the server batches them
    with ThreadPoolExecutor(len(NEEDS_TOOL) + len(NEEDS_NO_TOOL)) as pool:
        answers = list(pool.map(ask, enumerate(NEEDS_TOOL + NEEDS_NO_TOOL)))
    calling = 0
    for choice in answers[: len(NEEDS_TOOL)]:
        if choice.message.tool_calls:
            assert choice.finish_reason == "tool_calls"
            _valid(choice.message.tool_calls)
            calling += 1
        else:
            assert choice.message.content
    assert calling >= len(NEEDS_TOOL) // 2
    for choice in answers[len(NEEDS_TOOL):]:
        assert choice.message.tool_calls is None and choice.message.content


def test_parallel_calls_follow_parallel_tool_calls(bundled: LiveServer) -> None:
    c = _client(bundled)
    ask = [{"role": "user", "content": "What's the weather in Lisbon and in Paris?"}]
    both = c.chat.completions.create(model="default", messages=ask, tools=TOOLS, temperature=0, max_tokens=120)
    calls = both.choices[0].message.tool_calls
    assert calls is not None and len(calls) == 2
    _valid(calls)
    assert {json.loads(call.function.arguments)["city"] for call in calls} == {"Lisbon", "Paris"}
    one = c.chat.completions.create(model="default", messages=ask, tools=TOOLS, temperature=0, max_tokens=120,
                                    parallel_tool_calls=False)
    assert one.choices[0].message.tool_calls is not None and len(one.choices[0].message.tool_calls) == 1
    _valid(one.choices[0].message.tool_calls)


def test_streamed_calls_equal_the_whole_answer(bundled: LiveServer) -> None:
    c = _client(bundled)
    kwargs: dict[str, Any] = dict(model="default", messages=[{"role": "user", "content": "What's the weather in "
                                                                                          "Lisbon and in Paris?"}],
                                  tools=TOOLS, temperature=1.0, seed=7, max_tokens=120)
    whole = c.chat.completions.create(**kwargs).choices[0].message.tool_calls
    assert whole
    names: dict[int, str] = {}
    arguments: dict[int, str] = {}
    first_fragment_before_end = False
    for chunk in c.chat.completions.create(**kwargs, stream=True):
        for choice in chunk.choices:
            for call in choice.delta.tool_calls or []:
                if call.function.name:
                    names[call.index] = call.function.name
                arguments[call.index] = arguments.get(call.index, "") + (call.function.arguments or "")
                first_fragment_before_end |= choice.finish_reason is None and bool(call.function.arguments)
    assert first_fragment_before_end  # the arguments stream as they are generated
    assert [(names[i], arguments[i]) for i in sorted(names)] == [(w.function.name, w.function.arguments) for w in whole]


def test_pydantic_ai_agent_calls_its_tool(bundled: LiveServer) -> None:
    from pydantic_ai import Agent
    from pydantic_ai.models.openai import OpenAIChatModel
    from pydantic_ai.providers.openai import OpenAIProvider

    model = OpenAIChatModel("default", provider=OpenAIProvider(base_url=bundled.url + "/v1", api_key="unused"))
    asked: list[str] = []
    agent = Agent(model, model_settings={"max_tokens": 80, "temperature": 0.0})  # type: ignore[arg-type]

    @agent.tool_plain
    def get_weather(city: str) -> str:
        """Current weather in a city."""
        asked.append(city)
        return f"18 degrees and cloudy in {city}"

    result = agent.run_sync("What's the weather in Lisbon right now?")
    assert asked and all(isinstance(city, str) and city for city in asked)
    assert isinstance(result.output, str) and result.output

