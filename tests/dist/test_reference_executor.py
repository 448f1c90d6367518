"""The reference executor (one process) against single-process training: fast, no processes."""
import pytest
import torch

from helpers import MLP, assert_same_run, config_for, gradient_accumulation, plan_with, reference

from pdtool.schedule import peak_versions


@pytest.mark.parametrize("mode", ["flush", "gpipe"])
@pytest.mark.parametrize("split", [
    [((0, 1), 1), ((2, 3), 1)],
    [((0, 0), 1), ((1, 2), 1), ((3, 3), 1)],
    [((0, 1), 2), ((2, 3), 1)],
], ids=["2 stages", "3 stages", "replicated 2-1"])
def test_flush_and_gpipe_are_gradient_accumulation(tmp_path, mode, split):
    plan, path = plan_with(tmp_path, split, mode=mode)
    config = config_for(path, steps=3)
    run = reference(plan, config)
    losses, weights = gradient_accumulation(plan, config)
    assert_same_run(run.losses, run.weights, losses, weights)


@pytest.mark.parametrize("mode", ["pipedream", "vsync", "2bw"])
def test_one_stage_asynchronous_modes_are_plain_sgd_or_accumulation(tmp_path, mode):
    # a single unreplicated stage has no staleness: pipedream and vsync are plain SGD
    plan, path = plan_with(tmp_path, [((0, 3), 1)], mode=mode)
    config = config_for(path, steps=4)
    run = reference(plan, config)
    losses, weights = gradient_accumulation(plan, config)
    assert_same_run(run.losses, run.weights, losses, weights)


@pytest.mark.parametrize("mode", ["pipedream", "vsync", "2bw", "flush", "gpipe"])
def test_stashed_versions_stay_within_the_schedule_bound(tmp_path, mode):
    plan, path = plan_with(tmp_path, [((0, 0), 1), ((1, 1), 1), ((2, 3), 1)], mode=mode)
    config = config_for(path, steps=6)
    run = reference(plan, config)
    from pdtool.runtime.run import make_schedule

    bound = peak_versions(make_schedule(plan, config))
    assert all(run.peak_versions[rank] <= bound[rank] for rank in bound)
    assert len(run.losses) == make_schedule(plan, config).minibatches


def test_pipedream_weight_stashing_matches_a_hand_written_two_stage_pipeline(tmp_path):
    """Straight 2-stage 1F1B: stage 0 runs minibatch b on its weights after b - 1 updates
    (one minibatch is always in flight), stage 1 on its weights after b updates; each backward
    uses its forward's weights. Written out here with a weight history, no schedule code."""
    from torch.func import functional_call

    from pdtool.model.build import initial_model
    from pdtool.runtime.run import OptimizerConfig
    from pdtool.model.data import synthetic_source

    plan, path = plan_with(tmp_path, [((0, 1), 1), ((2, 3), 1)], mode="pipedream")
    lr, steps = 0.05, 6
    config = config_for(path, steps=steps, optimizer=OptimizerConfig(name="sgd", lr=lr, momentum=0.0, weight_decay=0.0))
    run = reference(plan, config)

    bundle = initial_model(MLP, config.seed)
    model, batch = bundle.module, synthetic_source(bundle, plan.profile.batch_size, config.seed).batch
    first = {n: p.detach().clone() for n, p in model.named_parameters() if n.split(".")[0] in ("0", "2")}
    second = {n: p.detach().clone() for n, p in model.named_parameters() if n.split(".")[0] in ("4", "6")}
    history = [first]  # stage 0's weights after k updates
    losses = {}
    for b in range(steps):
        w0 = {n: t.clone().requires_grad_() for n, t in history[max(0, b - 1)].items()}
        w1 = {n: t.clone().requires_grad_() for n, t in second.items()}
        inputs, target = batch(b)
        loss = bundle.loss_fn(functional_call(model, {**w0, **w1}, inputs), target)
        losses[b] = float(loss.detach())
        grads = torch.autograd.grad(loss, list(w0.values()) + list(w1.values()))
        g0, g1 = grads[:len(w0)], grads[len(w0):]
        second = {n: t - lr * g for (n, t), g in zip(second.items(), g1)}
        history.append({n: t - lr * g for (n, t), g in zip(history[-1].items(), g0)})
    assert run.losses == pytest.approx(losses, rel=1e-5)
    for name, value in {**history[-1], **second}.items():
        torch.testing.assert_close(run.weights[name], value)


def test_adam_with_weight_decay_is_gradient_accumulation_too(tmp_path):
    from pdtool.runtime.run import OptimizerConfig

    plan, path = plan_with(tmp_path, [((0, 1), 1), ((2, 3), 1)], mode="flush")
    config = config_for(path, steps=3, optimizer=OptimizerConfig(name="adam", lr=0.01, momentum=0.0, weight_decay=0.01))
    run = reference(plan, config)
    losses, weights = gradient_accumulation(plan, config)
    assert_same_run(run.losses, run.weights, losses, weights)


def test_replicated_stages_scale_their_learning_rate_by_r_s_over_r_0():
    from pdtool.runtime.worker.stepper import lr_scale
    from pdtool.schedule import generate

    assert lr_scale(generate("pipedream", (2, 1), 8), 0) == 1.0
    assert lr_scale(generate("pipedream", (2, 1), 8), 1) == 0.5
    assert lr_scale(generate("pipedream", (1, 3), 6), 1) == 3.0
    assert lr_scale(generate("flush", (2, 1), 8, 2), 1) == 1.0
