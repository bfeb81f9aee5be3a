"""A step's one-token stream deltas as columns, for a consumer in another process.

The engine process sends each step's outputs to the HTTP front in one message. As objects that
cost one ``RequestOutput`` per running request per step on the engine thread, and pickling a
dataclass per request: at a thousand streams, several times the scheduler's own work. The
plain decode rows (results' batched lane) put their deltas here instead, as plain lists that
pickle in one pass, and the front builds the objects on its side (``expand``). Rows whose text
the consumer makes (``Request.detokenize`` False) arrive as whole blocks gathered from the row
table; rows with text made in the engine are appended one by one.
"""

from __future__ import annotations

from collections.abc import Iterator

from radixgen.engine.request import RequestOutput

DeltaBlock = tuple[list[str], list[int], list[str] | None, list[int], list[int], list[int]]
"""(request ids, token ids, texts or None for no text, completion tokens, prompt tokens, cached
tokens), one entry per delta (lists: small numpy arrays pickle slower)."""


class StepDeltas:
    __slots__ = ("request_ids", "token_ids", "texts", "completion_tokens", "prompt_tokens", "cached_tokens",
                 "blocks")

    def __init__(self) -> None:
        self.request_ids: list[str] = []
        self.token_ids: list[int] = []
        self.texts: list[str] = []
        self.completion_tokens: list[int] = []
        self.prompt_tokens: list[int] = []
        self.cached_tokens: list[int] = []
        self.blocks: list[DeltaBlock] = []

    def __len__(self) -> int:
        return len(self.request_ids) + sum(len(block[0]) for block in self.blocks)

    def take(self) -> list[DeltaBlock] | None:
        """The deltas gathered since the last call (None if there were none), and a fresh start."""
        blocks = self.blocks
        if self.request_ids:
            blocks.append((self.request_ids, self.token_ids, self.texts, self.completion_tokens, self.prompt_tokens,
                           self.cached_tokens))
        if not blocks:
            return None
        self.__init__()  # type: ignore[misc]
        return blocks


def expand(blocks: list[DeltaBlock]) -> Iterator[RequestOutput]:
    """The deltas as the outputs a per-request callback would have received."""
    for ids, tokens, texts, completion, prompt, cached in blocks:
        for request_id, token, text, n, p, c in zip(ids, tokens, texts or [""] * len(ids), completion, prompt, cached,
                                                   strict=True):
            yield RequestOutput(request_id, [token], text, False, prompt_tokens=p, completion_tokens=n,
                                cached_tokens=c)
