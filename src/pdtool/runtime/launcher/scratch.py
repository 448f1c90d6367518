"""The launcher's scratch folder in the temp folder, and the sweep of what dead launchers left.

`pd train` keeps its workers' error files in a folder `pdtool-workers-<pid>-<random>` of the temp
folder (`tempfile.gettempdir()`, so `TMPDIR` moves it) and removes it when the job ends. A
launcher killed with SIGKILL cannot, so every launch first sweeps: it removes the folders whose
launcher is dead. A folder is swept only when all of these hold: its name has that pattern, it is
a real folder (not a link) owned by this user, and its `OWNER` file, which the launcher wrote when
it made the folder, names this machine, this pid namespace and a process that is no longer
running (its pid is gone, or now belongs to a process started at another time). A live
launcher's folder, another user's or machine's (a temp folder shared over the network), one of
another container, and anything pdtool did not make are left alone.

The same holds for the `pymp-*` folder of multiprocessing that holds the workers' forkserver
started first thing (`forked.start_early`: its socket and the file naming the model's modules):
the launcher marks it with a `FORKSERVER_OWNER` file, and only folders so marked whose launcher
is dead are swept (other programs' `pymp-*` folders are theirs).
"""
from __future__ import annotations

import json
import os
import re
import shutil
import socket
import stat
import tempfile

from ..peers import running

PREFIX = "pdtool-workers-"
OWNER = "owner.json"
"""The file in a scratch folder that names its launcher: host, pid namespace, pid, start time."""
_NAME = re.compile(rf"{PREFIX}[0-9]+-[A-Za-z0-9_]+")
FORKSERVER_OWNER = "pdtool-owner.json"
"""The file that marks multiprocessing's folder of a pd train launcher (`mark`), as `OWNER` does a scratch folder."""
_FORKSERVER = re.compile(r"pymp-[A-Za-z0-9_]+")
_OWNED = ((_NAME, OWNER), (_FORKSERVER, FORKSERVER_OWNER))


def make(swept=lambda path: None) -> str:
    """Sweep what dead launchers left (calling `swept` with each folder removed), then make this
    launcher's scratch folder; its path."""
    for path in sweep():
        swept(path)
    folder = tempfile.mkdtemp(prefix=f"{PREFIX}{os.getpid()}-")
    _write_owner(os.path.join(folder, OWNER))
    return folder


def mark(folder: str) -> None:
    """Mark multiprocessing's temp folder `folder` of this launcher as pdtool's (`sweep` removes
    it once this launcher is dead); a folder that cannot be marked is left unswept."""
    try:
        _write_owner(os.path.join(folder, FORKSERVER_OWNER))
    except OSError:
        pass


def _write_owner(path: str) -> None:
    with open(path, "x") as file:
        json.dump(_identity(os.getpid()), file)


def launcher_id(folder: str) -> str:
    """The id of the launcher that made scratch folder `folder` (`<pid>-<random>`): its workers'
    shared-memory files carry it (`peers.NODE_ENV`), so they are swept with the folder."""
    return os.path.basename(folder.rstrip(os.sep)).removeprefix(PREFIX)


def sweep(folder: str | None = None) -> list[str]:
    """Remove the scratch folders (and marked multiprocessing folders: `mark`) of dead launchers
    in `folder` (default: the temp folder); the paths removed."""
    folder = folder or tempfile.gettempdir()
    try:
        names = sorted(os.listdir(folder))
    except OSError:
        return []
    removed = []
    for name in names:
        path = os.path.join(folder, name)
        owner = next((owner for pattern, owner in _OWNED if pattern.fullmatch(name)), None)
        if owner is not None and _left_by_a_dead_launcher(path, owner):
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path)
    return removed


def _left_by_a_dead_launcher(path: str, owner_file: str = OWNER) -> bool:
    """Whether `path` is a scratch folder of this user (its launcher named in `owner_file`) whose
    launcher, on this machine and in this pid namespace, no longer runs."""
    try:
        info = os.lstat(path)
        if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.getuid():
            return False
        with open(os.path.join(path, owner_file)) as file:
            owner = json.load(file)
        pid = owner["pid"]
        if not isinstance(pid, int) or isinstance(pid, bool) or pid <= 0:
            return False
        here = _identity(pid)
    except (OSError, ValueError, KeyError, TypeError):
        return False  # not pdtool's, or its launcher is still writing it: leave it
    if (owner.get("host"), owner.get("namespace")) != (here["host"], here["namespace"]):
        return False  # another machine or container: not ours to judge
    if owner.get("started") is not None:  # /proc said when it started: gone, or the pid names another process
        return here["started"] != owner["started"]
    return not running(pid)


def _identity(pid: int) -> dict:
    """What names process `pid` of this machine: host, pid namespace, pid, and its start time in
    clock ticks since boot (None where /proc does not say: then the pid alone)."""
    try:
        namespace = os.readlink("/proc/self/ns/pid")
    except OSError:
        namespace = None
    return {"host": socket.gethostname(), "namespace": namespace, "pid": pid, "started": _start_ticks(pid)}


def _start_ticks(pid: int) -> int | None:
    """When process `pid` started (field 22 of /proc/PID/stat, clock ticks since boot), or None
    where there is no such process (or only its zombie, which holds nothing) or no /proc."""
    try:
        with open(f"/proc/{pid}/stat") as file:
            text = file.read()
    except OSError:
        return None
    fields = text[text.rfind(")") + 2:].split()  # after "pid (comm) ": field 3 (state) onwards
    if len(fields) < 20 or fields[0] == "Z" or not (fields[19].isascii() and fields[19].isdigit()):
        return None
    return int(fields[19])
