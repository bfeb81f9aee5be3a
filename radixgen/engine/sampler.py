"""Vectorised sampling for the whole batch: penalties, temperature, top-k, top-p, min-p, seeds.

Randomness is counter-based: request i's uniform draw at output position n is a hash of
(seed_i, n), computed for all rows at once. A request therefore samples the same tokens alone
or in any batch, and after being retracted and resumed, with no per-request generator objects.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from radixgen.engine.decode_batch import DecodeBatchCache, Keyed, current
from radixgen.engine.plan import StepPlan
from radixgen.engine.request import Request
from radixgen.engine.row_params import RowParams
from radixgen.kernels import ops  # noqa: F401  # defines torch.ops.radixgen.argmax_rows
from radixgen.staging import ReadBack, upload

StagedBuild = Callable[[list[torch.Tensor]], "SamplingBatch"]
"""Makes a sampling batch of its host arrays once they are on the device."""

_M32 = 0xFFFFFFFF


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """murmur3's 32-bit finaliser on int64 tensors holding uint32 values (wrapping multiply)."""
    x = x ^ (x >> 16)
    x = (x * 0x85EBCA6B) & _M32
    x = x ^ (x >> 13)
    x = (x * 0xC2B2AE35) & _M32
    return x ^ (x >> 16)


def uniform_from_counter(seeds: torch.Tensor, counters: torch.Tensor) -> torch.Tensor:
    """One float64 in [0, 1) per row from (seed, counter), both int64 [B]."""
    lo, hi = seeds & _M32, (seeds >> 32) & _M32
    h1 = _mix32(lo ^ _mix32(hi ^ _mix32((counters & _M32) ^ 0x9E3779B9)))
    h2 = _mix32(h1 ^ 0x68E31DA4)
    bits = ((h1 & 0xFFFFFF) << 24) | (h2 & 0xFFFFFF)  # 48 random bits
    return bits.double() / float(1 << 48)


@dataclass
class SamplingBatch:
    """Per-row sampling parameters as device tensors, built once per step."""

    temperatures: torch.Tensor  # [B] float32, 0 for greedy rows
    top_p: torch.Tensor  # [B] float32
    top_k: torch.Tensor  # [B] int64, vocab size where disabled
    min_p: torch.Tensor  # [B] float32
    seeds: torch.Tensor  # [B] int64
    counters: torch.Tensor  # [B] int64: tokens generated so far
    is_greedy: np.ndarray  # [B] bool (host)
    sampled_rows: torch.Tensor  # [S] int64: batch rows that sample (not greedy)
    max_top_k: int  # the largest top_k among them (host: sizes the top-k without reading the device)
    need_top_p: bool
    need_top_k: bool
    need_min_p: bool
    max_top_logprobs: int
    want_logprobs: bool
    rows: torch.Tensor  # [B] req_to_token rows (index of penalty state)
    penalized: torch.Tensor | None  # [P] positions in the batch with penalties
    repetition: torch.Tensor | None  # [P]
    frequency: torch.Tensor | None  # [P]
    presence: torch.Tensor | None  # [P]
    bias_index: tuple[torch.Tensor, torch.Tensor] | None = None  # ([N] batch rows, [N] token ids) of logit_bias
    bias_values: torch.Tensor | None = None  # [N] float32
    min_rows: np.ndarray | None = None  # [M] batch rows with a min_new_tokens not reached at build time
    min_tokens: np.ndarray | None = None  # [M] their min_new_tokens
    min_counters: np.ndarray | None = None  # [M] tokens generated so far (host copy of counters)
    min_banned: list[torch.Tensor] | None = None  # per min row: EOS and its stop token ids
    penalized_host: np.ndarray | None = None  # [P] ``penalized`` on the host
    biased_host: np.ndarray | None = None  # batch rows with a logit bias (host)

    def bias_positions(self, positions: torch.Tensor, i: int) -> torch.Tensor:
        """Batch row ``i``'s logit bias added to each of its positions."""
        if self.bias_index is None:
            return positions
        assert self.bias_values is not None
        if self.biased_host is None or i not in self.biased_host:  # decided on the host: no device read
            return positions
        mine = self.bias_index[0] == i
        positions = positions.clone()
        positions[:, self.bias_index[1][mine]] += self.bias_values[mine]
        return positions

    def mask_early_stops(self, logits: torch.Tensor) -> None:
        """Rows below their min_new_tokens cannot pick EOS or a stop token id yet."""
        if self.min_rows is None:
            return
        assert self.min_tokens is not None and self.min_counters is not None and self.min_banned is not None
        for j in np.flatnonzero(self.min_counters < self.min_tokens).tolist():
            logits[int(self.min_rows[j])].index_fill_(0, self.min_banned[j], float("-inf"))

    def advance(self) -> None:
        """Every request of the batch produced exactly one token since it was built."""
        self.counters += 1
        if self.min_counters is not None:
            self.min_counters += 1

    @classmethod
    def from_requests(cls, requests: list[Request], vocab_size: int, device: torch.device,
                      eos_token_ids: tuple[int, ...] = ()) -> SamplingBatch:
        """The batch of these requests, at their ``pool_row`` (tests, one-off batches)."""
        rows = np.fromiter((r.pool_row for r in requests), dtype=np.int64, count=len(requests))
        counters = np.fromiter((len(r.output_ids) for r in requests), dtype=np.int64, count=len(requests))
        return cls.from_rows(RowParams.of(requests), rows, counters, vocab_size, device, eos_token_ids)

    @classmethod
    def from_rows(cls, table: RowParams, rows: np.ndarray, counters: np.ndarray, vocab_size: int,
                  device: torch.device, eos_token_ids: tuple[int, ...] = ()) -> SamplingBatch:
        """The batch of the requests holding pool ``rows``, which have generated ``counters``
        tokens so far: gathers over the row table; only the rows with a logit bias or an unmet
        min_new_tokens look at their request."""
        host, build = cls.staged_rows(table, rows, counters, vocab_size, eos_token_ids)
        return build(upload(host, device))

    @classmethod
    def staged_rows(cls, table: RowParams, rows: np.ndarray, counters: np.ndarray, vocab_size: int,
                    eos_token_ids: tuple[int, ...] = ()) -> tuple[list[np.ndarray], StagedBuild]:
        """``from_rows`` in two halves: the host arrays to upload (with the step's own, in one
        copy), and the function that makes the batch of them once they are on the device."""
        temps = table.temperature[rows]
        top_p = table.top_p[rows]
        top_k = table.top_k[rows]
        top_k = np.where(top_k > 0, np.minimum(top_k, vocab_size), vocab_size)
        min_p = table.min_p[rows]
        greedy = temps == 0.0
        sampled = ~greedy
        penalized = np.flatnonzero(table.penalized[rows])

        # every array goes to the device in one copy; each entry's index into ``host`` is kept
        host: list[np.ndarray] = []

        def staged(a: np.ndarray) -> int:
            host.append(a)
            return len(host) - 1

        def pen(column: np.ndarray) -> int:
            return staged(column[rows[penalized]])

        bias = None
        biased = np.flatnonzero(table.biased[rows]).tolist()
        if biased:
            entries = [(i, t, v) for i in biased for t, v in (_owner(table, rows[i]).params.logit_bias or {}).items()]
            rows_b, toks_b, vals_b = zip(*entries, strict=True)
            bias = (staged(np.array(rows_b, dtype=np.int64)), staged(np.array(toks_b, dtype=np.int64)),
                    staged(np.array(vals_b, dtype=np.float32)))
        # min_new_tokens: unconstrained rows only (an automaton decides where its output ends)
        min_new = table.min_new[rows]
        short = np.flatnonzero((min_new > counters) & ~table.constrained[rows])
        min_rows = min_tokens = min_counters = None
        banned: list[int] = []
        if len(short):
            min_rows, min_tokens, min_counters = short.astype(np.int64), min_new[short], counters[short].copy()
            banned = [staged(np.array(sorted(set(eos_token_ids) | set(_owner(table, rows[i]).params.stop_token_ids)),
                                      dtype=np.int64)) for i in short.tolist()]
        top_logprobs = table.top_logprobs[rows]
        sampled_rows = np.flatnonzero(sampled).astype(np.int64)
        columns = {name: staged(np.asarray(a)) for name, a in (
            ("temperatures", temps), ("top_p", top_p), ("top_k", top_k), ("min_p", min_p), ("seeds", table.seed[rows]),
            ("counters", counters.astype(np.int64)), ("rows", rows.astype(np.int64)), ("sampled_rows", sampled_rows),
        )}
        has_penalties = bool(len(penalized))
        if has_penalties:
            columns |= {"penalized": staged(penalized.astype(np.int64)), "repetition": pen(table.repetition),
                        "frequency": pen(table.frequency), "presence": pen(table.presence)}

        def build(uploaded: list[torch.Tensor]) -> SamplingBatch:
            t = {name: uploaded[i] for name, i in columns.items()}
            return cls(
                temperatures=t["temperatures"], top_p=t["top_p"], top_k=t["top_k"], min_p=t["min_p"], seeds=t["seeds"],
                counters=t["counters"],
                is_greedy=greedy,
                sampled_rows=t["sampled_rows"],
                max_top_k=int(top_k[sampled].max()) if sampled.any() else 0,
                need_top_p=bool((top_p[sampled] < 1.0).any()),
                need_top_k=bool((top_k[sampled] < vocab_size).any()),
                need_min_p=bool((min_p[sampled] > 0.0).any()),
                max_top_logprobs=int(top_logprobs.max()) if len(rows) else 0,
                want_logprobs=bool(table.logprobs[rows].any()),
                rows=t["rows"],
                penalized=t.get("penalized"),
                repetition=t.get("repetition"),
                frequency=t.get("frequency"),
                presence=t.get("presence"),
                bias_index=(uploaded[bias[0]], uploaded[bias[1]]) if bias else None,
                bias_values=uploaded[bias[2]] if bias else None,
                min_rows=min_rows, min_tokens=min_tokens, min_counters=min_counters,
                min_banned=[uploaded[i] for i in banned] if banned else None,
                penalized_host=penalized.astype(np.int64) if has_penalties else None,
                biased_host=np.array(biased, dtype=np.int64) if biased else None,
            )

        return host, build


def _owner(table: RowParams, row: int) -> Request:
    req = table.owner[int(row)]
    assert req is not None, f"pool row {row} has no request"
    return req


class SamplingBatchCache:
    """A step's sampling tensors, gathered from the row table; reused while a decode batch is
    unchanged."""

    def __init__(self, vocab_size: int, device: torch.device, row_params: RowParams,
                 eos_token_ids: tuple[int, ...] = (), decode_batch: DecodeBatchCache | None = None) -> None:
        self.vocab_size, self.device, self.eos_token_ids = vocab_size, device, tuple(eos_token_ids)
        self.row_params = row_params
        self.decode_batch = decode_batch if decode_batch is not None else DecodeBatchCache()
        """Where the batch's tensors are kept (the planner's, which drops them with its batch)."""

    def get(self, plan: StepPlan) -> SamplingBatch:
        host, build = self.stage(plan)
        return build(upload(host, self.device))

    def stage(self, plan: StepPlan) -> tuple[list[np.ndarray], StagedBuild]:
        """The step's sampling batch in two halves (``SamplingBatch.staged_rows``): nothing to
        upload while the decode batch is unchanged."""
        cached: SamplingBatch | None = current(self.decode_batch.sampling, plan.batch_version)
        if cached is not None:
            cached.advance()  # every request produced exactly one token since
            return [], lambda _uploaded: cached
        host, build = SamplingBatch.staged_rows(self.row_params, plan.rows, self._counters(plan), self.vocab_size,
                                                self.eos_token_ids)
        version = plan.batch_version

        def build_and_keep(uploaded: list[torch.Tensor]) -> SamplingBatch:
            made = build(uploaded)
            self.decode_batch.sampling = Keyed(version, made) if version is not None else None
            return made

        return host, build_and_keep

    def _counters(self, plan: StepPlan) -> np.ndarray:
        """Tokens each request has generated: a row whose newest token is this step's first
        input (a decoding or drafting row) stands at output index prefix + 1 - prompt_len; the
        prefill rows (their first ``num_prefill``, outside speculative steps) count their own."""
        counters = plan.prefix_lens + 1 - self.row_params.prompt_len[plan.rows]
        if plan.kind.has_prompt_rows:
            head = plan.requests[: plan.num_prefill]
            counters[: len(head)] = np.fromiter((len(r.output_ids) for r in head), dtype=np.int64, count=len(head))
        return counters


@dataclass
class SampleResult:
    token_ids: np.ndarray  # [B] int64
    logprobs: np.ndarray | None  # [B] float32: log-prob of the chosen token
    top_ids: np.ndarray | None  # [B, n]
    top_logprobs: np.ndarray | None  # [B, n]

    def rows(self, keep: np.ndarray) -> SampleResult:
        """The results of the rows ``keep`` [B] bool."""
        def pick(a: np.ndarray | None) -> np.ndarray | None:
            return None if a is None else a[keep]

        return SampleResult(self.token_ids[keep], pick(self.logprobs), pick(self.top_ids), pick(self.top_logprobs))


class PenaltyState:
    """Token counts per req_to_token row for repetition / frequency / presence penalties.

    Allocated on first use ([rows, vocab] int32 + bool); a row is reset when a request that
    uses penalties takes it, and counts are bumped by one scatter per step.
    """

    def __init__(self, num_rows: int, vocab_size: int, device: torch.device) -> None:
        self.num_rows, self.vocab_size, self.device = num_rows, vocab_size, device
        self.output_counts: torch.Tensor | None = None
        self.prompt_mask: torch.Tensor | None = None

    def reset_row(self, row: int, prompt_ids: list[int], output_ids: list[int]) -> None:
        if self.output_counts is None:
            self.output_counts = torch.zeros((self.num_rows, self.vocab_size), dtype=torch.int32, device=self.device)
            self.prompt_mask = torch.zeros((self.num_rows, self.vocab_size), dtype=torch.bool, device=self.device)
        assert self.prompt_mask is not None
        self.output_counts[row].zero_()
        self.prompt_mask[row].zero_()
        self.prompt_mask[row, torch.tensor(prompt_ids, dtype=torch.int64, device=self.device)] = True
        if output_ids:
            ids = torch.tensor(output_ids, dtype=torch.int64, device=self.device)
            self.output_counts[row].index_add_(0, ids, torch.ones_like(ids, dtype=torch.int32))

    def apply(self, logits: torch.Tensor, batch: SamplingBatch) -> None:
        """Penalise logits in place for the penalised rows."""
        if batch.penalized is None:
            return
        assert self.output_counts is not None and self.prompt_mask is not None, "penalty row not reset"
        assert batch.repetition is not None and batch.frequency is not None and batch.presence is not None
        rows = batch.rows[batch.penalized]
        logits[batch.penalized] = _penalize(logits[batch.penalized], self.output_counts[rows], self.prompt_mask[rows],
                                            batch.repetition[:, None], batch.frequency[:, None],
                                            batch.presence[:, None])

    def apply_positions(self, positions: torch.Tensor, batch: SamplingBatch, i: int, draft: list[int]) -> torch.Tensor:
        """Batch row ``i``'s penalties at consecutive positions of a speculative step: position j
        counts the first j draft tokens as output (they precede it)."""
        assert batch.penalized is not None and batch.repetition is not None
        assert batch.frequency is not None and batch.presence is not None
        assert self.output_counts is not None and self.prompt_mask is not None, "penalty row not reset"
        assert batch.penalized_host is not None
        p = int(np.flatnonzero(batch.penalized_host == i)[0])
        row = batch.rows[i]
        drafted = torch.zeros(positions.shape, dtype=torch.int32, device=positions.device)
        if draft:
            steps = torch.arange(1, len(draft) + 1, device=positions.device)
            (draft_ids,) = upload([np.array(draft, dtype=np.int64)], positions.device)
            drafted[steps, draft_ids] = 1
        counts = self.output_counts[row][None, :] + drafted.cumsum(dim=0, dtype=torch.int32)
        return _penalize(positions, counts, self.prompt_mask[row][None, :], batch.repetition[p], batch.frequency[p],
                         batch.presence[p])

    def record(self, batch: SamplingBatch, token_ids: torch.Tensor) -> None:
        if batch.penalized is None or self.output_counts is None:
            return
        rows = batch.rows[batch.penalized]
        self.output_counts[rows, token_ids[batch.penalized]] += 1


def _penalize(logits: torch.Tensor, counts: torch.Tensor, prompt_mask: torch.Tensor, repetition: torch.Tensor,
              frequency: torch.Tensor, presence: torch.Tensor) -> torch.Tensor:
    seen = counts > 0
    # HF repetition penalty: over prompt and output, divide positive logits, multiply negative.
    in_context = seen | prompt_mask
    logits = torch.where(in_context, torch.where(logits > 0, logits / repetition, logits * repetition), logits)
    return logits - frequency * counts - presence * seen


def argmax_rows(logits: torch.Tensor) -> torch.Tensor:
    """Each row's first largest index (int64), as ``logits.argmax(dim=-1)``; float32 [B, V] logits
    go through ``torch.ops.radixgen.argmax_rows``, whose CPU kernel is vectorised (PyTorch's CPU
    argmax is not: ~4 ms for 64 x 49k logits)."""
    if logits.dim() == 2 and logits.dtype == torch.float32 and logits.shape[1] > 0:
        return torch.ops.radixgen.argmax_rows.default(logits)
    return logits.argmax(dim=-1)


class Sampler:
    def __init__(self, vocab_size: int, num_rows: int, device: torch.device) -> None:
        self.vocab_size = vocab_size
        self.penalties = PenaltyState(num_rows, vocab_size, device)

    def __call__(self, logits: torch.Tensor, batch: SamplingBatch) -> SampleResult:
        """Choose one token per row of float32 ``logits`` [B, vocab] (modified in place; grammar
        masks are applied before, as -inf)."""
        self.penalties.apply(logits, batch)
        if batch.bias_index is not None:
            assert batch.bias_values is not None
            logits.index_put_(batch.bias_index, batch.bias_values, accumulate=True)
        batch.mask_early_stops(logits)
        token_ids = argmax_rows(logits)
        if not batch.is_greedy.all():
            idx = batch.sampled_rows
            token_ids[idx] = sample_rows(logits[idx], batch, idx, batch.counters[idx])
        self.penalties.record(batch, token_ids)
        return self._result(logits, token_ids, batch)

    def _result(self, logits: torch.Tensor, token_ids: torch.Tensor, batch: SamplingBatch) -> SampleResult:
        chosen_lp = top_ids = top_lp = None
        if batch.want_logprobs or batch.max_top_logprobs:
            # of the model's distribution: after penalties, before temperature
            chosen_lp, top_ids, top_lp = logprob_parts(logits, token_ids, batch.max_top_logprobs)
        # the step's one read-back: everything the host needs, behind one event
        ids, lp, best_ids, best_lp = ReadBack([token_ids, chosen_lp, top_ids, top_lp]).wait()
        assert ids is not None
        return SampleResult(ids, lp, best_ids, best_lp)


def logprob_parts(logits: torch.Tensor, tokens: torch.Tensor, top: int) -> list[torch.Tensor | None]:
    """On the device: each row's log-probability of its token, and its ``top`` most likely (ids,
    log-probabilities; None when ``top`` is 0)."""
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    chosen = logprobs.gather(1, tokens[:, None]).squeeze(1)
    if not top or not logits.shape[0]:
        return [chosen, None, None]
    best = torch.topk(logprobs, top, dim=-1)
    return [chosen, best.indices, best.values]


def sample_rows(logits: torch.Tensor, batch: SamplingBatch, idx: torch.Tensor, counters: torch.Tensor) -> torch.Tensor:
    """One token for each row of ``logits``, sampled with the parameters of batch row ``idx``
    and the counter-based uniform of (its seed, ``counters``): a row's token depends only on
    its logits and which output token it is, so a position verified in a speculative step
    draws exactly what a decode step at that position would."""
    logits = logits / batch.temperatures[idx, None]
    if batch.need_top_k:
        top_k = batch.top_k[idx]
        kth = torch.topk(logits, batch.max_top_k, dim=-1).values.gather(1, (top_k - 1)[:, None])
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if batch.need_min_p:
        floor = batch.min_p[idx, None] * probs.max(dim=-1, keepdim=True).values
        probs = probs.masked_fill(probs < floor, 0.0)
    if batch.need_top_p:
        sorted_probs, order = probs.sort(dim=-1, descending=True)
        mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
        sorted_probs = sorted_probs.masked_fill(mass_before > batch.top_p[idx, None], 0.0)
        probs = torch.zeros_like(probs).scatter_(1, order, sorted_probs)
    # Inverse-CDF sampling with one counter-based uniform per row (the filters above only
    # zero entries, so the un-normalised CDF is scaled by its total instead of renormalising).
    cdf = probs.double().cumsum(dim=-1)
    u = uniform_from_counter(batch.seeds[idx], counters).to(cdf.device)
    targets = (u * cdf[:, -1]).unsqueeze(1)
    chosen = torch.searchsorted(cdf, targets, right=True).squeeze(1)
    return chosen.clamp_(max=logits.shape[-1] - 1)
