"""An agent loop through the openai client against the server, tool_choice auto, bundled model.

20 tasks over three tools (weather, currency conversion, calendar). Each task runs model -> tool
-> model until the model answers in text (at most 4 turns). Two ways side by side in one run:

- constrained: the server's own tool calling (the family's call format, calls constrained from
  their trigger, the scored call decision for templates that render no tools);
- after the fact: the way radixgen served tools before (and what an unconstrained server does):
  the tools described in a system message, the answer generated freely and parsed afterwards
  (a JSON object, or JSON inside <tool_call> tags).

Per way: the share of turns with calls whose every call validates against its tool's schema,
calls per task, turns per task, seconds per task.

    python benchmarks/bench_tools.py [--tasks 20]
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.common import print_table, write_json  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent

TOOLS: list[Any] = json.loads((ROOT / "tests" / "data" / "agent_tools.json").read_text())  # shared with the tests
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
TASKS = [
    "How warm is it in Madrid today?", "Do I need an umbrella in London?", "Weather report for Sydney, in celsius.",
    "What is the weather like in Chicago in fahrenheit?", "Is it sunny in Rome?",
    "How much is 250 Canadian dollars in US dollars?", "Exchange 75 euros into British pounds.",
    "What do 1000 yen come to in euros?", "Convert 12.5 Swiss francs to dollars.", "How many pesos is 40 dollars?",
    "Book a call with Marta on 2026-12-14 for 45 minutes.", "Add 'Pay rent' to my calendar on 2027-01-01.",
    "Create an event 'Team offsite' on 2026-12-20 lasting 240 minutes.", "Remind me of the concert on 2026-12-31.",
    "Put a 15 minute standup on 2026-12-08 in the calendar.",
    "I'm flying to Berlin tomorrow: what's the weather there?", "Please convert 5 bitcoins' worth, 300000 USD, to EUR.",
    "Schedule 'Dinner with parents' for 2026-12-24, 120 minutes.", "What's the temperature in Cairo right now?",
    "Change 60 Australian dollars to New Zealand dollars.",
]

# how tools were described and parsed before calls were constrained (radixgen's first round)
_AFTER_THE_FACT_PROMPT = (
    "You can call these tools:\n{tools}\n"
    'To call a tool, reply with only a JSON object: {{"name": <tool name>, "arguments": <arguments object>}}. '
    "Otherwise answer normally.")
_CALL_TAG = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)


def run_tool(name: str, arguments: dict[str, Any]) -> str:
    if name == "get_weather":
        return json.dumps({"city": arguments.get("city"), "temperature": 18, "sky": "cloudy"})
    if name == "convert_currency":
        return json.dumps({"amount": round(float(arguments.get("amount", 0)) * 0.93, 2)})
    return json.dumps({"created": True, "title": arguments.get("title")})


def valid(name: str, arguments_json: str) -> bool:
    import jsonschema

    try:
        jsonschema.validate(json.loads(arguments_json), SCHEMAS[name], format_checker=jsonschema.FormatChecker())
    except (json.JSONDecodeError, jsonschema.ValidationError, KeyError):
        return False
    return True


def after_the_fact_calls(text: str) -> list[tuple[str, str]] | None:
    """Calls read out of a freely generated answer, None when it does not look like one."""
    stripped = text.strip()
    candidates = _CALL_TAG.findall(stripped) or ([stripped] if stripped[:1] in "{[" else [])
    calls = []
    for candidate in candidates:
        try:
            obj = json.loads(candidate)
        except json.JSONDecodeError:
            return [("?", candidate)]  # an attempted call that does not parse
        for item in obj if isinstance(obj, list) else [obj]:
            if not isinstance(item, dict):
                return [("?", candidate)]
            calls.append((str(item.get("name")), json.dumps(item.get("arguments", item.get("parameters")))))
    return calls or None


def agent(client: Any, task: str, constrained: bool, seed: int) -> dict[str, Any]:
    messages: list[dict[str, Any]] = [{"role": "user", "content": task}]
    if not constrained:
        described = "\n".join(json.dumps(t["function"]) for t in TOOLS)
        messages.insert(0, {"role": "system", "content": _AFTER_THE_FACT_PROMPT.format(tools=described)})
    turns = call_turns = valid_turns = calls = 0
    started = time.perf_counter()
    for turn in range(4):
        turns += 1
        kwargs: dict[str, Any] = dict(model="default", messages=messages, temperature=0.7, seed=seed + turn,
                                      max_tokens=160)
        if constrained:
            message = client.chat.completions.create(tools=TOOLS, **kwargs).choices[0].message
            found = [(c.function.name, c.function.arguments, c.id) for c in message.tool_calls or []]
        else:
            message = client.chat.completions.create(**kwargs).choices[0].message
            parsed = after_the_fact_calls(message.content or "")
            found = [(n, a, f"call_{turn}_{i}") for i, (n, a) in enumerate(parsed or [])]
        if not found:
            break
        call_turns += 1
        calls += len(found)
        ok = all(valid(n, a) for n, a, _ in found)
        valid_turns += ok
        if not ok:
            break  # the agent loop cannot run a call it cannot parse or validate
        if constrained:
            messages.append({"role": "assistant", "content": None, "tool_calls": [
                {"id": i, "type": "function", "function": {"name": n, "arguments": a}} for n, a, i in found]})
            messages += [{"role": "tool", "tool_call_id": i, "content": run_tool(n, json.loads(a))} for n, a, i in found]
        else:
            messages.append({"role": "assistant", "content": message.content})
            messages.append({"role": "user", "content": "\n".join(run_tool(n, json.loads(a)) for n, a, _ in found)})
    return {"turns": turns, "call_turns": call_turns, "valid_turns": valid_turns, "calls": calls,
            "seconds": time.perf_counter() - started}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tasks", type=int, default=len(TASKS))
    parser.add_argument("--url", default=None, help="a running server (default: start one on the bundled model)")
    args = parser.parse_args()
    import openai

    from radixgen.ipc.launch import ServerProcess

    server = None if args.url else ServerProcess("--kv-cache-tokens", "16384", "--max-context-len", "2048",
                                                 timeout=300)
    url = args.url or server.url  # type: ignore[union-attr]
    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
    rows = []
    try:
        for constrained in (True, False):
            runs = [agent(client, task, constrained, seed) for seed, task in enumerate(TASKS[: args.tasks])]
            call_turns = sum(r["call_turns"] for r in runs)
            rows.append({
                "way": "constrained" if constrained else "after the fact",
                "tasks": len(runs),
                "tasks_with_a_call": sum(r["call_turns"] > 0 for r in runs),
                "call_turns": call_turns,
                "valid_call_turns_pct": 100.0 * sum(r["valid_turns"] for r in runs) / call_turns if call_turns else None,
                "calls_per_task": sum(r["calls"] for r in runs) / len(runs),
                "turns_per_task": sum(r["turns"] for r in runs) / len(runs),
                "s_per_task": sum(r["seconds"] for r in runs) / len(runs),
            })
    finally:
        if server is not None:
            server.stop()
    print_table(rows, ["way", "tasks", "tasks_with_a_call", "call_turns", "valid_call_turns_pct", "calls_per_task",
                       "turns_per_task", "s_per_task"])
    print("wrote", write_json("bench_tools", {"rows": rows}))


if __name__ == "__main__":
    main()
