"""The benchmark scripts still run (tiny settings; the numbers themselves come from `make bench`)."""
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.workers  # trains with worker processes (tests/README.md)


def test_time_to_accuracy_runs_and_prints_its_table(tmp_path):
    result = subprocess.run([sys.executable, str(ROOT / "bench" / "time_to_accuracy.py"), "--epochs", "2",
                             "--hidden", "32", "--modes", "flush", "--target", "0.05", "--plot",
                             str(tmp_path / "tta.png")], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    rows = [line for line in result.stdout.splitlines() if line.startswith("| ")]
    assert [row.split("|")[1].strip() for row in rows[1:]] == ["one process, 1 thread", "one process, 2 threads", "flush"]
    assert all(row.split("|")[2].strip() == "1" for row in rows[1:])  # 5% accuracy: reached after epoch 1
