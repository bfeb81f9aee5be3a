"""A step's plan as flat arrays: which requests, which tokens, where their K/V go.

The scheduler fills a ``StepPlan`` with numpy arrays (cheap to build on the host); the model
runner turns it into device tensors once per step (see ``build_attention_plan``).
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from radixgen.engine.request import Request
from radixgen.models.attention import AttentionPlan, PrefillSpan, additive_mask


class StepKind(enum.Enum):
    PREFILL = "prefill"
    DECODE = "decode"


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
    def num_prefill(self) -> int:
        return len(self.requests) - self.num_decode

    def split_mixed(self) -> tuple[StepPlan, StepPlan]:
        """A mixed step as (its prefill part, its decode part), for attention."""
        p, t = self.num_prefill, int(self.extend_lens[: self.num_prefill].sum())
        head = StepPlan(
            StepKind.PREFILL, self.requests[:p], self.rows[:p], self.prefix_lens[:p], self.extend_lens[:p],
            self.input_ids[:t], self.positions[:t], self.out_cache_loc[:t],
        )
        tail = StepPlan(
            StepKind.DECODE, self.requests[p:], self.rows[p:], self.prefix_lens[p:], self.extend_lens[p:],
            self.input_ids[t:], self.positions[t:], self.out_cache_loc[t:],
        )
        return head, tail


def build_attention_plan(
    plan: StepPlan, req_to_token: torch.Tensor, device: torch.device, dtype: torch.dtype,
    decode_kernel: Callable[..., torch.Tensor] | None = None, per_request_prefill: bool | None = None,
    prefill_kernel: Callable[..., torch.Tensor] | None = None,
    shared_prefix_kernel: Callable[..., tuple[torch.Tensor, torch.Tensor, torch.Tensor]] | None = None,
) -> AttentionPlan:
    """Device tensors for attention, built once per step and shared by every layer.
    ``decode_kernel``: the pool-reading decode kernel, used for decode steps when given.
    ``prefill_kernel``: the pool-reading prefill kernel, used for prefill (parts of) steps when given.
    ``shared_prefix_kernel``: with ``decode_kernel``, attends a prefix several decode rows share
    once for all of them (see ``shared_prefixes``).
    ``per_request_prefill``: attend prefill requests one by one (default: on CPU) rather than
    padded to the longest under one mask (elsewhere one masked call beats a launch per request)."""
    if per_request_prefill is None:
        per_request_prefill = device.type == "cpu"
    if plan.draft_lens is not None and decode_kernel is not None:
        # every token of a speculative step is a query at its own position over K/V already in
        # the pool: the decode kernel reads them in place, with a decode step's arithmetic
        return AttentionPlan(
            torch.from_numpy(plan.out_cache_loc).to(device), None, None, None, None, is_decode=True,
            decode_kernel=decode_kernel, req_to_token=req_to_token,
            rows=torch.from_numpy(np.repeat(plan.rows, plan.extend_lens)).to(device),
            seq_lens=torch.from_numpy(plan.positions + 1).to(device),
        )
    if plan.num_decode and plan.num_prefill:
        head, tail = plan.split_mixed()
        attn = build_attention_plan(
            head, req_to_token, device, dtype, decode_kernel, per_request_prefill, prefill_kernel)
        attn.decode_tail = build_attention_plan(
            tail, req_to_token, device, dtype, decode_kernel, shared_prefix_kernel=shared_prefix_kernel)
        attn.num_prefill_tokens = head.num_tokens
        attn.out_cache_loc = torch.from_numpy(plan.out_cache_loc).to(device)
        return attn
    out_cache_loc = torch.from_numpy(plan.out_cache_loc).to(device)
    batch = plan.batch_size
    if plan.kind is StepKind.PREFILL and prefill_kernel is not None:
        return AttentionPlan(
            out_cache_loc, None, None, None, None, is_decode=False, prefill_kernel=prefill_kernel,
            req_to_token=req_to_token, rows=torch.from_numpy(plan.rows).to(device),
            prefix_lens=torch.from_numpy(plan.prefix_lens).to(device),
            extend_lens=torch.from_numpy(plan.extend_lens).to(device),
        )
    if plan.kind is StepKind.PREFILL and (per_request_prefill or (batch == 1 and plan.prefix_lens[0] == 0)):
        spans = _prefill_spans(plan, req_to_token, device, dtype)
        return AttentionPlan(out_cache_loc, None, None, None, None, is_decode=False, spans=spans)

    if plan.kind is StepKind.DECODE and decode_kernel is not None:
        attn = AttentionPlan(
            out_cache_loc, None, None, None, None, is_decode=True, decode_kernel=decode_kernel,
            req_to_token=req_to_token, rows=torch.from_numpy(plan.rows).to(device),
            seq_lens=torch.from_numpy(plan.seq_lens).to(device),
        )
        sharing = shared_prefixes(req_to_token, plan.rows, plan.seq_lens) if shared_prefix_kernel is not None else None
        if sharing is not None:
            attn.shared_prefix_kernel = shared_prefix_kernel
            attn.shared_prefix, attn.group_leader = (torch.from_numpy(a).to(device) for a in sharing)
        return attn

    prefix = torch.from_numpy(plan.prefix_lens).to(device)
    extend = torch.from_numpy(plan.extend_lens).to(device)
    seq_lens = prefix + extend
    max_len = int(plan.seq_lens.max())
    rows = torch.from_numpy(plan.rows).to(device)
    kv_indices = req_to_token[rows, :max_len]  # [B, L]
    key_pos = torch.arange(max_len, device=device)

    if plan.kind is StepKind.DECODE:
        visible = (key_pos[None, :] < seq_lens[:, None]).view(batch, 1, 1, max_len)
        return AttentionPlan(
            out_cache_loc, kv_indices, additive_mask(visible, dtype), None, None, is_decode=True,
            query_positions=(seq_lens - 1)[:, None],
        )

    max_q = int(plan.extend_lens.max())
    q_pos = torch.arange(max_q, device=device)
    # key j is visible to new token i of request b iff j <= prefix_b + i (causal) and j < seq_b
    visible = (key_pos[None, None, :] <= (prefix[:, None, None] + q_pos[None, :, None])) & (
        key_pos[None, None, :] < seq_lens[:, None, None]
    )
    starts = torch.cumsum(extend, 0) - extend
    query_index = starts[:, None] + torch.minimum(q_pos[None, :], extend[:, None] - 1)  # [B, Q]
    is_real = q_pos[None, :] < extend[:, None]
    flat = torch.arange(batch * max_q, device=device).view(batch, max_q)
    query_unpad = flat[is_real]  # row-major == the flat token order
    return AttentionPlan(
        out_cache_loc, kv_indices, additive_mask(visible.unsqueeze(1), dtype), query_index, query_unpad,
        is_decode=False, query_positions=prefix[:, None] + q_pos[None, :],
    )


MIN_SHARED_PREFIX = 64
"""Keys decode rows must share for their prefix to be attended once for the group."""


def shared_prefixes(
    req_to_token: torch.Tensor, rows: np.ndarray, seq_lens: np.ndarray,
) -> tuple[np.ndarray, np.ndarray] | None:
    """Decode rows whose sequences begin with the same pool slots (a prompt prefix the radix
    tree shares): (keys each row shares with its group, 0 for none; the batch index of its
    group's first row), or None when no two rows share ``MIN_SHARED_PREFIX`` keys. Rows are
    grouped by the slot at key ``MIN_SHARED_PREFIX - 1`` (a slot belongs to one tree path, so
    rows holding it share everything before it), and a group shares the common run of its rows,
    short of each row's newest key."""
    if len(rows) < 2:
        return None
    table = req_to_token.numpy()
    eligible = np.flatnonzero(seq_lens > MIN_SHARED_PREFIX)
    if len(eligible) < 2:
        return None
    marks = table[rows[eligible], MIN_SHARED_PREFIX - 1]
    order = np.argsort(marks, kind="stable")
    starts = np.concatenate(([0], np.flatnonzero(np.diff(marks[order])) + 1))
    ends = np.append(starts[1:], len(order))
    shared = np.zeros(len(rows), dtype=np.int64)
    leader = np.arange(len(rows), dtype=np.int64)
    groups = ends - starts >= 2  # a row alone shares nothing; no Python per such row
    for start, end in zip(starts[groups].tolist(), ends[groups].tolist(), strict=True):
        members = eligible[order[start:end]]
        limit = int(seq_lens[members].min()) - 1
        block = table[rows[members], :limit]
        same = (block == block[0]).all(axis=0)
        length = limit if same.all() else int(np.argmin(same))
        if length >= MIN_SHARED_PREFIX:
            members = np.sort(members)
            shared[members] = length
            leader[members] = members[0]
    return (shared, leader) if shared.any() else None


def _prefill_spans(
    plan: StepPlan, req_to_token: torch.Tensor, device: torch.device, dtype: torch.dtype,
) -> list[PrefillSpan]:
    spans = []
    start = 0
    for row, prefix, extend in zip(plan.rows.tolist(), plan.prefix_lens.tolist(), plan.extend_lens.tolist(), strict=True):
        span = PrefillSpan(start, extend, prefix=prefix)
        if prefix:
            seq_len = prefix + extend
            span.kv_slots = req_to_token[row, :seq_len]
            # new token i sees keys 0 .. prefix + i
            key_pos = torch.arange(seq_len, device=device)
            visible = key_pos[None, :] <= prefix + torch.arange(extend, device=device)[:, None]
            span.mask = additive_mask(visible.view(1, 1, extend, seq_len), dtype)
        spans.append(span)
        start += extend
    return spans
