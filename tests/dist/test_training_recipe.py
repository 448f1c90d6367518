"""The training recipe (AdamW with decay groups, warm-up and decay of the learning rate, clipping
by the global norm) in every mode, against one process running the same recipe with gradient
accumulation (torch's own `clip_grad_norm_`) or the reference executor, and across a resume."""
import dataclasses

import pytest
import torch

from helpers import assert_same_run, config_for, gradient_accumulation, merged, plan_with, reference

from pdtool.artifacts.profile import ModelRef
from pdtool.runtime.launcher.launch import launch
from pdtool.runtime.launcher.session import run
from pdtool.runtime.recipe import LrSchedule, OptimizerConfig

# clip 0.05: below the MLP's gradient norm at every step, so every step is clipped
RECIPE = OptimizerConfig(name="adamw", lr=0.02, momentum=None, weight_decay=0.1, betas=(0.8, 0.95), eps=1e-7,
                         schedule=LrSchedule("cosine", 2, 0.002), clip_grad_norm=0.05)
SPLITS = {"2 stages": [((0, 1), 1), ((2, 3), 1)], "replicated 2-1": [((0, 1), 2), ((2, 3), 1)],
          "3 stages": [((0, 0), 1), ((1, 2), 1), ((3, 3), 1)]}


@pytest.mark.parametrize("mode, split", [("flush", "replicated 2-1"), ("gpipe", "3 stages"), ("zb", "3 stages")])
def test_the_recipe_in_the_synchronous_modes_is_one_process_with_gradient_accumulation(tmp_path, mode, split):
    plan, path = plan_with(tmp_path, SPLITS[split], mode=mode)
    config = config_for(path, steps=5, optimizer=RECIPE)
    result = reference(plan, config)
    losses, weights = gradient_accumulation(plan, config)
    assert_same_run(result.losses, result.weights, losses, weights, rel=1e-5, weight_tolerance=1e-5)
    # each part of the recipe changes the result: the comparison above can fail
    for part in ({"clip_grad_norm": None}, {"schedule": LrSchedule()}, {"weight_decay": 0.0}):
        other = gradient_accumulation(plan, dataclasses.replace(config, optimizer=dataclasses.replace(RECIPE, **part)))
        assert any(not torch.allclose(other[1][n], w) for n, w in weights.items()), part


def test_clipping_where_stages_step_on_their_own_gives_each_its_share_of_the_budget(tmp_path):
    # one stage: its share is the whole budget, so pipedream is one process clipping the whole model
    plan, path = plan_with(tmp_path, [((0, 3), 1)], mode="pipedream")
    config = config_for(path, steps=4, optimizer=RECIPE)
    result = reference(plan, config)
    losses, weights = gradient_accumulation(plan, config)
    assert_same_run(result.losses, result.weights, losses, weights, rel=1e-5, weight_tolerance=1e-5)
    from pdtool.runtime.worker.optim import stage_budget

    assert stage_budget(1.0, 25, 100) == pytest.approx(0.5)  # sqrt(P_s / P): the shares' squares add up to MAX^2


# flush: in test_bf16_pipelines_equal_their_reference_and_one_process_autocast_within_bf16 (fp32: the reference
# executor's test above, whose numbers the workers repeat)
@pytest.mark.parametrize("mode, split", [("2bw", "3 stages"), ("pipedream", "replicated 2-1")])
def test_workers_running_the_recipe_equal_their_oracle(tmp_path, mode, split):
    plan, path = plan_with(tmp_path, SPLITS[split], mode=mode)
    config = config_for(path, steps=4, optimizer=RECIPE)
    reports = launch(config, len(plan.used_ranks))
    losses, weights = merged(reports)
    expected = reference(plan, config)
    expected_losses, expected_weights = expected.losses, expected.weights
    assert_same_run(losses, weights, expected_losses, expected_weights, rel=1e-5, weight_tolerance=1e-5)
    head = next(r for r in reports.values() if r.stage == 0 and r.replica == 0)
    lrs = [entry[1] for entry in head.step_log]
    assert lrs[:2] == pytest.approx([0.01, 0.02])  # warm-up: (t + 1) / 2 of the peak
    assert all(entry[2] is not None and entry[2] > 0 for entry in head.step_log)


def test_a_run_resumed_in_its_warm_up_under_another_plan_continues_the_same_curve(tmp_path):
    recipe = dataclasses.replace(RECIPE, schedule=LrSchedule("cosine", 3, 0.002, total_steps=5))
    two_plan, two = plan_with(tmp_path, SPLITS["2 stages"], mode="flush", name="two.plan.json")
    _, three = plan_with(tmp_path, SPLITS["3 stages"], mode="flush", name="three.plan.json")
    whole_losses, expected = gradient_accumulation(two_plan, config_for(two, steps=5, group=2, optimizer=recipe))
    root = tmp_path / "ckpt"
    first = run(config_for(two, steps=2, group=2, optimizer=recipe, checkpoint_dir=str(root)))
    resumed = run(config_for(three, steps=5, group=2, optimizer=recipe, checkpoint_dir=str(root)), resume=True)
    assert resumed.first_step == 2
    losses = {**first.losses, **resumed.losses}
    weights = {n: t for r in resumed.reports.values() if r.replica == 0 for n, t in r.weights.items()}
    assert_same_run(losses, weights, whole_losses, expected, rel=1e-5, weight_tolerance=1e-5)
    head = next(r for r in resumed.reports.values() if r.stage == 0)
    assert [entry[1] for entry in head.step_log][0] == pytest.approx(0.02)  # step 3 of the warm-up: the peak


def test_bf16_pipelines_equal_their_reference_and_one_process_autocast_within_bf16(tmp_path):
    """Messages travel in bf16, so the pipeline rounds where one process may not (at the stage
    boundaries): against one process's autocast the tolerance is bf16's (2e-2); against the
    reference executor, which runs the same stages, it is exact."""
    plan, path = plan_with(tmp_path, SPLITS["replicated 2-1"], mode="flush")
    config = config_for(path, steps=4, optimizer=RECIPE, precision="bf16")
    reports = launch(config, len(plan.used_ranks))
    losses, weights = merged(reports)
    expected = reference(plan, config)
    assert_same_run(losses, weights, expected.losses, expected.weights, rel=1e-6)
    one_losses, one_weights = gradient_accumulation(plan, config)
    assert_same_run(losses, weights, one_losses, one_weights, rel=2e-2, weight_tolerance=2e-2)
    fp32_losses, _ = gradient_accumulation(plan, dataclasses.replace(config, precision="fp32"))
    assert losses != pytest.approx(fp32_losses, rel=1e-4)  # bf16 computed something else than fp32 does


def test_fp16_skips_the_steps_one_process_skips_on_every_stage(tmp_path):
    # a loss scale of 2^22 overflows fp16 gradients: steps are skipped, halving it, until it fits
    plan, path = plan_with(tmp_path, SPLITS["3 stages"], mode="flush")
    recipe = dataclasses.replace(RECIPE, initial_loss_scale=2.0 ** 22)
    config = config_for(path, steps=8, optimizer=recipe, precision="fp16")
    skipped = []
    one_losses, one_weights = gradient_accumulation(plan, config, skipped=skipped)
    assert 0 < len(skipped) < 8
    reports = launch(config, len(plan.used_ranks))
    for report in reports.values():
        assert [k for k, entry in enumerate(report.step_log) if entry[4]] == skipped
    losses, weights = merged(reports)
    assert_same_run(losses, weights, one_losses, one_weights, rel=2e-2, weight_tolerance=2e-2)


def test_an_fp16_forward_that_overflows_at_the_first_step_is_said_so_not_divergence(tmp_path):
    """Issue 35 item 14: a non-finite loss at step 1 under fp16 was reported as divergence (lower --lr)."""
    from pdtool.errors import LaunchError

    plan, path = plan_with(tmp_path, [((0, 0), 1), ((1, 1), 1)], mode="flush",  # the multiplication joins a Linear
                           ref=ModelRef("toymodels:fp16_overflow", {}))
    with pytest.raises(LaunchError, match="the forward overflowed fp16's range.*--precision bf16") as info:
        launch(config_for(path, steps=2, group=2, precision="fp16"), len(plan.used_ranks))
    assert "diverged" not in str(info.value)
