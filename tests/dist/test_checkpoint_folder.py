"""One writer per checkpoint folder, run ids, and one way out of what an interrupted run left:
two runs on one folder, a --resume beside a running job, an interrupted run's last checkpoint
with every shard but no manifest, and a SIGKILLed launcher."""
import json
import os
import signal
import subprocess
import time
from pathlib import Path

from click.testing import CliRunner

from helpers import plan_with
from test_faults import PD, alive, output_of, workers_of

from pdtool.artifacts.checkpoint import latest_complete, load_checkpoint, read_manifest
from pdtool.cli import cli


def _lock_record(ckpt: Path, pid: int, timeout_s: float = 60):
    """The lock's record once process `pid` holds the folder and writes into it."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            record = json.loads((ckpt / ".pdtool.lock").read_text() or "null")
        except (OSError, ValueError):
            record = None
        if record and record.get("pid") == pid and record.get("writer"):
            return record["writer"]
        time.sleep(0.05)
    raise AssertionError("the first run never held the folder")


def test_a_second_run_on_a_folder_in_use_is_one_line_and_the_first_one_completes_alone(tmp_path):
    _, path = plan_with(tmp_path, [((0, 1), 1), ((2, 3), 1)])
    ckpt = tmp_path / "ckpt"
    first = subprocess.Popen([PD, "train", str(path), "--steps", "600", "--checkpoint-dir", str(ckpt),
                              "--checkpoint-every", "100", "--quiet"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                             text=True, start_new_session=True)
    try:
        record = _lock_record(ckpt, first.pid)
        os.killpg(first.pid, signal.SIGSTOP)  # paused while it holds the folder: it cannot finish meanwhile
        try:
            for extra in ([], ["--resume"]):  # a new run, and a --resume, beside the running one
                second = CliRunner().invoke(cli, ["train", str(path), "--steps", "600", "--checkpoint-dir", str(ckpt),
                                                  *extra, "--quiet"])
                lines = second.stderr.strip().splitlines()
                assert second.exit_code == 1 and len(lines) == 1, second.stderr
                assert f"is in use by another pd train (pid {first.pid} on " in lines[0], lines
        finally:
            os.killpg(first.pid, signal.SIGCONT)
        _, err = first.communicate(timeout=120)
    finally:
        if first.poll() is None:
            os.killpg(first.pid, signal.SIGKILL)
    assert first.returncode == 0, err
    assert sorted(p.name for p in ckpt.glob("step-*")) == [f"step-{k:08d}" for k in range(100, 601, 100)]
    for folder in ckpt.glob("step-*"):  # every manifest completes the first run's own shards
        manifest = read_manifest(folder)
        assert manifest.run == record["run"] and all(record["run"] in e.file for e in manifest.shards.values())
        load_checkpoint(folder)


def test_resume_completes_the_checkpoint_an_interrupted_run_left_with_every_shard(tmp_path):
    """Killed between its last shard and the manifest: --resume writes the manifest, says so and
    continues from it; without --resume the folder is refused with the way out."""
    _, path = plan_with(tmp_path, [((0, 1), 1), ((2, 3), 1)])
    ckpt = tmp_path / "ckpt"
    first = CliRunner().invoke(cli, ["train", str(path), "--steps", "3", "--checkpoint-dir", str(ckpt),
                                     "--checkpoint-every", "1", "--quiet"])
    assert first.exit_code == 0, first.output
    (ckpt / "step-00000003" / "manifest.json").unlink()
    again = CliRunner().invoke(cli, ["train", str(path), "--steps", "5", "--checkpoint-dir", str(ckpt), "--quiet"])
    assert again.exit_code == 1 and "add --resume" in again.stderr
    resumed = CliRunner().invoke(cli, ["train", str(path), "--steps", "5", "--checkpoint-dir", str(ckpt), "--resume",
                                       "--quiet"])
    assert resumed.exit_code == 0, resumed.output
    assert f"completed {ckpt / 'step-00000003'}: the interrupted run" in resumed.stderr
    assert f"resuming from {ckpt / 'step-00000003'} (step 3)" in resumed.stderr
    assert "trained steps 4-5" in resumed.stdout and read_manifest(latest_complete(ckpt)).step == 5


def test_a_sigkilled_launcher_takes_its_workers_along_and_resume_continues(tmp_path):
    _, path = plan_with(tmp_path, [((0, 1), 1), ((2, 3), 1)])
    ckpt = tmp_path / "ckpt"
    process = subprocess.Popen([PD, "train", str(path), "--steps", "20000", "--checkpoint-dir", str(ckpt),
                                "--checkpoint-every", "50", "--quiet"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                               text=True)
    try:
        deadline = time.monotonic() + 60
        while not list(ckpt.glob("step-*/stage-*.pt")):
            assert process.poll() is None and time.monotonic() < deadline, output_of(process)
            time.sleep(0.05)
        workers = workers_of(process.pid)
        process.kill()  # the launcher alone: no chance to stop its workers or write a manifest
        process.communicate()
        deadline = time.monotonic() + 10
        while any(alive(w) for w in workers) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert workers and not any(alive(w) for w in workers)  # they die with their launcher
    finally:
        if process.poll() is None:
            process.kill()
    resumed = CliRunner().invoke(cli, ["train", str(path), "--steps", "5", "--checkpoint-dir", str(ckpt), "--resume",
                                       "--quiet"])
    newest = read_manifest(latest_complete(ckpt)).step if latest_complete(ckpt) else 0
    assert resumed.exit_code in (0, 1), resumed.output
    if newest < 5:  # killed early: it continues from what was complete, or from step 0
        assert resumed.exit_code == 0 and "trained steps" in resumed.stdout, resumed.output
    else:  # killed late: the checkpoint is already past --steps
        assert "ask for more steps" in resumed.stderr


def test_resuming_from_another_models_checkpoint_is_one_line_before_any_worker(tmp_path):
    from pdtool.artifacts.profile import ModelRef

    _, mine = plan_with(tmp_path, [((0, 1), 1), ((2, 3), 1)], name="mine.plan.json")
    wider = ModelRef("pdtool.zoo:mlp", {"in_features": 12, "hidden": 9, "depth": 3, "classes": 3})
    _, other = plan_with(tmp_path, [((0, 1), 1), ((2, 3), 1)], ref=wider, name="other.plan.json")
    ckpt = tmp_path / "ckpt"
    assert CliRunner().invoke(cli, ["train", str(other), "--steps", "2", "--checkpoint-dir", str(ckpt),
                                    "--quiet"]).exit_code == 0
    began = time.monotonic()
    result = CliRunner().invoke(cli, ["train", str(mine), "--steps", "4", "--checkpoint-dir", str(ckpt), "--resume"])
    lines = result.stderr.strip().splitlines()
    assert result.exit_code == 1 and len(lines) == 1 and time.monotonic() - began < 20, result.stderr
    assert "no checkpoint in" in lines[0] and "another model's checkpoint" in lines[0] and "worker rank" not in lines[0]
    assert sorted(p.name for p in ckpt.glob("step-*")) == ["step-00000002"]  # nothing set aside or changed
