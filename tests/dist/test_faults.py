"""Faults a running `pd train` meets: a worker that hangs (SIGSTOP), signals to the launcher
(SIGTERM, Ctrl-C's SIGINT), a port in use, a disk that fills up. Each must end the whole job within its bound, with
one line on stderr and the documented exit code, every worker process gone and the checkpoints
kept. And a one-machine job listens on loopback only."""
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from click.testing import CliRunner

from helpers import plan_with

from pdtool.artifacts.profile import ModelRef
from pdtool.cli import cli

PD = str(Path(sys.executable).parent / "pd")
DIGITS = ModelRef("pdtool.zoo:mlp", {"in_features": 64, "hidden": 16, "depth": 2, "classes": 10})


def children_of(pid):
    found = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            found.extend(int(child) for child in (task / "children").read_text().split())
        except FileNotFoundError:
            continue
    return found


def workers_of(pid):
    """The worker processes of the launcher `pid`: the children of its forkserver child (a process of its
    own, or a fork of the launcher: `pd train` forks it once it has imported torch)."""
    found = []
    launcher = Path(f"/proc/{pid}/cmdline").read_bytes()
    for server in children_of(pid):
        try:
            cmdline = Path(f"/proc/{server}/cmdline").read_bytes()
        except FileNotFoundError:
            continue
        if b"multiprocessing.forkserver" in cmdline or cmdline == launcher:
            found.extend(children_of(server))
    return sorted(found)


def alive(pid):
    try:
        state = Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0]
    except FileNotFoundError:
        return False
    return state != "Z"


def output_of(process):
    """What a `pd train` process printed, for an assertion's message: stopped first when it still
    runs (waiting for a job of 100000 steps to end would hang the suite)."""
    if process.poll() is None:
        process.kill()
    return process.communicate()


def start_training(tmp_path, *extra):
    _, path = plan_with(tmp_path, [((0, 1), 1), ((2, 2), 1)], ref=DIGITS, batch_size=32)
    ckpt = tmp_path / "ckpt"
    process = subprocess.Popen([PD, "train", str(path), "--data", "digits", "--steps", "10000", "--quiet",
                                "--checkpoint-dir", str(ckpt), "--checkpoint-every", "200", *extra],
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    deadline = time.monotonic() + 60
    while not (ckpt / "step-00000200" / "manifest.json").exists():  # training is under way
        assert process.poll() is None, output_of(process)
        assert time.monotonic() < deadline, "training did not start"
        time.sleep(0.2)
    return process, workers_of(process.pid), ckpt


def finish(process, bound_s):
    began = time.monotonic()
    try:
        _, err = process.communicate(timeout=bound_s + 30)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        raise
    return time.monotonic() - began, err.strip().splitlines()


def test_a_hung_worker_ends_the_job_within_the_timeout(tmp_path):
    process, workers, _ = start_training(tmp_path, "--timeout", "4")
    assert len(workers) == 2
    os.kill(workers[-1], signal.SIGSTOP)  # rank 1 stops answering
    took, lines = finish(process, 4)
    assert process.returncode == 1 and took < 4 + 6, (took, lines)
    # the peer's report names rank 1 (the peer records it before it kills the stopped rank 1)
    assert len(lines) == 1 and "which stopped answering" in lines[0] and "from rank 1" in lines[0], lines
    assert not any(alive(w) for w in workers)


@pytest.mark.parametrize("sig, code", [(signal.SIGTERM, 143), (signal.SIGINT, 130)], ids=["SIGTERM", "SIGINT"])
def test_a_signal_stops_every_worker_and_names_the_last_checkpoint(tmp_path, sig, code):
    from pdtool.artifacts.checkpoint import latest_complete

    process, workers, ckpt = start_training(tmp_path)
    os.kill(process.pid, sig)
    took, lines = finish(process, 5)
    assert process.returncode == code and took < 5, (took, lines)
    assert len(lines) == 1 and lines[0].startswith(f"pd: error: interrupted by {sig.name}: every worker was stopped")
    assert f"the last complete checkpoint is {latest_complete(ckpt)}" in lines[0]
    assert not any(alive(w) for w in workers)


def listening_addresses(pids):
    """(address, port) of every listening TCP socket of the processes `pids`."""
    inodes = set()
    for pid in pids:
        for fd in Path(f"/proc/{pid}/fd").iterdir():
            try:
                target = os.readlink(fd)
            except OSError:
                continue
            if target.startswith("socket:["):
                inodes.add(target[8:-1])
    found = []
    for table, width in (("/proc/net/tcp", 8), ("/proc/net/tcp6", 32)):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            if fields[3] == "0A" and fields[9] in inodes:  # 0A: LISTEN
                address, port = fields[1].split(":")
                found.append((address, int(port, 16)))
    return found


def test_a_one_machine_job_listens_on_loopback_only(tmp_path):
    process, workers, _ = start_training(tmp_path)
    try:
        addresses = listening_addresses([process.pid] + workers)
    finally:
        os.kill(process.pid, signal.SIGTERM)
        finish(process, 5)
    loopback = {"0100007F", "00000000000000000000000001000000"}  # 127.0.0.1 and ::1 as /proc/net writes them
    assert addresses and all(address in loopback for address, _ in addresses), addresses


def test_pd_trains_forkserver_is_a_fork_of_its_launcher(tmp_path):
    """`pd train` forks its workers' forkserver once it has imported torch (`forked._fork_forkserver`), instead
    of starting a Python of its own that imports torch again (about 1.9 s of CPU a job)."""
    process, workers, _ = start_training(tmp_path)
    try:
        launcher = Path(f"/proc/{process.pid}/cmdline").read_bytes()
        servers = {int(Path(f"/proc/{w}/stat").read_text().rsplit(")", 1)[1].split()[1]) for w in workers}
        cmdlines = [Path(f"/proc/{s}/cmdline").read_bytes() for s in servers]
    finally:
        os.kill(process.pid, signal.SIGTERM)
        finish(process, 5)
    assert len(workers) == 2 and len(servers) == 1 and cmdlines == [launcher], (workers, servers, cmdlines)


def test_a_port_in_use_is_one_line(tmp_path):
    import socket

    _, path = plan_with(tmp_path, [((0, 1), 1), ((2, 3), 1)])
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = CliRunner().invoke(cli, ["train", str(path), "--master-port", str(port)])
    assert result.exit_code == 1
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and f"cannot listen on 127.0.0.1:{port}" in lines[0] and "drop --master-port" in lines[0]


def test_a_worker_killed_mid_run_resumes_to_the_uninterrupted_result(tmp_path):
    """SIGKILL a worker while checkpoints are written every step (60 steps, killed once a worker began
    the 5th's folder); `--resume` continues from the last complete one and ends exactly where an
    uninterrupted run ends (flush is deterministic). The workers are watched, not the launcher's
    manifests: those it writes every 0.2 s, by when the workers of so small a model may have finished."""
    import torch

    from pdtool.artifacts.checkpoint import latest_complete, load_checkpoint

    _, path = plan_with(tmp_path, [((0, 1), 1), ((2, 2), 1)], ref=DIGITS, batch_size=32, mode="flush")
    args = ["train", str(path), "--data", "digits", "--steps", "60", "--quiet", "--checkpoint-every", "1"]
    whole, broken = tmp_path / "whole", tmp_path / "broken"
    done = CliRunner().invoke(cli, [*args, "--checkpoint-dir", str(whole)])  # in this process: its forkserver serves
    assert done.exit_code == 0, done.output
    process = subprocess.Popen([PD, *args, "--checkpoint-dir", str(broken)], stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True, start_new_session=True)
    deadline = time.monotonic() + 60
    while not (broken / "step-00000005").exists():  # 55 steps before its end
        assert process.poll() is None and time.monotonic() < deadline, output_of(process)
        time.sleep(0.005)
    os.killpg(process.pid, signal.SIGSTOP)  # the job stands still while its worker is found: it cannot end first
    try:
        os.kill(workers_of(process.pid)[-1], signal.SIGKILL)
    finally:
        os.killpg(process.pid, signal.SIGCONT)
    _, lines = finish(process, 10)
    assert process.returncode == 1 and len(lines) == 1 and "worker rank 1 failed" in lines[0], lines
    assert latest_complete(broken) is not None
    resumed = CliRunner().invoke(cli, [*args, "--checkpoint-dir", str(broken), "--resume"])
    assert resumed.exit_code == 0, resumed.output
    _, expected, _ = load_checkpoint(whole / "step-00000060")
    _, got, _ = load_checkpoint(broken / "step-00000060")
    assert expected.keys() == got.keys()
    for name in expected:
        torch.testing.assert_close(got[name], expected[name])


@pytest.fixture
def small_disk(tmp_path):
    """A 1 MiB tmpfs: a real file system that fills up (needs root; skipped elsewhere)."""
    folder = tmp_path / "disk"
    folder.mkdir()
    made = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(folder)], capture_output=True)
    if made.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here (root needed): {made.stderr.decode().strip()}")
    try:
        yield folder
    finally:
        subprocess.run(["umount", "-l", str(folder)], check=False)


def fill(folder, leave_bytes):
    """Fill the file system of `folder` until about `leave_bytes` are free."""
    stat = os.statvfs(folder)
    free = stat.f_bavail * stat.f_frsize
    (folder / "filler").write_bytes(b"\0" * max(free - leave_bytes, 0))


def test_a_full_disk_stops_the_job_with_one_line_and_keeps_the_checkpoints(tmp_path, small_disk):
    from pdtool.artifacts.checkpoint import latest_complete, verify_checkpoint

    _, path = plan_with(tmp_path, [((0, 1), 1), ((2, 2), 1)], ref=DIGITS, batch_size=32, mode="flush")
    fill(small_disk, 64 * 1024)  # room for a few checkpoints of this tiny model, not for 400
    ckpt = small_disk / "ckpt"
    began = time.monotonic()
    run = CliRunner().invoke(cli, ["train", str(path), "--data", "digits", "--steps", "400", "--quiet",
                                   "--checkpoint-dir", str(ckpt), "--checkpoint-every", "1"])
    lines = run.stderr.strip().splitlines()
    assert run.exit_code == 1 and len(lines) == 1 and "No space left on device" in lines[0], lines
    assert time.monotonic() - began < 60
    last = latest_complete(ckpt)
    assert last is not None and verify_checkpoint(last).step >= 1  # what was written before is intact
    assert f"the last complete checkpoint is {last}" in lines[0]
    assert not list(ckpt.rglob("*.tmp"))


def test_a_full_disk_under_an_output_is_one_line_and_leaves_the_old_file(tmp_path, small_disk):
    from pdtool.profiler import profile_model

    profile = tmp_path / "m.profile.json"
    profile_model(DIGITS, batch_size=4, repeats=1, warmup=0).save(profile)
    out = small_disk / "m.plan.json"
    out.write_text("an earlier plan\n")
    fill(small_disk, 0)
    run = subprocess.run([PD, "plan", str(profile), "--cluster", "2x1GB/s", "-o", str(out)], capture_output=True, text=True)
    lines = run.stderr.strip().splitlines()
    assert run.returncode == 1 and len(lines) == 1 and "No space left on device" in lines[0], lines
    assert out.read_text() == "an earlier plan\n" and not list(small_disk.glob("*.tmp"))


def test_a_launch_from_a_process_that_computed_on_several_threads_trains(tmp_path):
    """A process whose torch ran a parallel region on several threads (a notebook, a bench, a test run
    without pytest-xdist) and then launches in-process: its workers' forkserver must not be a fork of it
    (libgomp's pool does not survive a fork; the workers waited forever in their first multi-threaded op,
    and the job ended at --timeout), so `forked.start_early` starts one of its own (`_fork_is_safe`)."""
    _, path = plan_with(tmp_path, [((0, 1), 1), ((2, 3), 1)])
    script = (f"import sys, torch\ntorch.set_num_threads(2)\nx = torch.randn(256, 256)\nfor _ in range(20): x = "
              f"(x @ x).tanh()\nx.log_softmax(-1)\nfrom pdtool.cli import cli\nsys.argv = ['pd', 'train', "
              f"{str(path)!r}, '--steps', '2', '--threads', '2', '--timeout', '15', '--quiet']\ncli()\n")
    began = time.monotonic()
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120,
                          env=dict(os.environ, PDTOOL_CACHE_DIR="off"))
    assert done.returncode == 0, done.stderr[-2000:]
    assert "time per minibatch" in done.stdout and time.monotonic() - began < 15, (done.stdout, time.monotonic() - began)
