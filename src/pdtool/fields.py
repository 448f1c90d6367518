"""Places in parsed JSON, and the one-line errors that name the file and the field.

Every malformed artifact gets the same kind of message: `FILE: FIELD: PROBLEM; FIX`. The
artifacts' fields are read by `artifacts.record`; `At` is where a problem is, for it and for
the checks written by hand (`_validate` of each artifact).
"""
from __future__ import annotations

from typing import Any

from .errors import ArtifactError

MAX_COUNT = 2**50
"""Largest integer an artifact field may hold (bytes, counts): 1 PiB, far beyond any model,
well inside a float's exact integers, so sums over layers stay exact."""
MAX_NUMBER = 1e12
"""Largest number an artifact field may hold (milliseconds: about 30 years)."""

TYPE_NAMES = {"integer": "an integer", "number": "a number", "string": "a string", "boolean": "true or false",
              "array": "a list", "object": "an object", "null": "null"}


class At:
    """A place in file `source`: `where` is the path inside it (e.g. `layers[3]`); `note` ends
    the fix of the problems `wrong` reports (the schema that declares the field)."""

    def __init__(self, source: str, where: str = "", note: str = ""):
        self.source, self.where, self.note = source, where, note

    def at(self, key: str | int) -> "At":
        """The place of `key` (a field name, or a list index) inside this one."""
        where = f"{self.where}[{key}]" if isinstance(key, int) else ".".join(p for p in (self.where, key) if p)
        return At(self.source, where, self.note)

    def fail(self, problem: str, fix: str, key: str | None = None) -> None:
        path = self.at(key).where if key else self.where
        location = f"{self.source}: {path}: " if path else f"{self.source}: "
        raise ArtifactError(f"{location}{problem}; {fix}")

    def wrong(self, problem: str, fix: str = "fix the value or regenerate the file", key: str | None = None) -> None:
        """`fail`, naming the declaration the value breaks (`note`)."""
        self.fail(problem, f"{fix} {self.note}" if self.note else fix, key)

    def one_of(self, value: Any, allowed, what: str, key: str) -> None:
        """Fail unless `value` (the `what` at `key`) is one of `allowed`."""
        if value not in allowed:
            self.fail(f"unknown {what} {value!r}", f"use one of {', '.join(map(str, allowed))}", key)


def check_schema(data: Any, expected: str, source: str, older: tuple[str, ...] = ()) -> None:
    """Refuse a file whose `schema` field is not `expected` (or one of the `older` formats it
    reads), naming what it is instead."""
    if not isinstance(data, dict) or "schema" not in data:
        raise ArtifactError(f"{source}: no 'schema' field; this is not a pdtool artifact (expected {expected})")
    if data["schema"] != expected and data["schema"] not in older:
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
    "pdtool.plan/2": ("plan", "train it with pd train PLAN.json, or give the profile it was made from"),
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
    name = {int: "integer", float: "number", str: "string", list: "array", dict: "object"}.get(type(value))
    return f"{TYPE_NAMES[name] if name else type(value).__name__} ({value!r:.40})"
