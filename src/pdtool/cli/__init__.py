"""The `pd` command line: a thin shell over the library (the only package that imports click).

Data goes to stdout (`-o -`), talk and progress to stderr. A `PdtoolError` becomes one line
`pd: error: ...` on stderr and exit code 1; usage errors exit 2 (click's convention).
"""
from __future__ import annotations

import os

from ..signals import install as install_signal_handlers
from .group import cli
from . import export, plan, plot, profile, show, simulate, train  # noqa: F401 - each adds its command to `cli`

__all__ = ["cli", "main"]


def main() -> None:
    """Console-script entry point of `pd`."""
    # torch's C++ warnings (e.g. a peer whose host name has no reverse DNS entry) are not one line
    # of what to do; pd says what matters itself. TORCH_CPP_LOG_LEVEL=WARNING shows them again.
    os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")
    install_signal_handlers()
    cli(prog_name="pd")
