"""How `pd train`'s launcher starts its workers on this machine: forked from a forkserver that
has torch and the worker's modules imported (CPU workers), or spawned (GPU workers).

A forked worker starts in about 0.3 s instead of the 2-3 s a spawned one takes to import torch
and torch._dynamo, and in a process that launches more than once (the test suite) the
forkserver serves every launch. Its environment and standard streams are those of the first
launch, so every worker takes the launcher's at its own launch (`Launcher.restore`); cwd and
sys.path multiprocessing sets itself. The reaper (`launch._Reaper`) and the tests find the
workers by `worker_states`.
"""
from __future__ import annotations

import os
import sys
from pathlib import Path

FORKSERVER, SPAWN = "forkserver", "spawn"


def _workers() -> list[int]:
    """This process's worker processes: spawned children (`spawn_main` in their command line) and
    the children of its forkserver child."""
    found = []
    for child in _children("self"):
        try:
            cmdline = Path(f"/proc/{child}/cmdline").read_bytes()
        except OSError:
            continue
        if b"spawn_main" in cmdline:
            found.append(child)
        elif _FORKSERVER in cmdline:
            found.extend(_children(child))
    return found


def worker_states() -> dict[int, str]:
    """This process's live worker processes (its spawned children, or the children of its forkserver
    child): pid -> state letter (R, S, T, ...), from /proc; empty where /proc has no such files."""
    found = {}
    for pid in _workers():
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if state not in ("Z", "X"):
            found[pid] = state
    return found


_FORKSERVER = b"multiprocessing.forkserver"
"""In the command line of the forkserver that starts the workers (and of the workers it forks)."""


def _children(pid: int | str) -> list[int]:
    """The child processes of `pid` ("self": this one), from /proc."""
    found = []
    for children in Path(f"/proc/{pid}/task").glob("*/children"):
        try:
            found.extend(map(int, children.read_text().split()))
        except OSError:
            continue
    return found


PRELOAD = "pdtool.runtime.worker.preload"
"""The module the workers' forkserver imports before it forks any worker."""


def start_method(device: str, local_workers: int) -> str:
    """How the workers start: from the forkserver (`FORKSERVER`) when they compute on the CPU, else
    spawned (a forked process cannot use CUDA once its parent has touched it), and the forkserver
    is readied (`_preload`)."""
    from ..device import choose

    if choose(device, 0, local_workers).device.type != "cpu":
        return SPAWN
    _preload()
    return FORKSERVER


def _preload() -> None:
    """The workers start from a forkserver (multiprocessing's), which imports torch and the worker's
    modules once (`PRELOAD`): a worker is forked ready instead of importing them (about 2 s of CPU
    each). The forkserver starts at this process's first launch and serves every later one; its
    environment and standard streams are those of that first launch, which `_Launcher` corrects
    in each worker. (Its cwd and sys.path multiprocessing sets in each worker itself.)"""
    import multiprocessing

    multiprocessing.set_forkserver_preload([PRELOAD])


class Launcher:
    """What a worker takes from the launcher at this launch rather than from the forkserver it was
    forked from: the launcher's environment (with the job's network variables) and its standard
    output and error (passed as file descriptors)."""

    def __init__(self):
        self.env = dict(os.environ)
        self.streams = {fd: _Fd(fd) for fd in (1, 2) if _is_open(fd)}

    def restore(self) -> None:
        """In the worker, before anything else: the launcher's environment, overlaid by what torch's
        launcher set for this worker (the variables whose values differ from the forkserver's own,
        and those it always sets), random seeds of its own, and the launcher's standard streams.
        The forkserver's `alive` pipe, whose end multiprocessing hands every forked process, is
        closed: held by a worker, it would keep the forkserver alive after a SIGKILLed launcher,
        and the worker with it (a worker ends when the forkserver does: torch sets it a
        parent-death signal; the forkserver ends when that pipe closes)."""
        import tempfile
        from multiprocessing import forkserver

        base = getattr(sys.modules.get(PRELOAD), "BASE_ENV", None)
        own = {name: value for name, value in os.environ.items()
               if name in _ELASTIC_ENV or (base is not None and base.get(name) != value)}
        os.environ.clear()
        os.environ.update({**self.env, **own})
        tempfile.tempdir = None  # the forkserver's may come from another TMPDIR
        # random seeds as a fresh process has them, not the forkserver's (which every worker would share;
        # Python's `random` reseeds itself after a fork)
        import torch

        torch.default_generator.seed()
        if "numpy" in sys.modules:
            sys.modules["numpy"].random.seed()
        sys.stdout.flush()
        sys.stderr.flush()
        for target, fd in self.streams.items():
            if isinstance(fd, int):
                os.dup2(fd, target)
                os.close(fd)
        alive = getattr(forkserver._forkserver, "_forkserver_alive_fd", None)
        if alive is not None:
            os.close(alive)
            forkserver._forkserver._forkserver_alive_fd = None


_ELASTIC_ENV = ("RANK", "LOCAL_RANK", "GROUP_RANK", "ROLE_RANK", "ROLE_NAME", "LOCAL_WORLD_SIZE", "WORLD_SIZE",
                "GROUP_WORLD_SIZE", "ROLE_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "TORCH_NCCL_ASYNC_ERROR_HANDLING",
                "TORCHELASTIC_RESTART_COUNT", "TORCHELASTIC_MAX_RESTARTS", "TORCHELASTIC_RUN_ID",
                "TORCHELASTIC_USE_AGENT_STORE", "TORCHELASTIC_ERROR_FILE")
"""Variables torch's launcher sets for every worker, whatever their values (`_start_workers` of its
local agent, and `start_processes`)."""


class _Fd:
    """A file descriptor of the launcher that a forked worker receives as its own (multiprocessing
    passes it to the forkserver while it sends the worker's arguments); unpickles as that number."""

    def __init__(self, fd: int):
        self.fd = fd

    def __reduce__(self):
        from multiprocessing import context, reduction

        if context.get_spawning_popen() is None:  # not on the way to a worker: nothing to pass
            return _no_fd, ()
        return _detach, (reduction.DupFd(self.fd),)


def _detach(dup) -> int:
    return dup.detach()


def _no_fd() -> None:
    return None


def _is_open(fd: int) -> bool:
    try:
        os.fstat(fd)
    except OSError:
        return False
    return True
