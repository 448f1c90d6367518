"""`pd train --max-restarts N`: a job whose worker dies starts again from the newest complete
checkpoint, one line per restart, and ends with the weights of a run that never failed."""
import dataclasses

import torch
from click.testing import CliRunner

from helpers import config_for, plan_with
from test_checkpoint_resume import saved

from pdtool.artifacts.profile import ModelRef
from pdtool.cli import cli
from pdtool.runtime.launcher.session import run


def test_a_worker_killed_mid_run_restarts_from_the_newest_checkpoint_and_ends_as_an_uninterrupted_run(tmp_path):
    ref = ModelRef("toymodels:dying", {"after": 10**9})
    plan, whole_path = plan_with(tmp_path, [((0, 1), 1), ((2, 2), 1)], ref=ref, name="whole.plan.json")
    model = dict(plan.profile.model, kwargs={"after": 4})  # the last stage's worker dies at its 5th forward
    dying = dataclasses.replace(plan, profile=dataclasses.replace(plan.profile, model=model))
    dying.save(tmp_path / "dying.plan.json")
    run(config_for(whole_path, steps=6, checkpoint_dir=str(tmp_path / "whole"), checkpoint_every=2, threads=1))
    ckpt = tmp_path / "ckpt"
    result = CliRunner().invoke(cli, ["train", str(tmp_path / "dying.plan.json"), "--steps", "6", "--lr", "0.05",
                                      "--momentum", "0.9", "--checkpoint-dir", str(ckpt), "--checkpoint-every", "2",
                                      "--max-restarts", "2", "--threads", "1", "--quiet"])
    assert result.exit_code == 0, result.output
    lines = [line for line in result.stderr.splitlines() if "restart" in line]
    assert len(lines) == 1, result.stderr
    assert "worker rank 1 failed" in lines[0] and f"restart 1 of 2 from {ckpt / 'step-00000004'} (step 4)" in lines[0]
    assert "trained steps 5-6" in result.stdout
    expected, got = saved(tmp_path / "whole" / "step-00000006"), saved(ckpt / "step-00000006")
    assert sorted(got) == sorted(expected)
    for name, value in expected.items():
        torch.testing.assert_close(got[name], value, rtol=0, atol=0)


def test_restarts_need_a_checkpoint_folder_and_one_machine(tmp_path):
    for extra in (["--max-restarts", "1"], ["--max-restarts", "1", "--checkpoint-dir", str(tmp_path / "c"),
                                            "--nnodes", "2", "--master-port", "29999"]):
        result = CliRunner().invoke(cli, ["train", str(tmp_path / "missing.plan.json"), *extra])
        assert result.exit_code == 2 and "--max-restarts" in result.stderr
