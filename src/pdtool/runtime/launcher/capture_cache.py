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
  file it builds the model from), and the sha256 of each of those files that lies outside the
  Python installation (the experiment's own files and configs, which a user edits: an edit
  that keeps the size and restores the modification time is still seen): a hit needs every one
  of those files unchanged, the modules the model uses now loaded from the same files, and the
  first minibatch of the same shapes. Anything else is a miss: the launcher captures again and
  replaces the entry.

An entry is data, never code. What it can do: name the stages' programs, which may call only
torch's tensor operations, `operator`, `math`, a few builtins and the functions defined in the
consented model's own modules (`model.program.Allowed`: checked by the launcher before any
worker starts, and again by each worker on its own model), and name the modules the model's
classes come from, which the workers' forkserver imports once the plan's model passed consent
(the model's factory is consented as always: `pdtool.consent`), so that both import them side
by side. A standard-library module there, an entry or a folder not owned by the user or
writable by its group or by others (a shared `PDTOOL_CACHE_DIR`: ssh refuses such files too),
a link in place of an entry, or an entry that does not read as one, is a miss with one warning.

The folder is `$PDTOOL_CACHE_DIR`, else `$XDG_CACHE_HOME/pdtool/captures` (`~/.cache/...`);
`PDTOOL_CACHE_DIR=off` turns the cache off. It keeps the newest `KEEP` entries.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from ... import safefile

FORMAT = 4
"""Changes when an entry's content or the `Capture` it holds changes meaning (2: `hashes`; the
programs call only what `model.program.Allowed` lets them; 3: without torch.export's dtype assertions, traced on fake CPU tensors;
4: the parameters' and buffers' dtypes, which `--init-from` is checked against)."""

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


def content_hashes(files: dict[str, list]) -> dict[str, str]:
    """path -> sha256 of each of `files` (`loaded_files`) outside the Python installation: the
    files a user edits (the experiment's modules, the configs a factory reads)."""
    installed = _installed()
    found = {}
    for path, _, _ in files.values():
        if not path.startswith(installed) and path not in found:
            try:
                found[path] = safefile.sha256(path)
            except OSError:
                continue
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


@dataclass(frozen=True, kw_only=True)
class Entry:
    """A cached capture (module doc): the `Capture` as JSON text, the first minibatch's
    `signature`, the model's `modules`, its keyword inputs, what the checks said (`warnings`), the
    `files` it came from and the content `hashes` of those a user edits (`content_hashes`)."""

    capture: str
    batch: list
    modules: list[str]
    keywords: list[str]
    warnings: list[str]
    files: dict[str, list]
    hashes: dict[str, str] = dataclasses.field(default_factory=dict)
    path: str | None = dataclasses.field(default=None, compare=False)  # where `lookup` found it

    def unchanged(self) -> bool:
        """Every file the capture came from is still as it was (and has the same content, where
        `hashes` has it)."""
        for path, size, mtime in self.files.values():
            try:
                stat = os.stat(path)
            except OSError:
                return False
            if (stat.st_size, stat.st_mtime_ns) != (size, mtime):
                return False
        return content_hashes(self.files) == self.hashes

    def problem(self) -> str | None:
        """Why the entry's fields cannot be what `store` wrote (a damaged or planted entry), or None."""
        if not (isinstance(self.capture, str) and isinstance(self.batch, list) and _strings(self.keywords)
                and _strings(self.warnings) and _strings(self.modules)):
            return "fields of the wrong types"
        if not (isinstance(self.files, dict) and all(
                isinstance(k, str) and isinstance(v, list) and len(v) == 3 and isinstance(v[0], str)
                and all(isinstance(n, int) and not isinstance(n, bool) for n in v[1:]) for k, v in self.files.items())):
            return "a files table of the wrong form"
        if not (isinstance(self.hashes, dict) and all(isinstance(k, str) and isinstance(v, str)
                                                      for k, v in self.hashes.items())):
            return "a hashes table of the wrong form"
        for module in self.modules:
            if not all(part.isidentifier() for part in module.split(".")):
                return f"module {module!r}, which is no module name"
            if module.partition(".")[0] in sys.stdlib_module_names:
                return f"module {module!r} of Python's standard library, where no model's classes come from"
        return None

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


def lookup(name: str, warn: Callable[[str], None] = lambda message: None) -> Entry | None:
    """The entry `name` when it exists, is the user's own (`safefile.foreign`: the entry and its
    folder), reads as one and its files are unchanged; else None (`warn` hears why, where the
    entry is not simply missing or stale)."""
    where = _own_folder(warn)
    if where is None:
        return None
    path = where / f"{name}.json"
    try:
        with safefile.open_regular(path) as file:
            why = safefile.foreign(os.fstat(file.fileno()))
            if why is not None:
                warn(f"capture cache entry {path} is {why}, so pd train does not use it (as ssh refuses such files); "
                     "delete it, or set PDTOOL_CACHE_DIR to a folder of your own")
                return None
            data = json.loads(file.read())
        if not isinstance(data, dict) or data.pop("format", None) != FORMAT:
            return None
        entry = Entry(**data, path=str(path))
        why = entry.problem()
        if why is not None:
            warn(f"capture cache entry {path} is damaged ({why}); capturing again")
            return None
        if not entry.unchanged():
            return None
    except FileNotFoundError:
        return None
    except safefile.NotRegular as exc:
        warn(f"capture cache entry {exc.strerror}, so pd train does not use it; delete it")
        return None
    except (OSError, ValueError, TypeError, RecursionError, AttributeError):  # damaged: a miss, replaced on store
        return None
    try:
        os.utime(path, follow_symlinks=False)  # its last use, for `_prune`
    except OSError:
        pass
    return entry


def _own_folder(warn: Callable[[str], None]) -> Path | None:
    """The cache folder when the cache is on and the folder is the user's alone (or missing:
    `store` makes it so), else None with one warning."""
    where = folder()
    if where is None:
        return None
    try:
        info = os.stat(where)
    except FileNotFoundError:
        return where
    except OSError:
        return None
    why = safefile.foreign(info)
    if why is not None:
        warn(f"capture cache folder {where} is {why}, so pd train neither uses nor writes it (as ssh refuses such "
             f"files); chmod go-w it if it is yours, or set {ENV} to a folder of your own")
        return None
    return where


def _strings(values) -> bool:
    return isinstance(values, list) and all(isinstance(v, str) for v in values)


def store(name: str, entry: Entry) -> None:
    """Keep `entry` under `name`, readable by the user alone (nothing when the cache is off or
    the folder is not the user's or cannot be written: the cache never fails a run)."""
    where = folder()
    if where is None:
        return
    fields = {k: v for k, v in dataclasses.asdict(entry).items() if k != "path"}
    text = json.dumps({"format": FORMAT, **fields}, separators=(",", ":"))
    try:
        where.parent.mkdir(parents=True, exist_ok=True)
        where.mkdir(mode=0o700, exist_ok=True)
        if _own_folder(lambda message: None) is None:
            return
        with safefile.replaced(where / f"{name}.json", mode=0o600) as out:
            out.write(text.encode())
        _prune(where)
    except OSError:
        return


def _prune(where: Path) -> None:
    entries = sorted(where.glob("*.json"), key=lambda p: p.lstat().st_mtime if os.path.lexists(p) else 0, reverse=True)
    for old in entries[KEEP:]:
        try:
            old.unlink()
        except OSError:
            pass
