"""What a request asks for: ``SamplingParams``, checked when made (a bad value is the caller's
error, with what to change)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from radixgen.constraints.refusals import refusal_for
from radixgen.constraints.spec import (
    JSON_OBJECT,
    ConstraintSpec,
    choices_spec,
    regex_spec,
    schema_spec,
)
from radixgen.constraints.structural import structural_spec
from radixgen.errors import InvalidConstraintError, InvalidParamsError, PromptTooLongError

MAX_TOP_LOGPROBS = 20



def _check(ok: bool, name: str, allowed: str, value: object) -> None:
    if not ok:
        raise InvalidParamsError(f"{name} must be {allowed}, got {value!r}")


@dataclass(frozen=True)
class SamplingParams:
    """How to sample and when to stop. Validates itself; errors name the field and its range."""

    max_new_tokens: int = 128
    temperature: float = 1.0
    """0 means greedy."""
    top_p: float = 1.0
    top_k: int = -1
    """-1 (or 0) disables top-k."""
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    """HF semantics: over prompt and output tokens; >1 discourages repeats."""
    frequency_penalty: float = 0.0
    """OpenAI semantics: subtract penalty * count of the token in the output so far."""
    presence_penalty: float = 0.0
    """OpenAI semantics: subtract penalty once if the token appeared in the output."""
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: bool = False
    top_logprobs: int = 0
    skip_special_tokens: bool = True
    regex: str | None = None
    json_schema: Any = None
    """A JSON schema as a dict or JSON string, or a pydantic model class."""
    pydantic_model: Any = None
    """A pydantic model class: the same as ``json_schema=Model`` (its schema constrains the output,
    its field validators run on each completed field and its model validators on the object)."""
    choices: tuple[str, ...] | None = None
    json_object: bool = False
    """Any JSON object (OpenAI's response_format json_object)."""
    structural: dict[str, Any] | None = field(default=None, compare=False)
    """An output of parts (``constraints.structural``): tool calls a trigger starts inside free
    text, or a reasoning section before a JSON schema or tool calls."""
    validators: dict[str, Any] | None = field(default=None, compare=False)
    """Callbacks by JSON path ("$.price", "$.items[*].qty") run on each completed value; a False
    return or a ValueError rejects it: the request rolls back to the value's start and resamples."""
    max_validation_retries: int = 5
    """Times the model may write a rejected value again before the request ends
    ``constraint_violation``. Values the validators write themselves (a searched number, the
    closer of a list that repeats itself) use none; they are bounded at four per retry."""
    logit_bias: dict[int, float] | None = field(default=None, compare=False)
    """Token id -> a value in [-100, 100] added to its logit before sampling (OpenAI's logit_bias;
    -100 bans the token, 100 all but forces it). A constraint's mask still applies on top."""
    min_new_tokens: int = 0
    """EOS and the stop token ids are masked until this many tokens were generated (vLLM's and
    SGLang's min_tokens). A constrained output ends when its automaton does, regardless."""
    speculative: bool | None = None
    """Draft and verify n-gram continuations for this request (greedy requests only): None
    follows the engine's ``speculative`` setting, True or False overrides it."""
    prompt_logprob_start: int | None = None
    """Score the prompt too: return the log-probability of each prompt token from this index on,
    given the tokens before it (the DSL's ``select`` ranks choices with it). The prefix cache
    serves at most the tokens before ``prompt_logprob_start - 1``, so every scored position is
    computed."""
    constraint: ConstraintSpec | None = field(default=None, init=False, compare=False, repr=False)
    """Derived from the fields above and validated at construction."""

    def __post_init__(self) -> None:
        # Accept a single string / lists for convenience; store tuples (frozen, hashable).
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        for name in ("stop", "stop_token_ids", "choices"):
            value = getattr(self, name)
            if value is None and name != "choices":
                object.__setattr__(self, name, ())
            elif isinstance(value, list):
                object.__setattr__(self, name, tuple(value))
            elif value is not None and not isinstance(value, tuple):
                raise InvalidParamsError(f"{name} must be a list, got {type(value).__name__}")
        if self.pydantic_model is not None:
            model = self.pydantic_model
            _check(isinstance(model, type) and hasattr(model, "model_json_schema"), "pydantic_model",
                   "a pydantic model class", model)
            if self.json_schema is not None:
                raise InvalidParamsError("give at most one constraint per request; got json_schema, pydantic_model")
            object.__setattr__(self, "json_schema", model)
        self.validate()
        object.__setattr__(self, "constraint", self._constraint_spec())

    def _constraint_spec(self) -> ConstraintSpec | None:
        given = [name for name in ("regex", "json_schema", "choices", "structural") if getattr(self, name) is not None]
        given += ["json_object"] if self.json_object else []
        if len(given) > 1:
            raise InvalidParamsError(f"give at most one constraint per request; got {', '.join(given)}")
        if self.regex is not None:
            return regex_spec(self.regex)
        if self.json_schema is not None:
            spec = schema_spec(self.json_schema)
            # the grammar compiles (its masks are right), but generation would end in a violation
            refusal = refusal_for(spec)
            if refusal is not None:
                raise InvalidConstraintError(f"cannot generate for this json_schema: {refusal}")
            return spec
        if self.choices is not None:
            return choices_spec(list(self.choices))
        if self.structural is not None:
            return structural_spec(self.structural)
        return JSON_OBJECT if self.json_object else None

    def validate(self) -> None:
        for flag in ("ignore_eos", "logprobs", "skip_special_tokens", "json_object"):
            _check(isinstance(getattr(self, flag), bool), flag, "true or false", getattr(self, flag))
        _check(self.speculative is None or isinstance(self.speculative, bool), "speculative", "true, false or null",
               self.speculative)
        _check(self.regex is None or isinstance(self.regex, str), "regex", "a string", self.regex)
        _check(self.choices is None or all(isinstance(c, str) for c in self.choices), "choices", "strings",
               self.choices)
        _check(isinstance(self.max_new_tokens, int) and self.max_new_tokens >= 1,
               "max_new_tokens", "an integer >= 1", self.max_new_tokens)
        for name in ("temperature", "top_p", "min_p", "repetition_penalty",
                     "frequency_penalty", "presence_penalty"):
            value = getattr(self, name)
            _check(isinstance(value, (int, float)) and math.isfinite(value), name, "a finite number", value)
        _check(0.0 <= self.temperature <= 100.0, "temperature", "in [0, 100]", self.temperature)
        _check(0.0 < self.top_p <= 1.0, "top_p", "in (0, 1]", self.top_p)
        _check(isinstance(self.top_k, int) and (self.top_k == -1 or self.top_k >= 0),
               "top_k", "-1 (disabled) or an integer >= 0", self.top_k)
        _check(0.0 <= self.min_p <= 1.0, "min_p", "in [0, 1]", self.min_p)
        _check(0.0 < self.repetition_penalty <= 10.0, "repetition_penalty", "in (0, 10]",
               self.repetition_penalty)
        _check(-2.0 <= self.frequency_penalty <= 2.0, "frequency_penalty", "in [-2, 2]",
               self.frequency_penalty)
        _check(-2.0 <= self.presence_penalty <= 2.0, "presence_penalty", "in [-2, 2]",
               self.presence_penalty)
        _check(self.seed is None or (isinstance(self.seed, int) and 0 <= self.seed < 2**63),
               "seed", "None or an integer in [0, 2**63)", self.seed)
        _check(all(isinstance(s, str) and s for s in self.stop), "stop", "non-empty strings", self.stop)
        _check(len(self.stop) <= 16, "stop", "at most 16 strings", len(self.stop))
        _check(all(isinstance(t, int) and t >= 0 for t in self.stop_token_ids),
               "stop_token_ids", "non-negative integers", self.stop_token_ids)
        _check(isinstance(self.max_validation_retries, int) and 0 <= self.max_validation_retries <= 100,
               "max_validation_retries", "an integer in [0, 100]", self.max_validation_retries)
        _check(self.validators is None or (isinstance(self.validators, dict)
                                           and all(isinstance(k, str) and k.startswith("$") and callable(v)
                                                   for k, v in self.validators.items())),
               "validators", "a dict of JSON paths ('$...') to callables", self.validators)
        _check(self.prompt_logprob_start is None
               or (isinstance(self.prompt_logprob_start, int) and self.prompt_logprob_start >= 1),
               "prompt_logprob_start", "None or an integer >= 1 (the first token has no context)",
               self.prompt_logprob_start)
        _check(isinstance(self.min_new_tokens, int) and 0 <= self.min_new_tokens <= self.max_new_tokens,
               "min_new_tokens", f"an integer in [0, max_new_tokens={self.max_new_tokens}]", self.min_new_tokens)
        _check(self.logit_bias is None or (isinstance(self.logit_bias, dict) and all(
            isinstance(k, int) and not isinstance(k, bool) and k >= 0 and isinstance(v, (int, float))
            and math.isfinite(v) and -100 <= v <= 100 for k, v in self.logit_bias.items())),
               "logit_bias", "a dict of token ids to numbers in [-100, 100]", self.logit_bias)
        _check(isinstance(self.top_logprobs, int) and 0 <= self.top_logprobs <= MAX_TOP_LOGPROBS,
               "top_logprobs", f"an integer in [0, {MAX_TOP_LOGPROBS}]", self.top_logprobs)

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def engine_needs_text(self) -> bool:
        """Stop strings, a constraint (its validators and budget steering read the text): the
        engine detokenizes such a request whoever consumes it."""
        return bool(self.stop) or self.constraint is not None or self.validators is not None

    @property
    def has_penalties(self) -> bool:
        return (self.repetition_penalty != 1.0 or self.frequency_penalty != 0.0
                or self.presence_penalty != 0.0)


def context_room(prompt_len: int, max_context_len: int, max_tokens: int | None = None,
                 name: str = "max_new_tokens") -> int:
    """Tokens the context leaves after a ``prompt_len``-token prompt; refused with what to change
    when it leaves none, or fewer than ``max_tokens`` (the field called ``name`` in the error)."""
    room = max_context_len - prompt_len
    if room < 1:
        raise PromptTooLongError(f"the prompt has {prompt_len} tokens; the context holds {max_context_len} "
                                 "(max_context_len): shorten the prompt")
    if max_tokens is not None and max_tokens > room:
        raise PromptTooLongError(
            f"{name} is {max_tokens} but only {room} tokens fit after the {prompt_len}-token prompt "
            f"(context {max_context_len}, max_context_len): lower {name} or shorten the prompt")
    return room
