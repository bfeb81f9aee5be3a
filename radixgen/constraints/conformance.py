"""Score a grammar backend plus our validator layer on JSON-Schema-Test-Suite files.

An instance counts as accepted when the automaton accepts its text (serialized in our style:
", " and ": " separators, object keys in the schema's property order, integral numbers without
a fraction) followed by the stop
token, and no validator that can steer generation (rollback and resample) rejects it.
"""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from radixgen.constraints.compile import GrammarService
from radixgen.constraints.events import SchemaValidators, Validation, resolve_subschema
from radixgen.constraints.refs import deref
from radixgen.constraints.spec import schema_spec
from radixgen.errors import InvalidConstraintError


@dataclass
class SuiteScore:
    counts: Counter[str] = field(default_factory=Counter)
    per_file: dict[str, Counter[str]] = field(default_factory=dict)
    unsupported: dict[str, list[str]] = field(default_factory=dict)  # file -> reasons

    @property
    def total(self) -> int:
        return sum(self.counts.values())

    @property
    def right(self) -> int:
        return self.counts["valid_accepted"] + self.counts["invalid_rejected"]

    @property
    def invalid_accepted(self) -> int:
        return self.counts["invalid_accepted"]


def serialize(value: Any, schema: Any, root: dict[str, Any], path: tuple[Any, ...] = ()) -> str:
    if isinstance(value, dict):
        sub = resolve_subschema(root, path) if isinstance(root, dict) else None
        order = _property_order(root, sub) if isinstance(sub, dict) else []
        keys = sorted(value, key=lambda k: order.index(k) if k in order else len(order))
        items = [json.dumps(k, ensure_ascii=False) + ": " + serialize(value[k], schema, root, path + (k,)) for k in keys]
        return "{" + ", ".join(items) + "}"
    if isinstance(value, list):
        return "[" + ", ".join(serialize(v, schema, root, path + (i,)) for i, v in enumerate(value)) + "]"
    if isinstance(value, float) and value.is_integer() and abs(value) <= 2**53:
        # one text per number: 1.0 and 1 are the same JSON Schema value, written the way we generate it
        return str(int(value))
    return json.dumps(value, ensure_ascii=False)


def _property_order(root: dict[str, Any], node: dict[str, Any], depth: int = 0) -> list[str]:
    """The order a grammar generates an object's properties in: its own, then those its allOf
    branches and local $ref add (llguidance merges them in that order)."""
    order = list(node.get("properties") or {})
    if depth > 8:
        return order
    parts = [b for b in node.get("allOf", []) if isinstance(b, dict)]
    target = deref(root, {"$ref": node["$ref"]}) if isinstance(node.get("$ref"), str) else None
    if isinstance(target, dict):
        parts.insert(0, target)
    for part in parts:
        order += [name for name in _property_order(root, part, depth + 1) if name not in order]
    return order


DRAFT_URIS = {
    "draft4": "http://json-schema.org/draft-04/schema#",
    "draft7": "http://json-schema.org/draft-07/schema#",
    "draft2020-12": "https://json-schema.org/draft/2020-12/schema",
}


def score_suite(files: list[Path], service: GrammarService, tokenizer: Any, stop_token_id: int, *,
                draft: str = "draft2020-12") -> SuiteScore:
    """``draft`` names the suite folder the files come from: its schemas are read as that draft
    (the suite leaves ``$schema`` out; a real schema names it)."""
    return score_cases([(path.name, json.loads(path.read_text())) for path in files], service, tokenizer,
                       stop_token_id, draft=draft)


def score_cases(named_cases: list[tuple[str, list[dict[str, Any]]]], service: GrammarService, tokenizer: Any,
                stop_token_id: int, *, draft: str = "draft2020-12") -> SuiteScore:
    """``score_suite`` over cases already read: (a name to report them under, its cases), each
    case ``{"description", "schema", "tests": [{"data", "valid"}]}``."""
    score = SuiteScore()
    for name, cases in named_cases:
        counts: Counter[str] = Counter()
        for case in cases:
            schema = case["schema"]
            if isinstance(schema, dict) and "$schema" not in schema and draft != "draft2020-12":
                schema = {"$schema": DRAFT_URIS[draft], **schema}
            try:
                spec = schema_spec(schema)
                grammar = service.compile(spec)
                validators = SchemaValidators(spec.schema())
            except (InvalidConstraintError, RuntimeError, ValueError) as e:
                score.unsupported.setdefault(name, []).append(f"{case.get('description', name)}: {e}")
                for t in case["tests"]:
                    counts["valid_rejected" if t["valid"] else "invalid_rejected"] += 1
                continue
            for t in case["tests"]:
                text = serialize(t["data"], schema, schema if isinstance(schema, dict) else {})
                matcher = grammar.matcher()
                ids = tokenizer.encode(text, add_special_tokens=False)
                accepted = all(matcher.accept(i) for i in ids) and matcher.accept(stop_token_id)
                if accepted and not grammar.enforces_schema_exactly:  # as the engine does: no validators then
                    accepted = Validation(schema=validators).feed(text, final=True) is None
                counts[("valid_" if t["valid"] else "invalid_") + ("accepted" if accepted else "rejected")] += 1
        score.per_file[name] = counts
        score.counts.update(counts)
    return score
