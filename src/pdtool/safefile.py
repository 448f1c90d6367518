"""Files in folders that others may write, opened without following links.

A checkpoint folder, the capture cache or an export folder can be shared, and a file name in it
can be a symbolic link planted by someone else (`.pdtool.lock -> ../victim.txt`): opening it by
name would read or overwrite the link's target. Checking `is_symlink()` first leaves a race
between the check and the open. So every file pdtool reads or writes there is opened with
`O_NOFOLLOW` (a link as the last part of the path fails the open itself) and `O_NONBLOCK` (a pipe
planted in its place does not block the open), and then checked on the open descriptor: a regular
file, else `NotRegular`. Writes go to a new file made with `O_EXCL` beside the target and renamed
over it (`os.replace` replaces a link, never follows it). Pure standard library.
"""
from __future__ import annotations

import contextlib
import errno
import hashlib
import os
import stat
from pathlib import Path
from typing import BinaryIO, Iterator

BLOCK = 1 << 22
"""Bytes read at a time when hashing (4 MiB): a file is never in memory whole."""

_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
_CLOEXEC = getattr(os, "O_CLOEXEC", 0)
_NONBLOCK = getattr(os, "O_NONBLOCK", 0)


class NotRegular(OSError):
    """A path that is a symbolic link, a folder, a pipe or a device where pdtool expects its own
    regular file; its message says which (`str(error)`), for the caller's one line."""


def open_fd(path: str | os.PathLike, flags: int = os.O_RDONLY, mode: int = 0o666) -> int:
    """A descriptor of the regular file `path`, opened with `flags` without following a link;
    `NotRegular` when `path` is a link or not a regular file, other `OSError`s as `os.open`."""
    try:
        fd = os.open(path, flags | _NOFOLLOW | _CLOEXEC | _NONBLOCK, mode)
    except OSError as exc:
        if exc.errno == errno.ELOOP or (exc.errno == errno.EMLINK and os.path.islink(path)):
            raise NotRegular(exc.errno, f"{path} is a symbolic link, not a file pdtool wrote") from None
        if exc.errno in (errno.ENXIO, errno.EISDIR):
            raise NotRegular(exc.errno, f"{path} is not a regular file") from None
        raise
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise NotRegular(errno.EINVAL, f"{path} is not a regular file (a folder, pipe or device)")
        if _NONBLOCK:
            os.set_blocking(fd, True)
    except BaseException:
        os.close(fd)
        raise
    return fd


def open_regular(path: str | os.PathLike, mode: str = "rb") -> BinaryIO:
    """The regular file `path` opened as `open(path, mode)` would, without following a link
    (`open_fd`); modes "rb", "r+b" and "a+b" (made if missing), and their text forms."""
    flags = {"r": os.O_RDONLY, "r+": os.O_RDWR, "a+": os.O_RDWR | os.O_CREAT}[mode.replace("b", "")]
    fd = open_fd(path, flags)
    try:
        return os.fdopen(fd, mode) if "b" in mode else os.fdopen(fd, mode, encoding="utf-8")
    except BaseException:
        os.close(fd)
        raise


def read_bytes(path: str | os.PathLike) -> bytes:
    """The whole content of the regular file `path` (small files: manifests, entries, indexes)."""
    with open_regular(path) as file:
        return file.read()


def sha256(path: str | os.PathLike) -> str:
    """The sha256 (hex) of the regular file `path`, read in `BLOCK`s."""
    with open_regular(path) as file:
        return sha256_of(file)


def sha256_of(file: BinaryIO) -> str:
    """The sha256 (hex) of the open binary `file` from its start, read in `BLOCK`s."""
    digest = hashlib.sha256()
    file.seek(0)
    for block in iter(lambda: file.read(BLOCK), b""):
        digest.update(block)
    return digest.hexdigest()


def by_descriptor(file: BinaryIO, path: str | os.PathLike) -> str:
    """A name of the very file `file` has open, for a reader that wants a name (`torch.load`
    with `mmap`): /proc/self/fd/N on Linux (no later link or rename at `path` changes what it
    opens), else `path`."""
    name = f"/proc/self/fd/{file.fileno()}"
    return name if os.path.exists(name) else os.fspath(path)


class HashingWriter:
    """A binary file being written that hashes what goes through it (`torch.save` writes into it:
    the shard is hashed while written, never held whole)."""

    def __init__(self, file: BinaryIO):
        self._file = file
        self._digest = hashlib.sha256()
        self.written = 0

    def write(self, data) -> int:
        view = memoryview(data)
        self._file.write(view)
        self._digest.update(view)
        self.written += view.nbytes
        return view.nbytes

    def flush(self) -> None:
        self._file.flush()

    def hexdigest(self) -> str:
        return self._digest.hexdigest()


@contextlib.contextmanager
def replaced(path: str | os.PathLike, mode: int | None = None) -> Iterator[HashingWriter]:
    """Write a new file for `path` atomically: yields a `HashingWriter` on a new temporary file
    beside it (`O_EXCL`, never an existing file or link), then fsyncs and renames it over `path`;
    on any failure the temporary file is removed and `path` is as it was. `mode`: the new file's
    permissions (default: 0666 less the umask)."""
    target = Path(path)
    temporary = target.with_name(f".{target.name}.{os.getpid()}.{os.urandom(4).hex()}.tmp")
    fd = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL | _NOFOLLOW | _CLOEXEC, 0o600)
    try:
        os.fchmod(fd, default_mode() if mode is None else mode)
        with os.fdopen(fd, "wb") as file:
            writer = HashingWriter(file)
            yield writer
            file.flush()
            os.fsync(file.fileno())
        os.replace(temporary, target)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(temporary)
        raise


def default_mode() -> int:
    """0666 less this process's umask: the permissions `open` gives a new file."""
    umask = os.umask(0)
    os.umask(umask)
    return 0o666 & ~umask


def foreign(info: os.stat_result) -> str | None:
    """Why a file or folder with this `stat` is not this user's alone (owned by another user, or
    writable by its group or by others), or None when it is; ssh refuses such files likewise."""
    if hasattr(os, "geteuid") and info.st_uid != os.geteuid():
        return f"owned by user id {info.st_uid}, not by you"
    if info.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        return f"writable by {'others' if info.st_mode & stat.S_IWOTH else 'its group'} (mode {stat.S_IMODE(info.st_mode):o})"
    return None
