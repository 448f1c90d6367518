"""`pd train` under a cluster's own launcher (`runtime.launcher.external`): a 2-process job started by
torchrun itself, and one started as srun would, with SLURM's variables set by hand. Each trains
as pd train's own launcher does (flush: bit for bit), fails with one line on every process, and
ends on SIGTERM with one line and its checkpoints kept."""
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from helpers import plan_with

import pdtool
from pdtool.cli import cli
from pdtool.artifacts.checkpoint import latest_complete, load_checkpoint, read_manifest
from pdtool.artifacts.profile import ModelRef

PD = str(Path(sys.executable).parent / "pd")
PATH = os.pathsep.join([str(Path(pdtool.__file__).parents[1]), str(Path(__file__).parents[1])])  # this pdtool, toymodels
TRAIN = ["--steps", "6", "--checkpoint-every", "3", "--quiet", "--timeout", "20"]
_LAUNCHERS = ("SLURM_", "TORCHELASTIC_", "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_", "GROUP_")


def environment(**extra) -> dict[str, str]:
    """This environment without any launcher's variables, with this pdtool and the toy models importable."""
    env = {name: value for name, value in os.environ.items() if not name.startswith(_LAUNCHERS)}
    return {**env, "PYTHONPATH": PATH, **extra}


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def srun(plan, args, cwd, tasks=2):
    """`pd train plan args` in `tasks` processes with the variables srun sets (one machine): the
    started processes, rank order."""
    port = str(free_port())
    return [subprocess.Popen([PD, "train", str(plan), *args], cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                             text=True, env=environment(
                                 SLURM_PROCID=str(rank), SLURM_NTASKS=str(tasks), SLURM_LOCALID=str(rank),
                                 SLURM_JOB_NODELIST="localhost", SLURM_STEP_ID="0", SLURM_JOB_ID="4242",
                                 MASTER_PORT=port))
            for rank in range(tasks)]


def finish(processes, timeout=120):
    """[(exit code, stdout, stderr lines)] of processes, in order."""
    results = []
    for process in processes:
        out, err = process.communicate(timeout=timeout)
        results.append((process.returncode, out, err.strip().splitlines()))
    return results


def saved(folder):
    """A checkpoint's tensors: weights and buffers, then optimizer state."""
    _, tensors, extra = load_checkpoint(folder)
    return {**tensors, **{f"optimizer {name}": value for name, value in extra.items()}}


def assert_same_checkpoints(root, expected_root):
    steps = sorted(path.name for path in Path(expected_root).glob("step-*"))
    assert steps == ["step-00000003", "step-00000006"]
    assert sorted(path.name for path in Path(root).glob("step-*")) == steps
    for step in steps:
        expected, got = saved(Path(expected_root) / step), saved(Path(root) / step)
        assert sorted(got) == sorted(expected)
        for name, value in expected.items():
            torch.testing.assert_close(got[name], value, rtol=0, atol=0)


@pytest.fixture(scope="module")
def local(tmp_path_factory):
    """A flush plan of 2 workers trained by pd train's own launcher: (plan, its checkpoints, its metrics)."""
    folder = tmp_path_factory.mktemp("local")
    _, plan = plan_with(folder, [((0, 1), 1), ((2, 3), 1)], mode="flush")
    done = CliRunner().invoke(cli, ["train", str(plan), *TRAIN, "--checkpoint-dir", str(folder / "ckpt"), "--metrics",
                                    str(folder / "m.csv"), "--launcher", "local"])  # in this process
    assert done.exit_code == 0, done.output
    return plan, folder / "ckpt", (folder / "m.csv").read_text()


def test_a_torchrun_job_trains_as_pd_trains_own_launcher(local, tmp_path):
    plan, expected, metrics = local
    argv = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "--no-python",
            PD, "train", str(plan), *TRAIN, "--checkpoint-dir", "ckpt", "--metrics", "m.csv"]
    done = subprocess.run(argv, cwd=tmp_path, capture_output=True, text=True, env=environment(), timeout=120)
    assert done.returncode == 0, done.stderr
    assert "trained steps 1-6 (12 minibatches) on 2 workers" in done.stdout  # rank 0 reports the whole job
    assert [row.split(",")[:3] for row in (tmp_path / "m.csv").read_text().splitlines()] == \
        [row.split(",")[:3] for row in metrics.splitlines()]  # step, minibatches, loss
    assert_same_checkpoints(tmp_path / "ckpt", expected)


def test_a_job_started_with_slurms_variables_trains_as_pd_trains_own_launcher(local, tmp_path):
    plan, expected, metrics = local
    results = finish(srun(plan, [*TRAIN, "--checkpoint-dir", "ckpt", "--metrics", "m.csv"], tmp_path))
    assert [code for code, _, _ in results] == [0, 0], results
    assert "trained steps 1-6 (12 minibatches) on 2 workers" in results[0][1] and results[1][1] == ""
    assert not any(line.startswith("pd: error") for _, _, lines in results for line in lines)
    assert [row.split(",")[:3] for row in (tmp_path / "m.csv").read_text().splitlines()] == \
        [row.split(",")[:3] for row in metrics.splitlines()]
    assert_same_checkpoints(tmp_path / "ckpt", expected)


def test_a_failed_check_is_the_same_line_on_every_rank_before_any_worker_starts(local, tmp_path):
    plan, _, _ = local
    began = time.monotonic()
    results = finish(srun(plan, ["--steps", "2", "--data", "digits", "--checkpoint-dir", "ckpt"], tmp_path))
    lines = [lines for _, _, lines in results]
    assert [code for code, _, _ in results] == [1, 1], results
    assert all(len(each) == 1 and each[0].startswith("pd: error: the first minibatch of --data digits") and
               "does not fit the model" in each[0] for each in lines), lines
    assert lines[0] == lines[1]
    assert not (tmp_path / "ckpt").exists()  # refused before the checkpoint folder was touched
    assert time.monotonic() - began < 60


def test_sigterm_ends_every_process_with_one_line_and_keeps_the_checkpoints(local, tmp_path):
    plan, _, _ = local
    processes = srun(plan, ["--steps", "4000", "--checkpoint-every", "20", "--quiet", "--checkpoint-dir", "ckpt"],
                     tmp_path)
    deadline = time.monotonic() + 60
    while not (tmp_path / "ckpt" / "step-00000020" / "manifest.json").exists() and time.monotonic() < deadline:
        time.sleep(0.1)
    for process in processes:
        process.send_signal(signal.SIGTERM)
    results = finish(processes, timeout=30)
    assert [code for code, _, _ in results] == [143, 143], results
    (_, _, first), (_, _, second) = results
    assert second == ["pd: error: interrupted by SIGTERM: worker rank 1 stopped"]
    assert len(first) == 1 and first[0].startswith("pd: error: interrupted by SIGTERM: worker rank 0 stopped; the last "
                                                   "complete checkpoint is ckpt/step-"), first
    newest = latest_complete(tmp_path / "ckpt")
    assert str(newest.relative_to(tmp_path)) in first[0] and read_manifest(newest).step >= 20
    load_checkpoint(newest)


def test_a_failing_worker_under_torchrun_is_one_line(tmp_path):
    _, plan = plan_with(tmp_path, [((0, 1), 1), ((2, 2), 1)], ref=ModelRef("toymodels:exploding", {"after": 8}))
    argv = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "--no-python",
            PD, "train", str(plan), "--steps", "10", "--quiet"]
    done = subprocess.run(argv, cwd=tmp_path, capture_output=True, text=True, env=environment(), timeout=120)
    assert done.returncode == 1
    ours = [line for line in done.stderr.splitlines() if line.startswith("pd:")]
    assert ours[0] == "pd: error: worker rank 1 failed: RuntimeError: boom after 8 forwards", done.stderr
    assert len(ours) == 2 and "worker rank 0" in ours[1], ours  # torchrun stopped it: its own one line
    assert "traceback : pd: error: worker rank 1 failed: RuntimeError: boom" in done.stderr  # torchrun's report


def test_torchrun_restarts_resume_from_the_newest_checkpoint_and_end_as_an_uninterrupted_run(tmp_path):
    """A worker that raises after 8 forwards (4 flush steps), under torchrun --max-restarts 2 with
    --resume: each new attempt continues from the newest complete checkpoint (its store keys apart
    from the last attempt's), and the run ends with the weights of a run that never failed."""
    split = [((0, 1), 1), ((2, 2), 1)]
    _, failing = plan_with(tmp_path, split, mode="flush", ref=ModelRef("toymodels:exploding", {"after": 8}))
    _, whole = plan_with(tmp_path, split, mode="flush", ref=ModelRef("toymodels:exploding", {"after": 10**9}),
                         name="whole.plan.json")
    every = ["--steps", "10", "--checkpoint-every", "1", "--quiet"]
    argv = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "--max-restarts",
            "2", "--no-python", PD, "train", str(failing), *every, "--checkpoint-dir", "ckpt", "--resume"]
    done = subprocess.run(argv, cwd=tmp_path, capture_output=True, text=True, env=environment(), timeout=180)
    assert done.returncode == 0, done.stderr
    resumed = [line for line in done.stderr.splitlines() if line.startswith("pd: resuming from")]
    assert resumed == ["pd: resuming from ckpt/step-00000004 (step 4)", "pd: resuming from ckpt/step-00000008 (step 8)"]
    [(code, _, lines)] = finish([subprocess.Popen([PD, "train", str(whole), *every, "--checkpoint-dir", "whole"],
                                                  cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                                  text=True, env=environment())])
    assert code == 0, lines
    expected, got = saved(tmp_path / "whole" / "step-00000010"), saved(tmp_path / "ckpt" / "step-00000010")
    assert sorted(got) == sorted(expected)
    for name, value in expected.items():
        torch.testing.assert_close(got[name], value, rtol=0, atol=0)
