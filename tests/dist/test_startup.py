"""Start-up and signals in every phase of `pd train`: a worker stopped while it builds its stage,
a start-up slower than --startup-timeout, and SIGINT/SIGTERM while the launcher imports a model
factory that hangs. Each ends within its bound with pdtool's one line, no worker left."""
import json
import os
import signal
import subprocess
import time

import pytest

from helpers import plan_with
from test_faults import PD, alive, output_of, workers_of

from pdtool.artifacts.profile import ModelRef

SLOW = {"in_features": 12, "hidden": 8, "depth": 2, "classes": 3}
TESTS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ENV = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [TESTS, os.environ.get("PYTHONPATH")])))


def slow_plan(tmp_path, delay, rank=None):
    """A 2-stage plan whose model takes `delay` seconds to build (in every process, or only in the
    worker of rank `rank`), profiled without the delay."""
    _, path = plan_with(tmp_path, [((0, 1), 1), ((2, 2), 1)], ref=ModelRef("toymodels:slow_start", SLOW))
    data = json.loads(path.read_text())
    data["profile"]["model"]["kwargs"].update(delay=delay, rank=rank)
    path.write_text(json.dumps(data))
    return path


def ended_after(process, act):
    """Do `act` to a running pd train, then wait for it to end: (seconds that took, its stderr)."""
    try:
        act()
        began = time.monotonic()
        _, err = process.communicate(timeout=60)
        return time.monotonic() - began, err
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)


def test_a_worker_stopped_while_it_builds_its_stage_ends_the_job_within_the_timeout(tmp_path):
    path = slow_plan(tmp_path, 2.0)
    process = subprocess.Popen([PD, "train", str(path), "--steps", "3", "--timeout", "4", "--quiet"],
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True, env=ENV)
    deadline = time.monotonic() + 60
    while len(workers_of(process.pid)) < 2:  # the launcher's own build (2 s) is done, the workers start
        assert process.poll() is None and time.monotonic() < deadline, output_of(process)
        time.sleep(0.05)
    workers = workers_of(process.pid)
    took, err = ended_after(process, lambda: os.kill(workers[0], signal.SIGSTOP))  # rank 0: before its stage is built
    lines = err.strip().splitlines()
    assert process.returncode == 1 and len(lines) == 1, lines
    assert "waited for rank 0 to start, which stopped answering" in lines[0] and "--timeout" in lines[0], lines
    assert took < 2 + 4 + 8, took  # its build, the silence, the launcher's stop
    assert not any(alive(w) for w in workers)


def test_a_start_up_longer_than_the_startup_timeout_is_one_line(tmp_path):
    path = slow_plan(tmp_path, 30.0, rank=1)  # rank 1 builds for 30 s, alive all along
    began = time.monotonic()
    # 10 s: the launcher's own checks (the model built on meta, captured, checked) count too, a few seconds on a busy
    # 2-core machine (over 6 s with three tests at once on its two cores)
    done = subprocess.run([PD, "train", str(path), "--steps", "2", "--startup-timeout", "10", "--quiet"],
                          capture_output=True, text=True, timeout=120, env=ENV)
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 1 and len(lines) == 1, lines
    assert "rank 0 waited 10 s for rank(s) 1 to build their stages" in lines[0] and "--startup-timeout" in lines[0]
    assert time.monotonic() - began < 28


HANGS = {"sleeps": "import time\ntime.sleep(600)\n",
         "swallows": "import time\nwhile True:\n    try:\n        time.sleep(600)\n    except BaseException:\n"
                     "        pass\n"}


@pytest.mark.parametrize("command, hang, sig, code", [
    ("train", "sleeps", signal.SIGINT, 130), ("train", "swallows", signal.SIGTERM, 143),
    ("profile", "sleeps", signal.SIGTERM, 143),
], ids=["train-SIGINT-sleeps", "train-SIGTERM-swallows", "profile-SIGTERM-sleeps"])
def test_a_signal_while_pd_imports_a_hanging_factory_is_one_line(tmp_path, command, hang, sig, code):
    """Also when started in the background by a shell, which makes it ignore SIGINT, and when the
    factory swallows every exception (then it is ended GRACE_S seconds later)."""
    _, path = plan_with(tmp_path, [((0, 1), 1), ((2, 3), 1)])
    data = json.loads(path.read_text())
    data["profile"]["model"]["spec"] = "hanging:build"
    path.write_text(json.dumps(data))
    # the factory's module says it is being imported (a file), then hangs
    (tmp_path / "hanging.py").write_text("open('importing', 'w').close()\n" + HANGS[hang] + "def build(**kwargs):\n    pass\n")
    args = {"train": ["train", str(path), "--quiet"], "profile": ["profile", "-m", "hanging:build", "-o", "h.json"]}
    process = subprocess.Popen([PD, *args[command]], cwd=tmp_path, stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True, start_new_session=True,
                               preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN))
    deadline = time.monotonic() + 60
    while not (tmp_path / "importing").exists():  # pd imports torch and pdtool first
        assert process.poll() is None and time.monotonic() < deadline, output_of(process)
        time.sleep(0.05)
    time.sleep(0.2)  # inside its sleep
    assert process.poll() is None
    took, err = ended_after(process, lambda: process.send_signal(sig))
    lines = [line for line in err.strip().splitlines() if not line.startswith("pd: importing")]
    assert process.returncode == code and len(lines) == 1 and lines[0].startswith("pd: interrupted by "), err
    assert took < (1 if hang == "sleeps" else 8), took
    assert not (tmp_path / "h.json").exists()


def test_the_launchers_checks_are_bounded_by_the_startup_timeout(tmp_path):
    """A factory whose import hangs in the launcher (before any worker) ends after --startup-timeout."""
    _, path = plan_with(tmp_path, [((0, 1), 1), ((2, 3), 1)])
    data = json.loads(path.read_text())
    data["profile"]["model"]["spec"] = "hanging:build"
    path.write_text(json.dumps(data))
    (tmp_path / "hanging.py").write_text(HANGS["sleeps"] + "def build(**kwargs):\n    pass\n")
    began = time.monotonic()
    done = subprocess.run([PD, "train", str(path), "--startup-timeout", "2", "--quiet"], cwd=tmp_path,
                          capture_output=True, text=True, timeout=60)
    lines = [line for line in done.stderr.strip().splitlines() if not line.startswith("pd: importing")]
    assert done.returncode == 1 and len(lines) == 1 and "took more than --startup-timeout 2 s" in lines[0], done.stderr
    assert time.monotonic() - began < 15
