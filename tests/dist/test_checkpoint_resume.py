"""Checkpoints during `pd train`, resuming (also under another plan), and a crash mid-run."""

import dataclasses
import time

import pytest
import torch

from helpers import config_for, plan_with

from pdtool.artifacts.checkpoint import latest_complete, load_checkpoint, read_manifest
from pdtool.errors import LaunchError
from pdtool.artifacts.profile import ModelRef
from pdtool.runtime.launcher.session import run
from pdtool.schedule import MODES


def final_weights(result):
    weights = {}
    for report in result.reports.values():
        if report.replica == 0:
            weights.update(report.weights)
    return weights


def test_flush_resumed_under_another_plan_ends_where_an_uninterrupted_run_ends(tmp_path):
    """The uninterrupted run is one process's gradient accumulation (flush is, to these
    tolerances: test_train.py), computed here without starting workers."""
    from helpers import gradient_accumulation

    two_plan, two = plan_with(tmp_path, [((0, 1), 1), ((2, 3), 1)], mode="flush", name="two.plan.json")
    _, three = plan_with(tmp_path, [((0, 0), 1), ((1, 2), 1), ((3, 3), 1)], mode="flush", name="three.plan.json")
    whole_losses, expected = gradient_accumulation(two_plan, config_for(two, steps=4, group=2))
    root = tmp_path / "ckpt"
    first = run(config_for(two, steps=2, group=2, checkpoint_dir=str(root), checkpoint_every=1))
    assert sorted(p.name for p in root.glob("step-*")) == ["step-00000001", "step-00000002"]
    assert read_manifest(latest_complete(root)).step == 2
    resumed = run(config_for(three, steps=4, group=2, checkpoint_dir=str(root)), resume=True)
    assert resumed.first_step == 2 and sorted(resumed.losses) == [4, 5, 6, 7]
    assert resumed.losses == pytest.approx({b: whole_losses[b] for b in (4, 5, 6, 7)}, rel=1e-6)
    got = final_weights(resumed)
    assert sorted(got) == sorted(expected)
    for name, value in expected.items():
        torch.testing.assert_close(got[name], value)
    _, saved, _ = load_checkpoint(root / "step-00000004")
    for name, value in expected.items():
        torch.testing.assert_close(saved[name], value)
    assert first.losses == pytest.approx({b: whole_losses[b] for b in range(4)}, rel=1e-6)


def test_a_crash_leaves_the_last_complete_checkpoint_loadable(tmp_path):
    """A worker that raises stops the job quickly, with its error in one line (a worker killed
    instead: test_a_run_killed_and_resumed_...), and the checkpoints before it stay loadable."""
    ref = ModelRef("toymodels:exploding", {"after": 7})
    _, path = plan_with(tmp_path, [((0, 1), 1), ((2, 2), 1)], ref=ref, mode="pipedream")
    root = tmp_path / "ckpt"
    began = time.monotonic()
    with pytest.raises(LaunchError, match=r"^worker rank 1 failed: .*boom after 7 forwards; the other workers were "
                                          r"stopped"):
        run(config_for(path, steps=20, checkpoint_dir=str(root), checkpoint_every=1, return_weights=False))
    assert time.monotonic() - began < 30
    newest = latest_complete(root)
    assert newest is not None
    manifest, tensors, _ = load_checkpoint(newest)
    assert 1 <= manifest.step < 20 and "2.lin.weight" in tensors and "0.weight" in tensors


def test_resume_without_a_checkpoint_dir_is_refused(tmp_path):
    _, path = plan_with(tmp_path, [((0, 3), 1)])
    with pytest.raises(LaunchError, match="--resume needs --checkpoint-dir"):
        run(config_for(path), resume=True)


@pytest.mark.parametrize("mode", ["pipedream", "2bw"])
def test_asynchronous_modes_resume_on_their_schedule(tmp_path, mode):
    """With --checkpoint-every, a pipedream/2bw run drains its pipeline at every checkpoint; resumed
    from one, it runs the rest of that schedule, so it equals the reference executor's
    uninterrupted run of the whole drained schedule."""
    from helpers import reference

    plan, path = plan_with(tmp_path, [((0, 1), 1), ((2, 3), 1)], mode=mode)
    root = tmp_path / "ckpt"
    run(config_for(path, steps=2, checkpoint_dir=str(root), checkpoint_every=2))
    resumed = run(config_for(path, steps=4, checkpoint_dir=str(root), checkpoint_every=2), resume=True)
    expected = reference(plan, config_for(path, steps=4, checkpoint_dir=str(root), checkpoint_every=2))
    assert resumed.first_step == 2
    assert resumed.losses == pytest.approx({b: expected.losses[b] for b in resumed.losses}, rel=1e-6)
    got = final_weights(resumed)
    for name, value in expected.weights.items():
        torch.testing.assert_close(got[name], value)


@pytest.fixture(scope="module")
def dropping_plan(tmp_path_factory):
    """A 2-stage plan of `toymodels:dying` with dropout in both stages (its worker never killed)."""
    ref = ModelRef("toymodels:dying", {"after": 10**9, "dropout": 0.25})
    plan, _ = plan_with(tmp_path_factory.mktemp("plan"), [((0, 1), 1), ((2, 2), 1)], ref=ref)
    return plan


def saved(folder):
    """A checkpoint's tensors: weights and buffers, then optimizer state."""
    _, tensors, extra = load_checkpoint(folder)
    return {**tensors, **{f"optimizer {name}": value for name, value in extra.items()}}


@pytest.mark.parametrize("mode", MODES)
def test_a_run_killed_and_resumed_equals_the_uninterrupted_run_bit_for_bit(tmp_path, dropping_plan, mode):
    """Every mode, checkpoints every 2 steps: the last stage's worker is killed (SIGKILL) in the
    third segment; resumed from the checkpoint at step 4 to step 6, the run ends with the very
    weights, optimizer state and losses of the run that was never interrupted (dropout included)."""
    plan = dataclasses.replace(dropping_plan, mode=mode)
    plan.save(tmp_path / "whole.plan.json")
    per_step = 1 if mode in ("pipedream", "vsync") else 2
    model = dict(plan.profile.model, kwargs={"after": 4 * per_step + 1, "dropout": 0.25})  # dies in the third segment
    dataclasses.replace(plan, profile=dataclasses.replace(plan.profile, model=model)).save(tmp_path / "dying.plan.json")
    every = dict(steps=6, checkpoint_every=2)
    whole = run(config_for(tmp_path / "whole.plan.json", checkpoint_dir=str(tmp_path / "whole"), **every))
    began = time.monotonic()  # a killed worker stops the job quickly, and the launcher says which and how
    with pytest.raises(LaunchError, match=r"^worker rank 1 failed: exit code -9 \(SIGKILL\); the other workers were "
                                          r"stopped"):
        run(config_for(tmp_path / "dying.plan.json", checkpoint_dir=str(tmp_path / "ckpt"), **every))
    assert time.monotonic() - began < 30
    assert read_manifest(latest_complete(tmp_path / "ckpt")).step == 4
    resumed = run(config_for(tmp_path / "whole.plan.json", checkpoint_dir=str(tmp_path / "ckpt"), **every),
                  resume=True)
    assert resumed.first_step == 4
    assert resumed.losses == {b: whole.losses[b] for b in range(4 * per_step, 6 * per_step)}
    expected, got = final_weights(whole), final_weights(resumed)
    assert sorted(got) == sorted(expected)
    for name, value in expected.items():
        torch.testing.assert_close(got[name], value, rtol=0, atol=0)
    expected, got = saved(tmp_path / "whole" / "step-00000006"), saved(tmp_path / "ckpt" / "step-00000006")
    assert sorted(got) == sorted(expected)
    for name, value in expected.items():
        torch.testing.assert_close(got[name], value, rtol=0, atol=0)


def test_a_checkpoint_inside_a_round_of_replicas_is_refused(tmp_path):
    """pipedream steps a 2-replica stage once per 2 minibatches: a checkpoint every 3 steps would
    fall inside a step, where no schedule can drain; refused before any worker starts."""
    _, path = plan_with(tmp_path, [((0, 1), 1), ((2, 3), 2)])
    with pytest.raises(LaunchError, match=r"^--checkpoint-every 3: in mode pipedream the stages, replicated 1-2, step "
                                          r"once per round .* multiple of 2 minibatches \(2 steps\); use "
                                          r"--checkpoint-every 4$"):
        run(config_for(path, steps=6, checkpoint_dir=str(tmp_path / "ckpt"), checkpoint_every=3))
    assert not (tmp_path / "ckpt").exists()


def test_resume_never_writes_into_a_folder_it_did_not_create(tmp_path):
    """The newest checkpoint lost its manifest and a shard: resume from the one before, set the
    broken one aside (with its shards, minus the leftovers of interrupted writes) and write new
    folders."""
    _, path = plan_with(tmp_path, [((0, 1), 1), ((2, 3), 1)], mode="flush")
    root = tmp_path / "ckpt"
    run(config_for(path, steps=2, group=2, checkpoint_dir=str(root), checkpoint_every=1))
    broken = root / "step-00000002"
    (broken / "manifest.json").unlink()
    next(broken.glob("stage-1.*.pt")).unlink()  # killed before stage 1's shard: it cannot be completed
    (broken / ".stage-0.pt.x1y2.tmp").write_bytes(b"half a shard")
    [shard] = broken.glob("stage-0.*.pt")  # stage-0.RUN.pt
    old_shard = shard.read_bytes()
    warnings = []
    resumed = run(config_for(path, steps=3, group=2, checkpoint_dir=str(root)), resume=True, warn=warnings.append)
    assert resumed.first_step == 1
    aside = root / "step-00000002.set-aside"
    assert (aside / shard.name).read_bytes() == old_shard and not (aside / "manifest.json").exists()
    assert not list(aside.glob("*.tmp")) and not list(aside.glob(".*.tmp"))
    assert any("skipping checkpoint" in w for w in warnings) and any("set-aside" in w for w in warnings)
    assert read_manifest(root / "step-00000003").step == 3 and not (root / "step-00000002").exists()
