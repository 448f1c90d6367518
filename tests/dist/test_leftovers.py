"""What a `pd train` killed with SIGKILL leaves in the temp folder (its workers' error files) is
removed by the next `pd train`, and a run that ends normally leaves nothing there."""
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from helpers import plan_with

PD = str(Path(sys.executable).parent / "pd")


def scratch_folders(temp):
    return sorted(p.name for p in temp.iterdir() if p.name.startswith("pdtool-workers-"))


def test_the_next_run_sweeps_what_a_killed_launcher_left(tmp_path):
    _, path = plan_with(tmp_path, [((0, 1), 1), ((2, 3), 1)])
    temp = tmp_path / "tmp"
    temp.mkdir()
    env = {**os.environ, "TMPDIR": str(temp)}
    err = tmp_path / "stderr.txt"
    with open(err, "w") as stderr:
        killed = subprocess.Popen([PD, "train", str(path), "--steps", "20000", "--quiet"], env=env,
                                  stdout=subprocess.DEVNULL, stderr=stderr, start_new_session=True)
    deadline = time.monotonic() + 60
    while not any((temp / name / "owner.json").stat().st_size for name in scratch_folders(temp)
                  if (temp / name / "owner.json").exists()):
        assert killed.poll() is None and time.monotonic() < deadline, f"the launcher made no scratch folder: " \
                                                                         f"{err.read_text()}"
        time.sleep(0.1)
    os.killpg(killed.pid, signal.SIGKILL)  # the launcher and its workers, with no chance to clean up
    killed.wait()
    left = scratch_folders(temp)
    assert len(left) == 1 and left[0].startswith(f"pdtool-workers-{killed.pid}-")
    done = subprocess.run([PD, "train", str(path), "--steps", "2", "--quiet"], env=env, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr
    assert scratch_folders(temp) == []
