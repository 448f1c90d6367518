"""Bandwidths, memory sizes and latencies written with explicit units, and back.

Bandwidths are held in **bytes per second** (float), memory sizes in **bytes** (int),
latencies in **seconds** (float; text in `s`, `ms`, `us` or `ns`).
Text always carries its unit, and a `B` is a byte while a `b` or `bit` is a bit, so the two
are never confused: `10Gbit/s` == `10Gb/s` == 1.25e9 B/s, `12GB/s` == 12e9 B/s.

Prefixes: decimal `k` (or `K`), `M`, `G`, `T` are powers of 1000; binary `Ki`, `Mi`, `Gi`,
`Ti` are powers of 1024. Spaces between number, prefix and unit are allowed
(`12 GB/s`, `16 GiB`). Pure: no torch.
"""
from __future__ import annotations

import math
import re

from .errors import PlanError

_DECIMAL = {"": 1, "k": 1000, "K": 1000, "M": 1000**2, "G": 1000**3, "T": 1000**4}
_BINARY = {"Ki": 1024, "Mi": 1024**2, "Gi": 1024**3, "Ti": 1024**4}
_PREFIXES = {**_DECIMAL, **_BINARY}

_NUMBER = r"(?P<number>[0-9]+(?:\.[0-9]*)?(?:[eE][+-]?[0-9]+)?|\.[0-9]+(?:[eE][+-]?[0-9]+)?)"
_PREFIX = r"(?P<prefix>[kKMGT]i?)?"
_BANDWIDTH_RE = re.compile(rf"^{_NUMBER}\s*{_PREFIX}\s*(?:(?P<unit>B|bit|b)\s*/\s*s|(?P<bps>bps))$")
_BYTES_RE = re.compile(rf"^{_NUMBER}\s*{_PREFIX}\s*(?P<unit>B|bytes?|bits?|b)$")

_DURATION_RE = re.compile(rf"^{_NUMBER}\s*(?P<unit>s|ms|us|µs|ns)$")
_SECONDS = {"s": 1.0, "ms": 1e-3, "us": 1e-6, "µs": 1e-6, "ns": 1e-9}
DURATION_FORMS = "100us, 0.1ms, 2ms, 1e-4s"
BANDWIDTH_FORMS = "12GB/s, 1.5GiB/s, 500MB/s, 1.25e9B/s (bytes) or 10Gbit/s, 10Gb/s, 10Gbps (bits)"
BYTES_FORMS = "16GiB, 16GB, 512MiB, 1e9B"


def parse_bandwidth(text: str) -> float:
    """Bytes per second of a bandwidth such as `12GB/s`, `1.5GiB/s` or `10Gbit/s` (bits ÷ 8).

    Raises `PlanError` (one line naming the text and the accepted forms) for anything else,
    including a bandwidth that is not positive.
    """
    raw = str(text)
    match = _BANDWIDTH_RE.match(raw.strip())
    if match is None:
        raise PlanError(f"bandwidth {raw!r} is not understood; write a number with a unit, e.g. {BANDWIDTH_FORMS}")
    value = float(match["number"]) * _PREFIXES[match["prefix"] or ""]
    if match["bps"] or match["unit"] in ("bit", "b"):
        value /= 8
    if not (math.isfinite(value) and value > 0):
        raise PlanError(f"bandwidth {raw!r} must be positive and finite; e.g. {BANDWIDTH_FORMS}")
    return value


def parse_bytes(text: str) -> int:
    """Bytes of a memory size such as `16GiB`, `16GB`, `512MiB` or `1e9B` (rounded to a whole byte).

    Memory is given in bytes (`B`); a size in bits, a bare number or anything else raises
    `PlanError` naming the text and the accepted forms, and so does a size under one byte.
    """
    raw = str(text)
    match = _BYTES_RE.match(raw.strip())
    if match is None:
        raise PlanError(f"memory size {raw!r} is not understood; write a number with a unit, e.g. {BYTES_FORMS}")
    if match["unit"].startswith("b") and not match["unit"].startswith("byte"):
        raise PlanError(f"memory size {raw!r} is in bits; give memory in bytes (B), e.g. {BYTES_FORMS}")
    value = float(match["number"]) * _PREFIXES[match["prefix"] or ""]
    if not math.isfinite(value) or round(value) < 1:
        raise PlanError(f"memory size {raw!r} must be at least one byte; e.g. {BYTES_FORMS}")
    return int(round(value))


def parse_duration(text: str) -> float:
    """Seconds of a latency such as `100us`, `0.1ms` or `1e-4s` (zero allowed).

    Raises `PlanError` naming the text and the accepted forms for anything else (a bare number,
    a negative or infinite time)."""
    raw = str(text)
    match = _DURATION_RE.match(raw.strip())
    if match is None:
        raise PlanError(f"latency {raw!r} is not understood; write a number with a unit, e.g. {DURATION_FORMS}")
    value = float(match["number"]) * _SECONDS[match["unit"]]
    if not math.isfinite(value):
        raise PlanError(f"latency {raw!r} must be finite; e.g. {DURATION_FORMS}")
    return value


def format_duration(seconds: float) -> str:
    """A latency for people: `100 us`, `2.5 ms`, `1.2 s`."""
    for unit, scale in (("s", 1.0), ("ms", 1e-3), ("us", 1e-6)):
        if seconds >= scale:
            return f"{_mantissa(seconds / scale, 3)} {unit}"
    return f"{_mantissa(seconds / 1e-9, 3)} ns"


def exact_duration(seconds: float) -> str:
    """Text that `parse_duration` turns back into exactly `seconds` (for JSON files)."""
    for unit, scale in (("us", 1e-6), ("ms", 1e-3), ("s", 1.0)):
        for text in (f"{seconds / scale:.15g} {unit}", f"{seconds / scale!r} {unit}"):
            if parse_duration(text) == seconds:
                return text
    return f"{seconds!r} s"


# ----- formatting ------------------------------------------------------------------------------
def _scaled(value: float, prefixes: dict[str, int]) -> tuple[float, str]:
    """`value` divided by the largest prefix of `prefixes` that keeps it >= 1, and that prefix."""
    best = ""
    for prefix, factor in prefixes.items():
        if prefix != "K" and factor <= value and factor >= prefixes[best]:
            best = prefix
    return value / prefixes[best], best


def _mantissa(value: float, digits: int) -> str:
    """`value` to `digits` significant digits, never in exponent notation ("1.25", "12", "1000")."""
    text = f"{value:.{digits}g}"
    if "e" in text:
        text = f"{float(text):f}".rstrip("0").rstrip(".")
    return text


def _candidates(value: float, units: tuple[str, ...]) -> list[tuple[float, str, str]]:
    """(mantissa value, prefix, unit) for every unit asked for, decimal bytes first."""
    found = []
    for unit in units:
        if unit == "B":
            found.append((*_scaled(value, _DECIMAL), "B"))
        elif unit == "bit":
            found.append((*_scaled(value * 8, _DECIMAL), "bit"))
        elif unit == "iB":
            found.append((*_scaled(value, {"": 1, **_BINARY}), "B"))
    return found


def _pick(value: float, units: tuple[str, ...], digits: int, exact) -> tuple[str, str, str]:
    """(mantissa, prefix, unit) stating `value` exactly with the fewest decimals.

    Each unit of `units` gets its largest prefix that keeps the mantissa >= 1 and the fewest
    significant digits (at most `digits`) for which `exact` holds; the unit whose mantissa
    then has the fewest digits after the decimal point wins, ties going to the earlier unit
    ("12 GB/s" not "96 Gbit/s", "10 Gbit/s" not "1.25 GB/s"). When none is exact, the first
    unit is used, rounded to `digits` significant digits.
    """
    best = None
    for scaled, prefix, unit in _candidates(value, units):
        for d in range(1, digits + 1):
            text = _mantissa(scaled, d)
            if exact(text, prefix, unit):
                decimals = len(text.partition(".")[2])
                if best is None or decimals < best[0]:
                    best = (decimals, text, prefix, unit)
                break
    if best is None:
        scaled, prefix, unit = _candidates(value, units[:1])[0]
        return _mantissa(scaled, digits), prefix, unit
    return best[1:]


def _value_of(mantissa: str, prefix: str, unit: str) -> float:
    value = float(mantissa) * _PREFIXES[prefix]
    return value / 8 if unit == "bit" else value


def format_bandwidth(bytes_per_s: float, unit: str = "B") -> str:
    """Human text for a bandwidth in bytes/s, with up to 4 significant digits: "1.25 GB/s".

    `unit` = "B" writes bytes ("1.25 GB/s", or "1 GiB/s" when that is exact), "bit" writes
    bits ("10 Gbit/s"), "auto" picks whichever of those states the value exactly with the
    fewest decimals, ties going to bytes (so network links come out as "10 Gbit/s" and
    "25 Gbit/s", PCIe and NVLink as "12 GB/s" and "25 GB/s").
    """
    units = {"B": ("B", "iB"), "bit": ("bit",), "auto": ("B", "bit", "iB")}.get(unit)
    if units is None:
        raise ValueError(f"unit must be 'B', 'bit' or 'auto', not {unit!r}")
    if not (math.isfinite(bytes_per_s) and bytes_per_s > 0):
        return f"{bytes_per_s:g} B/s"

    def close(text: str, prefix: str, u: str) -> bool:
        return math.isclose(_value_of(text, prefix, u), bytes_per_s, rel_tol=1e-9)

    mantissa, prefix, u = _pick(bytes_per_s, units, 4, close)
    return f"{mantissa} {prefix}{u}/s"


def format_bytes(n: float) -> str:
    """Human text for a size in bytes, with up to 4 significant digits: "16 GiB", "1.5 GB"."""
    if not (math.isfinite(n) and n > 0):
        return f"{n:g} B"

    def close(text: str, prefix: str, u: str) -> bool:
        return math.isclose(_value_of(text, prefix, u), n, rel_tol=1e-9)

    mantissa, prefix, u = _pick(float(n), ("B", "iB"), 4, close)
    return f"{mantissa} {prefix}{u}"


def exact_bandwidth(bytes_per_s: float) -> str:
    """Text that `parse_bandwidth` turns back into exactly `bytes_per_s` (for JSON files)."""
    def exact(text: str, prefix: str, u: str) -> bool:
        return parse_bandwidth(f"{text}{prefix}{u}/s") == bytes_per_s

    mantissa, prefix, u = _pick(bytes_per_s, ("B", "bit", "iB"), 17, exact)
    text = f"{mantissa} {prefix}{u}/s"
    return text if parse_bandwidth(text) == bytes_per_s else f"{bytes_per_s!r} B/s"


def exact_bytes(n: int) -> str:
    """Text that `parse_bytes` turns back into exactly `n` bytes (for JSON files)."""
    def exact(text: str, prefix: str, u: str) -> bool:
        return parse_bytes(f"{text}{prefix}{u}") == n

    mantissa, prefix, u = _pick(float(n), ("B", "iB"), 17, exact)
    text = f"{mantissa} {prefix}{u}"
    return text if parse_bytes(text) == n else f"{n} B"
