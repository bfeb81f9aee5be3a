"""Incremental detokenization and stop-string matching for one request.

Token ids go through ``tokenizers``' ``DecodeStream``: one native step per token, which holds
back the bytes of a UTF-8 character split over tokens and decodes each token against its left
neighbour (leading-space markers), seeded with the prompt's last tokens. Text that could be the
start of a stop string is held back until it is known not to be. Text is kept as a list of
pieces (joined when read), so a long output is not copied again with each token.
"""

from __future__ import annotations

from typing import Any

from tokenizers.decoders import DecodeStream

# Prompt tokens kept as left context for decoding the first output tokens.
_CONTEXT_TOKENS = 4


class IncrementalDetokenizer:
    def __init__(
        self, tokenizer: Any, prompt_ids: list[int], *, skip_special_tokens: bool = True,
        stop: tuple[str, ...] = (),
    ) -> None:
        # transformers' fast tokenizers wrap the native one that DecodeStream steps with
        self.backend = getattr(tokenizer, "backend_tokenizer", tokenizer)
        self.skip_special_tokens = skip_special_tokens
        self._stream = DecodeStream(ids=list(prompt_ids[-_CONTEXT_TOKENS:]), skip_special_tokens=skip_special_tokens)
        self.stop = stop
        self.max_stop_len = max((len(s) for s in stop), default=0)
        self._pieces: list[str] = []  # all output text so far (after any stop-string trim)
        self.length = 0
        self._unsent: list[str] = []  # the end of that text not yet handed out
        self._unsent_len = 0
        self._tail = ""  # the text's last max_stop_len chars, where a stop string may begin
        self.stopped = False

    @property
    def text(self) -> str:
        if len(self._pieces) > 1:
            self._pieces = ["".join(self._pieces)]
        return self._pieces[0] if self._pieces else ""

    def add_token(self, token_id: int) -> str:
        """Feed one output token; return the text it adds (finds stop strings: sets
        ``stopped`` and trims the text at the stop)."""
        piece = self._stream.step(self.backend, token_id)
        if not piece:
            return ""  # an incomplete character or no visible text yet: wait for more tokens
        if self.stop:
            window = self._tail + piece
            hits = [i for s in self.stop if (i := window.find(s)) >= 0]
            if hits:
                self.stopped = True
                cut = len(window) - min(hits)  # chars to drop from the end once piece is in
                self._append(piece)
                self._drop_last(cut)
                return piece[: max(len(piece) - cut, 0)]
            self._tail = window[-self.max_stop_len :]
        self._append(piece)
        return piece

    def stream_token(self, token_id: int) -> str:
        """``add_token`` then ``take_delta(False)`` in one step, for a stream with no stop
        strings whose text has all been handed out (the batched lane's requests)."""
        if self.stop or self._unsent_len:
            self.add_token(token_id)
            return self.take_delta(False)
        piece = self._stream.step(self.backend, token_id)
        if piece:
            self._pieces.append(piece)
            self.length += len(piece)
            return piece
        return ""

    def _append(self, piece: str) -> None:
        self._pieces.append(piece)
        self._unsent.append(piece)
        self.length += len(piece)
        self._unsent_len += len(piece)

    def _drop_last(self, n: int) -> None:
        """Trim ``n`` chars from the end; they are unsent (a partial stop string is held back)."""
        text = self.text
        self._pieces = [text[: len(text) - n]]
        self.length -= n
        unsent = "".join(self._unsent)
        self._unsent = [unsent[: max(len(unsent) - n, 0)]]
        self._unsent_len = len(self._unsent[0])

    def take_delta(self, final: bool, upto: int | None = None) -> str:
        """Text not yet handed out; while not final, hold back a possible stop-string start,
        and whatever lies past char ``upto``."""
        if not self._unsent_len:
            return ""
        unsent = "".join(self._unsent)
        held = self._partial_stop_len() if not final and self.stop else 0
        if upto is not None:
            held = min(max(held, self.length - upto), len(unsent))
        delta, rest = unsent[: len(unsent) - held], unsent[len(unsent) - held :]
        self._unsent, self._unsent_len = ([rest] if rest else []), len(rest)
        return delta

    @property
    def sent(self) -> int:
        """Chars of the text already handed out."""
        return self.length - self._unsent_len

    def resume_after(self, sent: int) -> None:
        """Treat the first ``sent`` chars as handed out already (a rebuilt detokenizer after a
        rollback: what was streamed stays streamed)."""
        unsent = self.text[min(sent, self.length) :]
        self._unsent, self._unsent_len = ([unsent] if unsent else []), len(unsent)

    def _partial_stop_len(self) -> int:
        tail = self._tail
        for n in range(min(len(tail), self._unsent_len), 0, -1):
            suffix = tail[-n:]
            if any(s.startswith(suffix) for s in self.stop):
                return n
        return 0


class ConsumerText:
    """The text of a request the engine did not detokenize (``Request.detokenize`` False), made
    by its consumer from the outputs' token ids: the HTTP front, in its own process. Gives the
    text the engine would have given: such a request has no stop strings and no constraint, so
    it stops only on a stop token, which (as in the engine) is not part of the text."""

    __slots__ = ("_detok",)

    def __init__(self, tokenizer: Any, prompt_ids: list[int], skip_special_tokens: bool) -> None:
        self._detok = IncrementalDetokenizer(tokenizer, prompt_ids, skip_special_tokens=skip_special_tokens)

    @classmethod
    def for_prompt(cls, tokenizer: Any, prompt_ids: list[int], skip_special_tokens: bool) -> ConsumerText | None:
        """None when the prompt's last tokens (the decoding context) are not token ids of this
        vocabulary: the engine rejects such a request, with an error that says why."""
        vocab = len(tokenizer)
        if not all(isinstance(t, int) and 0 <= t < vocab for t in prompt_ids[-_CONTEXT_TOKENS:]):
            return None
        return cls(tokenizer, prompt_ids, skip_special_tokens)

    def fill(self, out: Any) -> None:
        """Set ``out.new_text`` (and a final's ``text``) from its new token ids."""
        detok = self._detok
        tokens = out.new_token_ids
        if not out.finished and len(tokens) == 1:  # a stream's step
            out.new_text = detok.stream_token(tokens[0])
            return
        if out.finished and tokens and out.finish_reason is not None and out.finish_reason.value == "stop":
            tokens = tokens[:-1]
        for token in tokens:
            detok.add_token(token)
        out.new_text = detok.take_delta(out.finished)
        if out.finished:
            out.text = detok.text
