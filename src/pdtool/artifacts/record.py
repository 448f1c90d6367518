"""Artifact records declared once: the fields of a frozen dataclass, each with its JSON form.

Every field of an artifact's dataclass is made by `field(KIND, ...)`: its JSON key (a dotted
key puts it in a nested object: `provenance.command`), its kind and range (`Int`, `Num`, `Str`,
a nested record, ...), whether it may be null, whether a file must have it and what it is when
absent. A record may add `DERIVED` figures, written for readers and checked on reading. From
these declarations alone `read` makes the dataclass of parsed JSON (every problem one line,
`FILE: FIELD: PROBLEM; FIX`), `write` makes the JSON tree, and `object_schema` the JSON Schema
published in `schemas/`. What they cannot say (layer ids in order, ranks used once, ...) each
artifact checks by hand (`_validate`, and a record's `_read_check`). Pure: no torch.
"""
from __future__ import annotations

import dataclasses
import functools
import inspect
import math
import os
import re
from dataclasses import MISSING, dataclass
from typing import Any, Callable

from ..fields import MAX_COUNT, MAX_NUMBER, TYPE_NAMES, At, describe
from ..jsonio import read_json, write_json

NEVER = object()
"""`omit` of a field that is always written."""
_TYPES = {"integer": lambda v: isinstance(v, int) and not isinstance(v, bool),
          "number": lambda v: isinstance(v, (int, float)) and not isinstance(v, bool),
          "string": lambda v: isinstance(v, str), "boolean": lambda v: isinstance(v, bool),
          "array": lambda v: isinstance(v, list), "object": lambda v: isinstance(v, dict)}


class Kind:
    """What a field holds in JSON: its `types` (JSON Schema names), how it reads (after the
    type check) and writes, and its schema."""

    types: tuple[str, ...] = ()

    def fits(self, value: Any) -> bool:
        return any(_TYPES[t](value) for t in self.types)

    def read(self, value: Any, at: At) -> Any:
        return value

    def write(self, value: Any, owner: Any) -> Any:
        return value

    def schema(self) -> dict[str, Any]:
        return {"type": self.types[0] if len(self.types) == 1 else list(self.types)}


@dataclass(frozen=True)
class Int(Kind):
    """An integer in [min, max]."""

    min: int = 0
    max: int = MAX_COUNT
    types = ("integer",)

    def fits(self, value: Any) -> bool:
        return _TYPES["integer"](value) and self.min <= value <= self.max

    def read(self, value: int, at: At) -> int:
        if value < self.min:
            at.wrong(f"must be >= {self.min}, found {value}")
        if value > self.max:
            at.wrong(f"must be <= {self.max} (2**50), found {value}")
        return value

    def schema(self) -> dict[str, Any]:
        return {"type": "integer", "minimum": self.min, "maximum": self.max}


@dataclass(frozen=True)
class Num(Kind):
    """A finite number in [min, max], read as a float."""

    min: float = 0.0
    max: float = MAX_NUMBER
    types = ("number",)

    def read(self, value: float, at: At) -> float:
        value = float(value)
        if not math.isfinite(value):
            at.wrong(f"must be a finite number, found {value}")
        if value < self.min:
            at.wrong(f"must be >= {self.min:g}, found {value:g}")
        if value > self.max:
            at.wrong(f"must be <= {self.max:g}, found {value:g}")
        return value

    def schema(self) -> dict[str, Any]:
        return {"type": "number", "minimum": self.min, "maximum": self.max}


@dataclass(frozen=True)
class Str(Kind):
    """A string; `choices` are its allowed values, which the artifact's `_validate` checks (so
    that a dataclass made in code is checked too) and the schema lists. A string that does not
    match `pattern` (a regular expression of the whole string) is refused on reading: it is not
    `means` (what it must be, in words)."""

    choices: tuple[str, ...] = ()
    pattern: str = ""
    means: str = ""
    types = ("string",)

    def read(self, value: str, at: At) -> str:
        if self.pattern and not re.fullmatch(self.pattern, value):
            at.wrong(f"expected {self.means or 'a string matching ' + self.pattern}, found {describe(value)}")
        return value

    def schema(self) -> dict[str, Any]:
        if self.choices:
            return {"enum": list(self.choices)}
        return {"type": "string", **({"pattern": f"^(?:{self.pattern})$"} if self.pattern else {})}


@dataclass(frozen=True)
class Const(Kind):
    """The string `value` and no other (an artifact's `schema`), or one of the `older` values
    (formats written before, read as they were)."""

    value: str
    fix: str
    older: tuple[str, ...] = ()
    types = ("string",)

    def read(self, value: str, at: At) -> str:
        if value != self.value and value not in self.older:
            at.wrong(f"schema is {value!r}, expected {self.value!r}", self.fix)
        return value

    def schema(self) -> dict[str, Any]:
        return {"enum": [*self.older, self.value]} if self.older else {"const": self.value}


class Bool(Kind):
    types = ("boolean",)


class Obj(Kind):
    """Any JSON object (e.g. a model factory's keyword arguments)."""

    types = ("object",)

    def read(self, value: dict, at: At) -> dict:
        return dict(value)


@dataclass(frozen=True, kw_only=True)
class ListOf(Kind):
    """A list of `item`s, read as a tuple (`sort`: sorted); a wrong item is `problem` (with the
    list as {value}, or with `each` the item at its own place); `fix` says what to do."""

    item: Kind
    problem: str
    fix: str
    sort: bool = False
    each: bool = False
    min_items: int = 0  # in the schema; the artifact checks it by hand, with its own message
    types = ("array",)

    def read(self, value: list, at: At) -> tuple:
        for index, item in enumerate(value):
            if not self.item.fits(item):
                (at.at(index) if self.each else at).wrong(self.problem.format(value=item if self.each else value),
                                                          self.fix)
        items = [self.item.read(item, at.at(index)) for index, item in enumerate(value)]
        return tuple(sorted(items) if self.sort else items)

    def write(self, value: tuple, owner: Any) -> list:
        return [self.item.write(item, owner) for item in value]

    def schema(self) -> dict[str, Any]:
        return {"type": "array", "items": self.item.schema(), **({"minItems": self.min_items} if self.min_items else {})}


class Pair(Kind):
    """Two integers [a, b], read as a tuple (a profile's edge)."""

    types = ("array",)

    def fits(self, value: Any) -> bool:
        return isinstance(value, list) and len(value) == 2 and all(_TYPES["integer"](x) for x in value)

    def read(self, value: list, at: At) -> tuple[int, int]:
        return value[0], value[1]

    def write(self, value: tuple, owner: Any) -> list:
        return list(value)

    def schema(self) -> dict[str, Any]:
        return {"type": "array", "prefixItems": [{"type": "integer", "minimum": 0}] * 2, "minItems": 2, "maxItems": 2}


@dataclass(frozen=True)
class Record(Kind):
    """A nested record of dataclass `cls` (`as_dict`: kept as the JSON object, once checked)."""

    cls: type
    as_dict: bool = False
    types = ("object",)

    def read(self, value: dict, at: At) -> Any:
        record = read(self.cls, value, at)
        return dict(value) if self.as_dict else record

    def write(self, value: Any, owner: Any) -> Any:
        return dict(value) if self.as_dict else write(value, owner)

    def schema(self) -> dict[str, Any]:
        name = getattr(self.cls, "SCHEMA_NAME", "")
        return {"$ref": f"urn:pdtool:schema:{name}"} if name else object_schema(self.cls)


@dataclass(frozen=True)
class MapOf(Kind):
    """A JSON object of `item`s under keys matching `keys` (a regular expression of the whole
    key, `means` in words), read as a dict (`number`: the keys read as integers, written back
    as decimal text, so `keys` should match only the decimal form of a number)."""

    item: Kind
    keys: str
    means: str
    number: bool = False
    types = ("object",)

    def read(self, value: dict, at: At) -> dict:
        found = {}
        for key, item in value.items():
            if not re.fullmatch(self.keys, key):
                at.wrong(f"key {key!r} is not {self.means}", "fix the key or regenerate the file")
            found[int(key) if self.number else key] = typed(self.item, item, at.at(key))
        return found

    def write(self, value: dict, owner: Any) -> dict:
        return {str(key): self.item.write(item, owner) for key, item in value.items()}

    def schema(self) -> dict[str, Any]:
        return {"type": "object", "propertyNames": {"pattern": f"^(?:{self.keys})$"},
                "additionalProperties": self.item.schema()}


@dataclass(frozen=True)
class Records(Kind):
    """A list of nested records of dataclass `cls`, read as a tuple; each knows its index."""

    cls: type
    min_items: int = 0  # in the schema; the artifact checks it by hand, with its own message
    types = ("array",)

    def read(self, value: list, at: At) -> tuple:
        return tuple(read(self.cls, item, at.at(index), index) for index, item in enumerate(value))

    def write(self, value: tuple, owner: Any) -> list:
        return [write(item, owner, index) for index, item in enumerate(value)]

    def schema(self) -> dict[str, Any]:
        return {"type": "array", **({"minItems": self.min_items} if self.min_items else {}),
                "items": object_schema(self.cls)}


@dataclass(frozen=True)
class Shared(Kind):
    """Parameters used by several layers or stages (tied weights): `[{"param": NAME, ids: [ID,
    ...]}, ...]`, read as `((NAME, (ID, ...)), ...)`."""

    ids: str  # "layers" or "stages"
    types = ("array",)

    def _members(self) -> tuple[Member, ...]:
        return (
            Member(name="param", key="param", kind=Str()),
            Member(
                name=self.ids,
                key=self.ids,
                kind=ListOf(item=Int(), problem=f"expected a list of {self.ids[:-1]} ids",
                            fix=f"list the {self.ids} that use the parameter", min_items=2),
            ),
        )

    def read(self, value: list, at: At) -> tuple:
        found = []
        for index, item in enumerate(value):
            values = read_members(self._members(), item, at.at(index))
            found.append((values["param"], values[self.ids]))
        return tuple(found)

    def write(self, value: tuple, owner: Any) -> list:
        return [{"param": name, self.ids: list(ids)} for name, ids in value]

    def schema(self) -> dict[str, Any]:
        return {"type": "array", "items": _object_schema(self._members())}


@dataclass(frozen=True, kw_only=True)
class Member:
    """One JSON field of a record: attribute `name`, JSON `key` (inside its group), `kind`;
    `required` in a file, `absent` the value when it is not, written unless it equals `omit`.
    A derived member has `get(record, owner, index)`: written, checked on reading, not kept."""

    name: str
    key: str
    kind: Kind
    null: bool = False
    required: bool = True
    absent: Any = None  # a value, or a function of the values read before it
    omit: Any = NEVER
    doc: str = ""
    get: Callable | None = None

    def missing(self, values: dict[str, Any]) -> Any:
        return self.absent(values) if callable(self.absent) else self.absent


def field(kind: Kind, default: Any = MISSING, *, key: str | None = None, null: bool = False,
          required: bool | None = None, missing: Any = MISSING, omit: Any = NEVER, doc: str = "",
          factory: Callable | None = None) -> Any:
    """A dataclass field declared with its JSON form (`Member`): `key` defaults to the field's
    name; a field with a default may be absent from a file unless `required`; `missing` (a
    value, or a function of the values read before it) replaces the default on reading."""
    spec = dict(key=key, kind=kind, null=null, required=required, missing=missing, omit=omit, doc=doc)
    if factory is not None:
        return dataclasses.field(default_factory=factory, metadata={"json": spec})
    return dataclasses.field(default=default, metadata={"json": spec})


def derived(key: str, kind: Kind, get: Callable, *, null: bool = False, required: bool = False,
            doc: str = "") -> Member:
    """A figure derived from the record (`get(record, owner, index)`), written for readers."""
    return Member(name=key, key=key, kind=kind, null=null, required=required, doc=doc, get=get)


@dataclass(frozen=True)
class Group:
    """Members written in the nested object `key`; `optional`: null or absent when its first
    member is None."""

    key: str
    members: tuple[Member, ...]
    optional: bool


@functools.cache
def layout(cls: type) -> tuple[Member | Group, ...]:
    """The JSON fields of record `cls`, in order: members and groups, then derived figures."""
    items: list[Member | Group] = []
    groups: dict[str, list[Member]] = {}
    for f in dataclasses.fields(cls):
        spec = f.metadata["json"]
        if spec["missing"] is not MISSING:
            absent = spec["missing"]
        elif f.default_factory is not MISSING:
            absent = lambda _, make=f.default_factory: make()  # noqa: E731
        else:
            absent = f.default
        required = f.default is MISSING and f.default_factory is MISSING if spec["required"] is None else spec["required"]
        group, _, key = (spec["key"] or f.name).rpartition(".")
        member = Member(name=f.name, key=key, kind=spec["kind"], null=spec["null"], required=required, absent=absent,
                        omit=spec["omit"], doc=spec["doc"])
        if group and group not in groups:
            groups[group] = []
            items.append(Group(group, (), False))
        (groups[group].append(member) if group else items.append(member))
    items = [Group(i.key, tuple(groups[i.key]), groups[i.key][0].absent is None) if isinstance(i, Group) else i
             for i in items]
    return tuple(items) + tuple(getattr(cls, "DERIVED", ()))


def _object(data: Any, at: At, known) -> None:
    if not isinstance(data, dict):
        at.wrong(f"expected an object, found {describe(data)}", "regenerate the file")
    unknown = sorted(set(data) - set(known))
    if unknown:
        at.wrong(f"unknown field {unknown[0]!r}", f"remove it (known fields: {', '.join(sorted(known))})")


def _member(member: Member, data: dict, at: At, values: dict[str, Any]) -> Any:
    if member.key not in data:
        if member.required:
            at.wrong("missing field", "regenerate the file with the current pdtool", member.key)
        return member.missing(values)
    return typed(member.kind, data[member.key], at.at(member.key), member.null)


def typed(kind: Kind, value: Any, at: At, null: bool = False) -> Any:
    """`value` at `at` read as `kind` (None when it is null and may be), once its JSON type is checked."""
    if value is None and null:
        return None
    if not any(_TYPES[t](value) for t in kind.types):
        wanted = [TYPE_NAMES[t] for t in kind.types] + (["null"] if null else [])
        at.wrong(f"expected {' or '.join(wanted)}, found {describe(value)}")
    return kind.read(value, at)


def read_members(items, data: Any, at: At) -> dict[str, Any]:
    """The values of `items` (members and groups) in the JSON object `data`, by attribute name."""
    _object(data, at, [item.key for item in items])
    values: dict[str, Any] = {}
    for item in items:
        if isinstance(item, Member):
            values[item.name] = _member(item, data, at, values)
        elif data.get(item.key) is None and item.optional:
            values.update((m.name, m.missing(values)) for m in item.members)
        elif item.key not in data:
            at.wrong("missing field", "regenerate the file with the current pdtool", item.key)
        else:
            values.update(read_members(item.members, data[item.key], at.at(item.key)))
    return values


def read(cls: type, data: Any, at: At, index: int | None = None) -> Any:
    """The record `cls` of the JSON object `data` at `at` (the `index`-th of its list)."""
    values = read_members(layout(cls), data, at)
    derived_values = {m.name: values.pop(m.name) for m in layout(cls) if isinstance(m, Member) and m.get}
    check = getattr(cls, "_read_check", None)
    if check is not None:
        check(at, values, derived_values, index)
    if _takes_source(cls):
        values["source"] = at.source
    return cls(**values)


@functools.cache
def _takes_source(cls: type) -> bool:
    """Whether `cls` takes the file's name (to name it in the messages of its own checks)."""
    return "source" in inspect.signature(cls).parameters


def write(record: Any, owner: Any = None, index: int | None = None) -> dict[str, Any]:
    """The JSON tree of `record` (`owner`: the record holding it, as the `index`-th of a list)."""
    return _write(layout(type(record)), record, owner, index)


def _write(items, record: Any, owner: Any, index: int | None) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for item in items:
        if isinstance(item, Group):
            empty = item.optional and getattr(record, item.members[0].name) is None
            out[item.key] = None if empty else _write(item.members, record, owner, index)
        elif item.get is not None:
            out[item.key] = item.get(record, owner, index)
        else:
            value = getattr(record, item.name)
            if item.omit is NEVER or value != item.omit:
                out[item.key] = None if value is None else item.kind.write(value, record)
    return out


def object_schema(cls: type) -> dict[str, Any]:
    """The JSON Schema of record `cls`'s object."""
    return _object_schema(layout(cls))


def _object_schema(items) -> dict[str, Any]:
    properties: dict[str, Any] = {}
    for item in items:
        if isinstance(item, Group):
            schema = _object_schema(item.members)
            if item.optional:
                schema["type"] = ["object", "null"]
        else:
            schema = item.kind.schema()
            if item.null:
                schema["type"] = [*([schema["type"]] if isinstance(schema["type"], str) else schema["type"]), "null"]
            if item.doc:
                schema["description"] = item.doc
        properties[item.key] = schema
    required = [item.key for item in items if (not item.optional if isinstance(item, Group) else item.required)]
    return {"type": "object", "additionalProperties": False, "required": required, "properties": properties}


class Artifact:
    """Mixin of a whole artifact (one file): `from_json` reads it, `to_json` writes it.
    `SCHEMA_NAME` names its schema (schemas/NAME.schema.json), which the messages cite."""

    SCHEMA_NAME = ""

    @classmethod
    def from_json(cls, data: Any, source: str | None = None):
        """Parse and check a document read from JSON; every problem is one `ArtifactError` line
        naming `source` (default: the schema's name)."""
        source = source or cls.SCHEMA_NAME
        cls._check_raw(data, source)
        return read(cls, data, At(source, "", f"(schema: pdtool/artifacts/schemas/{cls.SCHEMA_NAME}.schema.json)"))

    @classmethod
    def _check_raw(cls, data: Any, source: str) -> None:
        """Checks of the document before its fields are read (e.g. what kind of file it is)."""

    def to_json(self) -> dict[str, Any]:
        return write(self)

    @classmethod
    def load(cls, path: str | os.PathLike):
        return cls.from_json(read_json(path), str(path))

    def save(self, path: str | os.PathLike) -> None:
        write_json(path, self.to_json())
