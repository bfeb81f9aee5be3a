"""A request in the engine: where it stands (status, KV, output so far) and each feature's state for it."""

from __future__ import annotations

import enum
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from radixgen.constraints.state import ConstraintState
from radixgen.engine.ngram import DraftState
from radixgen.engine.output import FinishReason, RequestOutput, StepDeltas
from radixgen.engine.params import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    PREFILL = "prefill"
    DECODE = "decode"
    FINISHED = "finished"
    ABORTED = "aborted"


@dataclass(eq=False)
class Request:
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    rng_seed: int
    """The seed actually used: the caller's, or one drawn for this request at submission."""
    on_output: Callable[[RequestOutput], None] | None = None
    stream: bool = True
    """Call ``on_output`` for every token; when False, only once at the end."""
    detokenize: bool = True
    """Make the output's text here; False when the consumer makes it from the token ids (only
    for requests whose text the engine does not need: ``SamplingParams.engine_needs_text``)."""
    delta_sink: StepDeltas | None = None
    """Where a streamed one-token delta of a plain decode row goes instead of ``on_output``
    (columns for a consumer in another process); finals and every other delta still go to
    ``on_output``."""
    status: RequestStatus = RequestStatus.WAITING
    output_ids: list[int] = field(default_factory=list)
    pool_row: int = -1
    """Row of req_to_token while the request holds KV, else -1."""
    num_computed: int = 0
    """Leading tokens of prompt+output whose K/V are in the pool."""
    prefix_len: int = 0
    """Leading tokens whose slots belong to the radix tree (locked at ``last_node``)."""
    last_node: int = 0
    """Radix node where the locked cached prefix ends (the root when nothing is locked)."""
    cached_tokens: int = 0
    """Prompt tokens served from the prefix cache at first admission."""
    finish_reason: FinishReason | None = None
    error: str | None = None
    user_error: bool = False
    output_logprobs: list[float] = field(default_factory=list)
    output_top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)
    arrival_time: float = field(default_factory=time.monotonic)
    first_token_time: float | None = None
    num_retractions: int = 0
    admitted: bool = False
    constraint: ConstraintState | None = None
    """Constrained decoding's state for this request (None when unconstrained)."""
    prompt_logprobs: np.ndarray | None = None
    """[prompt_len - prompt_logprob_start] float32, filled as prefill computes the positions."""
    num_emitted: int = 0
    """Output tokens already handed to ``on_output`` (a step may append several)."""
    speculation: DraftState | None = None
    """N-gram drafting state when the engine speculates for this request (engine/speculative.py)."""

    @property
    def prompt_len(self) -> int:
        return len(self.prompt_ids)

    @property
    def seq_len(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    def tokens_left(self, max_context_len: int) -> int:
        """Output tokens the request may still generate: what max_new_tokens and the context
        leave."""
        return min(self.params.max_new_tokens - len(self.output_ids), max_context_len - self.seq_len)

    @property
    def is_finished(self) -> bool:
        return self.status in (RequestStatus.FINISHED, RequestStatus.ABORTED)

    def all_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids
