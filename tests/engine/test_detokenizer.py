from __future__ import annotations

from typing import Any

import pytest

from radixgen.engine.detokenizer import IncrementalDetokenizer

TEXTS = [
    "Hello, world! This is plain ASCII.",
    "Café au lait, naïve façade — “quotes”.",
    "日本語のテキストと中文混合。",
    "Emoji: 🚀🔥👍🏽 and a family 👨‍👩‍👧.",
    "  leading spaces\n\nnew lines\ttabs",
]


@pytest.mark.parametrize("text", TEXTS)
def test_deltas_concatenate_to_the_full_decode(tokenizer: Any, text: str) -> None:
    ids = tokenizer.encode(text, add_special_tokens=False)
    detok = IncrementalDetokenizer(tokenizer, tokenizer.encode("Say:", add_special_tokens=False))
    pieces = []
    for t in ids:
        detok.add_token(t)
        pieces.append(detok.take_delta(final=False))
    pieces.append(detok.take_delta(final=True))
    assert "".join(pieces) == tokenizer.decode(ids)
    assert all("\ufffd" not in p for p in pieces), "a partial UTF-8 character leaked out"


def test_stop_string_trims_and_holds_back_partial_match(tokenizer: Any) -> None:
    text = "The answer is 42. END of story"
    ids = tokenizer.encode(text, add_special_tokens=False)
    detok = IncrementalDetokenizer(tokenizer, [], stop=("END",))
    streamed = []
    for t in ids:
        detok.add_token(t)
        streamed.append(detok.take_delta(final=detok.stopped))
        if detok.stopped:
            break
    assert detok.stopped
    # nothing of "END" ever went out, not even the "E" before the rest of the stop arrived
    assert "".join(streamed) == "The answer is 42. "
