"""A request's n-gram drafting state (speculative.py drafts and verifies with it): an index of
where each recent n-gram of its tokens last occurred, the prompt's text for copies the index cannot
see, and how much it drafts next."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

_MIN_MATCH = 2
# Only the most recent tokens are indexed (and the prompt's text read for a text copy): a draft
# comes from the latest occurrence anyway.
INDEX_WINDOW = 4096
# A text copy needs this many characters of the output found in the prompt: fewer match by chance.
_TEXT_MIN_MATCH = 3
_TEXT_MAX_MATCH = 32
_TEXT_CHARS_PER_TOKEN = 8  # prompt text read per token to draft (a token is rarely longer)


@dataclass
class NgramIndex:
    """Where each n-gram of a request's tokens last occurred (n = 2 .. max_n), as the index of
    the token that followed it. The newest position is never indexed before it is looked up,
    so a lookup finds an earlier occurrence, never the suffix itself."""

    max_n: int
    tables: list[dict[tuple[int, ...], int]] = field(default_factory=list)
    indexed_to: int = 0
    """n-grams ending before this position are in the tables."""

    def __post_init__(self) -> None:
        self.tables = [{} for _ in range(self.max_n + 1)]

    def update(self, tokens: list[int]) -> None:
        end = len(tokens) - 1  # the last token's n-grams wait until a token follows them
        start = max(self.indexed_to, end - INDEX_WINDOW)
        for stop in range(start + 1, end + 1):  # n-grams tokens[stop - n : stop], followed by tokens[stop]
            for n in range(_MIN_MATCH, min(self.max_n, stop) + 1):
                self.tables[n][tuple(tokens[stop - n : stop])] = stop
        self.indexed_to = max(self.indexed_to, end)

    def propose(self, tokens: list[int], k: int) -> list[int]:
        """Up to ``k`` tokens that followed the longest recent match of the sequence's suffix
        (at least two tokens long: a single common token predicts too little to pay)."""
        return self.propose_from(tokens, k)[0]

    def propose_from(self, tokens: list[int], k: int) -> tuple[list[int], int]:
        """``propose``'s tokens and the position they start at in ``tokens`` (-1: none)."""
        for n in range(min(self.max_n, len(tokens)), _MIN_MATCH - 1, -1):
            start = self.tables[n].get(tuple(tokens[len(tokens) - n :]))
            if start is not None:
                return tokens[start : start + k], start
        return [], -1


def prompt_text_continuation(prompt_text: str, tail: str, k: int, encode: Callable[[str], list[int]]) -> list[int]:
    """Up to ``k`` tokens of the prompt text that follows the longest suffix of ``tail`` (the
    output's last characters) found in it, at least ``_TEXT_MIN_MATCH`` characters long.

    An answer that copies a name or a number from the prompt often starts it inside another
    token than the prompt did (``"INV`` after a quote, `` INV`` in the prompt), and the token index
    finds nothing until the two tokenizations agree again; the text still matches. The tokens
    are the continuation's own tokenization, which is how a model usually writes it."""
    end = -1
    for n in range(_TEXT_MIN_MATCH, min(len(tail), _TEXT_MAX_MATCH) + 1):
        at = prompt_text.rfind(tail[-n:])
        if at < 0:
            break  # a longer suffix contains this one: it is not there either
        end = at + n
    if end < 0 or end == len(prompt_text):
        return []
    span = prompt_text[end : end + k * _TEXT_CHARS_PER_TOKEN]
    ids = encode(span)
    if end + len(span) < len(prompt_text):
        ids = ids[:-1]  # the span may end inside a word: its last token would not be the model's
    return ids[:k]


@dataclass
class DraftState:
    """A speculating request's drafting state."""

    index: NgramIndex
    tokens: list[int] = field(default_factory=list)
    """The request's prompt and output, kept up to date by appending (not rebuilt each step)."""
    draft: list[int] = field(default_factory=list)
    """The tokens drafted for this step (verified after the forward)."""
    draft_forced: int = 0
    """How many of them lead the draft as the constraint's forced text."""
    draft_source: str = "ngram"
    """Where the rest came from: copied (a span of the prompt, by tokens or by text) or ngram
    (of the output)."""
    prompt_text: str | None = None
    """The prompt's recent text, decoded when a text copy is first looked for."""
    length: int = 2
    """How many guessed tokens to draft next (forced text comes on top): doubled after a guess
    accepted whole, otherwise one more than the last guess's accepted part (a drafted position
    costs about a quarter of a decode step here: benchmarks/bench_speculative.py)."""
    drafted: int = 0
    accepted: int = 0
    accepted_forced: int = 0
    """Of the accepted, those that were the constraint's forced text."""
    gave_up: bool = False
    """Not drafting (any more): its drafts stopped paying, or the request cannot speculate."""
