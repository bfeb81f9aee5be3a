"""A step's one-token stream deltas as columns, for a consumer in another process.

The engine process sends each step's outputs to the HTTP front in one message. As objects that
cost one ``RequestOutput`` per running request per step on the engine thread, and pickling a
dataclass per request: at a thousand streams, several times the scheduler's own work. The
plain decode rows (results' batched lane) put their deltas here instead, as plain lists that
pickle in one pass, and the front builds the objects on its side (``DeltaReader``). Rows whose
text the consumer makes (``Request.detokenize`` False) arrive as whole blocks gathered from the
row table; rows with text made in the engine are appended one by one.

What a steady batch repeats every step (its request ids, prompt and cached lengths) goes once:
its columns carry the batch's key, and later blocks of the same batch name only the key, which
the reader resolves to the columns it kept.
"""

from __future__ import annotations

from collections.abc import Iterator

from radixgen.engine.request import RequestOutput

Columns = tuple[int | None, list[str], list[int], list[int]]
"""(key or None, request ids, prompt tokens, cached tokens): what a block's rows keep from step
to step. Keyed columns stand for the same rows in every block that carries them."""

DeltaBlock = tuple[Columns | int, list[int], list[str] | None, list[int]]
"""(columns, or the key of keyed columns sent before; token ids; texts or None for no text;
completion tokens), one entry per delta (lists: small numpy arrays pickle slower)."""


class StepDeltas:
    __slots__ = ("request_ids", "token_ids", "texts", "completion_tokens", "prompt_tokens", "cached_tokens",
                 "blocks", "_sent_key")

    def __init__(self) -> None:
        self._sent_key: int | None = None
        self._start()

    def _start(self) -> None:
        self.request_ids: list[str] = []
        self.token_ids: list[int] = []
        self.texts: list[str] = []
        self.completion_tokens: list[int] = []
        self.prompt_tokens: list[int] = []
        self.cached_tokens: list[int] = []
        self.blocks: list[DeltaBlock] = []

    def __len__(self) -> int:
        return len(self.request_ids) + sum(len(block[1]) for block in self.blocks)

    def take(self) -> list[DeltaBlock] | None:
        """The deltas gathered since the last call (None if there were none), and a fresh start.
        Keyed columns already taken (the last key taken) are replaced by their key."""
        blocks = self.blocks
        if self.request_ids:
            blocks.append(((None, self.request_ids, self.prompt_tokens, self.cached_tokens), self.token_ids,
                           self.texts, self.completion_tokens))
        if not blocks:
            return None
        for i, (columns, tokens, texts, completion) in enumerate(blocks):
            key = columns if isinstance(columns, int) else columns[0]
            if key is None:
                continue
            if key == self._sent_key:
                blocks[i] = (key, tokens, texts, completion)
            else:
                self._sent_key = key
        self._start()
        return blocks

    def forget(self) -> None:
        """A new consumer starts: keyed columns go whole again."""
        self._sent_key = None


class DeltaReader:
    """The consumer's side: the deltas as the outputs a per-request callback would have
    received. Blocks naming a key it does not hold (columns sent to an earlier consumer) are
    skipped: their requests are not this consumer's."""

    def __init__(self) -> None:
        self._key: int | None = None
        self._columns: Columns | None = None

    def expand(self, blocks: list[DeltaBlock]) -> Iterator[RequestOutput]:
        for columns, tokens, texts, completion in blocks:
            if isinstance(columns, int):
                if columns != self._key or self._columns is None:
                    continue
                columns = self._columns
            elif columns[0] is not None:
                self._key, self._columns = columns[0], columns
            _, ids, prompt, cached = columns
            for request_id, token, text, n, p, c in zip(ids, tokens, texts or [""] * len(ids), completion, prompt,
                                                       cached, strict=True):
                yield RequestOutput(request_id, [token], text, False, prompt_tokens=p, completion_tokens=n,
                                    cached_tokens=c)
