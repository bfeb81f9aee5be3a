"""One step of the engine loop: plan, forward, sample, apply — the pipeline the loop thread runs
between draining its inbox, apart from the engine's blocking / asyncio front (engine.py).

Two pipelines share the device half of a step (``StepPipeline.execute``: the forward, the
verifications, the sampling, one read-back):

- ``StepPipeline``: plan, execute, apply, in that order on the loop thread.
- ``OverlapPipeline`` (``EngineConfig.overlap``): the device half runs on a worker thread. As
  soon as step N's tokens are read back, step N+1 (the same decode batch one position on, fed
  those tokens) is planned and handed to the worker, and only then are step N's results applied
  (detokenising, stops, constraints, streaming) while N+1 computes. N+1's grammar masks need
  N's tokens accepted by the matchers, so its sampling waits for them: the loop thread fills
  them right after applying N and hands them over (``_MaskHandoff``); its forward does not
  wait. A row whose request did not continue as N+1 assumed (it ended, was aborted, rolled
  back or jumped forward while N+1 was in flight) is dropped when N+1 lands and its KV slot
  freed: what is applied is exactly what a step planned after N would have produced.
"""

from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np
import torch

from radixgen.engine.compute_threads import release_idle_team
from radixgen.engine.constrained import DEAD_END, ConstrainedDecoding, mask_logits
from radixgen.engine.model_runner import ModelRunner, split_prompt_scores
from radixgen.engine.plan import StepKind, StepPlan
from radixgen.engine.request import Request
from radixgen.engine.sampler import Sampler, SampleResult, SamplingBatchCache
from radixgen.engine.scheduler import Scheduler
from radixgen.engine.speculative import Verdict
from radixgen.engine.speculative import verify as verify_drafts

logger = logging.getLogger(__name__)


@dataclass
class StepOutcome:
    """What the device half of a step gives back."""

    result: SampleResult
    verdicts: dict[int, Verdict] | None
    forward_s: float


class _MaskHandoff:
    """A lookahead step's grammar masks, filled by the loop thread once the step before it is
    applied, waited for by the worker just before it samples."""

    def __init__(self) -> None:
        self._ready = threading.Event()
        self._mask: np.ndarray | None = None

    def give(self, mask: np.ndarray | None) -> None:
        self._mask = mask
        self._ready.set()

    def take(self) -> np.ndarray | None:
        self._ready.wait()
        return self._mask


class StepPipeline:
    def __init__(self, scheduler: Scheduler, runner: ModelRunner, sampler: Sampler, constraints: ConstrainedDecoding,
                 sampling_batches: SamplingBatchCache) -> None:
        self.scheduler = scheduler
        self.runner = runner
        self.sampler = sampler
        self.constraints = constraints
        self.sampling_batches = sampling_batches
        self._penalty_resets: list[tuple[int, list[int], list[int]]] = []
        """(row, prompt, output so far): penalty counts to rebuild before the next step runs."""
        self._resets_lock = threading.Lock()

    @property
    def in_flight(self) -> bool:
        """A step is running on the device whose results are not applied yet."""
        return False

    def run(self) -> None:
        """Plan a step, run it and hand out its results (loop thread only); nothing when idle."""
        started = time.perf_counter()
        plan = self.scheduler.schedule()
        if plan is None:
            return
        self._prepare(plan)
        try:
            outcome = self.execute(plan)
        except Exception as e:  # an internal fault fails this step's requests, not the engine
            logger.exception("step failed")
            self.scheduler.fail_step(plan, f"internal error: {type(e).__name__}: {e}")
            return
        self._apply(plan, outcome)
        # the whole step, planning and applying included: a drafted row costs host work there too
        # (its drafts walked through the automaton, its tokens appended one by one), and a draft
        # pays only if the loop, not the forward alone, runs faster for it
        self._observe_cost(plan, time.perf_counter() - started)

    def _observe_cost(self, plan: StepPlan, seconds: float) -> None:
        drafter = self.scheduler.planner.drafter
        if drafter.active:
            drafter.cost.observe(plan, seconds)

    def settle(self) -> None:
        """Apply the step in flight, if any, and plan none after it (the loop's state is then a
        step boundary: every KV slot free, in the tree or held by a request)."""

    def close(self) -> None:
        """Wait for the step in flight and give its slots back without applying it."""

    def release_compute_threads(self) -> None:
        """Hand back the OpenMP teams of the threads that ran this engine's steps, the engine
        being idle (compute_threads.py: an idle team slows every other team in the process)."""
        release_idle_team()

    def _prepare(self, plan: StepPlan) -> None:
        """Loop-thread work before a planned step runs: the grammar masks of a plain step are
        known now, and go up with its inputs."""
        if plan.masks_early:
            plan.bitmask = self.constraints.host_bitmask(plan)

    def execute(self, plan: StepPlan, late_mask: _MaskHandoff | None = None) -> StepOutcome:
        """The device half of a step: forward, verification, sampling, one read-back. With
        ``late_mask``, the step's grammar masks come from there after the forward."""
        start = time.perf_counter()
        self._reset_penalties()
        if plan.kind.has_prompt_rows:
            for i, req in enumerate(plan.requests[: plan.num_prefill]):
                # first chunk since admission: (re)build the penalty counts of its row
                if req.params.has_penalties and plan.prefix_lens[i] == req.prefix_len:
                    self.sampler.penalties.reset_row(req.pool_row, req.prompt_ids, req.output_ids)
        early_mask = plan.masks_early
        with torch.inference_mode():  # logits are inference tensors; sampling edits them in place
            # so are the sampler's parameters when the batch changed: one upload for the step
            staged = self.sampling_batches.stage(plan) if early_mask else None
            logits, sampling_uploaded, row_masks = self.runner.forward_with(plan, staged[0] if staged else [])
            if plan.prompt_scoring is not None:
                logits, scores = split_prompt_scores(plan, logits)
                _record_prompt_scores(plan, scores)
            verdicts = None
            if plan.kind is StepKind.SPECULATIVE:
                sampling = self.sampling_batches.get(plan)
                logits, verdicts = verify_drafts(plan, logits, sampling, self.sampler.penalties,
                                                 self.constraints.scratch_mask(), DEAD_END)
            else:
                if plan.verify_counts is not None:
                    logits = self.constraints.verify_forced(plan, logits)
                sampling = staged[1](sampling_uploaded) if staged else self.sampling_batches.get(plan)
            # the sampled rows' masks: handed over once the step before was applied (lookahead),
            # uploaded with the inputs, or read now that verification has moved the matchers
            masks: np.ndarray | torch.Tensor | None
            if late_mask is not None:
                masks = late_mask.take()
            else:
                masks = row_masks if early_mask else self.constraints.host_bitmask(plan)
            if masks is not None:
                mask_logits(logits[: plan.batch_size], masks)
            result = self.sampler(logits, sampling)
        return StepOutcome(result, verdicts, time.perf_counter() - start)

    def _apply(self, plan: StepPlan, outcome: StepOutcome) -> None:
        self.scheduler.process_results(plan, outcome.result, forward_s=outcome.forward_s, verdicts=outcome.verdicts)
        replaced = self.scheduler.appender.replaced_samples
        for req in replaced:  # their sampled token was not the one kept: recount from the output
            self._queue_penalty_reset(req)
        replaced.clear()

    def _queue_penalty_reset(self, req: Request) -> None:
        if req.params.has_penalties and req.pool_row >= 0:
            with self._resets_lock:
                self._penalty_resets.append((req.pool_row, list(req.prompt_ids), list(req.output_ids)))

    def _reset_penalties(self) -> None:
        """Rebuild the queued rows' penalty counts: on the thread that runs the steps, after the
        step that last counted into them."""
        with self._resets_lock:
            resets, self._penalty_resets = self._penalty_resets, []
        for row, prompt_ids, output_ids in resets:
            self.sampler.penalties.reset_row(row, prompt_ids, output_ids)


@dataclass
class _InFlight:
    plan: StepPlan
    outcome: Future[StepOutcome]
    mask: _MaskHandoff | None


class OverlapPipeline(StepPipeline):
    """The device half of each step on a worker thread, the next decode step planned and
    started before this one's results are applied (module docstring)."""

    def __init__(self, scheduler: Scheduler, runner: ModelRunner, sampler: Sampler, constraints: ConstrainedDecoding,
                 sampling_batches: SamplingBatchCache) -> None:
        super().__init__(scheduler, runner, sampler, constraints, sampling_batches)
        self._worker = ThreadPoolExecutor(1, thread_name_prefix="radixgen-device", initializer=self._on_worker_start)
        self._pending: _InFlight | None = None
        self.num_lookahead_steps = 0
        """Steps started before the step before them was applied."""
        self.num_dropped_rows = 0
        """Rows of those whose request had not continued as assumed (computed, not applied)."""

    @property
    def in_flight(self) -> bool:
        return self._pending is not None

    def _on_worker_start(self) -> None:
        if self.runner.device.type == "cuda":  # the current device is per thread
            torch.cuda.set_device(self.runner.device)

    def run(self, lookahead: bool = True) -> None:
        if self._pending is None:
            plan = self.scheduler.schedule()
            if plan is None:
                return
            self._prepare(plan)
            self._pending = _InFlight(plan, self._worker.submit(self.execute, plan), None)
        current, self._pending = self._pending, None
        plan = current.plan
        try:
            outcome = current.outcome.result()
        except Exception as e:  # an internal fault fails this step's requests, not the engine
            logger.exception("step failed")
            keep = self._landed(plan)
            self.scheduler.fail_step(plan if keep is None else plan.decode_rows(keep),
                                     f"internal error: {type(e).__name__}: {e}")
            return
        nxt = None
        if lookahead and outcome.verdicts is None:
            nxt = self.scheduler.lookahead(plan, outcome.result)
        if nxt is not None:
            handoff = _MaskHandoff()
            self._pending = _InFlight(nxt, self._worker.submit(self.execute, nxt, handoff), handoff)
            self.num_lookahead_steps += 1
        try:
            keep = self._landed(plan)
            if keep is None:
                self._apply(plan, outcome)
                # planning and applying overlap other steps here: the step's own device half
                drafting_s = self.scheduler.planner.drafter.last_draft_s if plan.kind is StepKind.SPECULATIVE else 0.0
                self._observe_cost(plan, outcome.forward_s + drafting_s)
            elif keep.any():
                self._apply(plan.decode_rows(keep), StepOutcome(outcome.result.rows(keep), None, outcome.forward_s))
        finally:
            if nxt is not None:
                # the inputs of the step after this one were fixed when it was planned, above
                self.scheduler.planner.decode_batch.next_inputs = None
                self._fill_late_mask(nxt)

    def _landed(self, plan: StepPlan) -> np.ndarray | None:
        """A lookahead plan's rows to apply ([B] bool; the others' slots freed), None for any
        other plan (all of them)."""
        if not plan.lookahead:
            return None
        keep = self.scheduler.landed_rows(plan)
        if not keep.all():
            self.num_dropped_rows += int((~keep).sum())
            if plan.record is not None:
                plan.record.dropped_rows = int((~keep).sum())
            for req, kept in zip(plan.requests, keep.tolist(), strict=True):
                if not kept:  # the dropped step counted its sample into the row
                    self._queue_penalty_reset(req)
        self.scheduler.drop_rows(plan, keep)  # with rows dropped, the batch's cached parts go too
        return keep

    def _fill_late_mask(self, plan: StepPlan) -> None:
        """The lookahead step's masks, from the matchers as applying the step before left them.
        The host buffer they are filled in is next written after the worker has used them."""
        assert self._pending is not None and self._pending.mask is not None
        mask = None
        try:
            if self.scheduler.kv.row_params.constrained[plan.rows].any():
                mask = self.constraints.host_bitmask(plan, self.scheduler.landed_rows(plan))
        finally:  # the worker waits for it, whatever happened here
            self._pending.mask.give(mask)

    def settle(self) -> None:
        if self._pending is not None:
            self.run(lookahead=False)

    def release_compute_threads(self) -> None:
        super().release_compute_threads()  # the loop thread's, from loading the model
        self._worker.submit(release_idle_team).result()

    def close(self) -> None:
        pending, self._pending = self._pending, None
        if pending is not None:
            if pending.mask is not None:
                pending.mask.give(None)
            try:
                pending.outcome.result()
            except Exception:  # noqa: BLE001 - it is being discarded either way
                logger.debug("the step in flight at shutdown failed", exc_info=True)
            self.scheduler.drop_rows(pending.plan, np.zeros(pending.plan.batch_size, dtype=bool))
        self._worker.shutdown(wait=True)


def _record_prompt_scores(plan: StepPlan, scores: np.ndarray) -> None:
    scoring = plan.prompt_scoring
    assert scoring is not None
    for i in np.unique(scoring.owners).tolist():
        mine = scoring.owners == i
        store = plan.requests[i].prompt_logprobs
        assert store is not None
        store[scoring.offsets[mine]] = scores[mine]
