"""A request in the engine: where it stands (status, KV, output so far) and each feature's state for it."""

from __future__ import annotations

import enum
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from radixgen.constraints.backend import Matcher
from radixgen.constraints.budget import BudgetState
from radixgen.constraints.call_validation import StructuralValidation
from radixgen.constraints.events import Validation
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
    deltas: StepDeltas | None = None
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
    matcher: Matcher | None = None
    """The constraint automaton's state for this request (None when unconstrained)."""
    validation: Validation | StructuralValidation | None = None
    """Validators over the JSON output (None when there are none)."""
    token_text_ends: list[int] = field(default_factory=list)
    """Output text length after each output token (maps a rejected value's start to a token)."""
    bans: dict[int, set[int]] = field(default_factory=dict)
    """Output position -> tokens a validator rejected there (masked out when resampling)."""
    pending_extend: bool = False
    """Jump-forward appended forced tokens: compute them in the next prefill (extend) step."""
    forced_pending: int = 0
    """Forced tokens at the end of the output not yet checked against the model's greedy choice."""
    forced_mismatch: tuple[int, int, tuple[float, list[tuple[int, float]]]] | None = None
    """(forced tokens to keep, the model's token instead of the next one, its log-probability and
    top log-probabilities) found by verification."""
    pending_rollback: tuple[int, int, str] | None = None
    """(output tokens to keep, position whose token to ban, why) set by a validator rejection."""
    replacement_text: str | None = None
    """Written in place of the rolled-back value: a valid value the validators' search found
    (``Validation.search_number``), from the kept tokens' end."""
    constraint_warnings: list[str] | None = None
    """What the compiled grammar leaves to the validators (``Grammar.not_enforced``)."""
    num_rollbacks: int = 0
    dead_end: str | None = None
    """Why the constraint (with the validators' bans) allowed no token at this step, if it did not."""
    prompt_logprobs: np.ndarray | None = None
    """[prompt_len - prompt_logprob_start] float32, filled as prefill computes the positions."""
    budget: BudgetState | None = None
    """Budget steering's state for a constrained request (engine/steering.py)."""
    num_emitted: int = 0
    """Output tokens already handed to ``on_output`` (a step may append several)."""
    speculation: DraftState | None = None
    """N-gram drafting state when the engine speculates for this request (engine/speculative.py)."""
    sample_override: tuple[float, list[tuple[int, float]]] | None = None
    """Log-probability and top log-probabilities of a token that replaced this step's sample (the
    model's own choice found by jump-forward verification), recorded instead of the sample's."""

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
