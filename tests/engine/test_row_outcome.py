"""The appender's typed outcome per row, as the applier acts on it (engine/row_outcome.py): a
validator's rejection is a ``RollBack`` to the rejected value's first token, forced text appended
after a sample is an ``ExtendForced``, the last token a ``Finish``; nothing of it is left on the
request's state for a later step to find."""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from typing import Any

from radixgen import Engine, FinishReason
from radixgen.engine.row_outcome import ExtendForced, Finish, GoOn, RollBack
from tests.engine.test_validators import generate_rejecting_the_first_kind


def test_each_appended_token_says_what_follows_for_its_request(make_engine: Callable[..., Engine]) -> None:
    engine = make_engine(speculative="off")  # drafting would verify the forced text instead
    appender = engine.scheduler.appender
    append = appender.append_token
    seen: list[tuple[Any, int]] = []  # (outcome, output length after it)

    def recorded(req: Any, *args: Any, **kwargs: Any) -> Any:
        outcome = append(req, *args, **kwargs)
        seen.append((outcome, len(req.output_ids)))
        return outcome

    appender.append_token = recorded  # type: ignore[method-assign]
    out, kinds = generate_rejecting_the_first_kind(engine)
    assert out.finish_reason is FinishReason.STOP and json.loads(out.text)["kind"] != kinds[0]
    rollbacks = [(o, n) for o, n in seen if isinstance(o, RollBack)]
    assert len(rollbacks) == 1, "one rejected value, one rollback"
    rollback, length = rollbacks[0]
    assert rollback.rollback.keep < length and rollback.rollback.ban_at >= rollback.rollback.keep
    assert any(isinstance(o, ExtendForced) for o, _ in seen), "the keys are forced text, appended at once"
    assert any(isinstance(o, GoOn) for o, _ in seen)
    assert seen[-1][0] == Finish(FinishReason.STOP)
    assert all(not isinstance(o, Finish) for o, _ in seen[:-1]), "only the last token ends the request"


def test_a_token_the_automaton_refuses_after_its_mask_allowed_it_is_sampled_again_without_it(
        make_engine: Callable[..., Engine], monkeypatch: Any) -> None:
    """A backend whose parser refuses a token its mask allowed (llguidance did once, at temperature
    0.7): the token is banned where it stood and the position sampled again, the answer stays
    valid; a parser in an error state ends the request with its own reason instead."""
    from radixgen import SamplingParams
    from radixgen.constraints.llguidance_backend import LLGuidanceMatcher

    schema = {"type": "object", "properties": {"kind": {"enum": ["cat", "dog"]}}, "required": ["kind"]}
    accept = LLGuidanceMatcher.accept
    refused: list[tuple[int, int]] = []  # (position, token)

    def refuse_once(self: Any, token_id: int) -> bool:
        position = len(self._history)  # the first refusal is of a sampled token (not a completion walk's)
        if not refused and position == 4 and sys._getframe(1).f_code.co_name == "append_token":
            refused.append((position, token_id))
            return False
        return accept(self, token_id)

    monkeypatch.setattr(LLGuidanceMatcher, "accept", refuse_once)
    engine = make_engine(grammar_backend="llguidance", speculative="off", jump_forward=False)
    params = SamplingParams(max_new_tokens=40, temperature=0, json_schema=schema)
    out = engine.generate("Animal:", params)
    assert refused and out.finish_reason is FinishReason.STOP and json.loads(out.text)["kind"] in ("cat", "dog")
    assert out.token_ids[refused[0][0]] != refused[0][1], "the refused token was not sampled there again"
    assert engine.scheduler.stats.num_rollbacks == 1

    monkeypatch.setattr(LLGuidanceMatcher, "accept", lambda self, token_id: False)
    monkeypatch.setattr(LLGuidanceMatcher, "error", lambda self: "lexer error: too many expressions constructed")
    failed = engine.generate("Animal:", params)
    assert failed.finish_reason is FinishReason.ERROR and "too many expressions" in (failed.error or "")
