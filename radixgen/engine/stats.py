"""Scheduler counters (read by /metrics and benchmarks) and the per-step JSON-lines event log."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from typing import IO


@dataclass
class StepRecord:
    """What one step did; filled by the scheduler, written to the event log when enabled."""

    kind: str = ""
    """prefill, decode, or mixed (a prefill step that also decodes the running requests)."""
    batch_size: int = 0
    decode_rows: int = 0
    new_tokens: int = 0
    cached_tokens: int = 0
    evicted_tokens: int = 0
    retracted: int = 0
    retracted_again: int = 0
    """Of those, requests retracted before (admitted again too soon: the admit/retract cycle)."""
    rollbacks: int = 0
    jump_forwards: int = 0
    schedule_s: float = 0.0
    forward_s: float = 0.0
    drafted_tokens: int = 0
    accepted_tokens: int = 0
    verified_drafts: int = 0
    """Rows whose draft the step verified."""
    dropped_rows: int = 0
    """Overlapped scheduling: rows computed for requests that had ended or changed course by the
    time the step landed (counted in new_tokens, not applied)."""


class StepLog:
    """The record of the step being planned and applied (planner and result processor both
    write to it)."""

    def __init__(self) -> None:
        self.current = StepRecord()

    def begin(self) -> None:
        self.current = StepRecord()


class SchedulerStats:
    def __init__(self, event_log: str | None = None) -> None:
        self.num_steps = 0
        self.num_prefill_steps = 0
        self.num_decode_steps = 0
        self.batch_size_sum = 0
        self.decode_batch_size_sum = 0
        self.prompt_tokens = 0
        self.cached_prompt_tokens = 0
        self.computed_tokens = 0
        self.generated_tokens = 0
        self.evicted_tokens = 0
        self.num_retractions = 0
        self.num_repeat_retractions = 0
        self.num_rollbacks = 0
        self.num_jump_forwards = 0
        self.drafted_tokens = 0
        """Tokens speculative decoding drafted (and verified in a decode step)."""
        self.accepted_tokens = 0
        """Drafted tokens that became output."""
        self.verified_drafts = 0
        """Drafts verified (a request's draft in one step): accepted_tokens / verified_drafts is
        what a verification gains."""
        self.num_shortened = 0
        """Constrained requests that budget steering closed early so they finished in budget."""
        self.num_constraint_refusals = 0
        """Constrained requests refused before generating (no grammar compiles, or the shortest
        output the constraint allows does not fit the budget)."""
        self.num_constraint_violations = 0
        """Requests that ended ``constraint_violation`` (validators kept rejecting)."""
        self.num_searched_values = 0
        """Rejected numbers replaced by a valid value found by search (``Validation.search_number``)."""
        self.schedule_time_s = 0.0
        self.forward_time_s = 0.0
        self.queue_depth = 0
        self.running = 0
        self.kv_used = 0
        self.cached_tokens = 0
        self._log: IO[str] | None = open(event_log, "a", buffering=1) if event_log else None  # noqa: SIM115

    @property
    def cache_hit_rate(self) -> float:
        """Share of admitted prompt tokens served from the prefix cache."""
        return self.cached_prompt_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    @property
    def avg_batch_size(self) -> float:
        return self.batch_size_sum / self.num_steps if self.num_steps else 0.0

    @property
    def avg_decode_batch_size(self) -> float:
        return self.decode_batch_size_sum / self.num_decode_steps if self.num_decode_steps else 0.0

    def record(self, step: StepRecord, *, queue_depth: int, running: int, kv_used: int, cached: int) -> None:
        self.num_steps += 1
        self.batch_size_sum += step.batch_size
        if step.kind != "decode":
            self.num_prefill_steps += 1
        if step.decode_rows:  # a mixed step counts as both
            self.num_decode_steps += 1
            self.decode_batch_size_sum += step.decode_rows
        self.computed_tokens += step.new_tokens
        self.evicted_tokens += step.evicted_tokens
        self.num_retractions += step.retracted
        self.num_repeat_retractions += step.retracted_again
        self.num_rollbacks += step.rollbacks
        self.num_jump_forwards += step.jump_forwards
        self.drafted_tokens += step.drafted_tokens
        self.accepted_tokens += step.accepted_tokens
        self.verified_drafts += step.verified_drafts
        self.schedule_time_s += step.schedule_s
        self.forward_time_s += step.forward_s
        self.queue_depth, self.running, self.kv_used, self.cached_tokens = queue_depth, running, kv_used, cached
        if self._log is not None:
            record = asdict(step) | {"step": self.num_steps, "queue_depth": queue_depth, "running": running,
                                     "kv_used": kv_used, "tree_tokens": cached}
            self._log.write(json.dumps(record) + "\n")

    def snapshot(self) -> dict[str, float]:
        keys = ("num_steps", "num_prefill_steps", "num_decode_steps", "prompt_tokens", "cached_prompt_tokens",
                "computed_tokens", "generated_tokens", "evicted_tokens", "num_retractions", "num_repeat_retractions",
                "num_rollbacks", "num_jump_forwards", "drafted_tokens", "accepted_tokens", "verified_drafts", "num_shortened",
                "num_constraint_refusals", "num_constraint_violations", "num_searched_values", "schedule_time_s",
                "forward_time_s", "queue_depth", "running", "kv_used", "cached_tokens")
        out: dict[str, float] = {k: getattr(self, k) for k in keys}
        out |= {"cache_hit_rate": self.cache_hit_rate, "avg_batch_size": self.avg_batch_size,
                "avg_decode_batch_size": self.avg_decode_batch_size}
        return out

    def close(self) -> None:
        if self._log is not None:
            self._log.close()
            self._log = None
