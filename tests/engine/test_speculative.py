"""N-gram speculative decoding: the drafts, and outputs token for token those without it."""

from __future__ import annotations

import asyncio
import dataclasses
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from radixgen import Engine, SamplingParams
from radixgen.engine.ngram import NgramIndex, prompt_text_continuation, word_start_continuation
from radixgen.engine.speculative import GuessLengths

# prompts the tiny model continues with runs of repeated tokens (so drafts are accepted) and
# with turns (so some are rejected)
PROMPTS: list[Any] = [list(range(5, 40)) * 3, [7, 8, 9, 10] * 10, list(range(100, 180)), [3, 4] * 20,
                      "The quick brown fox jumps over the lazy dog. The quick brown"]


def greedy(n: int, **kw: Any) -> SamplingParams:
    return SamplingParams(max_new_tokens=n, temperature=0.0, ignore_eos=True, **kw)


def first_candidate(index: NgramIndex, tokens: list[int], k: int) -> list[int]:
    return next(index.candidates(tokens, k), ([], -1))[0]


def test_the_index_finds_the_latest_earlier_occurrence_of_the_longest_suffix() -> None:
    index = NgramIndex(max_n=3)
    tokens = [1, 2, 3, 9, 1, 2, 3, 7, 8, 2, 3]
    index.update(tokens)
    # suffix (2, 3): its latest earlier occurrence is followed by 7, 8, ...
    assert first_candidate(index, tokens, 3) == [7, 8, 2]
    tokens += [7]  # suffix (2, 3, 7) occurred once, before 8
    index.update(tokens)
    assert first_candidate(index, tokens, 2) == [8, 2]
    assert first_candidate(index, [5, 6, 42], 4) == []  # a suffix never seen before drafts nothing
    lone = NgramIndex(max_n=3)
    lone.update([4, 5, 6])
    assert first_candidate(lone, [4, 5, 6], 3) == [], "the suffix itself is not an earlier occurrence"


def test_the_index_offers_every_earlier_occurrence_longest_match_first_latest_first() -> None:
    index = NgramIndex(max_n=3)
    tokens = [1, 2, 3, 40, 9, 2, 3, 50, 1, 2, 3, 60, 7, 2, 3]
    index.update(tokens)
    # (7, 2, 3) never occurred before; (2, 3) did three times: the latest first, each once
    assert list(index.candidates(tokens, 1, limit=9)) == [([60], 11), ([50], 7), ([40], 3)]
    tokens[-3] = 1  # suffix (1, 2, 3): its two occurrences lead, then (2, 3)'s other one
    index = NgramIndex(max_n=3)
    index.update(tokens)
    assert list(index.candidates(tokens, 2, limit=9)) == [([60, 1], 11), ([40, 9], 3), ([50, 1], 7)]
    assert list(index.candidates(tokens, 2, limit=2)) == [([60, 1], 11), ([40, 9], 3)]


def test_a_value_begun_in_the_output_is_copied_from_where_a_prompt_word_starts_so() -> None:
    def chars(text: str) -> list[int]:
        return [ord(c) for c in text]

    prompt = "Invoice INV-20931 from Nordlicht GmbH, dated 2024-03-04, due 2024-04-03."
    assert word_start_continuation(prompt, '{"organisation": "N', "", 5, chars) == chars("ordli"), \
        "one character begins a word of the prompt: the INV's N does not"
    # the first "2" starts 20931, which the output holds: the first date is the one not yet written
    written = '{"id": "INV-20931", "dates": ["'
    assert word_start_continuation(prompt, written[-8:] + "2", written, 6, chars) == chars("024-03")
    written += '2024-03-04", "'
    assert word_start_continuation(prompt, written[-8:] + "20", written, 5, chars) == chars("24-04")
    assert word_start_continuation(prompt, 'x": "', "", 3, chars) == [], "no word begun"
    assert word_start_continuation(prompt, '"Q', "", 3, chars) == [], "no prompt word starts so"
    # every occurrence written already: the first
    assert word_start_continuation("due 2024-04-03 or 2025-01-01.", '"2', "2024-04-03 2025-01-01", 3, chars) == \
        chars("024")


def test_a_text_copy_continues_after_the_longest_suffix_found_in_the_prompt_text() -> None:
    def chars(text: str) -> list[int]:  # one token per character
        return [ord(c) for c in text]

    prompt = "ref X1-77 then ab X1-42, done"
    # the longest suffix found ("ab X1-" over "X1-") decides where, its latest occurrence too
    assert prompt_text_continuation(prompt, '"ab X1-', 2, chars) == chars("42")
    assert prompt_text_continuation(prompt, '"X1-', 2, chars) == chars("42")
    assert prompt_text_continuation(prompt, "ref X1-", 3, chars) == chars("77 ")
    assert prompt_text_continuation(prompt, "qX1-", 2, chars) == chars("42"), "three characters match"
    assert prompt_text_continuation(prompt, "q1-", 2, chars) == [], "two do not"
    assert prompt_text_continuation(prompt, "done", 2, chars) == [], "nothing follows the prompt's end"

    def words(text: str) -> list[int]:  # one token per word: the span's last one may be cut
        return [len(w) for w in text.split(" ")]

    assert prompt_text_continuation("a bcd efghij klmnopqrstuvwxyz0123", "bcd", 3, words) == [0, 6], \
        "a word the span cuts is left out"
    assert prompt_text_continuation("a bcd efghij klm", "bcd", 3, words) == [0, 6, 3], "the prompt's last word is whole"


@pytest.mark.real_model
def test_a_copy_that_starts_inside_another_token_is_drafted_from_the_prompt_text(real_engine: Engine) -> None:
    """An answer that starts a copied id after a quote tokenizes it otherwise than the prompt did:
    the token index finds no match, the prompt's text does, and the draft is its tokens."""
    from radixgen.config import EngineConfig
    from radixgen.engine.request import Request
    from radixgen.engine.speculative import NgramDrafter

    tok = real_engine.tokenizer
    prompt = tok.encode("Invoice INV-20931 dated 2024-03-04 from Nordlicht Bakery GmbH.", add_special_tokens=False)
    answer = tok.encode('{"id": "INV', add_special_tokens=False)
    req = Request("copy", prompt, SamplingParams(max_new_tokens=32, speculative=True), rng_seed=0)
    req.output_ids = list(answer)
    drafter = NgramDrafter(EngineConfig(speculative="ngram"), max_context_len=1024)
    drafter.tokenizer = tok
    drafts = drafter.draft([req])
    assert req.speculation is not None and req.speculation.draft_source == "copied"
    assert first_candidate(req.speculation.index, req.all_ids(), 2) == [], "the tokens alone match nothing"
    copied = tok.decode(drafts[req])  # the continuation, as long as guesses are drafted
    assert len(drafts[req]) >= 2 and "-20931 dated 2024".startswith(copied), copied


def test_drafts_must_be_accepted_as_often_as_they_cost_at_the_batch_size() -> None:
    """The break-even acceptance is a drafted position's cost over a decode step's cost per
    token, measured per batch size: at batch 1 a decode step of 20 ms and 4 ms per drafted
    position need 0.2; at batch 16 a step of 40 ms (2.5 ms a token) and 1 ms per position 0.4."""
    from types import SimpleNamespace

    import numpy as np

    from radixgen.engine.plan import StepKind
    from radixgen.engine.speculative import DraftCost

    def plan(rows: int, drafts: list[int] | None) -> Any:
        kind = StepKind.DECODE if drafts is None else StepKind.SPECULATIVE
        lens = None if drafts is None else np.array(drafts + [0] * (rows - len(drafts)))
        return SimpleNamespace(requests=[None] * rows, draft_lens=lens, kind=kind)

    cost = DraftCost()
    assert cost.break_even(1) == pytest.approx(0.2), "the default before anything is measured"
    cost.observe(plan(1, [2]), 0.028)  # one step: no fit yet
    assert cost.break_even(1) == pytest.approx(0.2)
    for _ in range(3):
        cost.observe(plan(1, None), 0.020)
        cost.observe(plan(1, [2]), 0.028)
        # every row drafts at 16: the drafts' own variation separates the step from the drafts
        cost.observe(plan(16, [4, 4]), 0.048)
        cost.observe(plan(16, [8, 8]), 0.056)
        cost.observe(plan(16, [2, 2]), 0.044)
    assert cost.break_even(1) == pytest.approx(0.2)
    assert cost.break_even(16) == pytest.approx(0.4)
    assert cost.break_even(12) == pytest.approx(0.3), "12 rows share the 16-row bucket's step times"


def test_the_cost_of_a_draft_is_told_apart_from_the_rows_that_shrink_with_it() -> None:
    """Inside the 16-row bucket the batch shrinks from 16 to 9 rows and drafts fewer tokens as it
    does: a step costs 5 ms + 1.5 ms a row + 0.5 ms a drafted position. Fitted on the drafted
    positions alone, the rows' cost would be read as the drafts' (about 1.2 ms each)."""
    from radixgen.engine.speculative import DraftCost

    cost = DraftCost()
    for rows in range(16, 8, -1):
        for extra in (0, 3, 7):
            drafted = 2 * rows + extra
            cost.observe_step(rows, drafted, (5 + 1.5 * rows + 0.5 * drafted) / 1000)
    assert cost.break_even(16) == pytest.approx(0.5 * 16 / 29)
    assert cost.break_even(10) == pytest.approx(0.5 * 10 / 20)


def test_measured_back_off_drafts_where_the_machine_says_it_pays() -> None:
    """speculative_max_batch None: an unmeasured batch size drafts (to be measured); a measured
    one drafts only for requests whose acceptance passes its break-even, so the same request
    stops drafting in a batch of 16 where positions are dear and drafts again once the batch has
    shrunk to 2; a request that asked for drafting drafts regardless."""
    from types import SimpleNamespace

    from radixgen.config import EngineConfig
    from radixgen.engine.ngram import DraftState, NgramIndex
    from radixgen.engine.speculative import NgramDrafter

    drafter = NgramDrafter(EngineConfig(), max_context_len=1024)
    assert drafter.max_batch is None
    state = DraftState(NgramIndex(3), drafted=20, accepted=10)  # half its drafts accepted
    req = SimpleNamespace(params=SimpleNamespace(speculative=None, constraint=SimpleNamespace(kind="json")),
                          speculation=state)
    assert drafter.drafting(req, 16), "nothing measured at 16 rows yet: draft, and measure"
    for drafted in (0, 16, 32, 48) * 3:
        # 16 rows: 16 ms a step, 1 ms a drafted position -> break-even 1.0 (capped at 0.95)
        drafter.cost.observe_step(16, drafted, 0.016 + 0.001 * drafted)
        # 2 rows: 10 ms a step, 0.5 ms a drafted position -> break-even 0.1
        drafter.cost.observe_step(2, drafted / 8, 0.010 + 0.0005 * drafted / 8)
    assert drafter.cost.break_even(16) == pytest.approx(0.95)
    assert drafter.cost.break_even(2) == pytest.approx(0.1)
    assert not drafter.drafting(req, 16)
    assert drafter.drafting(req, 2)
    for _ in range(30):  # decode steps alone at 16 rows: the measured cost stands
        drafter.cost.observe_step(16, 0, 0.016)
    assert not drafter.drafting(req, 16)
    asked = SimpleNamespace(params=SimpleNamespace(speculative=True, constraint=None), speculation=state)
    assert drafter.drafting(asked, 16)


@pytest.mark.parametrize("cache", [True, False])
def test_greedy_outputs_equal_those_without_speculation_alone_and_batched(
        make_engine: Callable[..., Engine], cache: bool) -> None:
    plain = make_engine(disable_radix_cache=not cache, speculative="off")
    spec = make_engine(disable_radix_cache=not cache, speculative="ngram")
    lengths = [40, 64, 23, 50, 31]
    expected = [o.token_ids for o in plain.generate(PROMPTS, [greedy(n) for n in lengths])]
    batched = [o.token_ids for o in spec.generate(PROMPTS, [greedy(n) for n in lengths])]
    stats = spec.scheduler.stats
    # fewer decode steps for the same tokens: accepted drafts became output without a step each
    assert stats.num_decode_steps < plain.scheduler.stats.num_decode_steps, stats.snapshot()
    alone = [spec.generate(p, greedy(n)).token_ids for p, n in zip(PROMPTS, lengths, strict=True)]
    assert batched == expected and alone == expected
    assert stats.accepted_tokens > 0 and stats.drafted_tokens >= stats.accepted_tokens, stats.snapshot()


def test_sampled_outputs_equal_those_without_speculation_for_the_same_seed(
        make_engine: Callable[..., Engine]) -> None:
    """A sampled request's drafts are checked against the token a decode step would sample at
    each position (its counter-based uniform), so the output is the same sample as without
    speculation: seeded, alone and batched, with the sampling filters, free and constrained.

    The tiny random model's distributions are nearly flat over 49k tokens, where the last-bit
    difference between an extend's and a decode's logits moves an inverse-CDF sample to a
    neighbouring token; top-k keeps a handful, so the same uniform picks the same token (an
    automaton's mask does the same for the regex)."""
    plain = make_engine(speculative="off")
    spec = make_engine(speculative="ngram")

    def sampled(n: int, seed: int, **kw: Any) -> SamplingParams:
        return SamplingParams(max_new_tokens=n, temperature=1.0, seed=seed, ignore_eos=True, **kw)

    params = [sampled(48, 1, top_k=2), sampled(40, 2, top_k=3, top_p=0.8), sampled(40, 3, top_k=3),
              sampled(32, 4, top_k=4, min_p=0.3), sampled(40, 5, top_k=2),
              SamplingParams(max_new_tokens=40, temperature=1.0, seed=6, regex=r"(ab|cd){3,12}x")]
    prompts = [*PROMPTS, "Pattern:"]
    expected = [o.token_ids for o in plain.generate(prompts, params)]
    assert [o.token_ids for o in spec.generate(prompts, params)] == expected
    stats = spec.scheduler.stats
    # accepted drafts became output without a step each
    assert stats.accepted_tokens > 0 and stats.num_decode_steps < plain.scheduler.stats.num_decode_steps, (
        stats.snapshot())
    assert [spec.generate(p, q).token_ids for p, q in zip(prompts, params, strict=True)] == expected


def test_log_probabilities_of_drafted_tokens_are_those_of_a_decode_step(make_engine: Callable[..., Engine]) -> None:
    plain = make_engine(speculative="off")
    spec = make_engine(speculative="ngram")
    params = [greedy(40, logprobs=True, top_logprobs=3), greedy(30, logprobs=True, regex=r"(ab|cd){3,12}x")]
    prompts = [PROMPTS[1], "Pattern:"]
    expected = plain.generate(prompts, params)
    got = spec.generate(prompts, params)
    assert spec.scheduler.stats.accepted_tokens > 0
    for want, have in zip(expected, got, strict=True):
        assert have.token_ids == want.token_ids
        assert have.logprobs is not None and want.logprobs is not None and len(have.logprobs) == len(have.token_ids)
        assert max(abs(a - b) for a, b in zip(have.logprobs, want.logprobs, strict=True)) < 1e-3
    assert got[0].top_logprobs is not None and expected[0].top_logprobs is not None
    assert [[t for t, _ in top] for top in got[0].top_logprobs] == [[t for t, _ in top] for top in expected[0].top_logprobs]


def test_penalties_and_logit_bias_count_the_drafts_before_each_position(make_engine: Callable[..., Engine]) -> None:
    """Through the engine: penalised and biased rows speculate and give the outputs they give
    without (test_sampler checks the penalties of each position exactly; the tiny model copies
    little once penalised strongly, so the light penalties are the ones whose drafts pass)."""
    plain = make_engine(speculative="off")
    spec = make_engine(speculative="ngram")
    params = [greedy(48, repetition_penalty=1.3), greedy(40, frequency_penalty=0.4, presence_penalty=0.3),
              greedy(64, frequency_penalty=0.02), greedy(64, frequency_penalty=0.05),
              greedy(40, logit_bias={9: 5.0, 8: -100.0}),
              SamplingParams(max_new_tokens=40, temperature=1.0, seed=3, top_k=3, ignore_eos=True,
                             repetition_penalty=1.2, logit_bias={10: 2.0})]
    prompts = [PROMPTS[0], PROMPTS[3], PROMPTS[1], PROMPTS[0], PROMPTS[1], PROMPTS[1]]
    expected = [o.token_ids for o in plain.generate(prompts, params)]
    assert [o.token_ids for o in spec.generate(prompts, params)] == expected
    assert 8 not in expected[4]
    for j in (2, 3):  # alone, the lightly penalised rows copy: their counts must include the accepted drafts
        before = spec.scheduler.stats.accepted_tokens
        assert spec.generate(prompts[j], params[j]).token_ids == expected[j]
        assert spec.scheduler.stats.accepted_tokens > before, spec.scheduler.stats.snapshot()


def test_speculation_under_retraction_keeps_outputs_and_the_pool_balanced(make_engine: Callable[..., Engine]) -> None:
    roomy = make_engine(speculative="off")
    expected = [o.token_ids for o in roomy.generate(PROMPTS * 2, greedy(60))]
    tight = make_engine(kv_cache_tokens=420, speculative="ngram")
    assert [o.token_ids for o in tight.generate(PROMPTS * 2, greedy(60))] == expected
    stats = tight.scheduler.stats
    assert stats.num_retractions > 0 and stats.accepted_tokens > 0, stats.snapshot()
    # make_engine checks on teardown that no slot leaked and the pool accounting balances


def test_constrained_outputs_equal_and_valid_with_speculation(make_engine: Callable[..., Engine]) -> None:
    plain = make_engine(speculative="off")
    spec = make_engine(speculative="ngram")
    schema = {"type": "object", "properties": {"a": {"type": "string", "maxLength": 12},
                                               "b": {"type": "array", "items": {"type": "integer"}, "maxItems": 4}},
              "required": ["a", "b"]}
    params = [greedy(80, json_schema=schema), greedy(40, regex=r"(ab|cd){3,8}x"), greedy(40, regex=r"[a-c]{5,20}")]
    prompts = ["Give a record:", "Pattern:", "Letters:"]
    expected = plain.generate(prompts, params)
    got = spec.generate(prompts, params)
    assert [o.token_ids for o in got] == [o.token_ids for o in expected]
    assert all(o.finish_reason.value == "stop" for o in got), [o.finish_reason for o in got]
    assert spec.scheduler.stats.drafted_tokens > 0, "the constrained requests drafted"


def test_validators_see_the_accepted_drafts_and_roll_them_back(make_engine: Callable[..., Engine]) -> None:
    """A validator that rejects a value made of drafted tokens rolls the output back into the
    verified draft, and the result is the one without speculation (here every copy of the
    first value is refused, so the request resamples while drafting from its own output)."""
    plain = make_engine(speculative="off")
    spec = make_engine(speculative="ngram")
    schema = {"type": "object", "properties": {"items": {"type": "array", "items": {"type": "string", "maxLength": 6},
                                                         "minItems": 3, "maxItems": 5}}, "required": ["items"]}

    def run(engine: Engine) -> tuple[list[int], int]:
        seen: list[str] = []

        def new_items_only(item: str) -> bool:
            ok = item not in seen
            seen.append(item)
            return ok

        before = engine.scheduler.stats.num_rollbacks
        out = engine.generate("List:", greedy(120, json_schema=schema, validators={"$.items[*]": new_items_only},
                                              max_validation_retries=30))
        assert out.finish_reason.value in ("stop", "constraint_violation"), out
        return out.token_ids, engine.scheduler.stats.num_rollbacks - before

    expected, plain_rollbacks = run(plain)
    got, spec_rollbacks = run(spec)
    assert got == expected and spec_rollbacks == plain_rollbacks > 0
    assert spec.scheduler.stats.drafted_tokens > 0


def test_the_text_a_constraint_forces_is_drafted(make_engine: Callable[..., Engine]) -> None:
    """Without jump-forward (as in batches past jump_forward_max_batch) the keys a schema forces
    are drafted and verified in the step, not decoded one by one: fewer steps, same output."""
    schema = {"type": "object", "properties": {"first_name": {"type": "string", "maxLength": 8},
                                               "family_name": {"type": "string", "maxLength": 8},
                                               "home_town": {"type": "string", "maxLength": 8}},
              "required": ["first_name", "family_name", "home_town"], "additionalProperties": False}
    plain = make_engine(jump_forward=False, speculative="off")
    spec = make_engine(jump_forward=False, speculative="ngram")
    params = SamplingParams(max_new_tokens=80, temperature=0.0, json_schema=schema)
    expected = plain.generate("Person:", params)
    got = spec.generate("Person:", params)
    assert got.token_ids == expected.token_ids and got.finish_reason.value == "stop"
    stats = spec.scheduler.stats
    assert stats.accepted_tokens >= 6, stats.snapshot()  # at least the three keys' forced tokens
    assert stats.num_decode_steps < plain.scheduler.stats.num_decode_steps


def test_forced_text_is_drafted_whole_and_only_the_guess_counts_toward_guess_lengths(
        make_engine: Callable[..., Engine]) -> None:
    """The grammar writes nothing else where it forces text, so a forced key is drafted up to
    ``speculative_max_draft`` tokens whatever length guesses have; what a guess after it is
    measured by is its own part (a forced part taken whole says nothing about the guess)."""
    from types import SimpleNamespace

    from radixgen.engine.ngram import DraftState

    key = "a_rather_long_property_name_to_force"
    schema = {"type": "object", "properties": {key: {"type": "integer"}}, "required": [key],
              "additionalProperties": False}
    engine = make_engine(jump_forward=False, speculative="ngram")
    drafter, seen = engine.scheduler.planner.drafter, []
    record = drafter.record

    def recorded(req: Any, drafted: int, accepted: int) -> None:
        assert req.speculation is not None
        seen.append((drafted, req.speculation.draft_forced))
        record(req, drafted, accepted)

    drafter.record = recorded  # type: ignore[method-assign]
    out = engine.generate("Number:", SamplingParams(max_new_tokens=30, temperature=0.0, json_schema=schema))
    assert out.finish_reason.value == "stop" and key in json.loads(out.text)
    assert seen and seen[0][1] == seen[0][0] == drafter.max_draft, seen  # the first draft: the key, at full length
    lengths = drafter.guess_lengths["copied"] = GuessLengths(8)
    state = DraftState(NgramIndex(3), draft_forced=3, draft_source="copied")
    req = SimpleNamespace(speculation=state, params=SamplingParams())
    record(req, 5, 5)  # forced 3 and a guess of 2, all right
    assert lengths.at_risk[1:4].tolist() == [1, 1, 0] and not lengths.ended.any()
    state.draft_forced = 3
    record(req, 6, 4)  # forced 3, then one of a guess of 3 right: the run ended at its second token
    assert lengths.ended[2] > 0 and lengths.at_risk[3] == 0
    state.draft_forced = 4
    before = lengths.at_risk.copy()
    record(req, 6, 2)  # the forced text itself was left: the guess was never reached
    assert (lengths.at_risk == before).all()


def test_guesses_are_as_long_as_they_pay_for_how_far_such_guesses_have_run() -> None:
    """Copies that run whole are drafted at the longest length, guesses wrong at once at one
    token; a dearer drafted position shortens them; every eighth guess explores the longest."""
    long_runs, short_runs = GuessLengths(8), GuessLengths(8)
    for _ in range(60):
        long_runs.observe(8, 8)
        short_runs.observe(8, 0)
    choices = [long_runs.choose(0.2) for _ in range(7)]
    assert choices == [8] * 7
    assert [short_runs.choose(0.2) for _ in range(7)] == [1] * 7, "the eighth explores"
    assert short_runs.choose(0.2) == 8
    halves = GuessLengths(8)
    for _ in range(60):  # right half the time at each token: about one token a guess
        halves.observe(8, 0)
        halves.observe(8, 1)
        halves.observe(8, 3)
        halves.observe(8, 8)
    cheap, dear = halves.choose(0.05), halves.choose(0.6)
    assert cheap > dear >= 1, (cheap, dear)


def test_a_request_overrides_the_engine_setting_either_way(make_engine: Callable[..., Engine]) -> None:
    off = make_engine(speculative="off")
    expected = off.generate(PROMPTS[1], greedy(48)).token_ids
    assert off.scheduler.stats.drafted_tokens == 0
    assert off.generate(PROMPTS[1], greedy(48, speculative=True)).token_ids == expected
    assert off.scheduler.stats.accepted_tokens > 0
    on = make_engine(speculative="ngram")
    assert on.generate(PROMPTS[1], greedy(48, speculative=False)).token_ids == expected
    assert on.scheduler.stats.drafted_tokens == 0
    with pytest.raises(ValueError, match="speculative"):
        greedy(4, speculative="yes")


def test_streamed_deltas_add_up_to_the_output_when_a_step_appends_several_tokens(
        make_engine: Callable[..., Engine]) -> None:
    spec = make_engine(speculative="ngram")

    async def stream() -> tuple[list[int], list[int], str, str]:
        ids: list[int] = []
        text = ""
        final = None
        async for out in spec.generate_stream([7, 8, 9, 10] * 10, greedy(48)):
            ids += out.new_token_ids
            text += out.new_text
            final = out
        assert final is not None and final.output_ids is not None and final.text is not None
        return ids, final.output_ids, text, final.text

    ids, output_ids, text, whole = asyncio.run(stream())
    assert ids == output_ids and len(ids) == 48 and text == whole
    assert spec.scheduler.stats.accepted_tokens > 0


@pytest.mark.real_model
def test_the_bundled_model_gives_the_same_chat_json_and_regex_outputs(
        make_engine: Callable[..., Engine], real_engine: Engine) -> None:
    text = ("Jonas Berg, 35, is a nurse at the central hospital in Oslo. He moved there from Bergen in 2015 "
            "and lives with his wife Ingrid near the harbour.")
    chat = real_engine.apply_chat_template
    prompts = [chat([{"role": "user", "content": "Repeat this text exactly, word for word:\n" + text}]),
               chat([{"role": "user", "content": "Extract the person as JSON with name, age, city and job.\nText: " + text}]),
               chat([{"role": "user", "content": "Give the name and the age in the text as 'Name, age'.\nText: " + text}])]
    schema = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"},
                                               "city": {"type": "string"}, "job": {"type": "string"}},
              "required": ["name", "age", "city", "job"]}
    params = [SamplingParams(max_new_tokens=64, temperature=0.0),
              SamplingParams(max_new_tokens=64, temperature=0.0, json_schema=schema),
              SamplingParams(max_new_tokens=24, temperature=0.0, regex=r"[A-Z][a-z]+ [A-Z][a-z]+, [0-9]{1,3}")]
    expected = [o.token_ids for o in real_engine.generate(
        prompts, [dataclasses.replace(p, speculative=False) for p in params])]
    spec = make_engine(model=str(real_engine.model_path), kv_cache_tokens=16384, max_context_len=2048,
                       speculative="ngram")
    assert [o.token_ids for o in spec.generate(prompts, params)] == expected
    copied = spec.generate(prompts[0], params[0])  # alone, its prefix now cached
    assert copied.token_ids == expected[0] and text[:40] in copied.text
    stats = spec.scheduler.stats
    assert stats.accepted_tokens >= 20, stats.snapshot()  # the copy was drafted from the prompt


def test_by_default_constrained_requests_draft_and_free_text_does_not(make_engine: Callable[..., Engine]) -> None:
    """The default (auto): constrained answers draft the text their grammar forces and spans copied
    from the prompt, and come out token for token as without drafting, greedy and seeded; a
    free-text request beside them does not draft."""
    off = make_engine(speculative="off")
    auto = make_engine()
    document = "Order 88-1204 from Alma Reyes, shipped to Lisbon on 2024-05-17, two crates of figs."
    schemas = [
        {"type": "object", "properties": {"order": {"type": "string", "maxLength": 12},
                                          "customer": {"type": "string", "maxLength": 20},
                                          "city": {"type": "string", "maxLength": 12}},
         "required": ["order", "customer", "city"], "additionalProperties": False},
        {"type": "object", "properties": {"shipped": {"type": "string", "format": "date"},
                                          "crates": {"type": "integer", "minimum": 0, "maximum": 99}},
         "required": ["shipped", "crates"], "additionalProperties": False},
    ]
    prompts = [f"{document}\nAs JSON:", f"Text: {document}\nThe fields:"]
    for temperature, seed in ((0.0, None), (0.8, 7)):
        params = [SamplingParams(max_new_tokens=60, temperature=temperature, seed=seed, json_schema=schema)
                  for schema in schemas]
        for prompt in prompts:
            expected = [o.token_ids for o in off.generate([prompt, prompt], params)]
            assert [o.token_ids for o in auto.generate([prompt, prompt], params)] == expected
    drafter = auto.scheduler.planner.drafter
    assert drafter.accepted_by_source["forced"] > 0, drafter.accepted_by_source
    assert sum(drafter.accepted_by_source.values()) == auto.scheduler.stats.accepted_tokens
    drafted = auto.scheduler.stats.drafted_tokens
    auto.generate(PROMPTS[1], greedy(32))  # free text: no draft under the default
    assert auto.scheduler.stats.drafted_tokens == drafted and off.scheduler.stats.drafted_tokens == 0


def test_a_draft_that_leaves_the_grammar_is_cut_at_that_token(tiny_engine: Engine) -> None:
    """The automaton walks the draft: tokens up to the first one it rejects are kept, the rest cut,
    and the automaton is left where it was (the verification walks it again)."""
    from radixgen.constraints.spec import regex_spec
    from radixgen.engine.speculative import _grammatical_draft

    grammar = tiny_engine.constraints.grammars().compile(regex_spec(r"ab[0-9]{3}z"))
    matcher = grammar.matcher()
    tok = tiny_engine.tokenizer

    def ids(text: str) -> list[int]:
        return [tok.convert_tokens_to_ids(c) for c in text]  # one token per character

    draft = ids("ab12x9z")  # leaves the grammar at "x"
    assert all(t != tok.unk_token_id for t in draft)
    assert _grammatical_draft(matcher, draft, iter(()))[0] == ids("ab12")
    assert _grammatical_draft(matcher, draft, iter(()))[0] == ids("ab12"), "the automaton was rolled back"
    eos = tiny_engine.model_config.eos_token_ids[0]
    assert _grammatical_draft(matcher, ids("ab123z") + [eos] + ids("ab"), iter(()))[0] == ids("ab123z"), \
        "the stop token that would end the automaton is left to the model"
    assert matcher.accept(ids("a")[0]) and not matcher.accept(ids("z")[0])


def test_a_guess_the_grammar_refuses_gives_way_to_the_next_after_the_forced_text(tiny_engine: Engine) -> None:
    """The latest copy of a suffix may leave the grammar where an earlier one does not: the draft
    takes the first guess whose first token the automaton takes after the forced tokens, cut
    where the automaton refuses it, and leaves the automaton where it was."""
    from radixgen.constraints.spec import regex_spec
    from radixgen.engine.speculative import _grammatical_draft

    grammar = tiny_engine.constraints.grammars().compile(regex_spec(r"ab[0-9]{3}z"))
    matcher = grammar.matcher()
    tok = tiny_engine.tokenizer

    def ids(text: str) -> list[int]:
        return [tok.convert_tokens_to_ids(c) for c in text]

    guesses = [(ids("x1"), 9), (ids("12x"), 4), (ids("345"), 2)]
    assert _grammatical_draft(matcher, ids("ab"), iter(guesses)) == (ids("ab12"), 4)
    assert _grammatical_draft(matcher, ids("ab"), iter(guesses[:1])) == (ids("ab"), -1), "no guess taken"
    assert _grammatical_draft(matcher, ids("ax"), iter(guesses)) == (ids("a"), -1), \
        "no guess follows forced text the automaton refused"
    assert matcher.accept(ids("a")[0]) and not matcher.accept(ids("z")[0]), "the automaton was rolled back"


def test_a_step_with_drafts_stays_within_the_full_precision_step_size(make_engine: Callable[..., Engine],
                                                                     tmp_path: Path) -> None:
    """Where larger steps run their linears in lower precision (bfloat16 tiles for a float32
    model), a step that verifies drafts is kept below that size, so its choices are a decode
    step's."""
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 10},
                                               "tags": {"type": "array", "items": {"type": "string", "maxLength": 5},
                                                        "minItems": 3, "maxItems": 3}},
              "required": ["name", "tags"], "additionalProperties": False}
    params = SamplingParams(max_new_tokens=50, temperature=0.0, json_schema=schema)
    prompts = [f"Record {i}:" for i in range(4)]
    log = tmp_path / "steps.jsonl"
    bounded = make_engine(event_log=str(log))
    bounded.scheduler.planner.drafter.max_step_tokens = 7
    outs = [o.token_ids for o in bounded.generate(prompts, params)]
    steps = [json.loads(line) for line in log.read_text().splitlines()]
    drafted = [s for s in steps if s["drafted_tokens"]]
    assert drafted, "drafts should have run"
    assert max(s["new_tokens"] for s in drafted) <= 7
    assert outs == [o.token_ids for o in make_engine(speculative="off").generate(prompts, params)]


def test_drafting_backs_off_in_a_large_batch_unless_a_request_asks(make_engine: Callable[..., Engine]) -> None:
    """auto drafts only while at most speculative_max_batch requests run; a request's own
    speculative=True drafts at any size; outputs are the same either way."""
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 10},
                                               "tags": {"type": "array", "items": {"type": "string", "maxLength": 5},
                                                        "minItems": 4, "maxItems": 4}},
              "required": ["name", "tags"], "additionalProperties": False}
    params = SamplingParams(max_new_tokens=60, temperature=0.0, json_schema=schema, ignore_eos=True)
    prompts = [f"Record {i}:" for i in range(6)]
    small, capped = make_engine(), make_engine(speculative_max_batch=2)
    expected = [o.token_ids for o in small.generate(prompts, params)]
    assert small.scheduler.stats.drafted_tokens > 0
    assert [o.token_ids for o in capped.generate(prompts, params)] == expected
    assert capped.scheduler.stats.drafted_tokens < small.scheduler.stats.drafted_tokens
    before = capped.scheduler.stats.drafted_tokens
    asked = dataclasses.replace(params, speculative=True)
    assert [o.token_ids for o in capped.generate(prompts, asked)] == expected
    assert capped.scheduler.stats.drafted_tokens - before >= small.scheduler.stats.drafted_tokens // 2


def test_the_draft_cost_is_each_steps_whole_time_planning_and_applying_included(
        make_engine: Callable[..., Engine], monkeypatch: pytest.MonkeyPatch) -> None:
    """A drafted row costs host work outside the forward too (its drafts walked, its tokens
    appended one by one): the cost model is given each decode and speculative step's time from
    its planning to the end of its applying, so a slower applying shows in what it measures."""
    import time

    from radixgen.engine.plan import StepKind

    engine = make_engine(speculative="ngram")
    applier, drafter = engine.scheduler.applier, engine.scheduler.planner.drafter
    applying = applier.process_results
    seen: list[tuple[StepKind, float]] = []

    def slow_applying(*args: Any, **kwargs: Any) -> Any:
        time.sleep(0.02)
        return applying(*args, **kwargs)

    monkeypatch.setattr(applier, "process_results", slow_applying)
    monkeypatch.setattr(drafter.cost, "observe", lambda plan, seconds: seen.append((plan.kind, seconds)))
    engine.generate([PROMPTS[1]], greedy(24))
    assert {kind for kind, _ in seen} >= {StepKind.SPECULATIVE}
    assert all(seconds >= 0.02 for _, seconds in seen), seen


def test_measured_back_off_drafts_only_where_acceptance_beats_break_even_by_a_margin() -> None:
    """At break-even a draft gains nothing and the fit's error decides: a request drafts where its
    acceptance is a tenth above the measured break-even, not where it only just passes it."""
    from types import SimpleNamespace

    from radixgen.config import EngineConfig
    from radixgen.engine.ngram import DraftState, NgramIndex
    from radixgen.engine.speculative import NgramDrafter

    drafter = NgramDrafter(EngineConfig(), max_context_len=1024)
    for drafted in (0, 16, 32, 48) * 3:  # 16 ms a step, 0.25 ms a drafted position: break-even 0.25
        drafter.cost.observe_step(16, drafted, 0.016 + 0.00025 * drafted)
    assert drafter.cost.break_even(16) == pytest.approx(0.25)

    def request(accepted: int) -> Any:
        return SimpleNamespace(params=SimpleNamespace(speculative=None, constraint=SimpleNamespace(kind="json")),
                               speculation=DraftState(NgramIndex(3), drafted=100, accepted=accepted))

    assert not drafter.drafting(request(27), 16), "0.27: past break-even, within its margin"
    assert drafter.drafting(request(28), 16), "0.28: a tenth past it"
