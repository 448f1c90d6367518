"""`make demo`, scaled down (one epoch): the README's main command, its every output and its summary."""
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.workers  # trains with worker processes (tests/README.md)


@pytest.mark.skipif(shutil.which("make") is None, reason="GNU make is not installed")
def test_make_demo_profiles_plans_draws_simulates_trains_and_summarises(tmp_path):
    pd = Path(sys.executable).parent / "pd"
    # -o install -o graphviz: this environment is the installed one (the test runs inside it).
    result = subprocess.run(["make", "--no-print-directory", "-o", "install", "-o", "graphviz", "demo",
                             f"PD={pd}", f"OUT={tmp_path}", "DEMO_EPOCHS=1"],
                            cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    summary = result.stdout[result.stdout.index("== demo summary =="):]
    accuracy = re.search(r"held-out accuracy: ([\d.]+)% of 320 samples", summary)  # the 5 whole minibatches of 360
    assert accuracy and 30 < float(accuracy.group(1)) <= 100  # one epoch of 22 minibatches learns something
    assert re.search(r"time per minibatch: measured [\d.]+ ms \(\d+ samples/s\), predicted [\d.]+ ms", summary)
    picture = tmp_path / ("demo.svg" if shutil.which("dot") else "demo.dot")
    for path in (tmp_path / "demo.profile.json", tmp_path / "demo.plan.json", picture, tmp_path / "demo.trace.json",
                 tmp_path / "demo.train-trace.json", tmp_path / "demo.metrics.csv", tmp_path / "demo.loss.png"):
        assert path.is_file() and path.stat().st_size > 0, path
        assert str(path) in summary
    plan = json.loads((tmp_path / "demo.plan.json").read_text())
    assert 2 <= len(plan["stages"]) <= 4 and all(s["replicas"] == 1 for s in plan["stages"])
    checkpoints = sorted((tmp_path / "demo.checkpoints").glob("step-*"))
    assert checkpoints and (checkpoints[-1] / "manifest.json").is_file() and str(checkpoints[-1]) in summary
