"""JSON Schemas of pdtool's files, made from the artifacts' declarations (`artifacts.record`).

`profile.schema.json`, `plan.schema.json`, `cluster.schema.json` and `manifest.schema.json` (a
checkpoint's manifest; JSON Schema 2020-12, in this folder) publish the structure of every file `pd` reads and writes: fields, types, ranges
and enumerations. They are generated: `python -m pdtool.artifacts.schemas` writes them again
from `generate`, and a test checks they are current. pdtool's own reader checks the same
declarations, so it does not use them; `check_document` checks a document against one (for
other tools, and tests) and turns the first problem into the one-line `ArtifactError` every
malformed file gets (`FILE: FIELD: PROBLEM; FIX`).
"""
from __future__ import annotations

import functools
import importlib.resources
import json
from pathlib import Path
from typing import Any

from ...errors import ArtifactError
from ...fields import describe

NAMES = ("profile", "plan", "cluster", "manifest")
ABOUT = {
    "profile": ("pdtool profile (pdtool.profile/1)", "A measured layer graph of one model at one minibatch size on "
                "one device (pd profile). Layers are listed in a topological order, ids 0, 1, 2, ...; edges go from a "
                "lower id to a higher one."),
    "plan": ("pdtool plan (pdtool.plan/2; reads /1)", "Stages, replicas and ranks for one profile on one cluster, the schedule "
             "mode and the cost model's prediction (pd plan). pd train executes it."),
    "cluster": ("pdtool cluster (pdtool.cluster/1)", "A hierarchy of workers: levels innermost first, each `count` "
                "units of the level below joined at `bandwidth`. Bandwidths are bytes/s (a number) or text with a "
                "unit: '12GB/s', '10Gbit/s'. A level may give `latency`, seconds or text ('100us'). `memory` is per "
                "worker, bytes or text ('16GiB'), null for no limit."),
    "manifest": ("pdtool checkpoint manifest (pdtool.checkpoint/1)", "The manifest.json of a checkpoint folder "
                 "(pd train --checkpoint-dir): the shard file of each stage with its sha256, written last, so a "
                 "checkpoint is complete when its manifest is there and every shard matches it."),
}
"""Each schema's title and description."""


def generate(name: str) -> dict[str, Any]:
    """The schema `name` (one of NAMES) as the artifact's declarations make it."""
    from ..cluster import Cluster
    from ..manifest import Manifest
    from ..plan import Plan
    from ..profile import Profile
    from ..record import object_schema

    title, description = ABOUT[name]
    return {"$schema": "https://json-schema.org/draft/2020-12/schema", "$id": f"urn:pdtool:schema:{name}",
            "title": title, "description": description,
            **object_schema({"profile": Profile, "plan": Plan, "cluster": Cluster, "manifest": Manifest}[name])}


def generated_text(name: str) -> str:
    """The text of schema `name` as this folder holds it."""
    return json.dumps(generate(name), indent=2) + "\n"


def main() -> None:
    """Write every schema into this folder from the declarations."""
    for name in NAMES:
        (Path(__file__).parent / f"{name}.schema.json").write_text(generated_text(name))
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

