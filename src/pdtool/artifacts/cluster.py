"""The cluster a plan is made for: levels of workers, innermost first, and memory per worker.

A cluster is a hierarchy (PipeDream, SOSP 2019, section 3.1): level 0 groups `count` workers
(GPUs of one server) linked at `bandwidth` bytes/s; level 1 groups `count` of those groups
(servers) at its own bandwidth; and so on. The number of workers is the product of the counts.
A level may also give its `latency`: the one-way time of a small message between two of its
units, as a ping-pong between two workers measures it (0 when not given); the simulator
charges it to every message and to every step of a ring all-reduce.

`parse_cluster` reads the three ways a user names one:

- levels, innermost first: `4x12GB/s,4x10Gbit/s` (spaces allowed, `4x V100 @ 12 GB/s` too),
  each with an optional latency after a `+`: `2x10Gbit/s+100us`;
- a JSON file: `{"levels": [{"count": 4, "bandwidth": "12GB/s", "latency": "5us"}, ...],
  "memory": "16GiB"}` (a bandwidth may also be a number in bytes/s, a latency in seconds, a
  memory size a number of bytes);
- a preset for the PipeDream paper's clusters: `cluster-a` or `cluster-b`, with the number of
  servers after a colon (`cluster-a:2`; 4 when omitted).

Bandwidths are bytes per second and memory is bytes everywhere in the code; text always
carries its unit (see `units`). Pure: no torch.
"""
from __future__ import annotations

import dataclasses
import math
import os
import re
from dataclasses import dataclass
from typing import Any, Callable

from ..errors import PlanError
from ..fields import At
from ..jsonio import read_json
from .record import Artifact, Const, Int, Kind, Records, Str, field
from ..units import (BANDWIDTH_FORMS, DURATION_FORMS, exact_bandwidth, exact_bytes, exact_duration,
                     format_bandwidth, format_bytes, format_duration, parse_bandwidth, parse_bytes, parse_duration)

SCHEMA = "pdtool.cluster/1"


MAX_WORKERS = 16384
"""Most workers a cluster may have: the planner's tables grow with the workers of a level."""
MIN_BANDWIDTH, MAX_BANDWIDTH = 1.0, 1e18
"""Bandwidths pdtool plans for, bytes/s: 1 B/s to 1 EB/s (a typo such as 2x1e-30B/s or 2x1e30GB/s is refused)."""
MAX_LATENCY = 10.0
"""Longest latency pdtool plans for, seconds (a typo such as 2x10GB/s+100s is refused)."""


@dataclass(frozen=True, kw_only=True)
class Quantity(Kind):
    """A number, or text with a unit that `parse` reads; written as the text `exact` makes (it
    parses back exactly). A value outside `ok` is `problem`, and `fix` says what to give."""

    parse: Callable[[str], float]
    exact: Callable[[float], str]
    convert: type
    ok: Callable[[float], bool]
    problem: str
    fix: str
    bound: tuple[str, float]  # its JSON Schema bound, e.g. ("minimum", 0)
    parse_fix: str = "fix the value"
    types = ("string", "number")

    def read(self, value: str | float, at: At) -> float:
        if isinstance(value, str):
            try:
                value = self.parse(value)
            except PlanError as exc:
                at.wrong(str(exc), self.parse_fix)
        if not (math.isfinite(value) and self.ok(value)):
            at.wrong(f"{self.problem}, found {value!r}", self.fix)
        return self.convert(value)

    def write(self, value: float, owner: Any) -> str:
        return self.exact(value)

    def schema(self) -> dict[str, Any]:
        return {"type": list(self.types), self.bound[0]: self.bound[1]}


@dataclass(frozen=True)
class Level:
    """One level of the hierarchy: `count` units (workers at level 0, servers at level 1, ...)
    and the `bandwidth` in bytes/s of the link between two units of this level; `latency` is
    the one-way time in seconds of a small message on that link."""

    count: int = field(Int(1))
    bandwidth: float = field(
        Quantity(parse=parse_bandwidth, exact=exact_bandwidth, convert=float, ok=lambda b: b > 0,
                 problem="must be positive", fix=f"give bytes/s as a number or text with a unit ({BANDWIDTH_FORMS})",
                 bound=("exclusiveMinimum", 0)),
        doc="bytes/s: a number, or text with a unit ('12GB/s', '10Gbit/s')",
    )
    latency: float = field(
        Quantity(parse=parse_duration, exact=exact_duration, convert=float, ok=lambda t: 0 <= t <= MAX_LATENCY,
                 problem=f"must be 0 to {MAX_LATENCY:g} s",
                 fix=f"give seconds as a number or text with a unit ({DURATION_FORMS})", bound=("minimum", 0)),
        0.0,
        omit=0.0,
        doc="one-way time of a small message between two units: seconds (a number), or text with "
        "a unit ('100us', '0.1ms'); 0 when absent",
    )

    def __post_init__(self) -> None:
        if isinstance(self.count, bool) or not isinstance(self.count, int) or self.count < 1:
            raise PlanError(f"a cluster level needs a count >= 1, not {self.count!r}; e.g. 4x12GB/s")
        if self.count > MAX_WORKERS:
            raise PlanError(f"a cluster level of {self.count} units is more than pdtool plans for (at most "
                            f"{MAX_WORKERS} workers in all); describe a smaller cluster")
        if isinstance(self.bandwidth, bool) or not isinstance(self.bandwidth, (int, float)) \
                or not (math.isfinite(self.bandwidth) and self.bandwidth > 0):
            raise PlanError(f"a cluster level needs a positive bandwidth in bytes/s, not {self.bandwidth!r}; "
                            f"e.g. {BANDWIDTH_FORMS}")
        if not MIN_BANDWIDTH <= self.bandwidth <= MAX_BANDWIDTH:
            raise PlanError(f"bandwidth {self.bandwidth:g} B/s is outside what pdtool plans for (1 B/s to 1 EB/s); "
                            f"give a real link's bandwidth, e.g. {BANDWIDTH_FORMS}")
        if isinstance(self.latency, bool) or not isinstance(self.latency, (int, float)) \
                or not (math.isfinite(self.latency) and 0 <= self.latency <= MAX_LATENCY):
            raise PlanError(f"a cluster level's latency must be 0 to {MAX_LATENCY:g} s, not {self.latency!r}; "
                            f"e.g. {DURATION_FORMS}")


@dataclass(frozen=True)
class Cluster(Artifact):
    """Levels innermost first, memory in bytes per worker (None = unlimited), and the preset
    `name` (e.g. "cluster-a:4") when it was built from one."""

    SCHEMA_NAME = "cluster"  # schemas/cluster.schema.json

    levels: tuple[Level, ...] = field(Records(Level, min_items=1))
    memory: int | None = field(
        Quantity(parse=parse_bytes, exact=exact_bytes, convert=int, ok=lambda m: m >= 1 and m == int(m),
                 problem="must be a whole number of bytes >= 1",
                 fix='fix it, write it with a unit ("16GiB") or write null for no limit', bound=("minimum", 1),
                 parse_fix="fix the value or write null for no limit"),
        None,
        null=True,
        doc="bytes per worker: a number, or text with a unit ('16GiB'); null for no limit",
    )
    name: str | None = field(Str(), None, null=True)
    schema: str = field(Const(SCHEMA, "give a cluster file or remove the field"), SCHEMA)

    def __post_init__(self) -> None:
        if not isinstance(self.levels, tuple) or not self.levels \
                or not all(isinstance(level, Level) for level in self.levels):
            raise PlanError("a cluster needs at least one level (a tuple of Level); e.g. 4x12GB/s,4x10Gbit/s")
        if self.workers > MAX_WORKERS:
            raise PlanError(f"a cluster of {self.workers} workers is more than pdtool plans for (at most {MAX_WORKERS}); "
                            "describe a smaller cluster")
        if self.memory is not None and (isinstance(self.memory, bool) or not isinstance(self.memory, int)
                                        or self.memory < 1):
            raise PlanError(f"memory per worker must be a whole number of bytes >= 1 or None, not {self.memory!r}")

    @property
    def workers(self) -> int:
        """Number of workers (GPUs): the product of the level counts."""
        return math.prod(level.count for level in self.levels)

    def describe(self) -> str:
        """One human line, e.g. "cluster-a:4 = 4x 12 GB/s, 4x 10 Gbit/s, 16 GiB per worker"."""
        parts = [f"{level.count}x {format_bandwidth(level.bandwidth, 'auto')}"
                 + (f" + {format_duration(level.latency)}" if level.latency else "") for level in self.levels]
        parts.append("no memory limit" if self.memory is None else f"{format_bytes(self.memory)} per worker")
        text = ", ".join(parts)
        return f"{self.name} = {text}" if self.name else text

    @classmethod
    def _read_check(cls, at: At, values: dict[str, Any], figures: dict[str, Any], index: int | None) -> None:
        if not values["levels"]:
            at.fail("a cluster needs at least one level", 'list levels innermost first, e.g. '
                    '[{"count": 4, "bandwidth": "12GB/s"}, {"count": 4, "bandwidth": "10Gbit/s"}]', "levels")


# ----- presets -----------------------------------------------------------------------------------
@dataclass(frozen=True, kw_only=True)
class _Preset:
    """A cluster of the PipeDream paper: `gpus` per server at `intra` bytes/s, servers at `inter`."""

    gpus: int
    intra: float
    inter: float
    memory: int
    about: str


_V100_MEMORY = 16 * 1024**3
# V100 16 GB (HBM2, 16 GiB on the card; CUDA reports about 15.8 GiB usable, and the original
# optimizer's default --memory_size is 16e9 bytes). Override with `--memory`.

PRESETS: dict[str, _Preset] = {
    # PipeDream (SOSP 2019), section 5.1, Cluster-A: Azure NC24 v3 servers, 4 V100 each over
    # PCIe, 10 Gbit/s Ethernet between servers. Intra-server figure is an assumption: PCIe 3.0
    # x16 peaks at 15.75 GB/s per direction (8 GT/s x 16 lanes x 128/130); GPU-to-GPU copies
    # reach about 12 GB/s in practice, so 12 GB/s.
    "cluster-a": _Preset(gpus=4, intra=12e9, inter=10e9 / 8, memory=_V100_MEMORY,
                         about="4 V100 per server over PCIe (12 GB/s), 10 Gbit/s between servers"),
    # Cluster-B: AWS p3.16xlarge servers, 8 V100 each over NVLink, 25 Gbit/s between servers.
    # Intra-server figure is an assumption: one NVLink 2.0 link moves 25 GB/s per direction. A
    # V100 has 6 links; in the DGX-1-style hybrid cube-mesh of p3.16xlarge a GPU pair shares
    # one or two links (25 or 50 GB/s) or none (two hops), so 25 GB/s per unit link is the
    # conservative figure for a directly linked pair.
    "cluster-b": _Preset(gpus=8, intra=25e9, inter=25e9 / 8, memory=_V100_MEMORY,
                         about="8 V100 per server over NVLink (25 GB/s), 25 Gbit/s between servers"),
}
DEFAULT_SERVERS = 4

_FORMS = ("levels innermost first like 4x12GB/s,4x10Gbit/s, a JSON file like cluster.json, "
          f"or a preset ({', '.join(f'{name}[:SERVERS]' for name in PRESETS)})")
_PRESET_RE = re.compile(r"^(?P<name>[A-Za-z][\w.-]*)(?:\s*:\s*(?P<servers>.*))?$")
_LEVEL_START_RE = re.compile(r"^[+-]?[0-9]+\s*[xX*]")  # [0-9], not \d: int() would take '٢' or '２' too
_LEVEL_RE = re.compile(r"^(?P<count>[+-]?[0-9]+)\s*[xX*]\s*(?:(?P<label>[^@]*?)\s*@\s*)?(?P<bandwidth>.+)$")


def preset(name: str, servers: int = DEFAULT_SERVERS) -> Cluster:
    """The preset cluster `name` with `servers` servers (see `PRESETS` for the figures)."""
    key = name.strip().lower()
    if key not in PRESETS:
        raise PlanError(f"unknown cluster preset {name!r}; use one of: "
                        + "; ".join(f"{n} ({p.about})" for n, p in PRESETS.items()))
    if isinstance(servers, bool) or not isinstance(servers, int) or servers < 1:
        raise PlanError(f"preset {key} needs a server count >= 1, not {servers!r}; e.g. {key}:{DEFAULT_SERVERS}")
    p = PRESETS[key]
    return Cluster(levels=(Level(p.gpus, p.intra), Level(servers, p.inter)), memory=p.memory,
                   name=f"{key}:{servers}")


def parse_cluster(spec: str, memory: str | None = None) -> Cluster:
    """The cluster named by `spec` (levels, JSON file or preset); `memory` (e.g. "16GiB"), when
    given, replaces the memory per worker the spec says.

    A malformed spec raises `PlanError`, a bad JSON file `ArtifactError`: one line each,
    naming what was given and the accepted forms.
    """
    text = spec.strip() if isinstance(spec, str) else ""
    if not text:
        raise PlanError(f"empty cluster spec {spec!r}; give {_FORMS}")
    match = _PRESET_RE.match(text)
    if match and match["name"].lower() in PRESETS:
        cluster = preset(match["name"], _servers(match["name"].lower(), match["servers"]))
    elif os.path.isfile(text):
        cluster = Cluster.from_json(read_json(text), text)
    elif _foreign_digit(text):
        digit = _foreign_digit(text)
        raise PlanError(f"cluster spec {text!r} has {digit!r} (U+{ord(digit):04X}), a digit other than 0-9; write "
                        "numbers with the digits 0-9, e.g. 4x12GB/s,4x10Gbit/s or cluster-a:4")
    elif _LEVEL_START_RE.match(text):
        cluster = _parse_levels(text)
    elif _is_bandwidth(text):
        raise PlanError(f"cluster spec {text!r} gives a bandwidth but no count; write COUNTxBANDWIDTH levels "
                        f"innermost first, e.g. 8x{text.replace(' ', '')} or 4x12GB/s,4x10Gbit/s")
    elif text.lower().endswith(".json") or "/" in text or os.sep in text:
        cluster = Cluster.from_json(read_json(text), text)  # read_json names the missing file
    elif match:
        raise PlanError(f"unknown cluster preset {text!r}; give {_FORMS}")
    else:
        raise PlanError(f"cluster spec {text!r} is not understood; give {_FORMS}")
    if memory is not None:
        cluster = dataclasses.replace(cluster, memory=parse_bytes(memory))
    return cluster


def _is_bandwidth(text: str) -> bool:
    try:
        parse_bandwidth(text)
    except PlanError:
        return False
    return True


def _foreign_digit(text: str) -> str | None:
    """The first character of `text` that is a digit but not one of 0-9 ('٢', '２', '¹'), or None."""
    return next((c for c in text if c.isdigit() and not c.isascii()), None)


def _servers(name: str, text: str | None) -> int:
    if text is None:
        return DEFAULT_SERVERS
    if not re.fullmatch(r"\s*[+-]?[0-9]+\s*", text) or int(text) < 1:
        raise PlanError(f"server count {text!r} in '{name}:{text}' must be a whole number >= 1 written with the "
                        f"digits 0-9; e.g. {name}:{DEFAULT_SERVERS}")
    return int(text)


def _parse_levels(text: str) -> Cluster:
    """`COUNTxBANDWIDTH[+LATENCY][,...]`, innermost first; a level may read `4x V100 @ 12GB/s`."""
    levels = []
    parts = text.split(",")
    for index, raw in enumerate(parts, 1):
        part = raw.strip()
        where = f"cluster level {index} of {len(parts)}"
        if not part:
            raise PlanError(f"{where} in {text!r} is empty; write COUNTxBANDWIDTH levels joined by commas, "
                            "e.g. 4x12GB/s,4x10Gbit/s")
        match = _LEVEL_RE.match(part)
        if match is None:
            raise PlanError(f"{where} {part!r} is malformed; write COUNTxBANDWIDTH, e.g. 4x12GB/s or 4x10Gbit/s")
        count = int(match["count"])
        if count < 1:
            raise PlanError(f"{where} {part!r} has count {count}; a level needs at least 1 unit, e.g. 4x12GB/s")
        bandwidth_text, latency = match["bandwidth"], 0.0
        head, plus, tail = bandwidth_text.rpartition("+")
        if plus and _is_bandwidth(head):  # BANDWIDTH+LATENCY (an exponent's + leaves no bandwidth before it)
            bandwidth_text = head
            try:
                latency = parse_duration(tail)
            except PlanError:
                raise PlanError(f"{where} {part!r}: latency {tail.strip()!r} is not understood; write a time with a "
                                f"unit after the +, e.g. 2x10Gbit/s+100us ({DURATION_FORMS})") from None
        try:
            bandwidth = parse_bandwidth(bandwidth_text)
        except PlanError as exc:
            raise PlanError(f"{where} {part!r}: {exc}") from None
        levels.append(Level(count, bandwidth, latency))
    return Cluster(levels=tuple(levels))
