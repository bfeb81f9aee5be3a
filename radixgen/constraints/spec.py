"""What a request asks its output to match, normalised into a hashable cache key."""

from __future__ import annotations

import contextlib
import json
import re
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, Literal

from radixgen.errors import InvalidConstraintError

ConstraintKind = Literal["regex", "json_schema", "choices", "json_object", "structural"]

if sys.version_info >= (3, 11):
    import re._constants as _sre_constants
    import re._parser as _sre_parser
else:  # pragma: no cover - Python 3.10
    import sre_constants as _sre_constants
    import sre_parse as _sre_parser

sre_parser = _sre_parser
"""Python's regex parser (its module moved in 3.11), for the other checks of patterns."""

_REPEATS = tuple(getattr(_sre_constants, name) for name in ("MAX_REPEAT", "MIN_REPEAT", "POSSESSIVE_REPEAT")
                 if hasattr(_sre_constants, name))

MAX_REGEX_POSITIONS = 4096
"""Largest regex, counted with repetitions unrolled: interegular's check and the compilers'
automata grow with it. Measured here: a{3000} took 0.4 s to check, a{10000} 4 s, an alternation of
1000 eight-letter words (9000 positions) 9 s."""

MAX_REGEX_STATES = 5000
"""States interegular may build to check a regex (across its intermediate automata). Measured
here: a 250-word alternation needs 4984 (0.85 s), a{1000} 4009; .+\\s{100} needs 10,520 (1.5 s)
and .+\\s{1000} more than we waited for: the check runs on the caller's thread (the server's
event loop), so it must be bounded in work, not only in the regex's size."""
MAX_REGEX_CHECK_S = 1.0

MAX_SCHEMA_DEPTH = 64
"""Deepest JSON nesting a schema may have: recursive walks (ours, the compilers', the
validators') stay far from Python's recursion limit. The engine may set a lower limit."""


@dataclass(frozen=True)
class ConstraintSpec:
    kind: ConstraintKind
    value: str
    """The regex, the schema or structure as canonical JSON, the choices as a JSON list, or '' for json_object."""
    depth: int = field(default=0, compare=False)
    """JSON nesting depth of a schema (measured once here; the engine checks it against its limit)."""

    @property
    def key(self) -> tuple[str, str]:
        return (self.kind, self.value)

    def schema(self) -> dict[str, Any]:
        assert self.kind == "json_schema"
        return json.loads(self.value)

    def structure(self) -> dict[str, Any]:
        assert self.kind == "structural"
        return json.loads(self.value)

    def choices(self) -> list[str]:
        assert self.kind == "choices"
        return json.loads(self.value)

    def pattern(self) -> str:
        """The regex a regex or choices spec stands for (choices: an alternation of the literals)."""
        assert self.kind in ("regex", "choices")
        return self.value if self.kind == "regex" else "(" + "|".join(re.escape(c) for c in self.choices()) + ")"


def regex_spec(pattern: str) -> ConstraintSpec:
    """Check a regex with interegular (syntax, non-empty language) before any backend sees it."""
    import interegular

    if not isinstance(pattern, str) or not pattern:
        raise InvalidConstraintError("regex must be a non-empty string")
    try:
        re.compile(pattern)
        size = _expanded_size(_sre_parser.parse(pattern))
        if size > MAX_REGEX_POSITIONS:
            raise InvalidConstraintError(
                f"regex {pattern[:80]!r} expands to about {size} positions once its repetitions are unrolled; the "
                f"limit is {MAX_REGEX_POSITIONS}: use smaller counts ('+' instead of '{{1,5000}}'), or choices for a "
                f"long list of alternatives")
        with state_budget(MAX_REGEX_STATES, MAX_REGEX_CHECK_S):
            fsm = interegular.parse_pattern(pattern).to_fsm()
    except StateBudgetExceeded:
        raise InvalidConstraintError(
            f"regex {pattern[:80]!r} needs an automaton of more than {MAX_REGEX_STATES} states to check; simplify "
            f"it (overlapping repeats such as '.+\\s{{100}}' grow it fastest), or use choices for a long list of "
            f"alternatives") from None
    except (re.error, interegular.patterns.InvalidSyntax) as e:
        raise InvalidConstraintError(f"regex {pattern!r} is not valid: {e or 'syntax error'}") from None
    except interegular.patterns.Unsupported as e:
        raise InvalidConstraintError(f"regex {pattern!r} uses an unsupported feature: {e}") from None
    if fsm.empty():
        raise InvalidConstraintError(f"regex {pattern!r} matches no string at all; nothing could be generated")
    return ConstraintSpec("regex", pattern)


class StateBudgetExceeded(Exception):
    pass



_budget = threading.local()
_budget_installed = False
_budget_lock = threading.Lock()


@contextlib.contextmanager
def state_budget(states: int, seconds: float) -> Iterator[None]:
    """Bound the states interegular may build on this thread, and its time. Its determinisation
    can grow exponentially and cannot be interrupted, so every state its ``crawl`` discovers is
    counted and the check is abandoned past the budget (interegular 0.3 builds every automaton
    through ``interegular.fsm.crawl``). States give the same answer on every machine; the time
    cap only backs them up, since large states cost more each."""
    global _budget_installed
    with _budget_lock:
        if not _budget_installed:
            import interegular.fsm as fsm_module

            unbounded = fsm_module.crawl

            def crawl(alphabet: Any, initial: Any, final: Any, follow: Any) -> Any:
                if getattr(_budget, "left", None) is None:
                    return unbounded(alphabet, initial, final, follow)

                def counted_final(state: Any) -> Any:  # called once per discovered state
                    _budget.left -= 1
                    if _budget.left < 0 or time.monotonic() > _budget.deadline:
                        raise StateBudgetExceeded
                    return final(state)

                return unbounded(alphabet, initial, counted_final, follow)

            fsm_module.crawl = crawl
            _budget_installed = True
    _budget.left, _budget.deadline = states, time.monotonic() + seconds
    try:
        yield
    finally:
        _budget.left = None


def _expanded_size(parsed: Any) -> int:
    """Positions of a parsed regex with every counted repetition unrolled (what an automaton
    builder allocates); unbounded repeats count once."""
    total = 0
    for op, arg in parsed:
        if op in _REPEATS:
            low, high, item = arg
            total += max(1, low if high == _sre_constants.MAXREPEAT else high) * _expanded_size(item)
        elif op is _sre_constants.SUBPATTERN:
            total += _expanded_size(arg[-1])
        elif op is _sre_constants.BRANCH:
            total += sum(_expanded_size(branch) for branch in arg[1])
        elif op in (_sre_constants.ASSERT, _sre_constants.ASSERT_NOT):
            total += _expanded_size(arg[1])
        else:
            total += 1
    return total


def schema_spec(schema: Any) -> ConstraintSpec:
    """A JSON schema given as a dict, a JSON string, or a pydantic model class."""
    if isinstance(schema, type) and hasattr(schema, "model_json_schema"):
        schema = schema.model_json_schema()
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except json.JSONDecodeError as e:
            raise InvalidConstraintError(f"json_schema is not valid JSON: {e}") from None
        except RecursionError:
            raise InvalidConstraintError(f"json_schema nests deeper than {MAX_SCHEMA_DEPTH} levels") from None
    if isinstance(schema, bool):
        schema = {} if schema else {"not": {}}
    if not isinstance(schema, dict):
        raise InvalidConstraintError(f"json_schema must be an object (dict), got {type(schema).__name__}")
    depth = json_depth(schema)
    if depth > MAX_SCHEMA_DEPTH:
        raise InvalidConstraintError(f"json_schema nests {depth} levels deep; the limit is {MAX_SCHEMA_DEPTH}")
    # key order is kept: property order is the order the fields are generated in
    text = json.dumps(schema, separators=(",", ":"))
    _check_schema_types(schema, "$")
    _check_patterns(schema)
    _check_refs_are_local(schema)
    return ConstraintSpec("json_schema", text, depth)


def _check_patterns(schema: Any) -> None:
    """A schema's regexes get the same size bound as a regex constraint: a huge one would hold
    the compile worker past its timeout and delay every other request's compile."""
    stack = [schema]
    while stack:
        node = stack.pop()
        if isinstance(node, dict):
            patterns = [node["pattern"]] if isinstance(node.get("pattern"), str) else []
            if isinstance(node.get("patternProperties"), dict):
                patterns += list(node["patternProperties"])
            for pattern in patterns:
                try:
                    size = _expanded_size(_sre_parser.parse(pattern))
                except (re.error, RecursionError, OverflowError):
                    continue  # an invalid pattern is the compiler's to report, with its path
                if size > MAX_REGEX_POSITIONS:
                    raise InvalidConstraintError(
                        f"json_schema pattern {pattern[:80]!r} expands to about {size} positions once its "
                        f"repetitions are unrolled; the limit is {MAX_REGEX_POSITIONS}")
            stack.extend(node.values())
        elif isinstance(node, list):
            stack.extend(node)


def json_depth(value: Any) -> int:
    """Nesting depth of a JSON value (a scalar is 0), without recursion."""
    deepest, stack = 0, [(value, 0)]
    while stack:
        node, depth = stack.pop()
        children = node.values() if isinstance(node, dict) else node if isinstance(node, list) else None
        if children is not None:
            deepest = max(deepest, depth + 1)
            stack.extend((child, depth + 1) for child in children)
    return deepest


_LITERALS = frozenset({"enum", "const", "default", "examples"})
_NAMED_SCHEMAS = frozenset({"properties", "patternProperties", "$defs", "definitions", "dependentSchemas"})


def _check_refs_are_local(schema: dict[str, Any]) -> None:
    """References must resolve inside the schema: nothing is fetched (no network at run time)."""
    ids: set[str] = set()
    refs: list[tuple[str, str, str]] = []
    # (node, where, whether node is a map of names to schemas rather than a schema)
    stack: list[tuple[Any, str, bool]] = [(schema, "$", False)]
    while stack:
        node, where, is_map = stack.pop()
        if isinstance(node, dict) and is_map:
            stack.extend((v, f"{where}.{k}", False) for k, v in node.items() if isinstance(v, (dict, list)))
        elif isinstance(node, dict):
            if isinstance(node.get("$id"), str):
                ids.add(node["$id"].rstrip("#"))
            for key in ("$ref", "$dynamicRef"):
                if isinstance(node.get(key), str):
                    refs.append((key, node[key], where))
            # a literal that holds a "$ref" key is data ({"enum": [{"$ref": "a"}]}), not a reference
            stack.extend((v, f"{where}.{k}", k in _NAMED_SCHEMAS) for k, v in node.items()
                         if isinstance(v, (dict, list)) and k not in _LITERALS)
        elif isinstance(node, list):
            stack.extend((v, f"{where}[{i}]", False) for i, v in enumerate(node))
    for key, ref, where in refs:
        target = ref.split("#", 1)[0]
        if target and not any(i == target or i.endswith("/" + target) for i in ids):
            raise InvalidConstraintError(
                f"{key} {ref!r} at {where} points outside the schema; only references inside it are supported"
            )


def choices_spec(choices: Any) -> ConstraintSpec:
    if not isinstance(choices, (list, tuple)) or not choices:
        raise InvalidConstraintError("choices must be a non-empty list of strings")
    if not all(isinstance(c, str) and c for c in choices):
        raise InvalidConstraintError("choices must all be non-empty strings")
    return ConstraintSpec("choices", json.dumps(list(choices)))


JSON_OBJECT = ConstraintSpec("json_object", "")

_JSON_TYPES = {"string", "number", "integer", "boolean", "object", "array", "null"}


def _check_schema_types(schema: Any, path: str) -> None:
    """Catch the common mistakes early with a path: unknown 'type' names, non-object subschemas."""
    stack = [(schema, path)]
    while stack:
        node, where = stack.pop()
        if isinstance(node, bool):
            continue
        if not isinstance(node, dict):
            raise InvalidConstraintError(f"schema at {where} must be an object or a boolean, got {type(node).__name__}")
        kind = node.get("type")
        kinds = kind if isinstance(kind, list) else [kind] if kind is not None else []
        for k in kinds:
            if k not in _JSON_TYPES:
                raise InvalidConstraintError(f"schema at {where}: 'type' {k!r} is not a JSON type; use one of {sorted(_JSON_TYPES)}")
        for key in ("properties", "$defs", "definitions", "patternProperties"):
            sub = node.get(key)
            if sub is not None:
                if not isinstance(sub, dict):
                    raise InvalidConstraintError(f"schema at {where}.{key} must be an object")
                stack.extend((v, f"{where}.{key}.{k}") for k, v in sub.items())
        for key in ("items", "additionalProperties", "not", "contains", "propertyNames", "if", "then", "else"):
            sub = node.get(key)
            if isinstance(sub, (dict, bool)):
                stack.append((sub, f"{where}.{key}"))
        for key in ("anyOf", "oneOf", "allOf", "prefixItems"):
            sub = node.get(key)
            if sub is not None:
                if not isinstance(sub, list):
                    raise InvalidConstraintError(f"schema at {where}.{key} must be a list")
                stack.extend((v, f"{where}.{key}[{i}]") for i, v in enumerate(sub))


def pattern_branches(pattern: str) -> list[str]:
    """The top-level alternatives of a regex, a group around the whole pattern opened first
    ("(^Hpt_|^Int_|_Armour_)" has three), each with its own anchors: JSON Schema patterns are
    searched, so each alternative is anchored, or not, on its own."""
    while pattern.startswith("(") and not pattern.startswith("(?") and _closing_paren(pattern) == len(pattern) - 1:
        pattern = pattern[1:-1]
    branches, start = [], 0
    for i, ch, depth in _structure(pattern):
        if ch == "|" and depth == 0:
            branches.append(pattern[start:i])
            start = i + 1
    return [*branches, pattern[start:]]


def _closing_paren(pattern: str) -> int:
    """Index of the parenthesis that closes the one the pattern opens with (-1 if none)."""
    return next((i for i, ch, depth in _structure(pattern) if ch == ")" and depth == 0), -1)


def _structure(pattern: str) -> Iterator[tuple[int, str, int]]:
    """The pattern's characters outside escapes and character classes, each with the group
    depth after it."""
    depth, escaped, in_class = 0, False, False
    for i, ch in enumerate(pattern):
        if escaped:
            escaped = False
        elif ch == "\\":
            escaped = True
        elif in_class:
            in_class = ch != "]"
        elif ch == "[":
            in_class = True
        else:
            depth += (ch == "(") - (ch == ")")
            yield i, ch, depth
