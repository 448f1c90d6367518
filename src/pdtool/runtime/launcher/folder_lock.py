"""One writer per checkpoint folder: the run that holds `.pdtool.lock` in it.

`pd train --checkpoint-dir DIR` takes an exclusive `fcntl.flock` on `DIR/.pdtool.lock` before it
looks at the folder and holds it until the run (with its restarts) ends; the kernel releases it
when the process dies, however it dies. A second run on the same folder is one line naming the
first one's process and machine. The file also records the last run that wrote into the folder
(`claim`: its id, plan, stage count and manifest meta), and it stays after the run: the next
`--resume` reads who wrote there last, so it can complete the checkpoints an interrupted run left
with every shard written (`checkpoint.complete_run`). A run that stops before it writes (a
mistake in its options) leaves that record as it was. Works on local file systems and on NFS (flock is emulated with
POSIX locks there); a file system that cannot lock is one line too.
"""
from __future__ import annotations

import fcntl
import json
import os
import socket
from pathlib import Path
from typing import Any

from ...errors import LaunchError
from ...safefile import NotRegular, open_regular

LOCK = ".pdtool.lock"


class FolderLock:
    """The lock of one checkpoint folder, held from `acquire` to `release`."""

    def __init__(self, root: Path, handle, previous: dict[str, Any] | None):
        self.root = root
        self._handle = handle
        self.previous = previous  # what the last run that wrote into the folder claimed (None: nothing readable)

    @classmethod
    def acquire(cls, root: str | os.PathLike) -> "FolderLock":
        """Lock `root` (made if needed) for this process and record its pid and machine;
        `LaunchError` when another process holds it or it cannot be made."""
        root = Path(root)
        path = root / LOCK
        try:
            root.mkdir(parents=True, exist_ok=True)
            handle = open_regular(path, "a+")  # never through a link planted in a shared folder
        except NotRegular as exc:
            raise LaunchError(f"--checkpoint-dir {root}: {exc.strerror}, so pd train will not lock or write it; remove "
                              "it, or give another --checkpoint-dir") from None
        except OSError as exc:
            raise LaunchError(f"--checkpoint-dir {root}: cannot create {LOCK} in it ({exc.strerror or exc}); give a "
                              "folder you can write to") from None
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _read(handle)
            handle.close()
            who = (f"pid {holder.get('pid')} on {holder.get('host')}" if holder else "another process")
            raise LaunchError(f"--checkpoint-dir {root} is in use by another pd train ({who}), and one folder has one "
                              "writer; wait for that run to end, or give another --checkpoint-dir") from None
        except OSError as exc:
            handle.close()
            raise LaunchError(f"--checkpoint-dir {root}: this file system cannot lock {LOCK} ({exc.strerror or exc}); "
                              "use a local folder, or one on a file system with locks") from None
        writer = (_read(handle) or {}).get("writer")
        lock = cls(root, handle, writer if isinstance(writer, dict) else None)
        try:
            lock._write(lock.previous)
        except LaunchError:
            handle.close()
            raise
        return lock

    def claim(self, writer: dict[str, Any]) -> None:
        """Record `writer` (JSON data: the run about to write into the folder)."""
        self._write(writer)

    def _write(self, writer: dict[str, Any] | None) -> None:
        try:
            self._handle.seek(0)
            self._handle.truncate()
            self._handle.write(json.dumps({"pid": os.getpid(), "host": socket.gethostname(), "writer": writer},
                                          sort_keys=True) + "\n")
            self._handle.flush()
        except OSError as exc:
            raise LaunchError(f"--checkpoint-dir {self.root}: cannot write {LOCK} ({exc.strerror or exc}); free some "
                              "space or give another folder") from None

    def release(self) -> None:
        """Let other runs have the folder (the file and its record stay for the next --resume)."""
        if self._handle is not None and not self._handle.closed:
            self._handle.close()  # closing releases the flock


def _read(handle) -> dict[str, Any] | None:
    """The JSON record in the lock file, or None when it is empty or not ours."""
    try:
        handle.seek(0)
        data = json.loads(handle.read() or "null")
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None
