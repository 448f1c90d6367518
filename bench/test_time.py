"""How long the test suite takes from a fresh clone: `make test` (what CI runs, the install
included) and `make test-fast` (the fast tier: no worker process, no `slow` test), against their budgets
of 8 minutes and 60 seconds on the 2-core development machine.

The repository is cloned into a temporary folder (its committed state: commit first), then
`make test` runs there (creating its virtual environment; pip's cache makes the install a
download-free one after the first time on a machine), then `make test-fast` in the same clone.
Each is timed by the wall clock; pytest's own summary line is kept beside it. Before and after,
the machine's speed of the moment: the fastest of 3 `python -c "import torch"` (most of the
suite's CPU is processes starting and importing torch), so that runs of other hours compare.

    python bench/test_time.py           # about 10 minutes here
"""
from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from record import recorded  # bench/record.py: the dated result file

ROOT = Path(__file__).resolve().parents[1]
BUDGETS = {"make test": 8 * 60, "make test-fast": 60}


def _timed(command: list[str], cwd: Path) -> tuple[float, int, list[str], list[str]]:
    """Wall seconds, exit code, pytest's summary lines and its slowest tests (`--durations`)."""
    began = time.monotonic()
    done = subprocess.run(command, cwd=cwd, capture_output=True, text=True, env={**os.environ, "CI": "true"})
    took = time.monotonic() - began
    lines = done.stdout.splitlines()
    summaries = [line.strip() for line in lines if " passed" in line or " failed" in line]
    slowest = [line.strip() for line in lines if re.match(r"\d+\.\d+s (call|setup|teardown) ", line.strip())]
    if done.returncode:
        sys.stderr.write(done.stdout[-4000:] + done.stderr[-4000:])
    return took, done.returncode, summaries, slowest


def _probe() -> str:
    """Seconds the fastest of 3 fresh Pythons takes to import torch (this Python's), as printed."""
    times = []
    for _ in range(3):
        began = time.monotonic()
        if subprocess.run([sys.executable, "-c", "import torch"], capture_output=True).returncode:
            return "- (this Python has no torch: run the bench with the venv's)"
        times.append(time.monotonic() - began)
    return f"{min(times):.2f} s"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--smoke", action="store_true", help="clone and list the targets only (the tests' run)")
    args = parser.parse_args()
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    with tempfile.TemporaryDirectory() as folder:
        clone = Path(folder) / "pdtool"
        subprocess.run(["git", "clone", "-q", str(ROOT), str(clone)], check=True)
        if args.smoke:
            subprocess.run(["make", "-n", "test", "test-fast"], cwd=clone, check=True, capture_output=True)
            print("smoke: cloned, make test and test-fast resolve")
            return 0
        print(f"commit {commit}, fresh clone; {os.cpu_count()} cores")
        before = _probe()
        print("| command | wall time | budget | within | pytest |")
        print("|---|---|---|---|---|")
        failed, slowest = 0, []
        for name in ("make test", "make test-fast"):
            took, code, summaries, slow = _timed(name.split(), clone)
            slowest = slowest or slow
            within = "yes" if took <= BUDGETS[name] and code == 0 else "NO"
            minutes, seconds = divmod(round(took), 60)
            print(f"| `{name}` | {minutes} min {seconds:02d} s | {BUDGETS[name] // 60} min {BUDGETS[name] % 60:02d} s "
                  f"| {within} | {'; '.join(summaries) or f'exit {code}'} |", flush=True)
            failed |= code
        print(f"\nmachine speed, `python -c 'import torch'` (fastest of 3): {before} before, {_probe()} after")
        if slowest:
            print("\nthe slowest tests of make test's second run, the workers tier and the slow tests "
                  "(`make test` prints them):")
            print("\n".join(f"    {line}" for line in slowest))
    return 1 if failed else 0


if __name__ == "__main__":
    with recorded("tests"):
        code = main()
    sys.exit(code)
