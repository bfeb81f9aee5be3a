"""An OpenAI request's fields as engine parameters: the model name and size limits every route
checks, response_format / regex / choices as a constraint, and ``SamplingParams`` with the
model's generation defaults where the request leaves a field out."""

from __future__ import annotations

from typing import Any

from fastapi import HTTPException, Request

from radixgen.api.protocol import SamplingFields
from radixgen.engine.params import SamplingParams, context_room
from radixgen.errors import InvalidParamsError


def check_model(req: SamplingFields, request: Request) -> None:
    """The model name and the request-size limits every route shares."""
    config = request.app.state.config
    if req.n > config.max_n:
        raise InvalidParamsError(f"n is {req.n}; the limit (max_n) is {config.max_n}")
    name = request.app.state.model_name
    if req.model is not None and req.model not in (name, "default", config.model):
        raise HTTPException(404, f"model {req.model!r} does not exist here; available: {name!r}")


def constraint_fields(req: Any) -> dict[str, Any]:
    """SamplingParams constraint keywords from response_format and the regex / choices extensions."""
    fields: dict[str, Any] = {}
    fmt = getattr(req, "response_format", None)
    if fmt is not None and fmt.type == "json_object":
        fields["json_object"] = True
    elif fmt is not None and fmt.type == "json_schema":
        spec = fmt.json_schema or {}
        schema = spec.get("schema")
        if schema is None:
            raise InvalidParamsError("response_format.json_schema.schema is required for type 'json_schema'")
        fields["json_schema"] = schema
    if getattr(req, "regex", None) is not None:
        fields["regex"] = req.regex
    if getattr(req, "choices", None) is not None:
        fields["choices"] = tuple(req.choices)
    if len(fields) > 1:
        raise InvalidParamsError(f"give at most one of response_format, regex and choices; got {', '.join(fields)}")
    return fields


def new_token_limit(prompt_len: int, engine_info: dict[str, Any], requested: int | None, *, name: str,
                    default: int | None = None) -> int:
    """How many tokens a request may generate: ``requested`` once it fits after the prompt (the one
    check, whose error names the field ``name``), else what the context's room and the server's
    cap (``max_new_tokens_limit``) allow, and at most ``default`` when the route has one."""
    room = context_room(prompt_len, engine_info["max_context_len"], requested, name=name)
    if requested:
        return requested
    cap = engine_info.get("max_new_tokens_limit")
    limit = room if cap is None else min(room, cap)
    return limit if default is None else min(limit, default)


def build_params(req: SamplingFields, prompt_len: int, engine_info: dict[str, Any], *, max_tokens: int | None,
                 logprobs: bool = False, top_logprobs: int = 0, seed_offset: int = 0,
                 constraint: dict[str, Any] | None = None) -> SamplingParams:
    bias = None
    if req.logit_bias:
        try:
            bias = {int(token): value for token, value in req.logit_bias.items()}
        except ValueError:
            raise InvalidParamsError("logit_bias keys must be token ids (integers as strings), "
                                     f"got {sorted(req.logit_bias)[:3]}") from None
    # a field the request leaves out takes the model's generation_config value, then OpenAI's default
    model = engine_info.get("sampling_defaults") or {}
    return SamplingParams(
        max_new_tokens=new_token_limit(prompt_len, engine_info, max_tokens, name="max_tokens"),
        temperature=model.get("temperature", 1.0) if req.temperature is None else req.temperature,
        top_p=model.get("top_p", 1.0) if req.top_p is None else req.top_p,
        top_k=int(model.get("top_k", -1)) if req.top_k is None else req.top_k,
        min_p=model.get("min_p", 0.0) if req.min_p is None else req.min_p,
        presence_penalty=req.presence_penalty or 0.0,
        frequency_penalty=req.frequency_penalty or 0.0,
        repetition_penalty=model.get("repetition_penalty", 1.0) if req.repetition_penalty is None
        else req.repetition_penalty,
        seed=None if req.seed is None else req.seed + seed_offset,
        stop=tuple([req.stop] if isinstance(req.stop, str) else req.stop or ()),
        stop_token_ids=tuple(req.stop_token_ids or ()),
        ignore_eos=req.ignore_eos,
        logit_bias=bias,
        min_new_tokens=req.min_tokens,
        speculative=req.speculative,
        logprobs=logprobs,
        top_logprobs=top_logprobs,
        **(constraint or {}),
    )
