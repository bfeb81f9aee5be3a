"""outlines-core behind the backend interface: a JSON schema becomes one regex
(``build_regex_from_schema``), the regex an eager token ``Index`` (every DFA state's allowed
tokens, computed at compile time). Masks are then table lookups, but the index can take seconds
to build for large schemas (measured by the constraints issue on 49 real-world schemas: p50 0.5 s,
p95 16.6 s, 6 past 60 s), so "auto" does not use it; the compile timeout bounds it."""

from __future__ import annotations

import json
import re
from typing import Any

import numpy as np

from radixgen.constraints.backend import Grammar, GrammarBackend, Matcher
from radixgen.constraints.schema_rewrite import DEFAULT_OPTIONS, GrammarOptions, grammar_schema
from radixgen.constraints.spec import ConstraintSpec
from radixgen.errors import InvalidConstraintError

try:
    import outlines_core
    from outlines_core.json_schema import build_regex_from_schema
except ImportError as e:  # pragma: no cover - the registry reports this
    raise ImportError("the outlines backend needs the package outlines-core: pip install outlines-core") from e

# Our JSON style is ", " and ": "; outlines puts this pattern around every separator.
_WHITESPACE = " ?"
_MAX_ROLLBACK = 4096  # tokens a validator may roll back (a whole JSON value)


def byte_level_alphabet() -> dict[str, int]:
    """Character -> byte of byte-level BPE vocabularies (GPT-2's scheme, used by SmolLM2, Llama 3,
    Qwen): printable bytes stand for themselves, the others are shifted past 255 in order."""
    direct = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    alphabet = {chr(b): b for b in direct}
    kept = set(direct)
    shifted = (b for b in range(256) if b not in kept)
    alphabet.update({chr(256 + i): b for i, b in enumerate(shifted)})
    return alphabet


def token_bytes(tokenizer: Any) -> dict[bytes, list[int]]:
    """Each ordinary token's bytes (special tokens left out: the stop token is handled apart)."""
    alphabet = byte_level_alphabet()
    special = set(tokenizer.all_special_ids)
    table: dict[bytes, list[int]] = {}
    for text, token_id in tokenizer.get_vocab().items():
        if token_id in special:
            continue
        if all(c in alphabet for c in text):
            raw = bytes(alphabet[c] for c in text)
        elif re.fullmatch(r"<0x[0-9A-Fa-f]{2}>", text):  # sentencepiece byte fallback
            raw = bytes([int(text[3:5], 16)])
        else:  # sentencepiece pieces: '▁' is a space
            raw = text.replace("\u2581", " ").encode()
        table.setdefault(raw, []).append(token_id)
    return table


class OutlinesMatcher(Matcher):
    def __init__(self, index: Any, stop_token_ids: frozenset[int]) -> None:
        self._guide = outlines_core.Guide(index, max_rollback=_MAX_ROLLBACK)
        self._stop_ids = stop_token_ids
        self.stop_token_ids = tuple(sorted(stop_token_ids))
        self._history: list[bool] = []  # per accepted token: was it the stop token (not given to the guide)

    def fill_bitmask(self, bitmask: np.ndarray, row: int) -> None:
        words = bitmask[row]
        if self.is_terminated():
            words[:] = 0
            return
        self._guide.write_mask_into(words.ctypes.data, words.size, 4)

    def accept(self, token_id: int) -> bool:
        if self.is_terminated():
            return False
        if token_id in self._stop_ids:
            if not self._guide.is_finished():
                return False
            self._history.append(True)
            return True
        try:
            self._guide.advance(token_id, return_tokens=False)
        except ValueError:  # no transition: the guide's state is unchanged
            return False
        self._history.append(False)
        return True

    def rollback(self, num_tokens: int) -> None:
        if num_tokens <= 0:
            return
        given = sum(not stop for stop in self._history[-num_tokens:])
        del self._history[-num_tokens:]
        if given:
            self._guide.rollback_state(given)

    def is_terminated(self) -> bool:
        return bool(self._history) and self._history[-1]

    def forced_string(self) -> str:
        return ""  # the index has no forced-text query; jump-forward simply does nothing here


class OutlinesGrammar(Grammar):
    compiled_by = "outlines"
    def __init__(self, index: Any, stop_token_ids: frozenset[int]) -> None:
        self._index = index
        self._stop_ids = stop_token_ids

    def matcher(self) -> Matcher:
        return OutlinesMatcher(self._index, self._stop_ids)


class OutlinesBackend(GrammarBackend):
    name = "outlines"

    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: list[int], *,
                 options: GrammarOptions = DEFAULT_OPTIONS) -> None:
        super().__init__(tokenizer, vocab_size, stop_token_ids, options=options)
        self._vocabulary = outlines_core.Vocabulary(stop_token_ids[0], token_bytes(tokenizer))
        self._stop_ids = frozenset(stop_token_ids)

    def compile(self, spec: ConstraintSpec) -> Grammar:
        if spec.kind == "structural":
            raise InvalidConstraintError(f"the {self.name} backend does not compile structural constraints (tool calls "
                                         "inside text, a reasoning section): use grammar_backend xgrammar or auto")
        try:
            if spec.kind in ("regex", "choices"):
                regex = spec.pattern()
            else:
                schema = grammar_schema(spec.schema(), self.options) if spec.kind == "json_schema" else {"type": "object"}
                regex = build_regex_from_schema(json.dumps(schema), _WHITESPACE)
            index = outlines_core.Index(regex, self._vocabulary)
        except (ValueError, RuntimeError, TypeError) as e:
            raise InvalidConstraintError(f"cannot compile the {spec.kind.replace('_', ' ')}: "
                                         f"{str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__}") from None
        return OutlinesGrammar(index, self._stop_ids)
