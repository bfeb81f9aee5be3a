"""Each pool row's request constants as arrays, written once when a request takes the row.

A step's sampling parameters and the stop checks of its decode rows are gathers over the
step's rows (``table.temperature[plan.rows]``), not a walk over its requests: the running set
changes at almost every step of a serving load (requests finish and arrive), so anything built
from the request objects would be rebuilt per step, per request, in Python.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from radixgen.engine.request import Request

if TYPE_CHECKING:
    from radixgen.engine.output import StepDeltas


class RowParams:
    def __init__(self, num_rows: int) -> None:
        self.temperature = np.zeros(num_rows, dtype=np.float32)
        self.top_p = np.ones(num_rows, dtype=np.float32)
        self.top_k = np.zeros(num_rows, dtype=np.int64)  # <= 0: no top-k
        self.min_p = np.zeros(num_rows, dtype=np.float32)
        self.seed = np.zeros(num_rows, dtype=np.int64)
        self.penalized = np.zeros(num_rows, dtype=bool)
        self.repetition = np.ones(num_rows, dtype=np.float32)
        self.frequency = np.zeros(num_rows, dtype=np.float32)
        self.presence = np.zeros(num_rows, dtype=np.float32)
        self.biased = np.zeros(num_rows, dtype=bool)
        self.logprobs = np.zeros(num_rows, dtype=bool)
        self.top_logprobs = np.zeros(num_rows, dtype=np.int64)
        self.min_new = np.zeros(num_rows, dtype=np.int64)
        self.constrained = np.zeros(num_rows, dtype=bool)
        self.prompt_len = np.zeros(num_rows, dtype=np.int64)
        self.max_new = np.zeros(num_rows, dtype=np.int64)
        self.ignore_eos = np.zeros(num_rows, dtype=bool)
        self.fast_lane = np.zeros(num_rows, dtype=bool)
        """Unconstrained, no stop strings or stop token ids, no log-probabilities: a decode
        token only appends, detokenizes and streams (the step applier's batched lane)."""
        self.cached_tokens = np.zeros(num_rows, dtype=np.int64)
        self.request_id = np.full(num_rows, None, dtype=object)
        self.sink = np.full(num_rows, -1, dtype=np.int64)
        """Index in ``sinks`` of the ``StepDeltas`` a streamed request whose text its consumer
        makes takes its one-token deltas into, as whole blocks; -1 for every other request."""
        self.sinks: list[StepDeltas] = []
        self.owner: list[Request | None] = [None] * num_rows
        """The request holding each row, for the rare per-request extras (logit bias, the stop
        token ids of min_new_tokens)."""

    def assign(self, row: int, req: Request) -> None:
        p = req.params
        self.temperature[row] = p.temperature
        self.top_p[row] = p.top_p
        self.top_k[row] = p.top_k
        self.min_p[row] = p.min_p
        self.seed[row] = req.rng_seed
        self.penalized[row] = p.has_penalties
        self.repetition[row] = p.repetition_penalty
        self.frequency[row] = p.frequency_penalty
        self.presence[row] = p.presence_penalty
        self.biased[row] = bool(p.logit_bias)
        self.logprobs[row] = p.logprobs
        self.top_logprobs[row] = p.top_logprobs
        self.min_new[row] = p.min_new_tokens
        self.constrained[row] = req.constraint is not None
        self.prompt_len[row] = req.prompt_len
        self.max_new[row] = p.max_new_tokens
        self.ignore_eos[row] = p.ignore_eos
        self.fast_lane[row] = (req.constraint is None and not p.stop
                               and not p.stop_token_ids and not p.logprobs and not p.top_logprobs)
        self.cached_tokens[row] = req.cached_tokens
        self.request_id[row] = req.request_id
        deltas = req.delta_sink
        self.sink[row] = self._sink_index(deltas) if deltas is not None and req.stream and not req.detokenize else -1
        self.owner[row] = req

    def end_at(self, rows: np.ndarray, max_context_len: int) -> np.ndarray:
        """[B] the sequence length at which each row ends: its max_new_tokens, or the context."""
        return np.minimum(self.prompt_len[rows] + self.max_new[rows], max_context_len)

    def release(self, row: int) -> None:
        self.owner[row] = None
        self.request_id[row] = None

    def _sink_index(self, deltas: StepDeltas) -> int:
        for i, known in enumerate(self.sinks):  # one per engine process; a few in tests
            if known is deltas:
                return i
        self.sinks.append(deltas)
        return len(self.sinks) - 1

    @classmethod
    def of(cls, requests: list[Request]) -> RowParams:
        """A table holding just these requests, at their ``pool_row`` (tests, one-off batches)."""
        table = cls(max((r.pool_row for r in requests), default=-1) + 1)
        for r in requests:
            table.assign(r.pool_row, r)
        return table
