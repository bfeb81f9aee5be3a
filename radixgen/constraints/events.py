"""Token-stream events for JSON outputs, and the validators that subscribe to them.

``JsonScanner`` follows the generated text character by character and reports each value as it
completes: its JSON path, where it started in the text and its parsed value. ``Validation``
runs the validators of a request on those events; a rejection names the value's start, so the
engine can roll the request back there, ban the first token it chose and resample.

Validators come from the schema (each completed value is checked against the subschema its
path resolves to, with semantic formats; the whole object against the whole schema), from a
pydantic model (its field validators on each top-level field as it completes, ``model_validate``
on the whole object) and from the caller
(``validators={"$.price": fn}``; ``[*]`` matches any array index).
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

from radixgen.constraints.drafts import as_2020_12, validator_class
from radixgen.constraints.refs import deref, pattern_schemas
from radixgen.constraints.value_search import (
    anchored_numbers,
    listed_literals,
    member_candidates,
    small_numbers,
)
from radixgen.json_lexer import CLOSE, OPEN, OUTSIDE, JsonStrings

Path = tuple[str | int, ...]
RepeatedItems = Literal["unique", "all", "off"]
Validator = Callable[[Any], Any]


@dataclass(frozen=True)
class CompletedValue:
    path: Path
    start: int  # character offset of the value's first character in the output text
    end: int
    value: Any
    key_starts: dict[str, int] | None = None
    """An object's keys, each with the offset of its opening quote (its first occurrence)."""


@dataclass(frozen=True)
class Rejection:
    path: Path
    start: int
    reason: str
    is_string: bool = False
    fatal: bool = False
    """The caller's validator raised something other than a rejection (a bug in user code): the
    request ends with ``constraint_violation`` instead of resampling."""
    replacement: str | None = None
    """A valid value's JSON text to write in the rejected value's place (a number whose
    validators the grammar cannot enforce, rejected more than once: ``Validation.search_number``)."""
    end: int = -1
    """Character offset just past the rejected value."""
    fallback: Rejection | None = None
    """Applied instead where the automaton refuses ``replacement`` at ``start`` (a container's
    closer where minItems, minProperties or a required property needs more)."""


def format_path(path: Path) -> str:
    return "$" + "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in path)


class JsonScanner:
    """Incremental JSON scanner over a text that grows (generated output, whitespace-tolerant)."""

    def __init__(self) -> None:
        self.text = ""
        # container frames: [kind ("{" or "["), start offset, key or index, expecting ("key"|"value"|"sep"),
        # an object's keys so far, each with where its opening quote stands]
        self._stack: list[list[Any]] = []
        self.duplicate_key: CompletedValue | None = None
        """The last key written a second time in its object (its path, and where it starts), until
        the reader takes it: the grammar cannot keep keys it does not name apart."""
        self._scalar_start: int | None = None
        self._strings = JsonStrings()
        self._string_is_key = False
        self._key_start = 0
        self._done = False

    def feed(self, chunk: str) -> list[CompletedValue]:
        out: list[CompletedValue] = []
        for ch in chunk:
            pos = len(self.text)
            self.text += ch
            self._step(ch, pos, out)
        return out

    @property
    def done(self) -> bool:
        """The root value is complete."""
        return self._done

    def finish(self) -> list[CompletedValue]:
        """End of output: a bare root number/literal completes here."""
        out: list[CompletedValue] = []
        if self._scalar_start is not None and not self._strings.in_string:
            self._complete_scalar(len(self.text), out)
        return out

    def _path(self) -> Path:
        return tuple(frame[2] for frame in self._stack)

    def _step(self, ch: str, pos: int, out: list[CompletedValue]) -> None:
        kind = self._strings.step(ch)
        if kind == CLOSE:
            if self._string_is_key:
                owner = self._stack[-1]
                owner[2] = key = json.loads(self.text[self._key_start : pos + 1])
                owner[3] = "colon"
                if key in owner[4]:
                    self.duplicate_key = CompletedValue(self._path(), self._key_start, pos + 1, key)
                else:
                    owner[4][key] = self._key_start
            else:
                self._complete_scalar(pos + 1, out)
            return
        if kind not in (OUTSIDE, OPEN):
            return  # string content
        if self._scalar_start is not None:
            if ch in ",}] \t\r\n":
                self._complete_scalar(pos, out)
            else:
                return
        if ch in " \t\r\n":
            return
        frame: list[Any] | None = self._stack[-1] if self._stack else None
        if frame is not None and frame[0] == "{" and frame[3] == "key":
            if kind == OPEN:
                self._string_is_key, self._key_start = True, pos
            elif ch == "}":
                self._close(pos, out)
            return
        if frame is not None and frame[3] == "colon":
            if ch == ":":
                frame[3] = "value"
            return
        if frame is not None and frame[3] == "sep":
            if ch == ",":
                if frame[0] == "{":
                    frame[3] = "key"
                else:
                    frame[2] += 1
                    frame[3] = "value"
            elif ch in "}]":
                self._close(pos, out)
            return
        # a value starts here
        if frame is not None and frame[0] == "[" and ch == "]":
            self._close(pos, out)
            return
        if ch == "{":
            self._stack.append(["{", pos, None, "key", {}])
        elif ch == "[":
            self._stack.append(["[", pos, 0, "value", None])
        elif kind == OPEN:
            self._string_is_key, self._scalar_start = False, pos
        else:
            self._scalar_start = pos

    def _complete_scalar(self, end: int, out: list[CompletedValue]) -> None:
        start = self._scalar_start
        assert start is not None
        self._scalar_start = None
        try:
            value = json.loads(self.text[start:end])
        except json.JSONDecodeError:
            return  # not valid JSON (the automaton should have prevented it): nothing to report
        out.append(CompletedValue(self._path(), start, end, value))
        self._after_value()

    def _close(self, pos: int, out: list[CompletedValue]) -> None:
        frame = self._stack.pop()
        try:
            value = json.loads(self.text[frame[1] : pos + 1])
        except json.JSONDecodeError:
            value = None
        out.append(CompletedValue(self._path(), frame[1], pos + 1, value, frame[4]))
        self._after_value()

    def _after_value(self) -> None:
        if self._stack:
            self._stack[-1][3] = "sep"
        else:
            self._done = True


class SchemaValidators:
    """Per-path subschema checks derived from a JSON schema (shared by requests; immutable)."""

    def __init__(self, schema: dict[str, Any]) -> None:
        from jsonschema import Draft202012Validator

        # the whole value is checked under the draft the schema names; values on a path against
        # the 2020-12 reading of their subschema (drafts.as_2020_12), which means the same
        root_cls = validator_class(schema)
        self.root = as_2020_12(schema)
        self._validator_cls = Draft202012Validator
        self._root_validator = root_cls(schema, format_checker=root_cls.FORMAT_CHECKER)
        self._cache: dict[int, Any] = {}  # id of a subschema inside self.root -> its validator
        self._combined: dict[tuple[int, str], Any] = {}  # see resolve_subschema

    def check(self, path: Path, value: Any) -> str | None:
        """Why ``value`` at ``path`` is invalid, or None."""
        validator = self._root_validator if not path else self._for_path(path)
        if validator is None:
            return None
        try:
            error = next(iter(validator.iter_errors(value)), None)
        except Exception:  # noqa: BLE001 - e.g. a $ref we cannot resolve offline: cannot judge here
            return None
        return None if error is None else f"{format_path(path + tuple(error.absolute_path))}: {error.message}"

    def keys_missing_their_dependencies(self, path: Path, obj: dict[str, Any]) -> list[str]:
        """The keys of ``obj`` at ``path`` whose dependencies (``dependentRequired``, or
        ``dependencies`` listing names) are absent, where that is all that is wrong with it;
        otherwise none."""
        validator = self._root_validator if not path else self._for_path(path)
        if validator is None:
            return []
        try:
            errors = list(validator.iter_errors(obj))
        except Exception:  # noqa: BLE001 - as in check
            return []
        keys: set[str] = set()
        for error in errors:
            names = error.validator_value
            if error.validator not in ("dependentRequired", "dependencies") or error.absolute_path \
                    or not isinstance(names, dict):
                return []
            keys.update(key for key, needed in names.items()
                        if key in obj and isinstance(needed, list) and any(n not in obj for n in needed))
        return sorted(keys)

    def _for_path(self, path: Path) -> Any:
        sub = resolve_subschema(self.root, path, self._combined)
        if not isinstance(sub, dict) or not sub:
            return None
        # keyed by the subschema itself: $[0] and $[1] differ under prefixItems, $[5] and $[6] do not
        validator = self._cache.get(id(sub))
        if validator is None:
            # the root's definitions stay reachable for $ref inside the subschema
            with_defs = {**{k: v for k, v in self.root.items() if k in ("$defs", "definitions")}, **sub}
            validator = self._cache[id(sub)] = self._validator_cls(
                with_defs, format_checker=self._validator_cls.FORMAT_CHECKER)
        return validator


def resolve_subschema(root: dict[str, Any], path: Path, combined: dict[tuple[int, str], Any] | None = None) -> Any:
    """A subschema every value at ``path`` must satisfy, read from the path alone (None where
    nothing is known). A property must satisfy its own schema (``properties``), those of the
    ``patternProperties`` that match it (else ``additionalProperties``), and the same from each
    ``allOf`` member: an ``allOf`` of them, made once per object schema and name where
    ``combined`` keeps them (callers that key on a subschema's identity pass it). What an
    ``anyOf`` / ``oneOf`` branch, a ``not`` or an ``if`` adds depends on more than the path and
    is left to the whole object's check; what is read here holds whichever branch is taken."""
    node: Any = deref(root, root)
    for part in path:
        if not isinstance(node, dict) or _UNDETERMINED & node.keys() or (isinstance(part, int) and "allOf" in node):
            return None
        if isinstance(part, int):
            prefix = node.get("prefixItems")
            if isinstance(prefix, list) and part < len(prefix):
                node = prefix[part]
            else:
                node = node.get("items")
        else:
            node = _property_schema(root, node, part, combined)
            if node is _UNKNOWN:
                return None
        node = deref(root, node)
        if node is None or node is True:
            return None
    return node


_UNKNOWN = object()
# a keyword after which the path alone says nothing of what a value must satisfy
_UNDETERMINED = frozenset({"$dynamicRef"})


def _property_schema(root: dict[str, Any], node: dict[str, Any], name: str,
                     combined: dict[tuple[int, str], Any] | None) -> Any:
    parts = _property_parts(root, node, name, 0)
    if parts is None:
        return _UNKNOWN
    if len(parts) <= 1:
        return parts[0] if parts else None
    if combined is None:
        return {"allOf": parts}
    key = (id(node), name)
    if key not in combined:
        combined[key] = (node, {"allOf": parts})  # the node kept alive with its id
    return combined[key][1]


def _property_parts(root: dict[str, Any], node: dict[str, Any], name: str, depth: int) -> list[Any] | None:
    """The schemas property ``name`` of an object checked against ``node`` must satisfy: its own
    (``properties``), those of the ``patternProperties`` that match it, else
    ``additionalProperties``; and the same from each member of ``node``'s allOf, which checks
    the same object. None where that is not determined by the name alone."""
    props = node.get("properties") or {}
    matched = pattern_schemas(node.get("patternProperties") or {}, name)
    if matched is None:
        return None  # a pattern Python's re cannot read: the parent's check decides
    if matched or name in props:
        parts = ([props[name]] if name in props else []) + matched
    else:
        parts = [node["additionalProperties"]] if "additionalProperties" in node else []
    for member in node.get("allOf") or []:
        member = deref(root, member)
        if member is True:
            continue
        if not isinstance(member, dict) or _UNDETERMINED & member.keys() or depth >= 8:
            return None
        inner = _property_parts(root, member, name, depth + 1)
        if inner is None:
            return None
        parts += inner
    return [p for p in parts if p is not True]


def _pydantic_field_check(model: Any, name: str | int, value: Any) -> str | None:
    """Run a pydantic model's validators of one field on its value as soon as it completes, so
    a bad field is resampled alone rather than the whole object. Errors located elsewhere (model
    validators that need the other fields) wait for the whole-object check."""
    from pydantic import ValidationError

    if not isinstance(name, str) or name not in model.model_fields:
        return None
    try:
        model.__pydantic_validator__.validate_assignment(model.model_construct(), name, value)
    except ValidationError as e:
        mine = [err for err in e.errors() if tuple(err.get("loc", ()))[:1] == (name,)]
        return f"$.{name}: {mine[0]['msg']}" if mine else None
    except Exception:  # noqa: BLE001 - a validator that reads fields not generated yet
        return None
    return None


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _path_matches(pattern: str, path: Path) -> bool:
    regex = "^" + re.escape(pattern).replace(r"\[\*\]", r"\[\d+\]") + "$"
    return re.match(regex, format_path(path)) is not None


class UserValidatorError(Exception):
    """A caller's validator failed with an exception that is not a rejection."""


class Validation:
    """One request's validators over its JSON output."""

    SEARCH_AFTER = 2
    """A value rejected this many times at one path is replaced by a searched valid one: its
    validators (multipleOf chains under not / oneOf, an if / then over listed arrays, ...) are
    outside what the grammar enforces, and resampling rarely lands on the few valid values."""
    MEMBER_RETRIES = 2
    """Rejections of a whole array sent to its last item before the array itself is rolled back
    (``_last_member_rejection``)."""
    SEARCH_INTEGERS, SEARCH_TENTHS, SEARCH_ANCHORED = 4_000, 1_000, 6_000
    """Candidates tried at most: integers within 2,000 of 0, then tenths within 50, then numbers
    anchored on the schema's multipleOf values and bounds (constraints/value_search.py). The
    search runs on the engine's loop thread: ~0.3 s for the first 5,000 when none fits."""

    def __init__(
        self, *, schema: SchemaValidators | None = None, model: Any = None,
        user: dict[str, Validator] | None = None, repeated_items: RepeatedItems = "unique",
    ) -> None:
        self.schema, self.model, self.user = schema, model, dict(user or {})
        self.repeated_items = repeated_items
        self.scanner = JsonScanner()
        self._items: dict[Path, list[str]] = {}  # array path -> its completed items (canonical JSON)
        self._rejections: dict[Path, int] = {}  # kept across rollbacks
        self._repeats_in: dict[Path, int] = {}  # container path -> items or keys refused as repeats (kept too)
        self._last_items: dict[Path, CompletedValue] = {}  # array path -> its last completed item
        self._member_retries: dict[Path, int] = {}  # array path -> rejections sent to its last item (kept too)

    settled = 0
    """Chars of the output no rejection can reach back into: none, the whole value is checked
    at its end."""

    def reset(self, text: str) -> None:
        """Re-scan from scratch (after a rollback) without running validators."""
        self.scanner = JsonScanner()
        self._items = {}
        self._last_items = {}
        for value in self.scanner.feed(text):
            if value.path and isinstance(value.path[-1], int):
                self._items.setdefault(value.path[:-1], []).append(json.dumps(value.value, sort_keys=True))
                self._last_items[value.path[:-1]] = value

    def feed(self, text: str, *, final: bool = False) -> Rejection | None:
        done = self.scanner.feed(text)
        if final:
            done += self.scanner.finish()
        for value in done:
            if value.path and isinstance(value.path[-1], int):  # an array item
                canonical = json.dumps(value.value, sort_keys=True)
                repeated = self._repeats(value, canonical)
                if repeated is not None:
                    return self._repeat_rejection(value, repeated)
                self._items.setdefault(value.path[:-1], []).append(canonical)
                self._last_items[value.path[:-1]] = value
            try:
                reason = self._check(value)
            except UserValidatorError as e:
                return Rejection(value.path, value.start, str(e), isinstance(value.value, str), fatal=True)
            if reason is not None:
                return self._dependent_key_rejection(value, reason) or self._last_member_rejection(value, reason) or Rejection(
                    value.path, value.start, reason, isinstance(value.value, str),
                    replacement=self._replacement(value), end=value.end)
        duplicate, self.scanner.duplicate_key = self.scanner.duplicate_key, None
        if duplicate is not None:
            # a key is written once: its repeat is the model starting over, closed at once
            return self._repeat_rejection(duplicate, f"{format_path(duplicate.path)}: the object has this key already",
                                          closer="}", close_after=1)
        return None

    def _dependent_key_rejection(self, value: CompletedValue, reason: str) -> Rejection | None:
        """An object whose only fault is a key written without the keys it depends on: that key
        is taken back (the grammar may not allow the missing ones after it), resampled after its
        quote, instead of the whole object, which the model tends to write out again as it was."""
        if self.schema is None or not isinstance(value.value, dict) or not value.key_starts:
            return None
        keys = [k for k in self.schema.keys_missing_their_dependencies(value.path, value.value) if k in value.key_starts]
        if not keys:
            return None
        first = min(keys, key=value.key_starts.__getitem__)
        return Rejection((*value.path, first), value.key_starts[first], reason, is_string=True)

    def _last_member_rejection(self, value: CompletedValue, reason: str) -> Rejection | None:
        """An array refused as a whole (its items each passed) whose last item is a scalar: that
        item is resampled first, then (on the second refusal) replaced by the first of
        ``member_candidates`` that mends the array; ``MEMBER_RETRIES`` times at most before the
        whole array is rolled back. What fails there relates items to each other (``contains``,
        a ``oneOf`` whose branches differ in what some item must be), and one item changed is
        the smallest edit that can mend it; rolled back whole, the model wrote it out again, and
        at the root the ban fell on the output's first token. A container item or an object's
        key is left to the whole rollback: its first token is often the only one the grammar
        allows there, and a ban on it would leave none."""
        if not isinstance(value.value, list) or not value.value or self._member_retries.get(value.path, 0) >= self.MEMBER_RETRIES:
            return None
        last = self._last_items.get(value.path)
        if last is None or isinstance(last.value, (list, dict)) or not value.start < last.start < last.end <= value.end:
            return None
        if self._wants_number(value.path) or self._listed_at(value.path):
            return None  # the whole value's own search (``_replacement``) fits better
        tries = self._member_retries[value.path] = self._member_retries.get(value.path, 0) + 1
        resample = Rejection(last.path, last.start, reason, isinstance(last.value, str))
        found = self._member_replacement(value, last) if tries > 1 else None
        if found is None:
            return resample
        return Rejection(last.path, last.start, reason, replacement=found, end=last.end, fallback=resample)

    def _listed_at(self, path: Path) -> list[Any]:
        """The literals (enum / const, through combinators) the schema lists for the value at ``path``."""
        if self.schema is None:
            return []
        node = resolve_subschema(self.schema.root, path) if path else self.schema.root
        return listed_literals(node, self.schema.root)

    def _member_replacement(self, array: CompletedValue, last: CompletedValue) -> str | None:
        """JSON text of a value that, in place of ``last``, passes its own validators and makes
        ``array`` pass; None when no candidate does."""
        for candidate in member_candidates(self._listed_at(last.path)):
            if candidate == last.value or not self._accepts(last, candidate):
                continue
            if self._accepts(array, [*array.value[:-1], candidate]):
                return json.dumps(candidate, ensure_ascii=False)
        return None

    def _repeat_rejection(self, value: CompletedValue, reason: str, closer: str = "]", close_after: int = SEARCH_AFTER) -> Rejection:
        """Roll a repeated array item (or an object's repeated key, ``closer`` "}") back; once its
        container has had ``close_after`` repeats, close the container before it instead (the
        separator goes, the closer is written): a model that repeats itself keeps repeating,
        and every retry used to be spent on it. Where the automaton refuses the closer there
        (minItems, a required property), the item or key is resampled (the fallback)."""
        container = value.path[:-1]
        count = self._repeats_in[container] = self._repeats_in.get(container, 0) + 1
        text = self.scanner.text
        separator = value.start - 1
        while separator >= 0 and text[separator] in " \t\r\n":
            separator -= 1
        resample = Rejection(value.path, value.start, reason, isinstance(value.value, str))
        if count < close_after or separator < 0 or text[separator] != ",":
            return resample
        return Rejection(value.path, separator, reason, replacement=closer, fallback=resample)

    def _replacement(self, value: CompletedValue) -> str | None:
        count = self._rejections[value.path] = self._rejections.get(value.path, 0) + 1
        if count < self.SEARCH_AFTER:
            return None  # the model's own next choice first
        if _is_number(value.value):
            found = self.search_number(value)
            return None if found is None else json.dumps(found)
        literal = self.search_literal(value)
        if literal is not None:
            return json.dumps(literal[0], ensure_ascii=False)
        if not self._wants_number(value.path):
            return None  # a string's search over numbers could only fail, ~0.1 s on the loop thread
        # a container or a string where the path wants a number the grammar does not insist on
        found = self.search_number(value)
        return None if found is None else json.dumps(found)

    def _wants_number(self, path: Path) -> bool:
        """The path's schema (or a member of its allOf) asks for a number or an integer."""
        if self.schema is None:
            return False
        pending = [resolve_subschema(self.schema.root, path) if path else self.schema.root]
        for _ in range(16):  # bounded: allOf may refer back to the root
            if not pending:
                break
            node = deref(self.schema.root, pending.pop())
            if not isinstance(node, dict):
                continue
            kinds = node.get("type")
            if {"number", "integer"} & set(kinds if isinstance(kinds, list) else [kinds]):
                return True
            pending += node.get("allOf") or [] if isinstance(node.get("allOf"), list) else []
        return False

    def search_literal(self, rejected: CompletedValue) -> tuple[Any] | None:
        """The first value the schema lists for ``rejected``'s path (``enum`` / ``const``, through
        its combinators) that every validator accepts, as a 1-tuple (the value may be None);
        None when the schema lists none there or none passes."""
        for candidate in self._listed_at(rejected.path):
            if candidate != rejected.value and self._accepts(rejected, candidate):
                return (candidate,)
        return None

    def search_number(self, rejected: CompletedValue) -> int | float | None:
        """The first number every validator of ``rejected``'s path accepts, smallest magnitude
        (so shortest) first: integers, then tenths where no integer near 0 fits, then numbers
        built from the schema's multipleOf values and bounds. None when none of the candidates does."""
        for candidate in small_numbers(self.SEARCH_INTEGERS, tenths=False):
            if self._accepts(rejected, candidate):
                return candidate
        for candidate in small_numbers(self.SEARCH_TENTHS, tenths=True):
            if self._accepts(rejected, candidate):
                return candidate
        anchored = anchored_numbers(self.schema.root, self.SEARCH_ANCHORED) if self.schema is not None else []
        for candidate in anchored:
            if self._accepts(rejected, candidate):
                return candidate
        return None

    def _accepts(self, rejected: CompletedValue, candidate: Any) -> bool:
        try:
            return self._check(CompletedValue(rejected.path, rejected.start, rejected.end, candidate)) is None
        except UserValidatorError:
            return False

    def _repeats(self, value: CompletedValue, canonical: str) -> str | None:
        """Why an array item is refused as a repeat of an earlier item of its array, or None.
        "unique" refuses repeats only in arrays whose schema sets uniqueItems (where a repeat
        is invalid anyway, so this only catches it an item earlier than the array's own check);
        "all" refuses them in every array (the loop small models fall into), which changes what
        a schema that allows duplicates can produce; "off" never."""
        if self.repeated_items == "off" or canonical not in self._items.get(value.path[:-1], ()):
            return None
        if self.repeated_items == "unique":
            array = resolve_subschema(self.schema.root, value.path[:-1]) if self.schema is not None else None
            if not (isinstance(array, dict) and array.get("uniqueItems") is True):
                return None
        return f"{format_path(value.path)}: repeats an earlier item of its array"

    def _check(self, value: CompletedValue) -> str | None:
        if self.schema is not None:
            reason = self.schema.check(value.path, value.value)
            if reason is not None:
                return reason
        if len(value.path) == 1 and self.model is not None:
            reason = _pydantic_field_check(self.model, value.path[0], value.value)
            if reason is not None:
                return reason
        if not value.path and self.model is not None:
            try:
                self.model.model_validate(value.value)
            except Exception as e:  # noqa: BLE001 - pydantic's ValidationError and friends
                return f"$: {e}"
        for pattern, fn in self.user.items():
            if _path_matches(pattern, value.path):
                try:
                    ok = fn(value.value)
                except (ValueError, TypeError, AssertionError) as e:
                    return f"{format_path(value.path)}: {e}"
                except Exception as e:  # noqa: BLE001 - any other failure of user code ends this request only
                    raise UserValidatorError(
                        f"the validator for {pattern} raised {type(e).__name__}: {e} (on {format_path(value.path)} = "
                        f"{value.value!r}); a validator rejects a value by returning False or raising ValueError"
                    ) from e
                if ok is False:
                    return f"{format_path(value.path)}: rejected by the validator for {pattern}"
        return None
