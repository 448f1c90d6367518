"""Checkpoints during `pd train`, resuming (also under another plan), and a crash mid-run."""

import pytest
import torch

from helpers import config_for, plan_with

from pdtool.artifacts.checkpoint import latest_complete, load_checkpoint, read_manifest
from pdtool.errors import LaunchError
from pdtool.artifacts.profile import ModelRef
from pdtool.runtime.session import run


def final_weights(result):
    weights = {}
    for report in result.reports.values():
        if report.replica == 0:
            weights.update(report.weights)
    return weights


def test_flush_resumed_under_another_plan_ends_where_an_uninterrupted_run_ends(tmp_path):
    _, two = plan_with(tmp_path, [((0, 1), 1), ((2, 3), 1)], mode="flush", name="two.plan.json")
    _, three = plan_with(tmp_path, [((0, 0), 1), ((1, 2), 1), ((3, 3), 1)], mode="flush", name="three.plan.json")
    whole = run(config_for(two, steps=4, group=2))
    root = tmp_path / "ckpt"
    first = run(config_for(two, steps=2, group=2, checkpoint_dir=str(root), checkpoint_every=1))
    assert sorted(p.name for p in root.glob("step-*")) == ["step-00000001", "step-00000002"]
    assert read_manifest(latest_complete(root))["step"] == 2
    resumed = run(config_for(three, steps=4, group=2, checkpoint_dir=str(root)), resume=True)
    assert resumed.first_step == 2 and sorted(resumed.losses) == [4, 5, 6, 7]
    assert resumed.losses == pytest.approx({b: whole.losses[b] for b in (4, 5, 6, 7)}, rel=1e-6)
    expected = final_weights(whole)
    got = final_weights(resumed)
    for name, value in expected.items():
        torch.testing.assert_close(got[name], value)
    _, saved, _ = load_checkpoint(root / "step-00000004")
    for name, value in expected.items():
        torch.testing.assert_close(saved[name], value)
    assert first.losses == pytest.approx({b: whole.losses[b] for b in range(4)}, rel=1e-6)


def test_a_crash_leaves_the_last_complete_checkpoint_loadable(tmp_path):
    ref = ModelRef("toymodels:exploding", {"after": 7})
    _, path = plan_with(tmp_path, [((0, 1), 1), ((2, 2), 1)], ref=ref, mode="pipedream")
    root = tmp_path / "ckpt"
    with pytest.raises(LaunchError, match="boom after 7 forwards"):
        run(config_for(path, steps=20, checkpoint_dir=str(root), checkpoint_every=1, return_weights=False))
    newest = latest_complete(root)
    assert newest is not None
    manifest, tensors, _ = load_checkpoint(newest)
    assert 1 <= manifest["step"] < 20 and "2.lin.weight" in tensors and "0.weight" in tensors


def test_resume_without_a_checkpoint_dir_is_refused(tmp_path):
    _, path = plan_with(tmp_path, [((0, 3), 1)])
    with pytest.raises(LaunchError, match="--resume needs --checkpoint-dir"):
        run(config_for(path), resume=True)


@pytest.mark.parametrize("mode", ["pipedream", "2bw"])
def test_asynchronous_modes_resume_on_their_schedule(tmp_path, mode):
    """A resumed pipedream/2bw run restarts its pipeline from the checkpoint (weights and
    optimizer state); it must equal the reference executor resumed the same way."""
    from helpers import reference

    plan, path = plan_with(tmp_path, [((0, 1), 1), ((2, 3), 1)], mode=mode)
    root = tmp_path / "ckpt"
    run(config_for(path, steps=2, checkpoint_dir=str(root)))
    resumed = run(config_for(path, steps=4, checkpoint_dir=str(root)), resume=True)
    expected = reference(plan, config_for(path, steps=2, resume=str(root / "step-00000002"),
                                          first_step=2))
    assert resumed.losses == pytest.approx(expected.losses, rel=1e-6)
    got = final_weights(resumed)
    for name, value in expected.weights.items():
        torch.testing.assert_close(got[name], value)


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
    assert read_manifest(root / "step-00000003")["step"] == 3 and not (root / "step-00000002").exists()
