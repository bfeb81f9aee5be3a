"""A chat request turned into engine jobs, shared by /v1/chat/completions and /v1/responses: the
model and limits checked, legacy functions read as tools, the tool mode decided (a scored
decision where configured), the prompt templated and tokenised off the event loop, the
constraint and the parameters of each of its n choices."""

from __future__ import annotations

import asyncio
import uuid
from dataclasses import dataclass
from typing import Any

from fastapi import Request

from radixgen.api import tool_decision
from radixgen.api.chat import ToolPlan, chat_prompt_ids, tool_mode
from radixgen.api.params import build_params, check_model, constraint_fields
from radixgen.api.protocol import ChatCompletionRequest, Tool
from radixgen.engine.params import SamplingParams
from radixgen.errors import InvalidParamsError
from radixgen.ipc.handle import EngineHandle


@dataclass
class ChatPlan:
    """A chat request turned into engine jobs (shared by /v1/chat/completions and /v1/responses)."""

    tools: ToolPlan
    jobs: list[tuple[str, list[int], SamplingParams]]
    base_id: str
    model: str


async def plan_chat(req: ChatCompletionRequest, request: Request, *, id_prefix: str = "chatcmpl") -> ChatPlan:
    check_model(req, request)
    state = request.app.state
    client: EngineHandle = state.client
    legacy = req.functions is not None
    if legacy:
        req = _functions_as_tools(req)
    mode, named = tool_mode(req)
    tools = ToolPlan(mode, list(req.tools or []), named, single=req.parallel_tool_calls is False, legacy=legacy,
                     fmt=state.chat_format)
    # templating and tokenising a long prompt must not stall the streams this loop serves
    prompt_ids = await asyncio.to_thread(chat_prompt_ids, state.tokenizer, req, mode, state.chat_format)
    config = state.config
    if tool_decision.applies(config.tool_call_decision, req, tools):
        best = await state.call_scorer.best_call(req, tools, prompt_ids, config.tool_call_threshold,
                                                 req.max_completion_tokens or req.max_tokens)
        if best is not None:
            tools.mode, tools.named, tools.scored = "named", best, True
    constraint = tools.constraint(constraint_fields(req))
    max_tokens = req.max_completion_tokens or req.max_tokens
    top = req.top_logprobs or 0
    if top and not req.logprobs:
        raise InvalidParamsError("top_logprobs needs logprobs=true")
    params = [build_params(req, len(prompt_ids), client.info, max_tokens=max_tokens,
                           logprobs=req.logprobs, top_logprobs=top, seed_offset=i, constraint=constraint)
              for i in range(req.n)]
    base_id = f"{id_prefix}-{uuid.uuid4().hex[:24]}"
    jobs = [(f"{base_id}-{i}", prompt_ids, p) for i, p in enumerate(params)]
    return ChatPlan(tools, jobs, base_id, state.model_name)


def _functions_as_tools(req: ChatCompletionRequest) -> ChatCompletionRequest:
    """The legacy functions / function_call fields as tools / tool_choice."""
    if req.tools is not None or req.tool_choice is not None:
        raise InvalidParamsError("give tools and tool_choice, or the legacy functions and function_call, not both")
    choice: Any = req.function_call
    if isinstance(choice, dict):
        if not isinstance(choice.get("name"), str):
            raise InvalidParamsError("function_call must be 'none', 'auto' or {'name': ...}")
        choice = {"type": "function", "function": {"name": choice["name"]}}
    return req.model_copy(update={"tools": [Tool(function=f) for f in req.functions or []], "tool_choice": choice,
                                  "functions": None, "function_call": None})
