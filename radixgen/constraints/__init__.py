"""Constrained decoding: specs (regex, JSON schema, choices, JSON object) compiled by a backend
into immutable grammars, per-request matchers, and the batch bitmask applied to logits."""

from __future__ import annotations

import importlib
from typing import Any

from radixgen.constraints.backend import Grammar, GrammarBackend, Matcher
from radixgen.constraints.compile import GrammarService
from radixgen.constraints.schema_rewrite import DEFAULT_OPTIONS, GrammarOptions
from radixgen.constraints.spec import (
    JSON_OBJECT,
    ConstraintSpec,
    choices_spec,
    regex_spec,
    schema_spec,
)


def __getattr__(name: str) -> Any:
    # the bitmask helpers import numpy; the specs, grammars and matchers (what the server's HTTP process
    # uses) do not
    if name == "allocate_bitmask":
        from radixgen.constraints import mask

        return getattr(mask, name)
    raise AttributeError(f"module 'radixgen.constraints' has no attribute {name!r}")


# name -> "module:class"; heavy backends are imported only when chosen.
BACKENDS = {
    "xgrammar": "radixgen.constraints.xgrammar_backend:XGrammarBackend",
    "llguidance": "radixgen.constraints.llguidance_backend:LLGuidanceBackend",
    "outlines": "radixgen.constraints.outlines_backend:OutlinesBackend",  # eager index: never "auto"
}
# "auto" routes each constraint to the best installed backend (auto_backend.py explains the measurements).
_AUTO_MEMBERS = ["xgrammar", "llguidance"]


def make_backend(name: str, tokenizer: Any, vocab_size: int, stop_token_ids: list[int], *,
                 options: GrammarOptions = DEFAULT_OPTIONS) -> GrammarBackend:
    if name == "auto":
        members, errors = [], []
        for candidate in _AUTO_MEMBERS:
            try:
                members.append(make_backend(candidate, tokenizer, vocab_size, stop_token_ids, options=options))
            except ImportError as e:
                errors.append(str(e))
        if not members:
            raise ImportError("no grammar backend is installed: " + "; ".join(errors))
        from radixgen.constraints.auto_backend import AutoBackend

        return members[0] if len(members) == 1 else AutoBackend(members)
    if name not in BACKENDS:
        raise ValueError(f"grammar_backend must be one of {['auto', *BACKENDS]}, got {name!r}")
    module, cls = BACKENDS[name].split(":")
    backend_cls = getattr(importlib.import_module(module), cls)
    return backend_cls(tokenizer, vocab_size, stop_token_ids, options=options)


__all__ = [
    "BACKENDS", "JSON_OBJECT", "ConstraintSpec", "Grammar", "GrammarBackend", "GrammarOptions", "GrammarService",
    "Matcher",
    "allocate_bitmask", "choices_spec", "make_backend", "regex_spec", "schema_spec",
]
