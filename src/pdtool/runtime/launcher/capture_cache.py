"""The launcher's capture, kept between runs: `pd train` of a plan it ran before skips the trace.

Capturing the plan's stages (`model.capture.cut`: torch.fx or torch.export on `meta`) and running
the first minibatch through them on fake tensors (`model.dryrun`) take the launcher 1-3 s (on
GPT-2 small, 2.2 s of torch.export alone), and the fake-tensor pass imports torch._dynamo.
People run the same plan again and again (a Makefile after an edit elsewhere, a sweep of
learning rates, a resumed run), so the launcher keeps each capture in a cache folder and uses it
again when nothing it came from has changed:

- the **key** (a file name): the plan's profile reference and stages, `pd train -m`, `--init`,
  `--data`, the current folder and the Python interpreter;
- the **entry** holds the `Capture` (JSON text, as the workers receive it), the first
  minibatch's shapes and dtypes, the modules the model's classes come from, and the path, size
  and modification time of every Python module loaded when it was captured (torch, transformers,
  the experiment's own files, pdtool) and of every file the model's factory opened (a config
  file it builds the model from): a hit needs every one of those files unchanged, the
  modules the model uses now loaded from the same files, and the first minibatch of the same
  shapes. Anything else is a miss: the launcher captures again and replaces the entry.

On a hit the workers' forkserver starts at once with the model's modules (`modules`), before the
launcher has even built the model, so both import them side by side. The entry is data: a
stage program is decoded as always (`model.program`: a function is looked up only among the
modules already imported), and the modules named in it are those a run of the same plan, model
spec and folder imported with the user's consent.

The folder is `$PDTOOL_CACHE_DIR`, else `$XDG_CACHE_HOME/pdtool/captures` (`~/.cache/...`);
`PDTOOL_CACHE_DIR=off` turns the cache off. It keeps the newest `KEEP` entries.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

FORMAT = 1
"""Changes when an entry's content or the `Capture` it holds changes meaning."""

ENV = "PDTOOL_CACHE_DIR"
OFF = ("", "off", "0", "no")
KEEP = 64
"""Entries kept: older ones (by last use) are removed when a new one is written."""


def folder() -> Path | None:
    """Where entries live, or None when the cache is off."""
    value = os.environ.get(ENV)
    if value is not None:
        return None if value.strip().lower() in OFF else Path(value)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "pdtool" / "captures"


def key(plan_json: dict[str, Any], data: str, override: str | None, init: str) -> str:
    """The entry's name for a plan (its JSON, `Plan.to_json()`) run with these options here."""
    stages = [[s.get("layers"), s.get("first_layer"), s.get("last_layer")] for s in plan_json.get("stages", [])]
    text = json.dumps({"format": FORMAT, "profile": plan_json.get("profile"), "stages": stages, "data": data,
                       "override": override, "init": init, "cwd": os.getcwd(), "python": sys.executable,
                       "version": sys.version}, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()


def signature(inputs, target, keywords: tuple[str, ...]) -> list | None:
    """The first minibatch's shapes and dtypes (and the model's keywords), or None when it holds
    something else than tensors (then no entry is kept)."""
    import torch

    parts = []
    for value in (*inputs, target):
        if value is None:
            parts.append(None)
        elif isinstance(value, torch.Tensor):
            parts.append([list(value.shape), str(value.dtype)])
        else:
            return None
    return [parts, list(keywords)]


def loaded_files(read: set[str] = frozenset()) -> dict[str, list]:
    """module name -> [file, size, mtime in ns] of every loaded module that has a file, and
    "<read>PATH" -> the same for each other file in `read` (what the model's factory read:
    `Reads`)."""
    found = {}
    named = [(name, getattr(module, "__file__", None)) for name, module in list(sys.modules.items())]
    for name, path in named + [(f"<read>{path}", path) for path in sorted(read)]:
        if not isinstance(path, str):
            continue
        try:
            stat = os.stat(path)
        except OSError:
            continue
        found[name] = [path, stat.st_size, stat.st_mtime_ns]
    return found


_VIRTUAL = ("/proc/", "/sys/", "/dev/")
"""Files of the kernel's (a library reading /proc/self/mountinfo), not of the model: their times change always."""


def _installed() -> tuple[str, ...]:
    """The Python installation's folders (its standard library and installed packages): a file
    there changes only when a package is installed again, which changes its modules too (transformers
    reads the source of its 3000 model files while it is imported: they are not recorded)."""
    return tuple(os.path.join(os.path.abspath(p), "") for p in {sys.prefix, sys.base_prefix, sys.exec_prefix})


class Reads:
    """The files opened while it lasts (Python's `open` audit event): a factory that builds its
    model from a config file on disk makes a capture that holds only while that file is as it
    was. (An audit hook cannot be removed: one hook serves every `Reads`, idle outside them.)"""

    _active: list[set[str]] = []
    _hooked = False

    def __enter__(self) -> set[str]:
        if not Reads._hooked:
            sys.addaudithook(Reads._hook)
            Reads._hooked = True
        self.paths: set[str] = set()
        Reads._active.append(self.paths)
        return self.paths

    def __exit__(self, *exc) -> None:
        Reads._active.remove(self.paths)

    @staticmethod
    def _hook(event: str, args) -> None:
        if event != "open" or not Reads._active:
            return
        path, mode = args[0], args[1]
        if isinstance(path, (str, bytes, os.PathLike)) and (mode is None or "r" in str(mode)):
            try:
                full = os.path.abspath(os.fsdecode(path))
            except (TypeError, ValueError):
                return
            if not full.startswith(_VIRTUAL + _installed()) and os.path.isfile(full):
                for paths in Reads._active:
                    paths.add(full)


@dataclass(frozen=True)
class Entry:
    """A cached capture (module doc): the `Capture` as JSON text, the first minibatch's
    `signature`, the model's `modules`, its keyword inputs, what the checks said (`warnings`), and
    the `files` it came from."""

    capture: str
    batch: list
    modules: list[str]
    keywords: list[str]
    warnings: list[str]
    files: dict[str, list]
    path: str | None = dataclasses.field(default=None, compare=False)  # where `lookup` found it

    def unchanged(self) -> bool:
        """Every file the capture came from is still as it was."""
        for path, size, mtime in self.files.values():
            try:
                stat = os.stat(path)
            except OSError:
                return False
            if (stat.st_size, stat.st_mtime_ns) != (size, mtime):
                return False
        return True

    def fits(self, batch: list | None) -> bool:
        """The first minibatch has the entry's shapes, and every module loaded now that the
        capture used comes from the file it came from then."""
        if batch is None or batch != self.batch:
            return False
        for name, (path, _, _) in self.files.items():
            module = sys.modules.get(name)
            if module is not None and getattr(module, "__file__", None) != path:
                return False
        return True


def lookup(name: str) -> Entry | None:
    """The entry `name` when it exists, reads, and its files are unchanged; else None."""
    where = folder()
    if where is None:
        return None
    path = where / f"{name}.json"
    try:
        data = json.loads(path.read_text())
        if data.pop("format", None) != FORMAT:
            return None
        entry = Entry(**data, path=str(path))
        if not (_strings(entry.modules) and _strings(entry.keywords) and _strings(entry.warnings)
                and isinstance(entry.capture, str) and entry.unchanged()):
            return None
    except (OSError, ValueError, TypeError):  # damaged: a miss, and the next store replaces it
        return None
    try:
        os.utime(path)  # its last use, for `_prune`
    except OSError:
        pass
    return entry


def _strings(values) -> bool:
    return isinstance(values, list) and all(isinstance(v, str) for v in values)


def store(name: str, entry: Entry) -> None:
    """Keep `entry` under `name` (nothing when the cache is off or the folder cannot be
    written: the cache never fails a run)."""
    where = folder()
    if where is None:
        return
    fields = {k: v for k, v in dataclasses.asdict(entry).items() if k != "path"}
    text = json.dumps({"format": FORMAT, **fields}, separators=(",", ":"))
    try:
        where.mkdir(parents=True, exist_ok=True)
        handle, temporary = tempfile.mkstemp(dir=where, prefix=".", suffix=".part")
        try:
            with os.fdopen(handle, "w") as out:
                out.write(text)
            os.replace(temporary, where / f"{name}.json")
        except BaseException:
            os.unlink(temporary)
            raise
        _prune(where)
    except OSError:
        return


def _prune(where: Path) -> None:
    entries = sorted(where.glob("*.json"), key=lambda p: p.stat().st_mtime if p.exists() else 0, reverse=True)
    for old in entries[KEEP:]:
        try:
            old.unlink()
        except OSError:
            pass
