"""One piece of planning in a second process, while this one does another.

`pd plan` solves two dynamic programs that share nothing but their inputs: the cost model's
(replicated stages allowed) and the straight pipelines' (`make.make_plan`). On a machine with
more than one core, `background` computes the second in a forked child while the first runs
here: 1000 layers on 4096 workers spend about 44 s in the first and 15 s in the second.

A child is forked only where that is safe: POSIX, no other Python thread (a forked copy of a
threaded process can inherit a lock another thread held) and torch not imported (a process
forked after OpenMP ran hangs in its next parallel region; `pd plan` never imports torch, a test
process or a notebook may have). numpy's OpenBLAS threads are fork-safe (OpenBLAS resets its pool
in a child). Otherwise, or when the child fails in any way, the work runs here when its result is
asked for, so the answer is the same either way. A child whose result is never asked for (the caller raised) is
killed and reaped when the `with` block ends.
"""
from __future__ import annotations

import contextlib
import os
import pickle
import signal
import sys
import threading
from typing import Callable, Iterator, TypeVar

T = TypeVar("T")


def forkable() -> bool:
    """Whether a child may be forked here to work in parallel (see the module doc), on several cores."""
    return (hasattr(os, "fork") and threading.active_count() == 1 and "torch" not in sys.modules
            and (os.cpu_count() or 1) > 1)


@contextlib.contextmanager
def background(work: Callable[[], T], worth: bool = True) -> Iterator[Callable[[], T]]:
    """Start `work` in a forked child (when `worth` it and `forkable`); yields a function that
    returns its result (waiting for the child, or computing it here)."""
    if not (worth and forkable()):
        yield work
        return
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: compute, hand the result over, leave without the parent's exit handlers
        os.close(read)
        try:
            data = pickle.dumps((True, work()), protocol=pickle.HIGHEST_PROTOCOL)
        except BaseException:  # noqa: BLE001 - the parent computes it itself
            data = pickle.dumps((False, None))
        try:
            with os.fdopen(write, "wb") as out:
                out.write(data)
        finally:
            os._exit(0)
    os.close(write)
    state = {"done": False}

    def result() -> T:
        with os.fdopen(read, "rb") as source:
            data = source.read()
        os.waitpid(pid, 0)
        state["done"] = True
        try:
            ok, value = pickle.loads(data)
        except Exception:  # noqa: BLE001 - the child died before writing it all
            ok, value = False, None
        return value if ok else work()

    try:
        yield result
    finally:
        if not state["done"]:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            with contextlib.suppress(OSError):
                os.close(read)
