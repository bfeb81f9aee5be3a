"""A step's one-token stream deltas as columns, for a consumer in another process.

The engine process sends each step's outputs to the HTTP front in one message. As objects that
cost one ``RequestOutput`` per running request per step on the engine thread, and pickling a
dataclass per request: at a thousand streams, several times the scheduler's own work. The
plain decode rows (results' batched lane) append their deltas here instead, as plain lists that
pickle in one pass, and the front builds the objects on its side (``expand``).
"""

from __future__ import annotations

from collections.abc import Iterator

from radixgen.engine.request import RequestOutput

DeltaColumns = tuple[list[str], list[int], list[str], list[int], list[int], list[int]]
"""(request ids, token ids, texts, completion tokens, prompt tokens, cached tokens)."""


class StepDeltas:
    __slots__ = ("request_ids", "token_ids", "texts", "completion_tokens", "prompt_tokens", "cached_tokens")

    def __init__(self) -> None:
        self.request_ids: list[str] = []
        self.token_ids: list[int] = []
        self.texts: list[str] = []
        self.completion_tokens: list[int] = []
        self.prompt_tokens: list[int] = []
        self.cached_tokens: list[int] = []

    def __len__(self) -> int:
        return len(self.request_ids)

    def take(self) -> DeltaColumns | None:
        """The deltas gathered since the last call (None if there were none), and a fresh start."""
        if not self.request_ids:
            return None
        columns = (self.request_ids, self.token_ids, self.texts, self.completion_tokens, self.prompt_tokens,
                   self.cached_tokens)
        self.__init__()  # type: ignore[misc]
        return columns


def expand(columns: DeltaColumns) -> Iterator[RequestOutput]:
    """The deltas as the outputs a per-request callback would have received."""
    for request_id, token, text, completion, prompt, cached in zip(*columns, strict=True):
        yield RequestOutput(request_id, [token], text, False, prompt_tokens=prompt, completion_tokens=completion,
                            cached_tokens=cached)
