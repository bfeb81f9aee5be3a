"""What the engine gives back: a request's ``FinishReason``, the per-step ``RequestOutput`` (a
delta, or the final state), the blocking front's ``GenerationOutput``, and the columnar wire
format of plain decode deltas (``StepDeltas`` / ``DeltaReader``).

Plain data without torch: the server's HTTP process imports it.

The delta wire format: a step's one-token stream deltas as columns, for a consumer in another
process.

The engine process sends each step's outputs to the HTTP front in one message. As objects that
cost one ``RequestOutput`` per running request per step on the engine thread, and pickling a
dataclass per request: at a thousand streams, several times the scheduler's own work. The
plain decode rows (the step applier's batched lane) put their deltas here instead, as plain lists that
pickle in one pass, and the front builds the objects on its side (``DeltaReader``). Rows whose
text the consumer makes (``Request.detokenize`` False) arrive as whole blocks gathered from the
row table; rows with text made in the engine are appended one by one.

What a steady batch repeats every step (its request ids, prompt and cached lengths) goes once:
its columns carry the batch's key, and later blocks of the same batch name only the key, which
the reader resolves to the columns it kept.
"""

from __future__ import annotations

import enum
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from radixgen.constraints.report import ConstraintReport


class FinishReason(str, enum.Enum):
    STOP = "stop"  # EOS, a stop token id or a stop string
    LENGTH = "length"  # max_new_tokens or the context limit
    ABORT = "abort"  # aborted by the caller (or its client went away)
    CONSTRAINT_VIOLATION = "constraint_violation"  # validators kept rejecting past the retry bound
    ERROR = "error"  # an internal fault ended this request; the engine keeps serving


@dataclass(slots=True)
class RequestOutput:
    """What one step produced for one request (a delta), or its final state when finished."""

    request_id: str
    new_token_ids: list[int]
    new_text: str
    finished: bool
    finish_reason: FinishReason | None = None
    error: str | None = None
    user_error: bool = False
    """The error is the caller's (a bad parameter), not an internal fault."""
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    new_logprobs: list[float] | None = None
    new_top_logprobs: list[list[tuple[int, float]]] | None = None
    output_ids: list[int] | None = None
    """Final output only: every output token id (streamed deltas add up to the same)."""
    prompt_logprobs: list[float] | None = None
    """Final output only, with ``prompt_logprob_start``: log-probabilities of the prompt's tokens
    from that index on."""
    text: str | None = None
    """Final output only: the whole output text."""
    constraint_warnings: list[str] | None = None
    """Final output only: what the constraint's grammar does not enforce (validators check it)."""
    shortened: bool = False
    """Final output only: budget steering closed the constrained output early (a string, an
    array or an object was ended, or the rest completed with its shortest valid text) so that it
    finished within max_new_tokens."""
    constraint: ConstraintReport | None = None
    """Final output only: what the constraint did (None for an unconstrained request)."""
    partial: Any = None
    """With ``include_partial`` (a JSON answer, streamed): the answer so far as an object of
    its complete values, on each delta in which a value completed (``constraints.partial``)."""


@dataclass
class GenerationOutput:
    """A finished request."""

    request_id: str
    text: str
    token_ids: list[int]
    finish_reason: FinishReason
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = 0
    error: str | None = None
    user_error: bool = False
    """The error is the caller's (e.g. an invalid constraint), not an internal fault."""
    logprobs: list[float] | None = None
    top_logprobs: list[list[tuple[int, float]]] | None = None
    prompt_logprobs: list[float] | None = None
    """With ``prompt_logprob_start``: log-probabilities of the prompt's tokens from there on."""
    shortened: bool = False
    """Budget steering closed the constrained output early so that it finished complete within
    max_new_tokens (finish_reason is still "stop")."""
    constraint_warnings: list[str] | None = None
    """What the constraint's grammar did not enforce (a lenient compile's dropped keywords);
    validators checked it instead."""
    constraint: ConstraintReport | None = None
    """What the constraint did: how the answer ended, whether it is valid, what was forced,
    drafted, rolled back, steered or searched (None for an unconstrained request)."""

    @classmethod
    def of_final(cls, final: RequestOutput, logprobs: list[float] | None,
                 top_logprobs: list[list[tuple[int, float]]] | None) -> GenerationOutput:
        """A request's final ``RequestOutput`` as the blocking front returns it, with the whole
        output's log-probabilities (the final output carries only its last step's)."""
        assert final.finished and final.finish_reason is not None
        assert final.output_ids is not None and final.text is not None
        return cls(request_id=final.request_id, text=final.text, token_ids=final.output_ids,
                   finish_reason=final.finish_reason, prompt_tokens=final.prompt_tokens,
                   completion_tokens=final.completion_tokens, cached_tokens=final.cached_tokens, error=final.error,
                   user_error=final.user_error, logprobs=logprobs, top_logprobs=top_logprobs,
                   prompt_logprobs=final.prompt_logprobs, shortened=final.shortened,
                   constraint_warnings=final.constraint_warnings, constraint=final.constraint)


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
                yield RequestOutput(request_id=request_id, new_token_ids=[token], new_text=text, finished=False,
                                    prompt_tokens=p, completion_tokens=n, cached_tokens=c)
