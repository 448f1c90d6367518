"""Reading typed fields out of parsed JSON, with errors that name the file and the field.

Artifacts (profile, plan, ...) are parsed with these helpers so that every malformed file
gets the same kind of one-line message: `FILE: FIELD: PROBLEM; FIX`.
"""
from __future__ import annotations

import math
from typing import Any

from .errors import ArtifactError

MAX_COUNT = 2**50
"""Largest integer an artifact field may hold (bytes, counts): 1 PiB, far beyond any model,
well inside a float's exact integers, so sums over layers stay exact."""
MAX_NUMBER = 1e12
"""Largest number an artifact field may hold (milliseconds: about 30 years)."""

_TYPE_NAMES = {int: "an integer", float: "a number", str: "a string", bool: "true or false",
               list: "a list", dict: "an object"}


class Fields:
    """A view of one JSON object that reads required fields with type checks.

    `source` names the file, `where` the object's path inside it (e.g. `layers[3]`).
    """

    def __init__(self, data: Any, source: str, where: str = "", known: tuple[str, ...] | None = None):
        self.source = source
        self.where = where
        if not isinstance(data, dict):
            self.fail(f"expected an object, found {describe(data)}", "regenerate the file")
        self.data = data
        if known is not None:
            unknown = sorted(set(data) - set(known))
            if unknown:
                self.fail(f"unknown field {unknown[0]!r}", f"remove it (known fields: {', '.join(sorted(known))})")

    def fail(self, problem: str, fix: str, key: str | None = None) -> None:
        path = ".".join(p for p in (self.where, key) if p)
        location = f"{self.source}: {path}: " if path else f"{self.source}: "
        raise ArtifactError(f"{location}{problem}; {fix}")

    def one_of(self, value: Any, allowed, what: str, key: str) -> None:
        """Fail unless `value` (the `what` at `key`) is one of `allowed`."""
        if value not in allowed:
            self.fail(f"unknown {what} {value!r}", f"use one of {', '.join(map(str, allowed))}", key)

    def get(self, key: str, kind: type | tuple[type, ...], optional: bool = False, default: Any = None) -> Any:
        if key not in self.data:
            if optional:
                return default
            self.fail("missing field", "regenerate the file with the current pdtool", key)
        value = self.data[key]
        if optional and value is None:
            return default
        kinds = kind if isinstance(kind, tuple) else (kind,)
        if float in kinds and isinstance(value, int) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, bool) and bool not in kinds or not isinstance(value, kinds):
            wanted = " or ".join(_TYPE_NAMES.get(k, k.__name__) for k in kinds)
            self.fail(f"expected {wanted}, found {describe(value)}", "fix the value or regenerate the file", key)
        return value

    def number(self, key: str, minimum: float = 0.0, maximum: float = MAX_NUMBER, optional: bool = False) -> float:
        """A finite number in [minimum, maximum]; None for a missing or null field when `optional`."""
        value = self.get(key, float, optional=optional)
        if value is None:
            return None
        if not math.isfinite(value):
            self.fail(f"must be a finite number, found {value}", "fix the value or regenerate the file", key)
        if value < minimum:
            self.fail(f"must be >= {minimum:g}, found {value:g}", "fix the value or regenerate the file", key)
        if value > maximum:
            self.fail(f"must be <= {maximum:g}, found {value:g}", "fix the value or regenerate the file", key)
        return value

    def count(self, key: str, minimum: int = 0, maximum: int = MAX_COUNT, optional: bool = False) -> int:
        """An integer in [minimum, maximum]; None for a missing or null field when `optional`."""
        value = self.get(key, int, optional=optional)
        if value is None:
            return None
        if value < minimum:
            self.fail(f"must be >= {minimum}, found {value}", "fix the value or regenerate the file", key)
        if value > maximum:
            self.fail(f"must be <= {maximum} (2**50), found {value}", "fix the value or regenerate the file", key)
        return value

    def items(self, key: str, optional: bool = False) -> list[tuple[str, "Fields | Any"]]:
        """The elements of list field `key`, each paired with its path (none when `optional`
        and the field is missing)."""
        return [(f"{self.where + '.' if self.where else ''}{key}[{i}]", item)
                for i, item in enumerate(self.get(key, list, optional=optional, default=[]) or [])]

    def shared(self, key: str, ids: str) -> tuple[tuple[str, tuple[int, ...]], ...]:
        """The optional list `key` of `{"param": NAME, ids: [int, ...]}` objects (parameters used
        by several layers or stages), as (name, ids) pairs."""
        found = []
        for where, item in self.items(key, optional=True):
            f = Fields(item, self.source, where, known=("param", ids))
            values = f.get(ids, list)
            if not all(isinstance(x, int) and not isinstance(x, bool) for x in values):
                f.fail(f"expected a list of {ids[:-1]} ids", f"list the {ids} that use the parameter", ids)
            found.append((f.get("param", str), tuple(values)))
        return tuple(found)

    def child(self, key: str, known: tuple[str, ...] | None = None) -> "Fields":
        path = f"{self.where}.{key}" if self.where else key
        return Fields(self.get(key, dict), self.source, path, known)


def check_schema(data: Any, expected: str, source: str) -> None:
    """Refuse a file whose `schema` field is not `expected`, naming what it is instead."""
    if not isinstance(data, dict) or "schema" not in data:
        raise ArtifactError(f"{source}: no 'schema' field; this is not a pdtool artifact (expected {expected})")
    if data["schema"] != expected:
        found, wanted = _KINDS.get(data["schema"]), _KINDS.get(expected, expected)
        if found is not None:  # another pdtool artifact: say what it is and what to do with it
            raise ArtifactError(f"{source}: this is a {found[0]} ({data['schema']}), not a {wanted[0]}; {found[1]}")
        raise ArtifactError(
            f"{source}: schema is {data['schema']!r}, expected {expected!r}; "
            "give a file of the right kind or regenerate it with this pdtool"
        )


_KINDS = {
    "pdtool.profile/1": ("profile", "plan it with pd plan PROFILE.json --cluster SPEC -o PLAN.json, then use the plan"),
    "pdtool.plan/1": ("plan", "train it with pd train PLAN.json, or give the profile it was made from"),
    "pdtool.cluster/1": ("cluster description", "give it to pd plan --cluster"),
    "pdtool.checkpoint/1": ("checkpoint manifest", "give its folder's parent to pd train --checkpoint-dir"),
}
"""What each artifact is, and what to do with one given where another kind was expected."""


def describe(value: Any) -> str:
    """A JSON value's kind and (shortened) text, for messages: `a number (-1.0)`."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    return f"{_TYPE_NAMES.get(type(value), type(value).__name__)} ({value!r:.40})"
