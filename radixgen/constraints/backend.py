"""The small interface every grammar backend implements.

Three objects, as in xgrammar and outlines-core: a backend compiles a spec into an immutable
``Grammar`` shared by all requests with that spec; each request gets its own ``Matcher``.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import Any

import numpy as np

from radixgen.constraints.schema_rewrite import DEFAULT_OPTIONS, GrammarOptions
from radixgen.constraints.spec import ConstraintSpec


class Grammar(ABC):
    """A compiled, immutable constraint. Thread-safe to share."""

    compiled_by: str = ""
    """The backend that compiled it (``auto`` hands each spec to one of the others)."""

    enforces_schema_exactly: bool = False
    """A JSON schema whose every keyword the automaton enforces: its outputs cannot fail the
    schema's validators, so they need not hold the stream back for a possible rollback."""

    not_enforced: tuple[str, ...] = ()
    """What a lenient compile left out of the automaton (llguidance's warnings, e.g. a ``not``
    it cannot express): the validators still check it, by rollback rather than by mask."""

    parts_enforced_exactly: frozenset[str | None] = frozenset()
    """For a structural constraint, the JSON parts whose schema the automaton enforces exactly,
    by tool name (None: the JSON answer); the others get validators (constraints/call_validation.py)."""

    @abstractmethod
    def matcher(self) -> Matcher:
        """A fresh per-request matcher at the start state."""


class Matcher(ABC):
    """Per-request automaton state.

    ``fill_bitmask(bitmask, row)`` writes the allowed next tokens of the current state into
    ``bitmask[row]`` (int32 words; bit i of word j allows token 32*j + i). ``accept(token)``
    advances and returns False if the token was not allowed (the state is unchanged then).
    ``rollback(n)`` undoes the last n accepted tokens. ``is_terminated()`` is True once the
    output is complete (the stop token was accepted). ``forced_string()`` is the text every
    continuation must start with (empty when the next character is not forced).
    ``is_completed()``: the output may end here (the automaton would take a stop token).
    """

    stop_token_ids: tuple[int, ...] = ()
    """The tokens that end the output (each backend's matcher is given them)."""

    @abstractmethod
    def fill_bitmask(self, bitmask: np.ndarray, row: int) -> None: ...

    @classmethod
    def fill_bitmasks(cls, matchers: list[Matcher], bitmask: np.ndarray, rows: list[int]) -> None:
        """``fill_bitmask`` for several matchers of this backend (one call where the backend
        fills a batch itself)."""
        for matcher, row in zip(matchers, rows, strict=True):
            matcher.fill_bitmask(bitmask, row)

    def error(self) -> str | None:
        """Why the automaton cannot go on from here (its own limits were reached), or None."""
        return None

    @abstractmethod
    def accept(self, token_id: int) -> bool: ...

    @abstractmethod
    def rollback(self, num_tokens: int) -> None: ...

    def accept_all(self, token_ids: Sequence[int]) -> bool:
        """Accept every token in order, or none: at the first refused one the tokens accepted
        before it are rolled back and False is returned."""
        for n, t in enumerate(token_ids):
            if not self.accept(t):
                self.rollback(n)
                return False
        return True

    @abstractmethod
    def is_terminated(self) -> bool: ...

    @abstractmethod
    def forced_string(self) -> str: ...

    def is_completed(self) -> bool:
        """The output may end here: a stop token is taken (and taken back, so the state is as it was)."""
        for t in self.stop_token_ids:
            if self.accept(t):
                self.rollback(1)
                return True
        return False


class GrammarBackend(ABC):
    """Compiles specs for one tokenizer and vocabulary size."""

    name: str

    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: list[int], *,
                 options: GrammarOptions = DEFAULT_OPTIONS) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.stop_token_ids = stop_token_ids
        self.options = options

    @abstractmethod
    def compile(self, spec: ConstraintSpec) -> Grammar:
        """Compile or raise ``InvalidConstraintError`` naming what is unsupported."""
