"""A request's n-gram drafting state (speculative.py drafts and verifies with it): an index of
where each recent n-gram of its tokens last occurred, the prompt's text for copies the index cannot
see, and how much it drafts next."""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

_MIN_MATCH = 2
# Only the most recent tokens are indexed (and the prompt's text read for a text copy): a draft
# comes from the latest occurrence anyway.
INDEX_WINDOW = 4096
# A text copy needs this many characters of the output found in the prompt: fewer match by chance.
_TEXT_MIN_MATCH = 3
_TEXT_MAX_MATCH = 32
_TEXT_CHARS_PER_TOKEN = 8  # prompt text read per token to draft (a token is rarely longer)
_LAST_WORD = re.compile(r"\w+$")
_VALUE = re.compile(r"\S+")
_VALUE_END = ".,;:!?)]}'\""


@dataclass
class NgramIndex:
    """Where each n-gram of a request's tokens occurred (n = 2 .. max_n), as the indexes of the
    tokens that followed it, oldest first. The newest position is never indexed before it is
    looked up, so a lookup finds an earlier occurrence, never the suffix itself."""

    max_n: int
    tables: list[dict[tuple[int, ...], list[int]]] = field(default_factory=list)
    indexed_to: int = 0
    """n-grams ending before this position are in the tables."""

    def __post_init__(self) -> None:
        self.tables = [{} for _ in range(self.max_n + 1)]

    def update(self, tokens: list[int]) -> None:
        end = len(tokens) - 1  # the last token's n-grams wait until a token follows them
        start = max(self.indexed_to, end - INDEX_WINDOW)
        for stop in range(start + 1, end + 1):  # n-grams tokens[stop - n : stop], followed by tokens[stop]
            for n in range(_MIN_MATCH, min(self.max_n, stop) + 1):
                self.tables[n].setdefault(tuple(tokens[stop - n : stop]), []).append(stop)
        self.indexed_to = max(self.indexed_to, end)

    def candidates(self, tokens: list[int], k: int, limit: int = 1) -> Iterator[tuple[list[int], int]]:
        """Up to ``limit`` continuations of the sequence's suffix, each up to ``k`` tokens and
        the position it starts at in ``tokens``: the longest match's occurrences first, the
        latest first among them, then shorter matches' other occurrences. The caller takes the
        first its grammar allows (the latest copy of "03" may be followed by a "." where a date
        needs a "-")."""
        seen: set[int] = set()
        for n in range(min(self.max_n, len(tokens)), _MIN_MATCH - 1, -1):
            for start in reversed(self.tables[n].get(tuple(tokens[len(tokens) - n :]), ())):
                if start in seen:
                    continue
                seen.add(start)
                yield tokens[start : start + k], start
                if len(seen) >= limit:
                    return


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
    return _prompt_tokens_from(prompt_text, end, k, encode)


def word_start_continuation(prompt_text: str, tail: str, output_text: str, k: int,
                            encode: Callable[[str], list[int]]) -> list[int]:
    """Up to ``k`` tokens of the prompt text that follows the output's last word so far (its
    letters and digits after the last other character, however short), where that word starts
    a word of the prompt: the first occurrence whose next characters the output does not hold
    yet, else the first.

    Where the output starts a copied value (``"N`` of ``"Nordlicht"``, the ``2`` of a date) no
    suffix of three characters is in the prompt yet; the value's first characters and the
    order of the prompt's values (a second date is the one not yet written) usually are enough."""
    word = _LAST_WORD.search(tail)
    if word is None:
        return []
    text = word.group()
    starts = [m.start() for m in re.finditer(r"(?<!\w)" + re.escape(text), prompt_text)]
    starts = [at for at in starts if at + len(text) < len(prompt_text)]
    if not starts:
        return []
    fresh = [at for at in starts if _value_at(prompt_text, at) not in output_text]
    end = (fresh or starts)[0] + len(text)
    return _prompt_tokens_from(prompt_text, end, k, encode)


def _prompt_tokens_from(prompt_text: str, end: int, k: int, encode: Callable[[str], list[int]]) -> list[int]:
    """Up to ``k`` tokens of the prompt text from ``end``, tokenized as a continuation."""
    span = prompt_text[end : end + k * _TEXT_CHARS_PER_TOKEN]
    ids = encode(span)
    if end + len(span) < len(prompt_text):
        ids = ids[:-1]  # the span may end inside a word: its last token would not be the model's
    return ids[:k]


def _value_at(text: str, at: int) -> str:
    """The prompt's value that starts at ``at``: its characters up to a space, less the
    punctuation that ends a sentence or a list around it ("2024-04-03." -> "2024-04-03")."""
    match = _VALUE.match(text, at)
    return match.group().rstrip(_VALUE_END) if match is not None else ""


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
    drafted: int = 0
    accepted: int = 0
    accepted_forced: int = 0
    """Of the accepted, those that were the constraint's forced text."""
    gave_up: bool = False
    """Not drafting (any more): its drafts stopped paying, or the request cannot speculate."""
