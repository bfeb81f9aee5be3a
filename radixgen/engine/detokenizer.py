"""Incremental detokenization and stop-string matching for one request.

Tokens are decoded in a short sliding window so that multi-byte UTF-8 characters split over
tokens, and tokens whose text depends on their left neighbour (leading-space markers), come out
right. Text that could be the start of a stop string is held back until it is known not to be.
"""

from __future__ import annotations

from typing import Any

# Prompt tokens kept as left context for decoding the first output tokens.
_CONTEXT_TOKENS = 4


class IncrementalDetokenizer:
    def __init__(
        self, tokenizer: Any, prompt_ids: list[int], *, skip_special_tokens: bool = True,
        stop: tuple[str, ...] = (),
    ) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.ids: list[int] = list(prompt_ids[-_CONTEXT_TOKENS:])
        self.prefix_offset = 0
        self.read_offset = len(self.ids)
        self.stop = stop
        self.max_stop_len = max((len(s) for s in stop), default=0)
        self.text = ""  # all output text decoded so far (after any stop-string trim)
        self.emitted = 0  # chars of self.text already handed out
        self.stopped = False

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def add_token(self, token_id: int) -> None:
        """Feed one output token; finds stop strings (sets ``stopped``, trims ``text``)."""
        self.ids.append(token_id)
        prefix_text = self._decode(self.ids[self.prefix_offset : self.read_offset])
        full_text = self._decode(self.ids[self.prefix_offset :])
        if len(full_text) <= len(prefix_text) or full_text.endswith("\ufffd"):
            return  # an incomplete character or no visible text yet: wait for more tokens
        new_text = full_text[len(prefix_text) :]
        self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
        if not self.stop:
            self.text += new_text
            return
        search_from = max(0, len(self.text) - self.max_stop_len + 1)
        self.text += new_text
        hits = [i for s in self.stop if (i := self.text.find(s, search_from)) >= 0]
        if hits:
            self.text = self.text[: min(hits)]
            self.stopped = True

    def take_delta(self, final: bool) -> str:
        """Text not yet handed out; while not final, hold back a possible stop-string start."""
        end = len(self.text)
        if not final and self.stop:
            end -= self._partial_stop_len()
        end = max(end, self.emitted)
        delta = self.text[self.emitted : end]
        self.emitted = end
        return delta

    def _partial_stop_len(self) -> int:
        tail = self.text[-self.max_stop_len :] if self.max_stop_len else ""
        for n in range(len(tail), 0, -1):
            suffix = tail[-n:]
            if any(s.startswith(suffix) for s in self.stop):
                return n
        return 0
