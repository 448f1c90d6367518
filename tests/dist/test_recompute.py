"""Activation recomputation (`pd plan --recompute`): a recomputing stage gives the same numbers as
one that keeps its activations, in every mode, and a memory limit that only a recomputing plan
meets gives a plan that trains."""
import dataclasses
import pytest
import torch
from click.testing import CliRunner

from helpers import assert_same_run, config_for, merged, plan_with, reference

from pdtool.artifacts.cluster import parse_cluster
from pdtool.artifacts.plan import Plan
from pdtool.artifacts.profile import ModelRef, Profile
from pdtool.cli import cli
from pdtool.errors import PlanError
from pdtool.planner import make_plan
from pdtool.runtime.launcher.launch import launch

# dropout in its classifier: a recomputed forward must draw the same random numbers as the first
VGG = ModelRef("pdtool.zoo:vgg16", {"width": 2, "image_size": 32, "hidden": 16, "classes": 3, "dropout": 0.5})
THREE = [((0, 9), 1), ((10, 18), 1), ((19, 21), 1)]
REPLICATED = [((0, 12), 2), ((13, 21), 1)]


def recomputing(plan: Plan, path, which=None) -> Plan:
    """`plan` with stages `which` (default: every stage) recomputing, saved at `path`."""
    stages = tuple(dataclasses.replace(s, recompute=which is None or i in which) for i, s in enumerate(plan.stages))
    plan = dataclasses.replace(plan, stages=stages)
    plan.save(path)
    return plan


@pytest.mark.parametrize("mode, split", [
    ("pipedream", THREE), ("pipedream", REPLICATED), ("2bw", THREE), ("flush", REPLICATED), ("zb", THREE),
], ids=["pipedream 1-1-1", "pipedream 2-1", "2bw 1-1-1", "flush 2-1", "zb 1-1-1"])
def test_recomputing_every_stage_changes_no_number(tmp_path, mode, split):
    """The reference executor (one process): the same losses and final weights (losses to 1e-6
    relative, weights to torch's float32 defaults), dropout and stashed weight versions included."""
    plan, path = plan_with(tmp_path, split, mode=mode, ref=VGG)
    again = recomputing(plan, tmp_path / "again.plan.json")
    kept = reference(plan, config_for(path, steps=4), ref=VGG)
    redone = reference(again, config_for(tmp_path / "again.plan.json", steps=4), ref=VGG)
    assert_same_run(redone.losses, redone.weights, kept.losses, kept.weights)
    assert redone.peak_versions == kept.peak_versions


@pytest.mark.parametrize("mode, which", [("pipedream", {0, 2}), ("zb", {1})], ids=["pipedream", "zb"])
def test_the_runtime_recomputes_the_stages_the_plan_marks(tmp_path, mode, which):
    """pd train's workers on a plan whose marked stages recompute: the numbers of the reference
    executor running the plan without recomputation."""
    plan, path = plan_with(tmp_path, THREE, mode=mode, ref=VGG)
    again = recomputing(plan, tmp_path / "again.plan.json", which)
    config = config_for(tmp_path / "again.plan.json", steps=3)
    losses, weights = merged(launch(config, len(again.used_ranks)))
    kept = reference(plan, config_for(path, steps=3), ref=VGG)
    assert_same_run(losses, weights, kept.losses, kept.weights)


def _limit_only_recomputation_meets(profile: Profile, cluster: str) -> int:
    """A memory limit per worker that no plan without recomputation meets and one with it does."""
    free = make_plan(profile, parse_cluster(cluster), recompute="none", simulate=False)
    need = max(s.memory_bytes for s in free.stages)
    for percent in range(98, 5, -2):
        limit = need * percent // 100
        memory = parse_cluster(cluster, f"{limit}B")
        try:
            make_plan(profile, memory, recompute="none", simulate=False)
            continue
        except PlanError:
            pass
        try:
            make_plan(profile, memory, recompute="auto", simulate=False)
            return limit
        except PlanError:
            break
    raise AssertionError("no limit separates the plans with and without recomputation")


def test_a_limit_only_a_recomputing_plan_meets_gives_a_plan_that_trains(tmp_path):
    """An MLP whose activations outweigh its weights, on 2 workers."""
    runner = CliRunner()
    profile_path, plan_path = tmp_path / "m.profile.json", tmp_path / "m.plan.json"
    result = runner.invoke(cli, ["profile", "-m", "pdtool.zoo:mlp", "-a", "in_features=64", "-a", "hidden=128",
                                 "-a", "depth=12", "-a", "classes=4", "--batch-size", "1024", "--repeats", "1",
                                 "-o", str(profile_path)])
    assert result.exit_code == 0, result.output
    limit = _limit_only_recomputation_meets(Profile.load(profile_path), "2x1GB/s")
    refused = runner.invoke(cli, ["plan", str(profile_path), "--cluster", "2x1GB/s", "--memory", f"{limit}B",
                                  "--recompute", "none", "-o", str(plan_path)])
    assert refused.exit_code != 0 and not plan_path.exists()
    assert "--recompute auto" in refused.output and "Traceback" not in refused.output
    result = runner.invoke(cli, ["plan", str(profile_path), "--cluster", "2x1GB/s", "--memory", f"{limit}B",
                                 "-o", str(plan_path)])
    assert result.exit_code == 0, result.output
    plan = Plan.load(plan_path)
    assert any(s.recompute for s in plan.stages)
    assert all(s.memory_bytes <= limit for s in plan.stages)
    shown = runner.invoke(cli, ["show", str(plan_path)])
    assert "recompute" in shown.output and "yes" in shown.output
    trained = runner.invoke(cli, ["train", str(plan_path), "--steps", "3"], catch_exceptions=False)
    assert trained.exit_code == 0, trained.output
    assert "trained steps 1-3" in trained.output


@pytest.mark.parametrize("recompute", [False, True], ids=["keeps", "recomputes"])
def test_a_recomputing_stage_keeps_nothing_for_its_backward_but_its_inputs(tmp_path, recompute):
    """Measured in one process: the bytes autograd saves for the backward during stage 0's forwards
    of the minibatches it holds in flight (pipedream, 2 stages: 2), against the plan's activations."""
    from pdtool.model.build import initial_model
    from pdtool.model.data import synthetic_source
    from pdtool.model.stages import plan_stages, sample_inputs
    from pdtool.runtime.run import make_schedule
    from pdtool.runtime.worker.executor import StageWorker

    ref = ModelRef("pdtool.zoo:mlp", {"in_features": 64, "hidden": 128, "depth": 6, "classes": 4})
    plan, path = plan_with(tmp_path, [((0, 3), 1), ((4, 6), 1)], ref=ref, batch_size=256)
    config = config_for(path)
    bundle = initial_model(ref, config.seed)
    stage = plan_stages(plan, bundle.module, sample_inputs(bundle, plan))[0]
    worker = StageWorker(
        stage=stage, schedule=make_schedule(plan, config), replica=0, optimizer=config.recipe, recompute=recompute
    )
    source = synthetic_source(bundle, plan.profile.batch_size, config.seed)
    saved = {}

    def pack(tensor):
        saved[tensor.untyped_storage().data_ptr()] = tensor.untyped_storage().nbytes()
        return tensor

    in_flight = plan.stages[0].in_flight
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        for b in range(in_flight):
            inputs, _ = source.batch(b)
            worker.forward(b, {stage.inputs[0]: inputs[0]})
    layer_outputs = plan.stages[0].activation_bytes - plan.stages[0].in_bytes
    if recompute:
        assert sum(saved.values()) == 0
    else:
        assert sum(saved.values()) >= in_flight * layer_outputs * 0.9
