"""JSON-Schema-Test-Suite (draft 2020-12): the automaton plus the steering validators.

Target of the constraints issue: >= 95% right (1,235 of 1,299) with 0 invalid accepted, with the
default settings (objects closed to their declared properties). With open objects (JSON
Schema's own reading) more valid instances are accepted; every backend alone must still accept
no invalid instance. `benchmarks/bench_constraints.py` prints the per-file table.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from radixgen.constraints import GrammarOptions, GrammarService, make_backend
from radixgen.constraints.conformance import score_suite

SUITE = Path(__file__).resolve().parent.parent / "data" / "json-schema-test-suite"
TARGET = 1235


@pytest.mark.parametrize(("backend", "open_objects", "at_least"), [
    ("auto", False, TARGET),  # the default
    ("auto", True, 1250),
    ("xgrammar", False, 1150),
    ("llguidance", False, 1200),
])
def test_suite_score(tokenizer: Any, backend: str, open_objects: bool, at_least: int) -> None:
    service = GrammarService(make_backend(backend, tokenizer, 49152, [tokenizer.eos_token_id],
                                          options=GrammarOptions(open_objects=open_objects)), timeout_s=30)
    files = sorted(SUITE.glob("*.json"))
    assert len(files) == 46
    score = score_suite(files, service, tokenizer, tokenizer.eos_token_id)
    assert score.total == 1299
    assert score.invalid_accepted == 0, {f: c for f, c in score.per_file.items() if c["invalid_accepted"]}
    assert score.right >= at_least, (score.right, dict(score.counts))
    assert "refRemote.json" in score.unsupported, "remote references are reported as unsupported, not ignored"
