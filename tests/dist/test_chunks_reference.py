"""Several stages per worker, executed (issue 37): the reference executor (tests/reference_executor.py,
every worker in one process, each stage its own `StageWorker`) runs the interleaved, ZB-V and
DualPipeV schedules of real stages and ends with the weights of one process accumulating the
same group, with AdamW, weight decay and global-norm clipping. It starts no worker process;
pd train's workers run one stage each so far, so these are the numbers they will have to match."""
import dataclasses

import pytest

from helpers import assert_same_run, config_for, gradient_accumulation, plan_with, reference

from pdtool.artifacts.plan import Plan
from pdtool.artifacts.profile import ModelRef
from pdtool.runtime.recipe import OptimizerConfig
from pdtool.schedule.placement import make

DEEP = ModelRef("pdtool.zoo:mlp", {"in_features": 12, "hidden": 8, "depth": 5, "classes": 3})  # 6 layers
ADAMW = OptimizerConfig(name="adamw", lr=0.01, weight_decay=0.1, clip_grad_norm=0.5)


def chunked_plan(tmp_path, mode, workers):
    """A plan of DEEP's 6 layers, one a stage (the last takes the rest), 2 stages on each of `workers`
    workers as `mode` places them."""
    stages = 2 * workers
    split = [((s, s if s < stages - 1 else 5), 1) for s in range(stages)]
    plan, _ = plan_with(tmp_path, split, mode="flush", ref=DEEP)
    placement = make("looped" if mode == "interleaved" else "v", stages, workers)
    chunked = dataclasses.replace(plan, mode=mode, stages=tuple(
        dataclasses.replace(stage, ranks=(w,)) for stage, w in zip(plan.stages, placement)))
    path = tmp_path / f"{mode}.plan.json"
    chunked.save(path)
    return Plan.load(path), path


@pytest.mark.parametrize("mode", ["interleaved", "zbv", "dualpipev"])
@pytest.mark.parametrize("workers", [2, 3])
def test_a_multi_chunk_schedule_is_gradient_accumulation(tmp_path, mode, workers):
    plan, path = chunked_plan(tmp_path, mode, workers)
    assert len(plan.used_ranks) == workers and plan.placement
    config = config_for(path, steps=3, group=2 * workers * 2 if mode == "dualpipev" else 2 * workers,
                        optimizer=ADAMW)
    run = reference(plan, config, ref=DEEP)
    losses, weights = gradient_accumulation(plan, config, ref=DEEP)
    assert_same_run(run.losses, run.weights, losses, weights, rel=1e-6, weight_tolerance=1e-6)
    assert set(run.peak_versions.values()) == {0}  # no stashed versions: every minibatch on the live weights


@pytest.mark.parametrize("mode", ["interleaved", "zbv", "dualpipev"])
def test_a_multi_chunk_schedule_in_bf16_is_bf16_gradient_accumulation(tmp_path, mode):
    """bf16 autocast over fp32 master weights: the same numbers as one process under autocast (they are
    bit-equal here, where nothing is cast between chunks; pd train's workers, whose messages travel in
    bf16, will be held to bf16's rounding)."""
    plan, path = chunked_plan(tmp_path, mode, 2)
    config = config_for(path, steps=3, group=8 if mode == "dualpipev" else 4, optimizer=ADAMW, precision="bf16")
    run = reference(plan, config, ref=DEEP)
    losses, weights = gradient_accumulation(plan, config, ref=DEEP)
    assert_same_run(run.losses, run.weights, losses, weights, rel=1e-6, weight_tolerance=1e-6)
