"""``grammar_backend="auto"``: each constraint goes to the backend measured best for it.

Measured here on the SmolLM2 tokenizer (benchmarks/bench_constraints.py): xgrammar fills a mask
in 12 us p50 / 30 us p95 per token, llguidance in 31 / 148 us, so xgrammar takes what it compiles
faithfully: regexes, choices and the JSON Schema subset real APIs use (typed objects, arrays,
scalars, anyOf/oneOf, local $ref), and tool calls inside text (faster per token in text and in calls alike:
benchmarks/bench_structural.py). Outside that subset xgrammar rejects valid instances (a
schema without "type" becomes an object, object-valued enums, unevaluatedProperties,
patternProperties, false subschemas), so those schemas go to llguidance, which follows JSON
Schema closely: JSON-Schema-Test-Suite 1,182 right with xgrammar alone, 1,230 with llguidance
alone, more with both. Tool calls go the same way: when any tool's schema (or the answer's) is
outside the subset, the whole structure goes to llguidance. So does a root string whose patterns
combine under not / oneOf (llguidance takes it as one lexeme: constraints/string_lark.py; one
too large for its lexer is refused, not handed to xgrammar, which would ignore the not), and so
is a schema with a string's length bounded beside its pattern that llguidance cannot compile
(xgrammar drops such lengths: a 10,000-character minimum came back as "m1"), and so is an allOf
over two recursive definitions that llguidance cannot compile (xgrammar does not intersect them).
A backend that refuses a constraint otherwise hands it to the other.
"""

from __future__ import annotations

import json
import logging

from radixgen.constraints.backend import Grammar, GrammarBackend
from radixgen.constraints.drafts import as_2020_12
from radixgen.constraints.refusals import intersected_recursions
from radixgen.constraints.schema_rewrite import pinned_literals
from radixgen.constraints.spec import ConstraintSpec
from radixgen.constraints.string_lark import root_string_lark
from radixgen.constraints.structural import structural_parts, structure_of
from radixgen.constraints.xgrammar_subset import (
    length_beside_pattern,
    within_xgrammar_subset,
    without_lengths_beside_patterns,
)
from radixgen.errors import InvalidConstraintError, UnenforceableConstraintError

logger = logging.getLogger(__name__)


class AutoBackend(GrammarBackend):
    name = "auto"

    def __init__(self, backends: list[GrammarBackend]) -> None:
        first = backends[0]
        super().__init__(first.tokenizer, first.vocab_size, first.stop_token_ids, options=first.options)
        self.backends = {b.name: b for b in backends}

    def choose(self, spec: ConstraintSpec) -> list[GrammarBackend]:
        """The backends to try for ``spec``, best first."""
        order = ["xgrammar", "llguidance"]
        schemas = ([spec.schema()] if spec.kind == "json_schema" else
                   [schema for _, schema in structural_parts(structure_of(spec))] if spec.kind == "structural" else [])
        # a root pinned to scalar literals: xgrammar writes each as JSON spells it (llguidance
        # wrote 1e+308 as a 309-digit integer), whatever else the schema says beside them
        literal_root = spec.kind == "json_schema" and _pinned_to_scalars(spec.schema())
        if not literal_root and (not all(within_xgrammar_subset(as_2020_12(schema)) for schema in schemas) or (
                spec.kind == "json_schema" and root_string_lark(spec.schema()) is not None)):
            order.reverse()
        return [self.backends[name] for name in order if name in self.backends]

    def compile(self, spec: ConstraintSpec) -> Grammar:
        first_error: InvalidConstraintError | None = None
        for backend in self.choose(spec):
            try:
                return backend.compile(spec)
            except UnenforceableConstraintError:
                raise  # the next backend would ignore what this one could not enforce
            except InvalidConstraintError as e:
                where = self._length_it_cannot_combine(backend, spec)
                if where is not None:
                    raise UnenforceableConstraintError(
                        f"{e}; {where} bounds a string's length beside its pattern, which the other backend "
                        "ignores: write the length into the pattern (a {m,n} repeat) or drop minLength / "
                        "maxLength") from e
                intersection = self._recursions_it_cannot_intersect(backend, spec)
                if intersection is not None:
                    where, refs = intersection
                    raise UnenforceableConstraintError(
                        f"{e}; {where}.allOf intersects the recursive definitions {refs[0]} and {refs[1]}, which "
                        f"llguidance unrolls {backend.options.max_recursion_depth} levels deep and the other "
                        "backend does not intersect, so no answer could be checked while it is written: merge "
                        "them into one definition, or drop the allOf") from e
                logger.debug("%s refused a %s: %s", backend.name, spec.kind, e)
                first_error = first_error or e
        assert first_error is not None
        raise first_error

    @staticmethod
    def _recursions_it_cannot_intersect(backend: GrammarBackend, spec: ConstraintSpec) -> tuple[str, list[str]] | None:
        """Where ``spec``'s schema intersects recursive definitions under allOf, when llguidance
        could not compile it: xgrammar, next, would let through anything the intersection forbids
        (a puzzle that asks for a nesting depth divisible by 2, 3 and 5 came back as ``{"allOf": []}``)."""
        if backend.name != "llguidance" or spec.kind != "json_schema":
            return None
        return intersected_recursions(as_2020_12(spec.schema()))

    @staticmethod
    def _length_it_cannot_combine(backend: GrammarBackend, spec: ConstraintSpec) -> str | None:
        """Where ``spec``'s schema bounds a string's length beside a pattern, when that is what
        ``backend`` (llguidance) could not compile: it compiles the schema without those lengths."""
        if backend.name != "llguidance" or spec.kind != "json_schema":
            return None
        schema = as_2020_12(spec.schema())
        where = length_beside_pattern(schema)
        if where is None:
            return None
        try:
            backend.compile(ConstraintSpec("json_schema", json.dumps(without_lengths_beside_patterns(schema))))
        except InvalidConstraintError:
            return None  # something else stops it too: handed on as before
        return where


def _pinned_to_scalars(schema: object) -> bool:
    pinned = pinned_literals(schema)
    return pinned is not schema and isinstance(pinned, dict) and not any(
        isinstance(value, (dict, list)) for value in pinned["enum"])
