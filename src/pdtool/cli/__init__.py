"""The `pd` command line: a thin shell over the library (the only package that imports click).

Data goes to stdout (`-o -`), talk and progress to stderr. A `PdtoolError` becomes one line
`pd: error: ...` on stderr and exit code 1; usage errors exit 2 (click's convention).
"""
from __future__ import annotations

import os

from .. import lazy_dynamo
from ..signals import install as install_signal_handlers
from .group import cli
from . import export, export_plan, plan, plot, profile, show, simulate, train  # noqa: F401 - each adds its command to `cli`

__all__ = ["cli", "main"]


def main() -> None:
    """Console-script entry point of `pd`."""
    # torch's C++ warnings (e.g. a peer whose host name has no reverse DNS entry) are not one line
    # of what to do; pd says what matters itself. TORCH_CPP_LOG_LEVEL=WARNING shows them again.
    os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")
    lazy_dynamo.install()  # torch._dynamo (2.7 s) only if the command needs it (pd profile's optimizer: not)
    install_signal_handlers()
    try:
        cli(prog_name="pd")  # click ends with SystemExit, whatever happened
        code = 0
    except SystemExit as stop:
        code = stop.code
    _exit(code)


def _exit(code) -> None:
    """End `pd` as Python would, less the interpreter's teardown: other threads are joined, the
    exit handlers run (multiprocessing's among them: the workers' forkserver and its temp folder
    go), the standard streams are flushed, and the process ends without freeing every module and
    torch's C++ state one by one, which took 1.1-1.2 s after a `pd train` here (a 2-step job: 6.1 s
    to the end of its work, 7.3 s to the end of the process; 5.0 s with this). pdtool closes or
    flushes every file it writes as it goes, so nothing waits for the teardown."""
    import atexit
    import sys
    import threading

    if code is None:
        code = 0
    elif not isinstance(code, int):  # sys.exit("message"): Python prints it and exits with 1
        print(code, file=sys.stderr)
        code = 1
    for thread in threading.enumerate():
        if thread is not threading.main_thread() and not thread.daemon:
            thread.join()
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a closed pipe (pd ... | head): nothing more to say there
            pass
    os._exit(code)
