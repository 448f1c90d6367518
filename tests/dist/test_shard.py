"""`--shard optimizer` and `--shard gradients` (issue 38): a replicated stage's replicas each keep
the optimizer state of their slice of the stage (ZeRO stage 1), and with `gradients` their slice
of the summed gradients, reduced after every backward (ZeRO stage 2). They end with the weights of
the unsharded run (`optimizer`: bit for bit; `gradients`: within fp32's rounding, its sums add in
another order) with the recipe (AdamW, weight decay, clipping by the global norm), in a
synchronous and an asynchronous mode, inside a pipeline and in pure data parallelism; checkpoints
keep the unsharded layout, so a run resumes across --shard both ways."""
import dataclasses

import pytest
import torch

from helpers import config_for, merged, plan_with

from pdtool.errors import LaunchError
from pdtool.runtime.launcher.launch import launch
from pdtool.runtime.launcher.session import run
from pdtool.runtime.recipe import LrSchedule, OptimizerConfig

pytestmark = pytest.mark.workers

RECIPE = OptimizerConfig(name="adamw", lr=0.02, momentum=None, weight_decay=0.1, betas=(0.8, 0.95), eps=1e-7,
                         schedule=LrSchedule("cosine", 2, 0.002), clip_grad_norm=0.05)


def _close_to_the_unsharded_run(sharded, plain, atol=1e-6):
    """The sharded run's losses and weights those of the unsharded one within fp32's rounding (its sums add in
    another order), every replica holding the same (gathered) weights, the same (fp16) steps skipped."""
    losses, weights = merged(plain)
    shard_losses, shard_weights = merged(sharded)
    assert shard_losses == pytest.approx(losses, rel=1e-5)
    assert weights.keys() == shard_weights.keys()
    for name, value in weights.items():
        torch.testing.assert_close(shard_weights[name], value, rtol=1e-5, atol=atol)
    _same_on_every_replica(sharded)
    for report in sharded.values():
        unsharded = next(r for r in plain.values() if r.rank == report.rank)
        assert [e[-1] for e in report.step_log] == [e[-1] for e in unsharded.step_log]


def _same_on_every_replica(reports):
    every = {(r.stage, r.replica): r.weights for r in reports.values()}
    for (stage, replica), held in every.items():
        for name, value in held.items():
            assert torch.equal(value, every[(stage, 0)][name])


@pytest.mark.parametrize("mode, split, precision", [
    ("flush", [((0, 1), 2), ((2, 3), 1)], "fp32"),      # a replicated stage inside a pipeline, stepping per group
    ("pipedream", [((0, 1), 1), ((2, 3), 2)], "fp32"),  # asynchronous: the replicated stage is the last one
    ("flush", [((0, 3), 2)], "bf16"),                   # pure data parallelism, autocast over fp32 masters
    ("zb", [((0, 1), 1), ((2, 3), 2)], "fp16"),         # split backward, loss scaling and its skipped steps
])
def test_a_sharded_optimizer_ends_with_the_unsharded_weights_bit_for_bit(tmp_path, mode, split, precision):
    plan, path = plan_with(tmp_path, split, mode=mode)
    # the modes' default groups: 1 in data parallelism and 3 for zb's (1, 2), so with sharded gradients a replica runs
    # fewer backwards than the other before some steps and reduces empty ones (zeros) to meet it
    config = config_for(path, steps=4, optimizer=RECIPE, precision=precision)
    plain = launch(config, len(plan.used_ranks))
    shard = launch(dataclasses.replace(config, shard="optimizer"), len(plan.used_ranks))
    losses, weights = merged(plain)
    shard_losses, shard_weights = merged(shard)
    assert shard_losses == losses
    assert weights.keys() == shard_weights.keys()
    for name, value in weights.items():
        assert torch.equal(shard_weights[name], value), name
    _same_on_every_replica(shard)  # the replicas of a sharded stage hold the same (gathered) weights
    # each replica of the sharded stage measured about half the optimizer state of an unsharded one
    replicated = next(s for s, (_, r) in enumerate(split) if r == 2)
    plain_state = next(r.memory["optimizer"] for r in plain.values() if r.stage == replicated)
    shard_state = [r.memory["optimizer"] for r in shard.values() if r.stage == replicated]
    assert all(0.4 * plain_state <= s <= 0.6 * plain_state for s in shard_state), (plain_state, shard_state)
    # sharded gradients: each replica's slice reduced after every backward, the weights of the unsharded run within
    # fp32's rounding (bf16's autocast and fp16's scaling round in the same places), the same steps skipped
    grads = launch(dataclasses.replace(config, shard="gradients"), len(plan.used_ranks))
    _close_to_the_unsharded_run(grads, plain)
    # measured gradients of a replica of the replicated stage: unsharded, its gradient and the flat buffer it
    # all-reduces in (and the count of backwards); sharded, its slice and one bucket's buffer (here the whole stage)
    held = {how: [r.memory["gradients"] for r in reports.values() if r.stage == replicated]
            for how, reports in (("plain", plain), ("gradients", grads))}
    params = next(r.memory["weights"] // (1 + r.peak_versions) for r in plain.values() if r.stage == replicated)
    assert held["plain"] == [2 * params + 4] * 2, (held, params)
    assert all(params // 2 < g < held["plain"][0] for g in held["gradients"]), (held, params)
    # and the unsharded run differs from a run without clipping: the comparisons above could fail
    assert losses != merged(launch(dataclasses.replace(
        config, optimizer=dataclasses.replace(RECIPE, clip_grad_norm=None)), len(plan.used_ranks)))[0]


def test_a_sharded_run_resumes_unsharded_and_back_as_the_uninterrupted_run(tmp_path):
    plan, path = plan_with(tmp_path, [((0, 1), 2), ((2, 3), 1)], mode="flush")
    recipe = dataclasses.replace(RECIPE, schedule=LrSchedule("cosine", 2, 0.002, total_steps=6))  # one horizon
    whole = run(config_for(path, steps=6, optimizer=recipe))
    root = str(tmp_path / "ckpt")
    first = run(config_for(path, steps=2, optimizer=recipe, shard="optimizer", checkpoint_dir=root))
    second = run(config_for(path, steps=4, optimizer=recipe, shard="none", checkpoint_dir=root), resume=True)
    third = run(config_for(path, steps=6, optimizer=recipe, shard="optimizer", checkpoint_dir=root), resume=True)
    assert (second.first_step, third.first_step) == (2, 4)
    assert {**first.losses, **second.losses, **third.losses} == whole.losses
    final = {n: t for r in third.reports.values() if r.replica == 0 for n, t in r.weights.items()}
    expected = {n: t for r in whole.reports.values() if r.replica == 0 for n, t in r.weights.items()}
    for name, value in expected.items():
        assert torch.equal(final[name], value), name
    # checkpoints keep the unsharded layout whatever the run sharded (sharded gradients keep nothing across a step;
    # sharded parameters are gathered): sharded gradients resume with sharded parameters, and those unsharded, with
    # the uninterrupted run's losses and weights within fp32's rounding
    root = str(tmp_path / "others")
    runs = [run(config_for(path, steps=2 * (k + 1), optimizer=recipe, shard=shard, checkpoint_dir=root), resume=k > 0)
            for k, shard in enumerate(("gradients", "parameters", "none"))]
    assert [r.first_step for r in runs] == [0, 2, 4]
    losses = {b: loss for r in runs for b, loss in r.losses.items()}
    assert losses == pytest.approx(whole.losses, rel=1e-5)
    final = {n: t for r in runs[-1].reports.values() if r.replica == 0 for n, t in r.weights.items()}
    for name, value in expected.items():
        torch.testing.assert_close(final[name], value, rtol=1e-5, atol=1e-6)


def test_shard_without_replicas_or_with_a_factory_optimizer_is_one_line_before_any_worker(tmp_path):
    from pdtool.artifacts.plan import Plan
    from pdtool.runtime.run import check_shard

    plan, path = plan_with(tmp_path, [((0, 1), 1), ((2, 3), 1)], mode="flush")
    with pytest.raises(LaunchError, match="no stage of .* has replicas"):
        check_shard(plan, config_for(path, shard="optimizer"))
    plan, path = plan_with(tmp_path, [((0, 1), 2), ((2, 3), 1)], mode="flush", name="r.plan.json")
    factory = dataclasses.replace(RECIPE, name="torch.optim:RMSprop")
    with pytest.raises(LaunchError, match="only the built-in optimizers"):
        check_shard(plan, config_for(path, shard="optimizer", optimizer=factory))
    check_shard(Plan.load(str(path)), config_for(path, shard="optimizer"))  # accepted
    check_shard(Plan.load(str(path)), config_for(path, shard="gradients"))  # accepted
    check_shard(Plan.load(str(path)), config_for(path, shard="parameters", group=4))  # accepted
    # sharded parameters: one version of the weights, and replicas that run their actions in one order
    with pytest.raises(LaunchError, match="--shard parameters gathers one version .* mode pipedream keeps one per "
                                          "minibatch in flight; use --shard gradients, or a mode that keeps one"):
        check_shard(plan, config_for(path, shard="parameters", mode="pipedream"))
    # the mode the run uses decides (pd train --mode): a zb plan's sharded stage reduces at the step, under flush after
    # every backward, where the replicated middle stage of (1, 3, 1) deadlocks
    middle, middle_path = plan_with(tmp_path, [((0, 0), 1), ((1, 1), 3), ((2, 3), 1)], mode="zb", name="m.plan.json")
    check_shard(middle, config_for(middle_path, shard="parameters", group=6))
    with pytest.raises(LaunchError, match="--shard parameters would deadlock this schedule once the replicas of "
                                          "stage.s. 1 reduce after every backward"):
        check_shard(middle, config_for(middle_path, shard="parameters", group=6, mode="flush"))
    with pytest.raises(LaunchError, match="first replica of each stage alone, which cannot gather the weights"):
        check_shard(plan, config_for(path, shard="parameters", group=4, eval_every=1))
    with pytest.raises(LaunchError, match="replicas of stage 0 run their actions in different orders .*a --group "
                                          "that is a multiple of the stage's replicas"):
        check_shard(plan, config_for(path, shard="parameters", group=3))
    # a weight the replicated stage shares with another stage: its copies add whole gradients at every step
    from pdtool.artifacts.profile import ModelRef

    plan, path = plan_with(tmp_path, [((0, 1), 2), ((2, 3), 1)], mode="flush", ref=ModelRef("toymodels:tied_lm"),
                           name="t.plan.json")
    for kind in ("gradients", "parameters"):
        with pytest.raises(LaunchError, match=f"--shard {kind} keeps .* emb.weight is shared by stages 0, 1, .* use "
                                              "--shard optimizer"):
            check_shard(plan, config_for(path, shard=kind))
    check_shard(plan, config_for(path, shard="optimizer"))


def test_a_weight_without_dimensions_is_one_line_before_any_worker_with_sharded_parameters(tmp_path):
    from pdtool.artifacts.plan import Plan
    from pdtool.artifacts.profile import ModelRef
    from pdtool.runtime.launcher.job import prepare

    plan, path = plan_with(tmp_path, [((0, 1), 2)], mode="flush", ref=ModelRef("toymodels:scalar_parameter"))
    with pytest.raises(LaunchError, match="stage 0's 1.t has none; use --shard gradients"):
        prepare(Plan.load(str(path)), config_for(path, shard="parameters", group=2))
    prepare(Plan.load(str(path)), config_for(path, shard="gradients", group=2))  # accepted


def test_tied_weights_and_recomputation_shard_exactly(tmp_path):
    """gpipe on a tied language model, its first stage (the embedding, tied to the last stage's head)
    replicated twice, sharded and recomputing its activations: the weights of the unsharded run, bit
    for bit, and the head's copy of the tied weight equal to the embedding's."""
    from pdtool.artifacts.profile import ModelRef

    tied = ModelRef("toymodels:tied_lm")
    plan, path = plan_with(tmp_path, [((0, 1), 2), ((2, 3), 1)], mode="gpipe", ref=tied)
    plan = dataclasses.replace(plan, stages=(dataclasses.replace(plan.stages[0], recompute=True),) + plan.stages[1:])
    plan.save(path)
    config = config_for(path, steps=3, group=4, optimizer=RECIPE)
    plain = launch(config, len(plan.used_ranks))
    shard = launch(dataclasses.replace(config, shard="optimizer"), len(plan.used_ranks))
    assert merged(shard)[0] == merged(plain)[0]
    for name, value in merged(plain)[1].items():
        assert torch.equal(merged(shard)[1][name], value), name
    last = next(r for r in shard.values() if r.stage == 1)
    assert torch.equal(last.weights["emb.weight"], merged(shard)[1]["emb.weight"])  # the head's copy


def test_undoing_the_plans_sharding_past_its_memory_limit_says_so(tmp_path):
    from pdtool.artifacts.cluster import parse_cluster
    from pdtool.memory import memory_model
    from pdtool.runtime.launcher.job import check_memory
    from pdtool.runtime.run import resolved
    from pdtool.sim.simulate import simulate

    plan, path = plan_with(tmp_path, [((0, 1), 2), ((2, 3), 1)], mode="flush")
    plan = dataclasses.replace(plan, stages=(dataclasses.replace(plan.stages[0], param_bytes=40_000),
                                             dataclasses.replace(plan.stages[1], param_bytes=100)))
    config = config_for(path, optimizer=RECIPE, shard="none")
    model = memory_model(None, 2, "fp32", "flush", True, True)
    plain, sharded = (max(model.per_worker(p, simulate(p)).values()) for p in (plan, plan.with_shard("optimizer")))
    assert sharded < plain
    capped = dataclasses.replace(plan, cluster=parse_cluster("3x1GB/s", memory=f"{(plain + sharded) // 2}B"))
    check_memory(capped.with_shard("optimizer"), config, resolved(capped, config))  # fits sharded
    with pytest.raises(LaunchError, match="leave out --shard none"):
        check_memory(capped, config, resolved(capped, config), unsharding=True)


@pytest.mark.parametrize("mode, split, precision, group", [
    ("flush", [((0, 1), 2), ((2, 3), 1)], "fp32", 4),  # a replicated stage inside a pipeline, whole backwards
    ("gpipe", [((0, 3), 2)], "bf16", 2),               # pure data parallelism, autocast over fp32 masters
    ("zb", [((0, 1), 1), ((2, 3), 2)], "fp16", 4),     # split backward (kept gathered to the step), loss scaling
])
def test_sharded_parameters_end_with_the_unsharded_weights(tmp_path, mode, split, precision, group):
    """--shard parameters (ZeRO stage 3, FSDP2 over the replicas): the weights and losses of the unsharded run
    within fp32's rounding, every replica gathering the same weights, the same fp16 steps skipped, and each replica
    of the sharded stage measuring half the weights and optimizer state of an unsharded one."""
    plan, path = plan_with(tmp_path, split, mode=mode)
    config = config_for(path, steps=4, group=group, optimizer=RECIPE, precision=precision)
    plain = launch(config, len(plan.used_ranks))
    shard = launch(dataclasses.replace(config, shard="parameters"), len(plan.used_ranks))
    _close_to_the_unsharded_run(shard, plain)
    replicated = next(s for s, (_, r) in enumerate(split) if r == 2)
    for term in ("weights", "optimizer"):
        whole = next(r.memory[term] for r in plain.values() if r.stage == replicated)
        halves = [r.memory[term] for r in shard.values() if r.stage == replicated]
        assert all(0.4 * whole <= h <= 0.6 * whole for h in halves), (term, whole, halves)
