"""Canonical, atomic JSON files.

Canonical: sorted keys, indent 2, trailing newline, floats rounded to `SIGNIFICANT_DIGITS`
significant digits, no NaN or infinity. The same data always gives the same bytes, so plan
files diff well and Make sees no change when nothing changed.

Atomic: the text goes to a temporary file in the target's folder, then `os.replace` moves it
into place. A reader (or Make) never sees half a file, and a failure leaves the old file as
it was. The path "-" means standard output.
"""
from __future__ import annotations

import json
import math
import os
import sys
from pathlib import Path
from typing import Any

from . import safefile
from .errors import ArtifactError

SIGNIFICANT_DIGITS = 6


def _round(value: Any, path: str) -> Any:
    if isinstance(value, bool) or value is None or isinstance(value, (int, str)):
        return value
    if isinstance(value, float):
        if not math.isfinite(value):
            raise ArtifactError(f"cannot write {value} at {path or 'top level'}: JSON artifacts hold finite numbers only")
        rounded = float(f"{value:.{SIGNIFICANT_DIGITS}g}")
        return 0.0 if rounded == 0 else rounded
    if isinstance(value, dict):
        return {str(k): _round(v, f"{path}.{k}") for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_round(v, f"{path}[{i}]") for i, v in enumerate(value)]
    raise ArtifactError(f"cannot write a {type(value).__name__} at {path or 'top level'} to JSON")


def canonical_json(data: Any) -> str:
    """The canonical text of `data` (a tree of dicts, lists, str, int, float, bool, None)."""
    return json.dumps(_round(data, ""), sort_keys=True, indent=2, allow_nan=False) + "\n"


def check_writable(path: str | os.PathLike, inputs: tuple[str | os.PathLike, ...] = ()) -> Path | None:
    """Fail early, before long work, if `path` cannot be written; returns its folder ("-": None).

    Refused: a missing or read-only folder, a folder, an existing path that is not a regular
    file (a device such as /dev/null, a pipe: writing replaces it with a file), and any of the
    command's `inputs` (writing would destroy what the command reads)."""
    if str(path) == "-":
        return None
    target = Path(path)
    folder = target.parent
    if not folder.is_dir():
        raise ArtifactError(f"cannot write {target}: folder {folder} does not exist; create it first")
    if target.is_dir():
        raise ArtifactError(f"cannot write {target}: it is a folder; give a file name")
    if os.path.lexists(target) and not target.is_file():
        raise ArtifactError(f"cannot write {target}: it exists and is not a regular file (a device, pipe or broken "
                            "link), which the atomic write would replace; give a file name")
    for source in inputs:
        if str(source) != "-" and os.path.exists(source) and os.path.exists(target) and os.path.samefile(source, target):
            raise ArtifactError(f"cannot write {target}: it is also this command's input {source}, which the output "
                                "would replace; give another output file")
    if not os.access(folder, os.W_OK):
        raise ArtifactError(f"cannot write {target}: folder {folder} is not writable; choose another output")
    return folder


def write_text_atomic(path: str | os.PathLike, text: str) -> None:
    """Write `text` to `path` atomically; "-" writes to standard output."""
    if str(path) == "-":
        sys.stdout.write(text)
        sys.stdout.flush()
        return
    write_bytes_atomic(path, text.encode("utf-8"))


def write_bytes_atomic(path: str | os.PathLike, data: bytes) -> None:
    """Write `data` to `path` atomically: a temporary file in the same folder, fsync, then
    `os.replace` (`safefile.replaced`); the file gets the usual permissions, and a failure leaves
    no trace."""
    check_writable(path)
    try:
        with safefile.replaced(path) as out:
            out.write(data)
    except OSError as exc:  # a full disk (ENOSPC), a quota, an I/O error: the old file stays as it was
        raise ArtifactError(f"cannot write {path}: {exc.strerror or exc}; free space or choose another output "
                            "(any previous file there is unchanged)") from None


def write_json(path: str | os.PathLike, data: Any) -> None:
    """Write `data` canonically and atomically to `path` ("-" for standard output)."""
    write_text_atomic(path, canonical_json(data))


def read_json(path: str | os.PathLike, *, follow_links: bool = True) -> Any:
    """Read a JSON file, turning every failure into one clear `ArtifactError`. `follow_links`
    False: a file of a folder others may write, opened without following a link (`safefile`)."""
    try:
        if str(path) == "-":
            text = sys.stdin.read()
        elif follow_links:
            text = Path(path).read_text(encoding="utf-8")
        else:
            text = safefile.read_bytes(path).decode("utf-8")
    except safefile.NotRegular as exc:
        raise ArtifactError(f"{exc.strerror}; pdtool reads its own regular files only, remove it") from None
    except FileNotFoundError:
        raise ArtifactError(f"{path}: no such file; check the path or create it first") from None
    except IsADirectoryError:
        raise ArtifactError(f"{path}: is a folder, not a JSON file; give the file inside it") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise ArtifactError(f"{path}: cannot read it ({exc}); check the file and its permissions") from None
    def refuse_constant(name: str) -> Any:
        raise ArtifactError(f"{path}: {name} is not a number pdtool reads (JSON artifacts hold finite numbers only); "
                            "put a finite value there or regenerate the file")

    def finite_float(literal: str) -> float:
        value = float(literal)
        if not math.isfinite(value):
            raise ArtifactError(f"{path}: the number {literal} is too large (beyond a float's range); put a finite "
                                "value there or regenerate the file")
        return value

    try:
        return json.loads(text, parse_constant=refuse_constant, parse_float=finite_float)
    except json.JSONDecodeError as exc:
        raise ArtifactError(
            f"{path}: not valid JSON (line {exc.lineno}, column {exc.colno}: {exc.msg}); "
            "regenerate the file or fix it by hand"
        ) from None
    except RecursionError:
        raise ArtifactError(f"{path}: JSON nested too deeply to be a pdtool file; check the file") from None


def round_sig(value: float) -> float:
    """`value` as a canonical file stores it (SIGNIFICANT_DIGITS significant digits)."""
    return _round(value, "")


def round_float_fields(obj: Any) -> None:
    """Round every float field of a frozen dataclass in place, as the file will hold it.

    Artifacts call this when they are made, so that what is in memory equals what a save
    and load give back, and values derived from the fields (ratios, speedups) agree too.
    """
    for name in getattr(obj, "__dataclass_fields__", {}):
        value = getattr(obj, name)
        if isinstance(value, float):
            object.__setattr__(obj, name, round_sig(value))
