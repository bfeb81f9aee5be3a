"""The scored call decision for ``tool_choice="auto"`` (ServerConfig.tool_call_decision).

A model not trained to call tools (SmolLM2-135M-Instruct among them) almost never writes a
call's trigger on its own, though its scores still tell a question a tool answers from one it
does not: the log-probability of a call's opening (``<tool_call>[{"name": "get_weather"``)
after the question, minus the same after a content-free question ("Hello."), is high when the
question is about what a tool does. When the best tool's difference reaches the threshold, the
turn calls that tool (the model writes the arguments under the constraint; where parallel calls
are allowed it may call it more than once). The difference picks the tool better than the
model's own choice after a forced opening: measured on the bundled model, it chose
create_event for a weather question.

Scoring costs one short prefill per tool for the question (its prefix comes from the radix
cache) and, once per tool set, the same for the baseline.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import uuid
from collections import OrderedDict
from typing import Any

from radixgen import tool_formats
from radixgen.api.chat import ChatFormat, ToolPlan, chat_prompt_ids
from radixgen.api.protocol import ChatCompletionRequest, Tool
from radixgen.engine.params import SamplingParams
from radixgen.ipc.handle import EngineHandle

logger = logging.getLogger(__name__)

_BASELINE_CACHE = 256
_COST_MARGIN_TOKENS = 8


def applies(decision: str, req: ChatCompletionRequest, plan: ToolPlan) -> bool:
    """Whether this turn is decided by scores: auto tool choice, right after a user message."""
    if plan.mode != "auto" or not req.messages or req.messages[-1].role != "user":
        return False  # after a tool's result the model answers (or calls again) on its own
    if decision == "auto":
        return not plan.fmt.calls.template_renders_tools
    return decision == "scored"


class CallScorer:
    def __init__(self, client: EngineHandle, tokenizer: Any, fmt: ChatFormat) -> None:
        self.client, self.tokenizer, self.fmt = client, tokenizer, fmt
        self._baselines: OrderedDict[tuple[int, ...], list[float]] = OrderedDict()

    async def best_call(self, req: ChatCompletionRequest, plan: ToolPlan, prompt_ids: list[int],
                        threshold: float, max_tokens: int | None) -> Tool | None:
        """The tool this turn calls, or None when the scores say it answers in text."""
        names = [t.function.name for t in plan.tools]
        baseline_req = req.model_copy(update={"messages": [
            *(m for m in req.messages if m.role in ("system", "developer")),
            req.messages[-1].model_copy(update={"content": tool_formats.BASELINE_QUESTION})]})
        baseline_ids = await asyncio.to_thread(chat_prompt_ids, self.tokenizer, baseline_req, "auto", self.fmt)
        key = tuple(baseline_ids)
        baseline = self._baselines.get(key)
        question, fresh = await asyncio.gather(self._scores(prompt_ids, names),
                                               self._scores(baseline_ids, names) if baseline is None else _done(baseline))
        if baseline is not None:
            self._baselines.move_to_end(key)
        else:
            baseline = fresh
            if all(math.isfinite(v) for v in fresh):  # a failed score is not remembered
                self._baselines[key] = fresh
                if len(self._baselines) > _BASELINE_CACHE:
                    self._baselines.popitem(last=False)
        best, _, wanted = tool_formats.best_call(question, baseline, threshold)
        if not wanted or (max_tokens is not None and max_tokens < self._least_cost(plan.tools[best])):
            return None  # "auto" never fails for want of room: a call that cannot fit becomes text
        return plan.tools[best]

    def _least_cost(self, tool: Tool) -> int:
        """Tokens of a call of ``tool`` with empty required values, plus a margin: the least
        a forced call takes (the engine refuses a constraint whose shortest output cannot fit)."""
        required = (tool.function.parameters or {}).get("required") or []
        call = self.fmt.calls.render_calls([(tool.function.name, json.dumps({k: "" for k in required}))])
        return len(self.tokenizer.encode(call, add_special_tokens=False)) + _COST_MARGIN_TOKENS

    async def _scores(self, prefix: list[int], names: list[str]) -> list[float]:
        """log P(the call's opening naming each tool | prefix)."""
        calls = self.fmt.calls
        jobs = []
        for name in names:
            opening = self.tokenizer.encode(tool_formats.call_opening(calls, name), add_special_tokens=False)
            params = SamplingParams(max_new_tokens=1, temperature=0.0, prompt_logprob_start=len(prefix))
            jobs.append(self._score(prefix + opening, params))
        return list(await asyncio.gather(*jobs))

    async def _score(self, ids: list[int], params: SamplingParams) -> float:
        """The opening's log-probability; -inf (no call) when it cannot be scored, so a failed
        decision leaves the turn to the model instead of failing the request."""
        if len(ids) + 1 > self.client.info["max_context_len"]:
            return float("-inf")  # the request itself is then refused (or fits without the opening)
        logprobs: list[float] = []
        async for out in self.client.generate(f"score-{uuid.uuid4().hex[:16]}", ids, params, stream=False):
            if out.error is not None:
                logger.warning("scoring a tool call failed: %s", out.error)
                return float("-inf")
            if out.finished:
                logprobs = out.prompt_logprobs or []
        return float(sum(logprobs))


async def _done(value: list[float]) -> list[float]:
    return value
