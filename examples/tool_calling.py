# %% [markdown]
# # Tool calling with radixgen
#
# A weather question, answered with a tool: the model picks the tool (constrained to the tool
# names, ranked by its own scores), writes the arguments under the function's JSON schema, the
# function runs on local fake data, and the model answers with its result. First with the
# Python DSL in-process, then through the OpenAI client against `radixgen serve`.
#
# Runs on the bundled SmolLM2-135M-Instruct on CPU: `python examples/tool_calling.py` or this
# notebook top to bottom.

# %%
import json
from typing import Annotated, Literal

from pydantic import Field

from radixgen.lang import Runtime, run_tools, tool

runtime = Runtime()  # the bundled model, in this process

# %% [markdown]
# ## The tools: typed Python functions
#
# Annotations become the JSON schema of the arguments, the docstring the description.

# %%
FORECASTS = {
    "Paris": {"sky": "light rain", "celsius": 14},
    "London": {"sky": "overcast", "celsius": 11},
    "Tokyo": {"sky": "sunny", "celsius": 22},
}


@tool
def get_weather(
    city: Annotated[str, Field(pattern=r"^[A-Z][a-z]+( [A-Z][a-z]+)?$", description="City name, capitalised")],
    unit: Literal["celsius", "fahrenheit"] = "celsius",
) -> dict:
    """Current weather in a city."""
    report = FORECASTS.get(city, {"sky": "clear", "celsius": 18})
    degrees = report["celsius"] if unit == "celsius" else round(report["celsius"] * 9 / 5 + 32)
    return {"city": city, "sky": report["sky"], "temperature": degrees, "unit": unit}


@tool
def get_local_time(city: Annotated[str, Field(pattern=r"^[A-Z][a-z]+( [A-Z][a-z]+)?$")]) -> str:
    """Local time in a city."""
    return {"Paris": "14:05", "London": "13:05", "Tokyo": "21:05"}.get(city, "12:00")


print(json.dumps(get_weather.schema(), indent=1))

# %% [markdown]
# ## The loop with the DSL
#
# `tool_choice="required"` makes the first turn a call (with "auto", the server's scored
# decision would make it: the call's opening scored after the question against a content-free
# one); after the tool's result the model answers.

# %%
run = run_tools("What's the weather like in Paris right now?", [get_weather, get_local_time],
                backend=runtime, tool_choice="required", max_calls=2, seed=0)
for call in run.calls:
    print(f"called {call.name}({call.arguments.model_dump()}) -> {call.result}")
print("answer:", run.answer)

first = run.calls[0]
assert first.name in ("get_weather", "get_local_time")
# the arguments satisfy the function's schema: the pattern, the enum
{"get_weather": get_weather, "get_local_time": get_local_time}[first.name].parameters.model_validate(
    first.arguments.model_dump())
assert run.answer.strip(), "the model answered after the tool's result"

# %% [markdown]
# The whole conversation, as chat messages:

# %%
for message in run.state.messages():
    print(f"[{message['role']}] {message['content'][:200]}")
runtime.close()

# %% [markdown]
# ## The same through the OpenAI client
#
# `radixgen serve` speaks the OpenAI API: the tools go in `tools`, the call comes back in
# `tool_calls` with arguments constrained to the schema, and the result goes back as a `tool`
# message.

# %%
from openai import OpenAI

from radixgen.ipc.launch import launch_server

tools = {t.name: t for t in (get_weather, get_local_time)}
question = [{"role": "user", "content": "What's the weather like in Paris right now?"}]

with launch_server() as server:  # the bundled model on a free loopback port; stopped at the end
    client = OpenAI(base_url=server.url + "/v1", api_key="unused")
    response = client.chat.completions.create(model="default", messages=question, temperature=0, max_tokens=64,
                                              tools=[t.openai() for t in tools.values()], tool_choice="required")
    call = response.choices[0].message.tool_calls[0]
    arguments = json.loads(call.function.arguments)
    result = tools[call.function.name].call(arguments)  # validates the arguments, then runs the function
    print(f"called {call.function.name}({arguments}) -> {result}")

    messages = [*question, response.choices[0].message.model_dump(exclude_none=True),
                {"role": "tool", "tool_call_id": call.id, "content": json.dumps(result)}]
    final = client.chat.completions.create(model="default", messages=messages, temperature=0, max_tokens=64,
                                           tools=[t.openai() for t in tools.values()], tool_choice="none")
print("answer:", final.choices[0].message.content)
assert final.choices[0].message.content and final.choices[0].finish_reason in ("stop", "length")
