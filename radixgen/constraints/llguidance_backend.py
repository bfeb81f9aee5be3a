"""llguidance behind the backend interface: an Earley parser over a lazily built lexer, so
compiling costs about a millisecond and masks are computed per step (tens of microseconds).
Follows JSON Schema closely (it rejects what it cannot enforce rather than ignoring it)."""

from __future__ import annotations

import json
from typing import Any

import numpy as np

from radixgen.constraints.backend import Grammar, GrammarBackend, Matcher
from radixgen.constraints.schema_rewrite import DEFAULT_OPTIONS, GrammarOptions, grammar_schema
from radixgen.constraints.spec import ConstraintSpec
from radixgen.constraints.string_lark import root_string_lark
from radixgen.constraints.structural import llguidance_structural_lark, structure_of
from radixgen.errors import InvalidConstraintError, UnenforceableConstraintError

try:
    import llguidance
    import llguidance.hf
except ImportError as e:  # pragma: no cover - the registry reports this
    raise ImportError("the llguidance backend needs the package llguidance: pip install llguidance") from e

# Our JSON style (", " and ": ", no other whitespace), the same as the xgrammar backend's.
_JSON_OPTIONS: Any = {"item_separator": ", ", "key_separator": ": ", "whitespace_flexible": False, "lenient": True}


_STRING_LEXEME_LIMITS = llguidance.LLParserLimits(initial_lexer_fuel=20_000_000, step_lexer_fuel=2_000_000)


class LLGuidanceMatcher(Matcher):
    def __init__(self, matcher: Any, stop_token_ids: frozenset[int]) -> None:
        self._m = matcher
        self._stop_ids = stop_token_ids
        self.stop_token_ids = tuple(sorted(stop_token_ids))
        # per accepted token: (given to llguidance, ended the output). A stop token after the
        # parser has stopped on its own is ours alone: llguidance has nothing to consume then.
        self._history: list[tuple[bool, bool]] = []

    def fill_bitmask(self, bitmask: np.ndarray, row: int) -> None:
        words = bitmask[row]
        if self._m.is_stopped():  # complete: only a stop token may follow
            words[:] = 0
            for t in self._stop_ids:
                words[t // 32] |= np.int32(np.uint32(1 << (t % 32)).view(np.int32))
            return
        assert words.flags.c_contiguous
        self._m.unsafe_compute_mask_ptr(words.ctypes.data, words.nbytes)
        if self._m.is_error():  # llguidance then allows a stop token: a dead end, not an answer
            words[:] = 0

    def error(self) -> str | None:
        return _first_line([self._m.get_error()]) if self._m.is_error() else None

    def accept(self, token_id: int) -> bool:
        if self.is_terminated():
            return False
        is_stop = token_id in self._stop_ids
        if self._m.is_error():
            return False
        if self._m.is_stopped():  # complete: only a stop token may follow
            if not is_stop:
                return False
            self._history.append((False, True))
            return True
        # try_consume refuses without entering llguidance's error state (consume_token would not)
        if self._m.try_consume_tokens([token_id]) != 1:
            return False
        self._history.append((True, is_stop))
        return True

    def rollback(self, num_tokens: int) -> None:
        if num_tokens <= 0:
            return
        given = sum(g for g, _ in self._history[-num_tokens:])
        del self._history[-num_tokens:]
        if given:
            self._m.rollback(given)

    def is_terminated(self) -> bool:
        return bool(self._history) and self._history[-1][1]

    def forced_string(self) -> str:
        if self.is_terminated() or self._m.is_stopped():
            return ""
        forced = self._m.compute_ff_bytes()
        # a cut in the middle of a UTF-8 character is left for the model to finish
        return forced.decode("utf-8", errors="ignore") if forced else ""


class LLGuidanceGrammar(Grammar):
    compiled_by = "llguidance"
    def __init__(self, prototype: Any, stop_token_ids: frozenset[int]) -> None:
        self._prototype = prototype
        self._stop_ids = stop_token_ids

    def matcher(self) -> Matcher:
        return LLGuidanceMatcher(self._prototype.deep_copy(), self._stop_ids)


class LLGuidanceBackend(GrammarBackend):
    name = "llguidance"

    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: list[int], *,
                 options: GrammarOptions = DEFAULT_OPTIONS) -> None:
        super().__init__(tokenizer, vocab_size, stop_token_ids, options=options)
        self._tokenizer = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab_size, eos_token=stop_token_ids[0])
        self._stop_ids = frozenset(stop_token_ids)
        added = getattr(tokenizer, "added_tokens_decoder", {}) or {}
        # markers that are one special token (``[TOOL_CALLS]``) are matched as that token: their
        # text is not in the token's bytes as llguidance sees them
        self._special_ids = {t.content: i for i, t in added.items() if getattr(t, "special", False) and i < vocab_size}

    def compile(self, spec: ConstraintSpec) -> Grammar:
        string_lark = None
        if spec.kind == "structural":
            grammar = llguidance.LLMatcher.grammar_from_lark(llguidance_structural_lark(
                structure_of(spec), self.options, _JSON_OPTIONS, self._special_ids.get))
        elif spec.kind == "regex":
            grammar = llguidance.LLMatcher.grammar_from_regex(spec.value)
        elif spec.kind == "choices":
            grammar = llguidance.LLMatcher.grammar_from_regex(spec.pattern())
        elif spec.kind == "json_schema" and (string_lark := root_string_lark(spec.schema())) is not None:
            # not / oneOf over a root string's patterns: one lexeme the JSON compiler cannot write
            grammar, schema = llguidance.LLMatcher.grammar_from_lark(string_lark), spec.schema()
        else:
            schema = grammar_schema(spec.schema(), self.options) if spec.kind == "json_schema" else {"type": "object"}
            grammar = llguidance.LLMatcher.grammar_from_json_schema(json.dumps(schema), defaults=_JSON_OPTIONS)
        failed, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar, self._tokenizer)
        if failed:
            why = _first_line(messages)
            if spec.kind == "json_schema" and "nsatisfiable" in why and "@1" in json.dumps(schema):
                why += (f" (its recursive definitions are unrolled {self.options.max_recursion_depth} levels deep, "
                        "json_max_recursion_depth: one whose required properties refer back to itself has no "
                        "instance that ends; make the recursive property optional or nullable)")
            if string_lark is not None:
                raise _lexeme_too_large(why)
            raise InvalidConstraintError(f"cannot compile the {spec.kind.replace('_', ' ')}: {why}")
        # a lexeme of intersections and complements builds many derivatives: more fuel for it
        # (~50k / ms at the start, ~14k / ms per token), within its own matcher only
        limits = _STRING_LEXEME_LIMITS if string_lark is not None else None
        prototype = llguidance.LLMatcher(self._tokenizer, grammar, log_level=0, limits=limits)
        if prototype.is_error():
            why = _first_line([prototype.get_error()])
            if string_lark is not None:
                raise _lexeme_too_large(why)
            raise InvalidConstraintError(f"cannot compile the {spec.kind.replace('_', ' ')}: {why}")
        if string_lark is not None:
            _check_lexeme_evaluates(prototype, self._tokenizer.tokenize_str('"'), self.vocab_size)
        grammar_out = LLGuidanceGrammar(prototype, self._stop_ids)
        grammar_out.not_enforced = tuple(_first_line([m]) for m in messages if m.strip())
        return grammar_out


def _first_line(messages: list[str]) -> str:
    return messages[0].strip().splitlines()[0] if messages and messages[0].strip() else "unknown error"


_LEXEME_PROBE_TOKENS = 12


def _check_lexeme_evaluates(prototype: Any, quote: list[int], vocab_size: int) -> None:
    """Refuse a string lexeme whose masks llguidance cannot compute (its derivatives outgrow
    the lexer's limits), probed after the opening ``quote`` and along a few allowed tokens: at
    generation the matcher would fail on one of the first tokens."""
    probe = prototype.deep_copy()
    probe.consume_tokens(quote)
    words = np.zeros((vocab_size + 31) // 32, dtype=np.int32)
    for _ in range(_LEXEME_PROBE_TOKENS):
        if probe.is_error() or probe.is_stopped():
            break
        probe.unsafe_compute_mask_ptr(words.ctypes.data, words.nbytes)
        allowed = np.flatnonzero(np.unpackbits(words.view(np.uint8), bitorder="little"))
        if probe.is_error() or not len(allowed):
            break
        probe.consume_tokens([int(allowed[len(allowed) // 2])])  # a middle token: text, not the closing quote
    if probe.is_error():
        raise _lexeme_too_large(_first_line([probe.get_error()]))


def _lexeme_too_large(why: str) -> UnenforceableConstraintError:
    return UnenforceableConstraintError(f"cannot compile the json schema: its string's patterns, combined under not / "
                                        f"oneOf, are too large to enforce ({why}); simplify them or split the value")
