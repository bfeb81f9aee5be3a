"""A step's plan as flat arrays: which requests, which tokens, where their K/V go.

The scheduler fills a ``StepPlan`` with numpy arrays (cheap to build on the host); the model
runner hands its attention part (``attention_batch``) to the attention backend, which turns it
into device tensors once per step.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

import numpy as np

from radixgen.engine.request import Request
from radixgen.engine.stats import StepRecord
from radixgen.models.attention import AttentionBatch


class StepKind(enum.Enum):
    """The shape of a step. Overlapped scheduling's lookahead step is a ``DECODE`` planned early
    (``StepPlan.lookahead``)."""

    PREFILL = "prefill"
    """Prompt chunks (and jump-forward's forced tokens) only."""
    MIXED = "mixed"
    """Prompt chunks first, then every running request's next token (``num_decode`` rows)."""
    DECODE = "decode"
    """One token per running request."""
    SPECULATIVE = "speculative"
    """Drafting rows (their newest token and drafts, verified by the step) first, then the
    ``num_decode`` rows decoding one token."""

    @property
    def runs_as_extend(self) -> bool:
        """Rows of any length, through the prefill attention path (all but ``DECODE``)."""
        return self is not StepKind.DECODE

    @property
    def has_prompt_rows(self) -> bool:
        """Its first ``num_prefill`` rows are prompt chunks (each counts its own outputs)."""
        return self in (StepKind.PREFILL, StepKind.MIXED)

    @property
    def decodes_running(self) -> bool:
        """The running requests advance in this step (they reserved their slots for it)."""
        return self is not StepKind.PREFILL


@dataclass
class PromptScoring:
    """Prompt positions whose next-token log-probability a prefill step reports."""

    token_index: np.ndarray  # [S] flat index into the step's tokens
    targets: np.ndarray  # [S] the prompt token that follows each position
    owners: np.ndarray  # [S] index of the request in the batch
    offsets: np.ndarray  # [S] index into that request's ``prompt_logprobs``


@dataclass
class StepPlan:
    kind: StepKind
    requests: list[Request]
    rows: np.ndarray  # [B] req_to_token row of each request
    prefix_lens: np.ndarray  # [B] tokens already in the pool before this step
    extend_lens: np.ndarray  # [B] new tokens this step (1 for decode)
    input_ids: np.ndarray  # [T]
    positions: np.ndarray  # [T]
    out_cache_loc: np.ndarray  # [T] slots receiving the new tokens' K/V
    sample_mask: np.ndarray | None = None
    """[B] bool: requests whose next token is sampled this step (False for a non-final chunk)."""
    verify_counts: np.ndarray | None = None
    """[B] prefill only: how many forced tokens at the end of each request's extend need the
    logits of the positions before them (jump-forward verification)."""
    draft_lens: np.ndarray | None = None
    """[B] speculative steps only: how many draft tokens follow each request's newest token in
    its extend (0 for the rows that decode one token); their logits come as ``verify_counts``."""
    prompt_scoring: PromptScoring | None = None
    batch_version: int | None = None
    """Decode only: equal versions mean the same requests in the same order as before."""
    num_decode: int = 0
    """Prefill only: the last ``num_decode`` requests are running requests decoding one token
    in this step alongside the prefill (a mixed step); their tokens come last."""
    bitmask: np.ndarray | None = None
    """[B, vocab / 32] int32 grammar bitmask of the sampled rows, filled on the host before the
    forward (steps without forced tokens or drafts to verify); the model runner uploads it with
    the step's inputs and applies it to the logits on the device."""
    record: StepRecord | None = None
    """The step's record in the scheduler's log, kept with the plan: under overlapped
    scheduling the next step is planned before this one's results are applied."""
    lookahead: bool = False
    """Planned from the step before it, before that step's results were applied (overlapped
    scheduling): a row whose request did not continue as assumed is dropped when it lands."""

    @property
    def batch_size(self) -> int:
        return len(self.requests)

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def seq_lens(self) -> np.ndarray:
        return self.prefix_lens + self.extend_lens

    @property
    def masks_early(self) -> bool:
        """The grammar masks are known before the forward (no forced tokens or drafts to verify
        first): they go up with the step's inputs."""
        return self.kind is not StepKind.SPECULATIVE and self.verify_counts is None

    @property
    def num_prefill(self) -> int:
        return len(self.requests) - self.num_decode

    def decode_rows(self, keep: np.ndarray) -> StepPlan:
        """A decode plan narrowed to the rows ``keep`` [B] bool (a new batch: no version)."""
        assert self.kind is StepKind.DECODE and self.draft_lens is None and self.verify_counts is None
        return StepPlan(
            kind=self.kind, requests=[r for r, k in zip(self.requests, keep.tolist(), strict=True) if k],
            rows=self.rows[keep], prefix_lens=self.prefix_lens[keep], extend_lens=self.extend_lens[keep],
            input_ids=self.input_ids[keep], positions=self.positions[keep], out_cache_loc=self.out_cache_loc[keep],
            sample_mask=None if self.sample_mask is None else self.sample_mask[keep],
            bitmask=None if self.bitmask is None else self.bitmask[keep], record=self.record,
        )

    def attention_batch(self) -> AttentionBatch:
        """The host plan the attention backend prepares the step's metadata from."""
        return AttentionBatch(
            self.rows, self.prefix_lens, self.extend_lens, self.positions, self.out_cache_loc,
            is_decode=self.kind is StepKind.DECODE, num_decode=self.num_decode, is_draft=self.kind is StepKind.SPECULATIVE,
        )
