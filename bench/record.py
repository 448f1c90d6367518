"""Dated result files: what a benchmark printed, with the command and the machine that made it.

Every benchmark runs its `main` inside `recorded(theme)`: what it prints still goes to the
terminal, and once it ends without an error the whole output is written to
`bench/results/<theme>_<machine>_<date>.md` (e.g. `train_speed_cpu2_2026-12-04.md`; `<machine>`
is the accelerator or the CPU's core count), beside the command line, the machine (CPU model,
cores, memory, GPU), Python and torch. A second run on the same day and machine replaces the
file; `docs/benchmarks.md` states the current figures and links the files. `--smoke` runs, runs
that fail and runs under `PDTOOL_BENCH_RESULTS=off` (the test suite sets it) write nothing;
`PDTOOL_BENCH_RESULTS=FOLDER` writes there instead.
"""
from __future__ import annotations

import contextlib
import datetime
import io
import os
import platform
import shlex
import sys
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"
OFF = "off"


class _Tee(io.TextIOBase):
    """Writes to the terminal and keeps a copy."""

    def __init__(self, terminal):
        self.terminal, self.copy = terminal, io.StringIO()

    def write(self, text: str) -> int:
        self.copy.write(text)
        return self.terminal.write(text)

    def flush(self) -> None:
        self.terminal.flush()


def machine() -> tuple[str, str]:
    """(short name for file names, one line describing the machine)."""
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as info:
            cpu = next((line.split(":", 1)[1].strip() for line in info if line.startswith("model name")), cpu)
    except OSError:
        pass
    cores = os.cpu_count() or 0
    memory = ""
    try:
        with open("/proc/meminfo") as info:
            kib = int(next(line.split()[1] for line in info if line.startswith("MemTotal:")))
        memory = f", {kib / 2**20:.0f} GiB memory"
    except (OSError, StopIteration, ValueError):
        pass
    gpu = ""
    try:
        import torch

        torch_version = torch.__version__
        if torch.cuda.is_available():
            gpu = torch.cuda.get_device_name(0)
    except ImportError:
        torch_version = "not installed"
    short = ("".join(c for c in gpu.lower().replace("nvidia", "") if c.isalnum()) or f"cpu{cores}")
    line = (f"{cpu}, {cores} cores{memory}" + (f", GPU {gpu}" if gpu else ", no GPU")
            + f"; Python {platform.python_version()}, torch {torch_version}")
    return short, line


@contextlib.contextmanager
def recorded(theme: str, argv: list[str] | None = None):
    """Run the body with its output also kept; on success write it as `theme`'s result file."""
    argv = sys.argv if argv is None else argv
    where = os.environ.get("PDTOOL_BENCH_RESULTS")
    keep = not ("--smoke" in argv or "--help" in argv or "-h" in argv or where == OFF)
    began = datetime.datetime.now()
    tee = _Tee(sys.stdout)
    if keep:
        sys.stdout = tee
    os.environ["PDTOOL_BENCH_RESULTS"] = OFF  # the processes a bench starts (itself, as a child) record nothing
    try:
        yield tee if keep else None
    finally:
        sys.stdout = tee.terminal
        if where is None:
            os.environ.pop("PDTOOL_BENCH_RESULTS", None)
        else:
            os.environ["PDTOOL_BENCH_RESULTS"] = where
    if not keep:
        return
    short, described = machine()
    folder = Path(where) if where else RESULTS
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{theme}_{short}_{began:%Y-%m-%d}.md"
    minutes = (datetime.datetime.now() - began).total_seconds() / 60
    command = "python bench/" + " ".join(shlex.quote(a) for a in [Path(argv[0]).name] + list(argv[1:]))
    path.write_text(f"# {theme}: {began:%Y-%m-%d}\n\n"
                    f"- command: `{command}` ({minutes:.1f} minutes, started {began:%H:%M})\n"
                    f"- machine: {described}\n\n"
                    "```\n" + tee.copy.getvalue().rstrip("\n") + "\n```\n")
    print(f"wrote {path}")
