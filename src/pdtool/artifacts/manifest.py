"""The manifest of a checkpoint (`manifest.json`): which shard file of each stage, with its sha256,
completes the checkpoint taken after `step` optimizer steps of the plan `plan_sha256`.

Declared once (`artifacts.record`): reading, writing and `schemas/manifest.schema.json` come from
the fields below. `checkpoint` writes and reads the file (`write_manifest`, `read_manifest`) and
checks the shards it names. Pure: no torch.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..errors import ArtifactError
from .record import Artifact, Const, Int, MapOf, Obj, Record, Str, field

SCHEMA = "pdtool.checkpoint/1"
RUN_ID = "[A-Za-z0-9]{1,64}"
"""A run id: what `shard_name` puts in a file name (12 hex digits as `pd train` makes them)."""
RUN_ID_MEANS = "1-64 ASCII letters and digits"


@dataclass(frozen=True)
class ShardFile:
    """One stage's shard: its file in the checkpoint's folder and the file's sha256 (hex)."""

    file: str = field(Str(pattern=r"(?!\.\.?$)[^/]+", means="a file name in the checkpoint's folder (no '/', "
                          "not '.' or '..')"))
    sha256: str = field(Str())


@dataclass(frozen=True, kw_only=True)
class Manifest(Artifact):
    """A checkpoint's manifest: `shards` maps each stage to its `ShardFile`, `meta` is free JSON
    data (the schedule mode, samples seen, ...), `run` the run whose shards it completes (None,
    and absent from the file, for checkpoints of pdtool versions before run ids)."""

    SCHEMA_NAME = "manifest"  # schemas/manifest.schema.json

    step: int = field(Int(), doc="optimizer steps taken before the checkpoint")
    plan_sha256: str = field(Str(), doc="sha256 (hex) of the plan file the run trained")
    shards: dict[int, ShardFile] = field(MapOf(Record(ShardFile), "0|[1-9][0-9]*", "a stage number (decimal digits)",
                                               number=True), doc="each stage's shard, by stage number")
    meta: dict[str, Any] = field(Obj(), factory=dict, required=True, doc="free JSON data of the run")
    run: str | None = field(Str(pattern=RUN_ID, means=f"a run id ({RUN_ID_MEANS})"), None, omit=None,
                            doc="the run that wrote the shards; absent in checkpoints of older pdtool versions")
    schema: str = field(Const(SCHEMA, ""), SCHEMA, required=True)

    @classmethod
    def _check_raw(cls, data: Any, source: str) -> None:
        if not isinstance(data, dict) or data.get("schema") != SCHEMA:
            found = data.get("schema") if isinstance(data, dict) else type(data).__name__
            raise ArtifactError(f"{source}: schema {found!r} is not {SCHEMA!r}; this is not a pdtool checkpoint manifest")
