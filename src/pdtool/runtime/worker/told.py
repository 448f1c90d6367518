"""The modules a launcher names to its workers' forkserver (`runtime.launcher.forked`).

The launcher writes, at each launch and before it forks a worker of it, a JSON file in its own
multiprocessing folder (made private by `tempfile.mkdtemp`): {"path": its sys.path and current
folder, "modules": the names of the modules the model's classes come from, "files": the file each
was imported from}, written whole, then renamed into place. The forkserver learns the file's path
from `VARIABLE` ("LAUNCHER_PID:PATH") when it starts. One started first thing by `pd train` waits
for the file's first version and imports every module it names (`worker.preload_model`: its
one launch). Every forkserver, before each fork (`import_before_each_fork`), reads a newer
version: it imports the named modules it lacks that come from installed packages (the Python
installation's folders and pdtool's own: transformers' modeling files, torchvision's models), and
forgets a module it holds from another file than the launcher's (a factory of another experiment
folder under the same name) so that the workers import the launcher's. A process that launches
more than once (the Python API, a sweep, the test suite) so forks every launch's workers with the
model's library imported once, as `pd train`'s one launch does, rather than importing it in each
worker (0.6-1.5 s of CPU for transformers). Only stdlib imports here: the launcher imports this
before torch."""
from __future__ import annotations

import importlib
import json
import os
import sys

VARIABLE = "PDTOOL_FORKSERVER_MODULES"
FILE = "forkserver-modules.json"


def write(path: str, modules) -> None:
    """Name `modules` (imported in this process with the user's consent) at `path`; something is
    written whatever the names hold (a forkserver waiting for the file must hear something)."""
    folders = [os.fspath(p) for p in sys.path if isinstance(p, (str, os.PathLike))]
    here = [] if os.getcwd() in folders else [os.getcwd()]
    try:
        names = [str(m) for m in modules]
        files = {m: _file_of(m) for m in names}
        text = json.dumps({"path": folders + here, "modules": names,
                           "files": {m: f for m, f in files.items() if isinstance(f, str)}})
    except (TypeError, ValueError, ImportError):
        text = json.dumps({"path": folders, "modules": [], "files": {}})  # the workers import the model's modules
    with open(path + ".part", "w") as file:
        file.write(text)
    os.replace(path + ".part", path)


def _file_of(name: str) -> str | None:
    """The file module `name` was imported from, or would be (found along sys.path, running none of
    its packages' code: a run whose capture came from the cache imports no model)."""
    if name in sys.modules:
        return getattr(sys.modules[name], "__file__", None)
    from importlib.machinery import PathFinder

    spec, parts = None, name.split(".")
    for end in range(1, len(parts) + 1):
        spec = PathFinder.find_spec(".".join(parts[:end]), None if spec is None else spec.submodule_search_locations)
        if spec is None or (end < len(parts) and not spec.submodule_search_locations):
            return None
    return spec.origin


def read(path: str) -> tuple[list[str], list[str], dict[str, str]] | None:
    """(sys.path, modules, files) named at `path`; None where it cannot be read."""
    try:
        with open(path) as file:
            named = json.load(file)
        return ([str(p) for p in named["path"]], [str(m) for m in named["modules"]],
                {str(m): str(f) for m, f in named.get("files", {}).items()})
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None


def import_before_each_fork(path: str) -> None:
    """In the forkserver: before each fork, take in the modules a newer version of the file at
    `path` names (`refresh`)."""
    server, fork, seen = os.getpid(), os.fork, {}

    def fork_after_imports() -> int:
        if os.getpid() == server:
            refresh(path, seen)
        return fork()

    os.fork = fork_after_imports


def refresh(path: str, seen: dict) -> None:
    """Import the installed modules the file at `path` names that this process lacks; forget those it
    holds from other files. `seen` remembers the version of the file last read."""
    try:
        stat = os.stat(path)
    except OSError:
        return
    version = (stat.st_ino, stat.st_mtime_ns, stat.st_size)
    if seen.get("version") == version:
        return
    seen["version"] = version
    named = read(path)
    if named is None:
        return
    _, modules, files = named
    for name in modules:
        wanted = files.get(name)
        if name not in sys.modules:
            if wanted is None or not _installed(wanted):
                continue
            found = _file_of(name)  # along this process's sys.path (an earlier launch's folder may shadow it)
            if found is None or not _same(found, wanted):
                continue  # not the launcher's module: its workers import the launcher's themselves
            try:
                importlib.import_module(name)
            except (Exception, SystemExit):  # noqa: BLE001 - a worker imports it again, and reports what fails there
                continue
        held = getattr(sys.modules.get(name), "__file__", None)
        if wanted is not None and held is not None and not _same(held, wanted):
            _forget(name, held)  # another folder's module of that name: each worker imports the launcher's


def _forget(name: str, held: str) -> None:
    """Take module `name`, held from file `held`, out of this process; when it is not an installed
    package's, its whole top-level package with it (`exp.model` of another folder came with that
    folder's `exp`, whose path would find its `model` again)."""
    if _installed(held):
        del sys.modules[name]
        return
    top = name.partition(".")[0]
    for loaded in [m for m in sys.modules if m == top or m.startswith(top + ".")]:
        file = getattr(sys.modules[loaded], "__file__", None)
        if loaded == name or (file is not None and not _installed(file)):  # a namespace shared with installed
            del sys.modules[loaded]                                          # packages keeps those


def _installed(file: str) -> bool:
    """Whether `file` is part of an installed package: under the Python installation's folders
    (the standard library, site-packages) or pdtool's own."""
    import sysconfig

    paths = sysconfig.get_paths()
    roots = [paths[k] for k in ("stdlib", "platstdlib", "purelib", "platlib") if k in paths]
    roots.append(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))  # src/pdtool
    real = os.path.realpath(file)
    return any(real.startswith(os.path.realpath(root) + os.sep) for root in roots)


def _same(a: str, b: str) -> bool:
    return os.path.realpath(a) == os.path.realpath(b)
