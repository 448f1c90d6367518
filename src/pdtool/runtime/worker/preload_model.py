"""What the workers' forkserver imports when `pd train` starts it first thing
(`runtime.launcher.forked.start_early`): the worker's modules (`preload`: torch among them; torch._dynamo
as `lazy_dynamo`'s stand-in where the launcher runs with it: `LAZY_VARIABLE`), then
the modules the model's classes come from, which the launcher names only once it has imported
them with the user's consent (or a run of the same plan, model and folder did: `capture_cache`).
The forkserver, a fork of the launcher once it imported torch (`forked._fork_forkserver`), imports the rest while the launcher builds the model; it forks no worker
before this module is done. The launcher names the modules in a JSON file (`worker.told`), at the
path in `told.VARIABLE`, always before it forks a worker. A launcher that ends first
takes the forkserver along at once (a parent-death signal, on Linux), so nothing it started holds
its standard streams open after it (`pd train ... | tee` ends with it). Nothing here may initialise
CUDA (see `preload`)."""
import importlib
import os
import signal
import sys
import time

from . import told

LAZY_VARIABLE = "PDTOOL_FORKSERVER_LAZY_DYNAMO"
"""Set (to 1) when the launcher runs with `lazy_dynamo`'s stand-in (`pd`'s own process, one launch):
this forkserver then imports torch._dynamo only if a worker needs it. A process that launches more
than once (the test suite) keeps the forkserver's real one for every launch."""
POLL_S = 0.02
_PR_SET_PDEATHSIG = 1


def _end_with(launcher: int) -> None:
    """End this process when `launcher`, its parent, does (Linux: at once; elsewhere `_await`
    notices it once the imports are done)."""
    if sys.platform.startswith("linux"):
        import ctypes

        try:
            ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
        except (OSError, AttributeError):
            pass
    if os.getppid() != launcher:  # it ended before the signal was asked for
        os._exit(0)


def _await(launcher: int, path: str) -> None:
    """Wait for the file at `path` of the launcher (process `launcher`), then import what it
    names; end this process when the launcher ends first (it then never forks a worker from here)."""
    while not os.path.exists(path):
        if os.getppid() != launcher:
            os._exit(0)
        time.sleep(POLL_S)
    named = told.read(path)
    if named is None:
        return  # the workers import what they need themselves
    sys.path[:], modules, _ = named
    for name in modules:
        try:
            importlib.import_module(name)
        except Exception:  # noqa: BLE001 - a worker imports it again, and reports what fails there
            pass


def serve(launcher: int, path: str, lazy: bool) -> None:
    """Ready this process to fork the workers of `launcher`: end with it, import the worker's modules
    (`preload`; `lazy_dynamo`'s stand-in first when `lazy`), then those the file at `path` names."""
    _end_with(launcher)
    # a Ctrl-C in the terminal reaches this process group: pd says one line, this process says nothing (the
    # launcher's end ends it); the forkserver hands its workers the handler it finds after this, so it is put back
    interrupt = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        if lazy:
            importlib.import_module("pdtool.lazy_dynamo").install()
        importlib.import_module("pdtool.runtime.worker.preload")
        _await(launcher, path)
    finally:
        signal.signal(signal.SIGINT, interrupt)


_told = os.environ.get(told.VARIABLE, "")  # `preload` takes it out: a worker forked from here is told nothing
_lazy = os.environ.pop(LAZY_VARIABLE, "") == "1"
if _told:
    serve(int(_told.partition(":")[0]), _told.partition(":")[2], _lazy)
