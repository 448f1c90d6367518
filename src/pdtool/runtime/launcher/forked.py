"""How `pd train`'s launcher starts its workers on this machine: forked from a forkserver that
has torch and the worker's modules imported (CPU workers), or spawned (GPU workers).

A forked worker starts in about 0.3 s instead of the 2-3 s a spawned one takes to import torch
and torch._dynamo, and in a process that launches more than once (the test suite) the
forkserver serves every launch. Its environment and standard streams are those of the first
launch, so every worker takes the launcher's at its own launch (`worker.entry.LaunchState`); cwd and
sys.path multiprocessing sets itself. The reaper (`launch._Reaper`) and the tests find the
workers by `worker_states`.
"""
from __future__ import annotations

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


def start_method(device: str, local_workers: int, modules: tuple[str, ...] = ()) -> str:
    """How the workers start: from the forkserver (`FORKSERVER`) when they compute on the CPU, else
    spawned (a forked process cannot use CUDA once its parent has touched it), and the forkserver
    is readied (`_preload`, with `modules` besides the worker's own)."""
    from ..device import choose

    if choose(device, 0, local_workers).device.type != "cpu":
        return SPAWN
    _preload(modules)
    return FORKSERVER


_PRELOADED: list[str] = [PRELOAD]


def _preload(modules: tuple[str, ...] = ()) -> None:
    """The workers start from a forkserver (multiprocessing's), which imports torch and the worker's
    modules once (`PRELOAD`), and the model's (`warm`): a worker is forked ready instead of
    importing them (about 2 s of CPU each for torch, 0.6-1.5 s for transformers). The forkserver
    starts at this process's first launch (or `warm`) and serves every later one; its
    environment and standard streams are those of that first launch, which `worker.entry.LaunchState` corrects
    in each worker (`worker.entry.LaunchState`). (Its cwd and sys.path multiprocessing sets in each worker itself.)"""
    import multiprocessing

    _PRELOADED.extend(m for m in modules if m not in _PRELOADED)
    multiprocessing.set_forkserver_preload(list(_PRELOADED))


def warm(device: str, local_workers: int, model) -> None:
    """Start the workers' forkserver now when they will be forked from it, with the modules of the
    launcher's `model` (a `ModelBundle` the launcher built: the modules its modules' classes come
    from, e.g. transformers' modeling_gpt2 or the experiment's own) imported, so that those imports run while pd train
    checks the plan, once per machine rather than once per worker. Only modules the launcher
    already imported (with the user's consent) are named."""
    import sys

    classes = {type(m).__module__ for m in model.module.modules()}
    modules = tuple(sorted(m for m in classes if m in sys.modules))
    if start_method(device, local_workers, modules) == FORKSERVER:
        from multiprocessing import forkserver

        try:
            forkserver.ensure_running()
        except OSError:  # e.g. a temp folder whose path is too long for a socket: the launch says so itself
            pass
