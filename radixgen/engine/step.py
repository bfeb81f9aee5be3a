"""One step of the engine loop: plan, forward, sample, apply — the pipeline the loop thread runs
between draining its inbox, apart from the engine's blocking / asyncio front (engine.py)."""

from __future__ import annotations

import logging
import time

import numpy as np
import torch

from radixgen.engine.batch import StepKind, StepPlan
from radixgen.engine.constrained import ConstrainedDecoding
from radixgen.engine.model_runner import ModelRunner, split_prompt_scores
from radixgen.engine.sampler import Sampler, SamplingBatchCache
from radixgen.engine.scheduler import Scheduler

logger = logging.getLogger(__name__)


class StepPipeline:
    def __init__(self, scheduler: Scheduler, runner: ModelRunner, sampler: Sampler, constraints: ConstrainedDecoding,
                 sampling_batches: SamplingBatchCache) -> None:
        self.scheduler = scheduler
        self.runner = runner
        self.sampler = sampler
        self.constraints = constraints
        self.sampling_batches = sampling_batches

    def run(self) -> None:
        """Plan a step, run it and hand out its results (loop thread only); nothing when idle."""
        plan = self.scheduler.schedule()
        if plan is None:
            return
        start = time.perf_counter()
        try:
            if plan.kind is StepKind.PREFILL:
                for i, req in enumerate(plan.requests[: plan.num_prefill]):
                    # first chunk since admission: (re)build the penalty counts of its row
                    if req.params.has_penalties and plan.prefix_lens[i] == req.prefix_len:
                        self.sampler.penalties.reset_row(req.pool_row, req.prompt_ids, req.output_ids)
            # the grammar masks of a plain step are known before its forward: they go up with its inputs
            early_mask = plan.draft_lens is None and plan.verify_counts is None
            if early_mask:
                plan.bitmask = self.constraints.host_bitmask(plan)
            with torch.inference_mode():  # logits are inference tensors; sampling edits them in place
                # so are the sampler's parameters when the batch changed: one upload for the step
                staged = self.sampling_batches.stage(plan) if early_mask else None
                logits, sampling_uploaded = self.runner.forward_with(plan, staged[0] if staged else [])
                if plan.prompt_scoring is not None:
                    logits, scores = split_prompt_scores(plan, logits)
                    _record_prompt_scores(plan, scores)
                verdicts = None
                if plan.draft_lens is not None:
                    sampling = self.sampling_batches.get(plan)
                    logits, verdicts = self.constraints.verify_drafts(plan, logits, sampling, self.sampler.penalties)
                else:
                    if plan.verify_counts is not None:
                        logits = self.constraints.verify_forced(plan, logits)
                    sampling = staged[1](sampling_uploaded) if staged else self.sampling_batches.get(plan)
                result = self.sampler(logits, sampling, None if early_mask else self.constraints.bitmask(plan))
        except Exception as e:  # an internal fault fails this step's requests, not the engine
            logger.exception("step failed")
            self.scheduler.fail_step(plan, f"internal error: {type(e).__name__}: {e}")
            return
        self.scheduler.process_results(plan, result, forward_s=time.perf_counter() - start, verdicts=verdicts)
        replaced = self.scheduler.outputs.replaced_samples
        for req in replaced:  # their sampled token was not the one kept: recount from the output
            if req.params.has_penalties and req.pool_row >= 0:
                self.sampler.penalties.reset_row(req.pool_row, req.prompt_ids, req.output_ids)
        replaced.clear()


def _record_prompt_scores(plan: StepPlan, scores: np.ndarray) -> None:
    scoring = plan.prompt_scoring
    assert scoring is not None
    for i in np.unique(scoring.owners).tolist():
        mine = scoring.owners == i
        store = plan.requests[i].prompt_logprobs
        assert store is not None
        store[scoring.offsets[mine]] = scores[mine]
