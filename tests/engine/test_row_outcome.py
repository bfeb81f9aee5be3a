"""The appender's typed outcome per row, as the applier acts on it (engine/row_outcome.py): a
validator's rejection is a ``RollBack`` to the rejected value's first token, forced text appended
after a sample is an ``ExtendForced``, the last token a ``Finish``; nothing of it is left on the
request's state for a later step to find."""

from __future__ import annotations

import json
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
