"""Speculative decoding without a draft model: n-gram drafts, verified in the decode step.

A greedy request's next tokens are often a copy of tokens it has seen (extraction copies the
prompt's names and numbers, a repeated answer repeats itself). Before a decode step, such a
request looks up its last n tokens (the longest n that matches, up to ``speculative_ngram_max``)
in an index of its own prompt and output, and drafts the tokens that followed their latest
earlier occurrence; a constrained request's draft is cut at the first token its automaton
would reject. The step then feeds the request's newest token and its k drafts as one extend
(the planner's speculative rows) and takes the logits after each of them. Verification keeps
the longest prefix of the draft that equals the model's own greedy choice (under the
constraint's mask at each position) and adds the model's choice after it, so the output is
token for token the one without speculation; the slots of rejected drafts are freed at once.

A request whose drafts stop being accepted stops drafting (``_GIVE_UP_*``). Sampled requests,
penalties, logit biases, min_tokens and log-probabilities are not speculated (the sampler's
state for them is per step, not per position).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from radixgen.config import EngineConfig
from radixgen.constraints import apply_bitmask
from radixgen.constraints.mask import ALL_ALLOWED, ban_tokens
from radixgen.engine.batch import StepPlan
from radixgen.engine.request import Request

# After this many drafted tokens, a request whose drafts were accepted less often than this
# stops drafting: each drafted token costs a position of compute in the step.
_GIVE_UP_AFTER = 24
_GIVE_UP_BELOW = 0.2
_MIN_MATCH = 2
# Only the most recent tokens are indexed: a draft comes from the latest occurrence anyway.
_INDEX_WINDOW = 4096


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
        start = max(self.indexed_to, end - _INDEX_WINDOW)
        for stop in range(start + 1, end + 1):  # n-grams tokens[stop - n : stop], followed by tokens[stop]
            for n in range(_MIN_MATCH, min(self.max_n, stop) + 1):
                self.tables[n][tuple(tokens[stop - n : stop])] = stop
        self.indexed_to = max(self.indexed_to, end)

    def propose(self, tokens: list[int], k: int) -> list[int]:
        """Up to ``k`` tokens that followed the longest recent match of the sequence's suffix
        (at least two tokens long: a single common token predicts too little to pay)."""
        for n in range(min(self.max_n, len(tokens)), _MIN_MATCH - 1, -1):
            start = self.tables[n].get(tuple(tokens[len(tokens) - n :]))
            if start is not None:
                return tokens[start : start + k]
        return []


@dataclass
class DraftState:
    """A speculating request's drafting state."""

    index: NgramIndex
    tokens: list[int] = field(default_factory=list)
    """The request's prompt and output, kept up to date by appending (not rebuilt each step)."""
    draft: list[int] = field(default_factory=list)
    """The tokens drafted for this step (verified after the forward)."""
    length: int = 2
    """How many tokens to draft next: doubled after a draft accepted whole, otherwise one more
    than the last draft's accepted part (a drafted position costs about a quarter of a decode
    step here: benchmarks/bench_speculative.py)."""
    drafted: int = 0
    accepted: int = 0
    gave_up: bool = False
    """Not drafting (any more): its drafts stopped paying, or the request cannot speculate."""


@dataclass
class Verdict:
    """What verification found for one speculative row."""

    accepted: list[int]
    """The leading draft tokens the model would have produced itself."""
    next_token: int
    """The model's choice after them."""


class NgramDrafter:
    def __init__(self, config: EngineConfig, max_context_len: int) -> None:
        self.by_default = config.speculative == "ngram"
        self.requested = False
        """A request asked for speculation while it is off by default."""
        self.max_context_len = max_context_len
        self.max_draft = config.speculative_max_draft
        self.step_budget = config.speculative_step_budget
        self.ngram_max = config.speculative_ngram_max
        self.drafted_tokens = 0
        self.accepted_tokens = 0

    @property
    def active(self) -> bool:
        """Whether any request may draft (off by default and never asked for: no cost per step)."""
        return self.by_default or self.requested

    def eligible(self, req: Request) -> bool:
        p = req.params
        wanted = self.by_default if p.speculative is None else p.speculative
        return (wanted and p.is_greedy and not p.has_penalties and not p.logit_bias and not p.logprobs
                and not p.top_logprobs and req.validation is None)

    def draft(self, reqs: list[Request]) -> dict[Request, list[int]]:
        """Drafts for this step's running requests (those that have one), within the budget."""
        budget = self.step_budget
        drafts: dict[Request, list[int]] = {}
        for req in reqs:
            if budget <= 0:
                break
            state = req.speculation
            if state is None:
                state = req.speculation = DraftState(NgramIndex(self.ngram_max), gave_up=not self.eligible(req))
            if state.gave_up or len(req.output_ids) < req.params.min_new_tokens:
                continue
            # the newest token and the drafts must fit the request's budget and the context
            room = min(state.length, budget, req.params.max_new_tokens - len(req.output_ids) - 1,
                       self.max_context_len - req.seq_len - 1)
            if room <= 0:
                continue
            tokens = _current_tokens(req, state)
            state.index.update(tokens)
            draft = state.index.propose(tokens, room)
            if draft and req.matcher is not None:
                draft = _grammatical_prefix(req, draft)
            if draft:
                state.draft = draft
                drafts[req] = draft
                budget -= len(draft)
        return drafts

    def record(self, req: Request, drafted: int, accepted: int) -> None:
        state = req.speculation
        assert state is not None
        state.draft = []
        state.drafted += drafted
        state.accepted += accepted
        if drafted:
            state.length = min(self.max_draft, 2 * drafted) if accepted == drafted else accepted + 1
        self.drafted_tokens += drafted
        self.accepted_tokens += accepted
        if state.drafted >= _GIVE_UP_AFTER and state.accepted < _GIVE_UP_BELOW * state.drafted:
            state.gave_up = True


def _current_tokens(req: Request, state: DraftState) -> list[int]:
    tokens = state.tokens
    mirrored = len(tokens) - req.prompt_len  # output tokens already in the copy
    if mirrored < 0 or mirrored > len(req.output_ids) or (mirrored and tokens[-1] != req.output_ids[mirrored - 1]):
        tokens = state.tokens = req.all_ids()  # first use, or the output was cut back (a rollback)
    else:
        tokens.extend(req.output_ids[mirrored:])
    return tokens


def _grammatical_prefix(req: Request, draft: list[int]) -> list[int]:
    """The draft up to the first token the request's automaton rejects (its state unchanged)."""
    matcher = req.matcher
    assert matcher is not None
    taken = 0
    for token in draft:
        if matcher.is_terminated() or not matcher.accept(token):
            break
        taken += 1
    if taken:
        matcher.rollback(taken)
    return draft[:taken]


def verify(plan: StepPlan, logits: torch.Tensor, bitmask: np.ndarray, dead_end: str) -> tuple[torch.Tensor, dict[int, Verdict]]:
    """Check each speculative row's drafts against the model's greedy choice at every position.

    ``logits`` holds the batch's last positions first, then for each speculative row the
    positions before each of its drafts (``ModelRunner.forward``). Returns the batch's rows and
    a verdict per speculative row. ``bitmask``: a one-row host buffer for constrained rows;
    ``dead_end``: why a constrained row whose mask allows nothing cannot go on."""
    assert plan.draft_lens is not None
    batch = plan.batch_size
    last_choice = logits[:batch].argmax(dim=-1).tolist()
    extra = logits[batch:]
    extra_choice = extra.argmax(dim=-1).tolist() if extra.shape[0] else []
    verdicts: dict[int, Verdict] = {}
    row = 0
    for i, k in enumerate(plan.draft_lens.tolist()):
        if not k:
            continue
        req = plan.requests[i]
        state = req.speculation
        assert state is not None and len(state.draft) == k
        if req.matcher is None:
            choices = [*extra_choice[row : row + k], last_choice[i]]
            accepted = 0
            while accepted < k and choices[accepted] == state.draft[accepted]:
                accepted += 1
            verdicts[i] = Verdict(state.draft[:accepted], choices[accepted])
        else:
            positions = torch.cat([extra[row : row + k], logits[i : i + 1]])
            verdicts[i] = _verify_constrained(req, state.draft, positions, bitmask, dead_end)
        row += k
    return logits[:batch], verdicts


def _verify_constrained(req: Request, draft: list[int], positions: torch.Tensor, bitmask: np.ndarray,
                        dead_end: str) -> Verdict:
    """Walk the draft with the request's automaton, taking the masked argmax at each position;
    the automaton is left as it was (the accepted tokens are appended the ordinary way)."""
    matcher = req.matcher
    assert matcher is not None
    walked = 0  # draft tokens the automaton has taken
    choice = int(positions[0].argmax())
    for j in range(len(draft) + 1):
        bitmask.fill(ALL_ALLOWED)
        matcher.fill_bitmask(bitmask, 0)
        banned = req.bans.get(len(req.output_ids) + j)
        if banned:
            ban_tokens(bitmask[0], banned)
        if not bitmask[0].any():
            if j == 0:
                req.dead_end = dead_end  # as a plain decode step would have found
            else:  # nothing may follow the last draft token: it is the model's choice, not a draft
                matcher.rollback(walked)
                return Verdict(draft[: j - 1], draft[j - 1])
            break
        scores = positions[j : j + 1].clone()
        apply_bitmask(scores, torch.from_numpy(bitmask).to(scores.device))
        choice = int(scores.argmax())
        if j == len(draft) or choice != draft[j] or not matcher.accept(choice):
            break
        walked += 1
    if walked:
        matcher.rollback(walked)
    return Verdict(draft[:walked], choice)
