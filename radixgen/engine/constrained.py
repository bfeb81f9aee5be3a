"""The engine's side of constrained decoding: compiling specs, giving requests their matcher
and validators, the step's bitmask, and checking jump-forward's forced tokens."""

from __future__ import annotations

import json
import logging
import threading
from collections import OrderedDict
from typing import Any

import numpy as np
import torch

from radixgen.config import EngineConfig
from radixgen.constraints import (
    Grammar,
    GrammarOptions,
    GrammarService,
    allocate_bitmask,
    make_backend,
)
from radixgen.constraints.backend import Matcher
from radixgen.constraints.budget import Completer, Completion, RegexCompletions, pattern_examples
from radixgen.constraints.call_validation import StructuralValidation
from radixgen.constraints.events import SchemaValidators, Validation
from radixgen.constraints.mask import ALL_ALLOWED, ban_tokens
from radixgen.constraints.spec import ConstraintSpec
from radixgen.constraints.state import ConstraintState, ForcedMismatch
from radixgen.constraints.structural import structural_parts, structure_of
from radixgen.engine.plan import StepPlan
from radixgen.engine.request import Request
from radixgen.engine.sampler import logprob_parts
from radixgen.engine.steering import BudgetSteering
from radixgen.errors import InvalidParamsError
from radixgen.kernels.ops import apply_bitmask
from radixgen.staging import ReadBack, upload

logger = logging.getLogger(__name__)

_SHORTEST_CACHE_SIZE = 1024
DEAD_END = ("the constraint reached a state that no token of this model can continue (it may need "
             "characters the tokenizer cannot produce): simplify the constraint")


ShortestOutput = tuple[Completion | None, RegexCompletions | None, tuple[str, ...]]
"""A constraint's shortest output, a regex's completion table, a schema's pattern examples."""


class ConstrainedDecoding:
    def __init__(self, config: EngineConfig, tokenizer: Any, vocab_size: int, stop_token_ids: list[int]) -> None:
        self.config, self.tokenizer, self.vocab_size = config, tokenizer, vocab_size
        self.stop_token_ids = stop_token_ids
        self._service: GrammarService | None = None
        self._lock = threading.Lock()
        self._bitmask = allocate_bitmask(config.max_running_requests, vocab_size)
        self._schema_validators: dict[str, SchemaValidators] = {}
        self.steering: BudgetSteering | None = None
        if config.budget_steering and tokenizer is not None:
            self.steering = BudgetSteering(Completer(tokenizer, vocab_size), tokenizer,
                                           margin_tokens=config.budget_margin_tokens)
        self._shortest: OrderedDict[tuple[str, str], ShortestOutput] = OrderedDict()

    def grammars(self) -> GrammarService:
        """The compiler service, created on first use (building the tokenizer index costs ~1 s)."""
        with self._lock:
            if self._service is None:
                backend = make_backend(self.config.grammar_backend, self.tokenizer, self.vocab_size, self.stop_token_ids,
                                       options=GrammarOptions(self.config.json_open_objects,
                                                               self.config.json_max_recursion_depth))
                self._service = GrammarService(backend, timeout_s=self.config.grammar_compile_timeout_s)
            return self._service

    def attach(self, req: Request, grammar: Grammar, max_context_len: int) -> None:
        """Give a request whose grammar is ready its matcher, validators and budget (loop
        thread). Raises ``InvalidParamsError`` when the shortest output the constraint allows
        does not fit the request's budget: better refused now than cut off at the end."""
        state = ConstraintState(grammar.matcher(), warnings=list(grammar.not_enforced) or None,
                                backend=grammar.compiled_by)
        spec = req.params.constraint
        assert spec is not None
        if self.steering is not None:
            shortest, dfa, strings = self._shortest_output(spec, state.matcher)
            budget = req.tokens_left(max_context_len)
            if shortest is not None and shortest.cost > budget:
                raise InvalidParamsError(
                    f"the shortest output the {spec.kind.replace('_', ' ')} allows is {shortest.cost} tokens "
                    f"({shortest.text[:80]!r}), but this request may generate only {budget}: raise max_tokens "
                    f"(max_new_tokens) to at least {shortest.cost}")
            if shortest is not None:
                self.steering.start(state, spec, shortest, dfa, strings)
        state.validation = self._validation(req, grammar)
        req.constraint = state

    def _shortest_output(self, spec: ConstraintSpec, matcher: Matcher
                         ) -> ShortestOutput:
        """The shortest output of ``spec``; for a regex or choices, its completion table; for a
        schema, the shortest match of each of its patterns for completions to write (cached)."""
        assert self.steering is not None
        cached = self._shortest.get(spec.key)
        if cached is not None:
            self._shortest.move_to_end(spec.key)
            return cached
        dfa = None
        if spec.kind in ("regex", "choices"):
            try:
                dfa = RegexCompletions(spec.pattern())
            except Exception:  # noqa: BLE001 - interegular cannot read it: walk the matcher instead
                logger.debug("no DFA for %s; budget completions walk the matcher", spec.kind)
        strings = pattern_examples(spec.schema()) if spec.kind == "json_schema" else ()
        cached = self._shortest[spec.key] = (self.steering.shortest(matcher, dfa, strings), dfa, strings)
        if len(self._shortest) > _SHORTEST_CACHE_SIZE:
            self._shortest.popitem(last=False)
        return cached

    def _validation(self, req: Request, grammar: Grammar) -> Validation | StructuralValidation | None:
        params, spec = req.params, req.params.constraint
        if spec is not None and spec.kind == "structural":
            structure = structure_of(spec)
            checked = {name: self._validators_for(schema) for name, schema in structural_parts(structure)
                       if name not in grammar.parts_enforced_exactly}
            return StructuralValidation(structure, checked, self.config.json_repeated_items) if checked else None
        model = params.json_schema if isinstance(params.json_schema, type) and hasattr(
            params.json_schema, "model_validate") else None
        schema = None
        # an automaton that enforces the whole schema leaves its validators nothing to reject
        if spec is not None and spec.kind == "json_schema" and not grammar.enforces_schema_exactly:
            schema = self._validators_for(spec.schema())
        repeats = self.config.json_repeated_items
        is_json = spec is not None and spec.kind in ("json_schema", "json_object")
        if schema is None and model is None and not params.validators and not (repeats == "all" and is_json):
            return None  # nothing can roll text back: the output streams as it grows
        return Validation(schema=schema, model=model, user=params.validators, repeated_items=repeats)

    def _validators_for(self, schema: Any) -> SchemaValidators:
        key = json.dumps(schema, sort_keys=True)
        validators = self._schema_validators.get(key)
        if validators is None:
            validators = self._schema_validators[key] = SchemaValidators(schema)
        return validators

    def host_bitmask(self, plan: StepPlan, live: np.ndarray | None = None) -> np.ndarray | None:
        """Allowed-token rows for this step's constrained requests that sample (None if none),
        on the host [B, vocab / 32] int32 (a buffer reused by the next step); ``live`` [B]
        bool: only those rows (the others allow everything)."""
        rows = [i for i, r in enumerate(plan.requests)
                if r.constraint is not None and (plan.sample_mask is None or plan.sample_mask[i])
                and (live is None or live[i])]
        if not rows:
            return None
        mask = self._bitmask[: plan.batch_size]
        mask.fill(ALL_ALLOWED)
        by_backend: dict[type[Matcher], tuple[list[Matcher], list[int]]] = {}
        for i in rows:
            state = plan.requests[i].constraint
            assert state is not None
            matcher = state.matcher
            group = by_backend.setdefault(type(matcher), ([], []))
            group[0].append(matcher)
            group[1].append(i)
        for kind, (matchers, indices) in by_backend.items():
            kind.fill_bitmasks(matchers, mask, indices)
        for i in rows:
            req = plan.requests[i]
            state = req.constraint
            assert state is not None
            banned = state.bans.get(len(req.output_ids))
            if banned:
                ban_tokens(mask[i], banned)
            if not mask[i].any():  # nothing may follow: whatever is sampled will be rejected
                failure = state.matcher.error()
                state.mark_dead_end(
                    "the validators rejected every token that could continue the output here" if banned else
                    automaton_failed(failure) if failure else DEAD_END)
        return mask

    def scratch_mask(self) -> np.ndarray:
        """A one-row host bitmask buffer (speculative verification fills it position by position)."""
        return self._bitmask[:1]

    def verify_forced(self, plan: StepPlan, logits: torch.Tensor) -> torch.Tensor:
        """Check jump-forward's forced tokens against the model's greedy choice under the mask,
        position by position; at the first difference, record the model's token instead (the
        scheduler drops the rest). Returns the logits of the last positions only.

        The masks of every verified position are filled on the host first (each matcher walked
        back over its forced tokens and forward again), applied on the device, and the choices
        with their log-probabilities come back in one read."""
        assert plan.verify_counts is not None
        batch = plan.batch_size
        counts = plan.verify_counts.tolist()
        total = sum(counts)
        masks = np.full((total, self._bitmask.shape[1]), ALL_ALLOWED, dtype=self._bitmask.dtype)
        row = 0
        for i, m in enumerate(counts):
            if not m:
                continue
            req = plan.requests[i]
            state = req.constraint
            assert state is not None
            matcher = state.matcher
            forced = req.output_ids[len(req.output_ids) - m :]
            matcher.rollback(m)
            walked, takes, _ = walk_masks(state, forced, masks.shape[1], len(req.output_ids) - m)
            again = matcher.accept_all(forced)  # back to the state after them
            assert takes == [True] * m and again, "a forced token the matcher had accepted was refused"
            masks[row : row + m] = walked[:m]
            row += m
        positions = logits[batch : batch + total]
        choices = mask_logits(positions.clone(), masks).argmax(dim=-1)
        top = max((plan.requests[i].params.top_logprobs for i, m in enumerate(counts) if m), default=0)
        host = ReadBack([choices, *logprob_parts(positions, choices, top)]).wait()
        choice_ids, chosen_lp, top_ids, top_lp = host
        assert choice_ids is not None and chosen_lp is not None
        row = 0
        for i, m in enumerate(counts):
            if not m:
                continue
            req = plan.requests[i]
            forced = req.output_ids[len(req.output_ids) - m :]
            for j, tok in enumerate(forced):
                choice = int(choice_ids[row + j])
                if choice != tok:
                    state = req.constraint
                    assert state is not None
                    state.matcher.rollback(m - j)  # back to the state before the first token that differs
                    n = req.params.top_logprobs
                    pairs = ([] if not n or top_ids is None or top_lp is None else
                             list(zip(top_ids[row + j, :n].tolist(), top_lp[row + j, :n].tolist(), strict=True)))
                    state.record_mismatch(ForcedMismatch(len(req.output_ids) - m + j, choice,
                                                         float(chosen_lp[row + j]), pairs))
                    break
            row += m
        return logits[:batch]

    def shutdown(self) -> None:
        if self._service is not None:
            self._service.shutdown()


def automaton_failed(failure: str) -> str:
    """What a request is told when its constraint's parser fails (``Matcher.error()``)."""
    return f"the constraint's automaton failed: {failure}; simplify the constraint"


def mask_logits(logits: torch.Tensor, masks: np.ndarray | torch.Tensor) -> torch.Tensor:
    """Where grammar masks act on logits, for every kind of step: the tokens row j of ``masks``
    [rows, vocab / 32] bans get -inf in row j of ``logits``, in place (a host mask goes up
    first). The step masks its sampled rows before penalties and bias, which keep -inf as it
    is, and outside any CUDA graph (graph_runner.py says why); verification masks a copy of the
    positions it checks. Returns ``logits``."""
    device_masks = masks if isinstance(masks, torch.Tensor) else upload([masks], logits.device)[0]
    apply_bitmask(logits, device_masks)
    return logits


def forced_token_ids(tokenizer: Any, forced: str) -> list[int]:
    """The tokens of a constraint's forced text, the last one left for the model: it may merge
    with what follows ('"' + 'John' -> '"John')."""
    return list(tokenizer.encode(forced, add_special_tokens=False))[:-1]


def walk_masks(state: ConstraintState, tokens: list[int], width: int, first_position: int
               ) -> tuple[np.ndarray, list[bool], int | None]:
    """The row's masks before each of ``tokens`` and after the last: mask j is the automaton's
    after taking tokens[:j], with the validators' bans at output position ``first_position + j``.
    The walk stops after a token the automaton refuses, or before a position that allows nothing;
    the automaton is left as it was. Returns (the masks filled, whether each token walked was
    taken, the first position that allows nothing or None). Speculative drafts and jump-forward's
    forced tokens are both verified over these masks."""
    matcher = state.matcher
    masks = np.full((len(tokens) + 1, width), ALL_ALLOWED, dtype=np.int32)
    takes: list[bool] = []
    dead_at = None
    filled = walked = 0
    for j in range(len(tokens) + 1):
        matcher.fill_bitmask(masks, j)
        banned = state.bans.get(first_position + j)
        if banned:
            ban_tokens(masks[j], banned)
        if not masks[j].any():
            dead_at = j
            break
        filled = j + 1
        if j == len(tokens):
            break
        took = bool(matcher.accept(tokens[j]))
        takes.append(took)
        if not took:
            break
        walked += 1
    if walked:
        matcher.rollback(walked)
    return masks[:filled], takes, dead_at
