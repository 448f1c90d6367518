"""Tied weights across stages (an embedding that is also the output head): 2bw, flush and gpipe
add the copies' gradients before each step, so flush and gpipe train as one process does, and
2bw as the reference executor (and as one process for its first step, where no version lags)."""
import pytest
import torch

from helpers import assert_same_run, config_for, gradient_accumulation, merged, plan_with, reference

from pdtool.artifacts.checkpoint import latest_complete, load_checkpoint
from pdtool.errors import LaunchError
from pdtool.artifacts.profile import ModelRef
from pdtool.runtime.launcher.launch import launch
from pdtool.runtime.launcher.session import run

TIED = ModelRef("toymodels:tied_lm")


@pytest.mark.parametrize("mode, split", [
    ("flush", [((0, 0), 1), ((1, 2), 1), ((3, 3), 1)]),
    ("gpipe", [((0, 1), 2), ((2, 3), 1)]),
], ids=["flush 1-1-1", "gpipe 2-1"])
def test_tied_weights_train_as_in_one_process(tmp_path, mode, split):
    plan, path = plan_with(tmp_path, split, mode=mode, ref=TIED)
    config = config_for(path, steps=3, group=4)
    reports = launch(config, len(plan.used_ranks))
    losses, weights = merged(reports)
    expected_losses, expected_weights = gradient_accumulation(plan, config, ref=TIED)
    assert_same_run(losses, weights, expected_losses, expected_weights, rel=1e-5)
    last = next(r for r in reports.values() if r.stage == len(split) - 1)
    torch.testing.assert_close(last.weights["emb.weight"], expected_weights["emb.weight"])  # the head's copy too


@pytest.mark.parametrize("split", [[((0, 0), 1), ((1, 2), 1), ((3, 3), 1)], [((0, 1), 2), ((2, 3), 1)]],
                         ids=["1-1-1", "2-1"])
def test_tied_weights_in_2bw_equal_the_reference_executor(tmp_path, split):
    plan, path = plan_with(tmp_path, split, mode="2bw", ref=TIED)
    config = config_for(path, steps=3, group=4)
    losses, weights = merged(launch(config, len(plan.used_ranks)))
    expected = reference(plan, config, ref=TIED)
    assert_same_run(losses, weights, expected.losses, expected.weights, rel=1e-5)
    # the first step sees no lag (every stage on version 0): it is gradient accumulation
    first = config_for(path, steps=1, group=4)
    once = reference(plan, first, ref=TIED)
    expected_losses, expected_weights = gradient_accumulation(plan, first, ref=TIED)
    assert_same_run(once.losses, once.weights, expected_losses, expected_weights, rel=1e-5)


def test_tied_weights_checkpoint_once_and_resume(tmp_path):
    """The uninterrupted run is one process's gradient accumulation (flush with tied weights is:
    test_tied_weights_train_as_in_one_process), computed without starting workers."""
    plan, path = plan_with(tmp_path, [((0, 1), 1), ((2, 3), 1)], mode="flush", ref=TIED)
    root = tmp_path / "ckpt"
    whole_losses, whole_weights = gradient_accumulation(plan, config_for(path, steps=4, group=2), ref=TIED)
    run(config_for(path, steps=2, group=2, checkpoint_dir=str(root)))
    _, saved, extra = load_checkpoint(latest_complete(root))  # loads: the tied weight is in one shard only
    assert "emb.weight" in saved and "emb.weight::momentum_buffer" in extra
    resumed = run(config_for(path, steps=4, group=2, checkpoint_dir=str(root)), resume=True)
    assert_same_run(*merged(resumed.reports), {b: whole_losses[b] for b in range(4, 8)}, whole_weights, rel=1e-6)


def test_tied_weights_in_an_asynchronous_mode_are_refused_in_one_line_before_any_worker_starts(tmp_path):
    _, path = plan_with(tmp_path, [((0, 1), 1), ((2, 3), 1)], mode="pipedream", ref=TIED)
    with pytest.raises(LaunchError, match=r"p\.plan\.json: parameter emb\.weight is used by stages 0 and 1 "
                                          r"\(tied weights\), and mode 'pipedream' would update its copies after "
                                          r"different minibatches; use --mode 2bw, flush, gpipe, zb or zb2"):
        launch(config_for(path, steps=2), 2)  # the launcher's checks (job.with_capture), not a worker's
