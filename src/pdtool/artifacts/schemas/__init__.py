"""JSON Schemas of pdtool's files, and validation against them.

`profile.schema.json`, `plan.schema.json` and `cluster.schema.json` (JSON Schema 2020-12, in
this folder) describe the structure of every file `pd` reads and writes: fields, types, ranges
and enumerations. `check_document` checks a parsed document against one of them and turns the
first problem into the one-line `ArtifactError` every malformed file gets
(`FILE: FIELD: PROBLEM; FIX`). What a schema cannot say (layer ids in order, edges between
existing layers, ranks used once, ...) the artifact classes check after it.
"""
from __future__ import annotations

import functools
import importlib.resources
import json
from typing import Any

from ...errors import ArtifactError
from ...fields import describe

NAMES = ("profile", "plan", "cluster")
_TYPES = {"integer": "an integer", "number": "a number", "string": "a string", "boolean": "true or false",
          "array": "a list", "object": "an object", "null": "null"}


def schema(name: str) -> dict[str, Any]:
    """The schema `name` (one of NAMES) as a JSON tree."""
    return json.loads(_text(name))


def check_document(data: Any, name: str, source: str) -> None:
    """Raise ArtifactError naming `source` and the field unless `data` satisfies schema `name`."""
    import jsonschema

    error = jsonschema.exceptions.best_match(_validator(name).iter_errors(data))
    if error is not None:
        raise ArtifactError(_explain(error, name, source))


class SchemaChecked:
    """Mixin of the artifact classes: `from_json` reads a document with the class's own `_read`
    (its specific messages come first), then checks it against the schema `SCHEMA_NAME`, so
    every file pdtool accepts satisfies its published schema."""

    SCHEMA_NAME = ""

    @classmethod
    def from_json(cls, data: Any, source: str | None = None):
        """Parse and check a document read from JSON; every problem is one `ArtifactError` line
        naming `source` (default: the schema's name)."""
        source = source or cls.SCHEMA_NAME
        parsed = cls._read(data, source)
        check_document(data, cls.SCHEMA_NAME, source)
        return parsed

    @classmethod
    def _read(cls, data: Any, source: str):
        raise NotImplementedError


def _text(name: str) -> str:
    if name not in NAMES:
        raise ValueError(f"no schema {name!r}")
    return importlib.resources.files(__name__).joinpath(f"{name}.schema.json").read_text()


@functools.lru_cache(maxsize=None)
def _validator(name: str):
    import jsonschema
    from referencing import Registry, Resource

    registry = Registry().with_resources((schema(other)["$id"], Resource.from_contents(schema(other))) for other in NAMES)
    return jsonschema.Draft202012Validator(schema(name), registry=registry)


def _explain(error, name: str, source: str) -> str:
    """One line for a jsonschema error: where, what, and how to fix it."""
    where = "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in error.absolute_path).lstrip(".")
    kind, value, expected = error.validator, error.instance, error.validator_value
    fix = "fix the value or regenerate the file"
    if kind == "required":
        missing = next((k for k in expected if isinstance(value, dict) and k not in value), expected[0])
        where, problem, fix = ".".join(p for p in (where, missing) if p), "missing field", \
            "regenerate the file with the current pdtool"
    elif kind == "additionalProperties":
        allowed = sorted(error.schema.get("properties", {}))
        extra = sorted(set(value) - set(allowed))
        problem, fix = f"unknown field {extra[0]!r}", f"remove it (known fields: {', '.join(allowed)})"
    elif kind == "type":
        wanted = expected if isinstance(expected, list) else [expected]
        problem = f"expected {' or '.join(_TYPES.get(t, t) for t in wanted)}, found {describe(value)}"
    elif kind in ("minimum", "exclusiveMinimum"):
        problem = f"must be {'>=' if kind == 'minimum' else '>'} {expected:g}, found {value!r}"
    elif kind in ("enum", "const"):
        choices = expected if kind == "enum" else [expected]
        problem = f"is {value!r}, expected {' or '.join(repr(c) for c in choices)}"
    elif kind == "minItems":
        problem = f"needs at least {expected} item{'s' if expected > 1 else ''}, found {len(value)}"
    elif kind == "maxItems":
        problem = f"has {len(value)} items, at most {expected} allowed"
    else:
        problem = error.message
    location = f"{source}: {where}: " if where else f"{source}: "
    return f"{location}{problem}; {fix} (schema: pdtool/artifacts/schemas/{name}.schema.json)"

