"""cli/pd.mk in an experiment's Makefile: targets re-run only when their inputs changed."""
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.skipif(shutil.which("make") is None, reason="GNU make is not installed")


def make(folder, *targets, question=False):
    args = ["make", "--no-print-directory"] + (["-q"] if question else []) + list(targets)
    return subprocess.run(args, cwd=folder, capture_output=True, text=True)


@pytest.mark.slow
def test_touching_the_profile_remakes_the_plan_and_nothing_else(tmp_path):
    (tmp_path / "Makefile").write_text(
        f"include {ROOT / 'cli' / 'pd.mk'}\n"
        f"PD = {Path(sys.executable).parent / 'pd'}\n"
        "PD_MODEL_tiny = pdtool.zoo:mlp\n"
        "PD_ARGS_tiny = -a in_features=12 -a hidden=8 -a depth=2 -b 4 --repeats 1 --warmup 0 -q\n"
        "PD_CLUSTER = 2x1GB/s\n")
    first = make(tmp_path, "tiny.plan.json")
    assert first.returncode == 0, first.stderr
    assert "pd profile" in first.stdout and "pd plan" in first.stdout
    assert make(tmp_path, "tiny.plan.json", question=True).returncode == 0  # nothing to do
    plan_mtime = (tmp_path / "tiny.plan.json").stat().st_mtime_ns
    time.sleep(0.01)
    future = time.time() + 2
    os.utime(tmp_path / "tiny.profile.json", (future, future))
    assert make(tmp_path, "tiny.plan.json", question=True).returncode == 1
    again = make(tmp_path, "tiny.plan.json")
    assert again.returncode == 0 and "pd plan" in again.stdout and "pd profile" not in again.stdout
    assert (tmp_path / "tiny.plan.json").stat().st_mtime_ns > plan_mtime


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("dot") is None, reason="graphviz's dot is missing: pictures fall back to .dot")
def test_a_picture_keeps_the_profile_and_plan_it_was_made_from(tmp_path):
    (tmp_path / "Makefile").write_text(
        f"include {ROOT / 'cli' / 'pd.mk'}\n"
        f"PD = {Path(sys.executable).parent / 'pd'}\n"
        "PD_MODEL_tiny = pdtool.zoo:mlp\n"
        "PD_ARGS_tiny = -a in_features=12 -a hidden=8 -a depth=2 -b 4 --repeats 1 --warmup 0 -q\n")
    result = make(tmp_path, "tiny.svg")
    assert result.returncode == 0, result.stderr
    assert (tmp_path / "tiny.profile.json").exists() and (tmp_path / "tiny.plan.json").exists()
    assert make(tmp_path, "tiny.svg", question=True).returncode == 0


@pytest.mark.workers
def test_the_digits_example_trains_and_reports_its_accuracy(tmp_path):
    shutil.copy(ROOT / "examples" / "digits" / "Makefile", tmp_path / "Makefile")
    args = [f"PDTOOL={ROOT}", f"PD={Path(sys.executable).parent / 'pd'}", "EPOCHS=1", "digits.metrics.csv"]
    result = make(tmp_path, *args)
    assert result.returncode == 0, result.stderr
    assert "held-out accuracy:" in result.stdout
    assert (tmp_path / "digits.metrics.csv").read_text().startswith("step,")
    assert make(tmp_path, *args, question=True).returncode == 0  # nothing changed: nothing to do
    future = time.time() + 2
    os.utime(tmp_path / "digits.plan.json", (future, future))  # a new plan: train again, nothing else
    again = make(tmp_path, "-n", *args)  # what make would run (the training itself ran above)
    assert again.returncode == 0 and "pd train" in again.stdout
    assert "pd profile" not in again.stdout and "pd plan" not in again.stdout


@pytest.mark.workers
def test_the_gpt2_example_copied_elsewhere_trains_its_own_model(tmp_path):
    """What a user does: copy examples/gpt2 (factory file and Makefile) and run make."""
    pytest.importorskip("transformers", reason="needs the hf extra: pip install -e '.[hf]'")
    for name in ("Makefile", "gpt2_text.py"):
        shutil.copy(ROOT / "examples" / "gpt2" / name, tmp_path / name)
    result = make(tmp_path, f"PDTOOL={ROOT}", f"PD={Path(sys.executable).parent / 'pd'}", "STEPS=3",
                  "PD_ARGS_gpt2=-b 2 --threads 1 --repeats 1 --warmup 0 -q")
    assert result.returncode == 0, result.stderr
    assert "uses mode 2bw" in result.stderr  # the tied head: pd plan chose the mode and said why
    assert "loss " in result.stdout and " at step 3 " in result.stdout
    assert (tmp_path / "gpt2.svg").exists() and (tmp_path / "gpt2.loss.png").exists()
    # the same plan again: the launcher takes its capture and checks from the cache (the tests' own folder), and
    # nothing the first run read (its config, /proc files, the data's module) made the entry stale
    again = subprocess.run([str(Path(sys.executable).parent / "pd"), "train", "gpt2.plan.json", "--data",
                            "gpt2_text:text", "--steps", "2", "--threads", "1"], cwd=tmp_path, capture_output=True,
                           text=True, timeout=300)
    assert again.returncode == 0, again.stderr
    assert "the model's capture and checks come from" in again.stderr and "trained steps 1-2" in again.stdout
