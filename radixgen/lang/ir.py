"""What a program appends to its state: text, generations, selections and role blocks.

``gen`` and ``select`` build plain descriptions; nothing runs until a state executes them.
Expressions concatenate with ``+`` so that a fixed frame and its holes read as one line:
``s += '{"city": "' + gen("city", stop='"') + '"}'``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from radixgen.errors import InvalidParamsError


class Expr:
    def __add__(self, other: Any) -> Concat:
        return Concat.of(self, other)

    def __radd__(self, other: Any) -> Concat:
        return Concat.of(other, self)

    def describe(self) -> str:
        raise NotImplementedError


@dataclass
class Concat(Expr):
    parts: list[str | Expr]

    @classmethod
    def of(cls, *items: Any) -> Concat:
        parts: list[str | Expr] = []
        for item in items:
            if isinstance(item, Concat):
                parts.extend(item.parts)
            elif isinstance(item, (str, Expr)):
                parts.append(item)
            else:
                raise TypeError(f"cannot append {type(item).__name__} to a program; use str, gen() or select()")
        return cls(parts)

    def describe(self) -> str:
        inner = [p.describe() for p in self.parts if isinstance(p, Expr)]
        return " + ".join(inner) if inner else "text"


@dataclass
class Gen(Expr):
    """Generate text into variable ``name`` (None: append without capturing)."""

    name: str | None
    params: dict[str, Any] = field(default_factory=dict)
    """SamplingParams fields given here; the run's defaults fill the rest."""

    def describe(self) -> str:
        return f"gen({self.name!r})"


@dataclass
class Select(Expr):
    """Append the choice the model scores highest (mean log-probability per token)."""

    name: str | None
    choices: list[str]

    def describe(self) -> str:
        return f"select({self.name!r})"


@dataclass
class RoleBegin(Expr):
    role: str

    def describe(self) -> str:
        return f"{self.role}() block"


@dataclass
class RoleEnd(Expr):
    role: str

    def describe(self) -> str:
        return f"end of {self.role}() block"


def gen(
    name: str | None = None, *, max_tokens: int | None = None, stop: str | list[str] | None = None,
    temperature: float | None = None, top_p: float | None = None, top_k: int | None = None,
    min_p: float | None = None, seed: int | None = None, regex: str | None = None,
    json_schema: Any = None, choices: list[str] | None = None, validators: dict[str, Any] | None = None,
    ignore_eos: bool | None = None, **sampling: Any,
) -> Gen:
    """A generation captured as ``s[name]``. ``json_schema`` takes a dict, a JSON string or a
    pydantic model (then ``s[name]`` is the parsed model); ``choices`` samples one of the strings
    under a constraint (``select`` ranks them by score instead); ``validators`` map JSON paths to
    callables run inside the decode loop (in-process Runtime only). Other keywords are
    SamplingParams fields."""
    given = {"max_new_tokens": max_tokens, "stop": stop, "temperature": temperature, "top_p": top_p,
             "top_k": top_k, "min_p": min_p, "seed": seed, "regex": regex, "json_schema": json_schema,
             "choices": tuple(choices) if choices is not None else None, "validators": validators,
             "ignore_eos": ignore_eos, **sampling}
    return Gen(name, {k: v for k, v in given.items() if v is not None})


def select(name: str | None, choices: list[str]) -> Select:
    """Choose among ``choices`` by the model's own scores; the prefix is computed once."""
    if not isinstance(choices, (list, tuple)) or not choices:
        raise InvalidParamsError("select needs a non-empty list of choices")
    if not all(isinstance(c, str) and c for c in choices):
        raise InvalidParamsError("select's choices must be non-empty strings")
    return Select(name, list(choices))
