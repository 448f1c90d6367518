"""How `pd` answers SIGINT (Ctrl-C) and SIGTERM in every phase: one line, exit 128 + the signal.

`install` (called by the console script, not by the library) makes both signals raise `Stopped`
in the main thread, whatever the process inherited (a job started in the background by a
non-interactive shell ignores SIGINT otherwise). `Stopped` is a `BaseException`, like
`KeyboardInterrupt`, so that no `except Exception` on the way (a model factory's, an import's)
can swallow it; the CLI turns it into its line. While `pd train`'s workers run, torch's launcher
answers the signals itself (it stops the workers) and `runtime.launcher.launch` puts these handlers back
afterwards. A command whose main thread does not give way (a factory that catches everything and
keeps waiting) is ended `GRACE_S` seconds after the first signal, still with one line.
"""
from __future__ import annotations

import os
import signal
import sys
import threading
from contextlib import contextmanager
from typing import Iterator

GRACE_S = 5.0
"""Seconds a command has, after the first signal, to stop by itself before it is ended."""

SIGNALS = (signal.SIGINT, signal.SIGTERM)


class Stopped(BaseException):
    """A signal asked pd to stop; `exit_code` is 128 + its number."""

    def __init__(self, signum: int):
        self.signum = signum
        self.exit_code = 128 + signum
        super().__init__(f"interrupted by {signal.Signals(signum).name}")


def install() -> None:
    """Answer SIGINT and SIGTERM by raising `Stopped` in the main thread (see the module docstring)."""
    ending: list[threading.Timer] = []  # the one timer of this process, once a signal came

    def stop(signum: int, frame) -> None:
        if not ending:
            ending.append(threading.Timer(GRACE_S, _end_now, (signum,)))
            ending[0].daemon = True
            ending[0].start()
        raise Stopped(signum)
    for signum in SIGNALS:
        signal.signal(signum, stop)


def _end_now(signum: int) -> None:
    name = signal.Signals(signum).name
    sys.stderr.write(f"pd: interrupted by {name}; the command did not stop within {GRACE_S:g} s, so it was ended "
                     "(files pd writes are replaced whole, so none is half-written)\n")
    sys.stderr.flush()
    os._exit(128 + signum)


class _Overdue(BaseException):
    """Raised in the main thread when a `deadline` passes (a BaseException: nothing swallows it)."""


@contextmanager
def deadline(seconds: float, error: Exception) -> Iterator[None]:
    """Raise `error` when the block has not finished after `seconds` (SIGALRM; in the main thread
    of a platform that has it, else no bound). E.g. the launcher's checks of `pd train`, which
    import and build the model, are bounded by --startup-timeout as the workers' start-up is."""
    if not hasattr(signal, "setitimer") or threading.current_thread() is not threading.main_thread():
        yield
        return

    def overdue(signum, frame):
        raise _Overdue()
    previous = signal.signal(signal.SIGALRM, overdue)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    except _Overdue:
        raise error from None
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
