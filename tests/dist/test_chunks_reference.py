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


def chunked_plan(tmp_path, mode, workers, ref=DEEP, layers=6, batch_size=4):
    """A plan of the `layers` layers of `ref` (DEEP's 6), one a stage (the last takes the rest), 2
    stages on each of `workers` workers as `mode` places them."""
    stages = 2 * workers
    split = [((s, s if s < stages - 1 else layers - 1), 1) for s in range(stages)]
    plan, _ = plan_with(tmp_path, split, mode="flush", ref=ref, batch_size=batch_size)
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


@pytest.mark.parametrize("mode, workers", [("interleaved", 2), ("zbv", 2), ("dualpipev", 2), ("interleaved", 3)])
def test_pd_trains_workers_of_several_stages_as_one_process_accumulates(tmp_path, mode, workers):
    """The runtime: each worker builds and runs its chunks (one StageWorker a stage), hands its own
    boundaries over in the process and sends the rest; the same weights as one process."""
    from helpers import merged

    from pdtool.runtime.launcher.launch import launch

    plan, path = chunked_plan(tmp_path, mode, workers)
    config = config_for(path, steps=3, group=4 * workers if mode == "dualpipev" else 2 * workers, optimizer=ADAMW)
    losses, weights = merged(launch(config, workers))
    expected_losses, expected_weights = gradient_accumulation(plan, config, ref=DEEP)
    assert_same_run(losses, weights, expected_losses, expected_weights, rel=1e-6, weight_tolerance=1e-6)


@pytest.mark.parametrize("mode", ["interleaved", "zbv"])
def test_tied_weights_on_workers_of_several_stages_train_as_one_process(tmp_path, mode):
    """An embedding that is also the output head, on stages 0 and 3 of 2 workers x 2 chunks: on two
    workers in the looped placement (an all-reduce of the copies' gradients), on worker 0 alone in
    the V (its two copies added in the process); either way one process's gradient accumulation."""
    import torch

    from helpers import merged

    from pdtool.runtime.launcher.launch import launch

    tied = ModelRef("toymodels:tied_lm")
    plan, path = chunked_plan(tmp_path, mode, 2, ref=tied, layers=4)
    assert plan.shared and plan.untrainable() is None
    config = config_for(path, steps=3, group=4, optimizer=ADAMW)
    reports = launch(config, 2)
    losses, weights = merged(reports)
    expected_losses, expected_weights = gradient_accumulation(plan, config, ref=tied)
    assert_same_run(losses, weights, expected_losses, expected_weights, rel=1e-5, weight_tolerance=1e-6)
    copies = [r.weights["emb.weight"] for r in reports.values() if "emb.weight" in r.weights]
    assert len(copies) == (2 if mode == "interleaved" else 1)  # worker 1 holds the head in the looped placement
    for copy in copies:
        torch.testing.assert_close(copy, expected_weights["emb.weight"])


@pytest.mark.parametrize("mode", ["interleaved", "zbv"])
def test_workers_of_several_stages_evaluate_through_the_pipeline(tmp_path, mode):
    """--evaluate: the held-out split runs forward through the chunks (handed over inside a worker,
    sent between workers); its loss and accuracy are one process's on the trained weights."""
    from test_evaluation import BATCH, MLP, one_process_scores

    from helpers import merged

    from pdtool.runtime.launcher.job import prepare
    from pdtool.runtime.launcher.session import run

    plan, path = chunked_plan(tmp_path, mode, 2, ref=MLP, layers=4, batch_size=BATCH)
    config = config_for(path, steps=2, group=4, data="digits", evaluate=True, eval_every=1, optimizer=ADAMW)
    job = prepare(plan, config)
    result = run(job.config)
    assert sorted(result.evals) == [1, 2]
    _, weights = merged(result.reports)
    expected = one_process_scores(MLP, weights, job.config.eval_batches)
    assert result.evals[2][:3] == pytest.approx(expected, rel=1e-5)


def test_a_checkpoint_of_an_interleaved_run_resumes_under_one_stage_a_worker(tmp_path):
    """One shard a stage: an interleaved run's checkpoint (2 workers x 2 chunks, AdamW) resumed under a
    3-stage flush plan continues the curve of one process accumulating the same group."""
    from pdtool.runtime.launcher.session import run

    plan, path = chunked_plan(tmp_path, "interleaved", 2)
    _, flat = plan_with(tmp_path, [((0, 1), 1), ((2, 3), 1), ((4, 5), 1)], mode="flush", ref=DEEP,
                        name="flat.plan.json")
    root = tmp_path / "ckpt"
    first = run(config_for(path, steps=2, group=4, optimizer=ADAMW, checkpoint_dir=str(root), checkpoint_every=1))
    resumed = run(config_for(flat, steps=4, group=4, optimizer=ADAMW, checkpoint_dir=str(root)), resume=True)
    losses, weights = gradient_accumulation(plan, config_for(path, steps=4, group=4, optimizer=ADAMW), ref=DEEP)
    assert resumed.first_step == 2 and sorted(resumed.losses) == list(range(8, 16))
    assert first.losses == pytest.approx({b: losses[b] for b in range(8)}, rel=1e-6)
    got = {name: t for report in resumed.reports.values() for name, t in report.weights.items()}
    assert_same_run(resumed.losses, got, {b: losses[b] for b in range(8, 16)}, weights, rel=1e-6,
                    weight_tolerance=1e-6)


@pytest.mark.parametrize("mode, options, line", [
    ("interleaved", ["--group", "3"], "group=3 for mode 'interleaved' on 2 workers: it sends the microbatches through "
                                      "the chunks in rounds of one per worker, so the group must be a multiple of 2; "
                                      "use 2 or 4"),
    ("dualpipev", ["--group", "2"], "group=2 for mode 'dualpipev' on 4 stages: its warm-up and cool-down need at least "
                                    "as many microbatches as stages; use a group >= 4"),
    ("interleaved", ["--mode", "flush"], "mode 'flush' runs one stage per worker, but the schedule places several on a "
                                         "worker ((0, 1, 0, 1)); drop the placement, or use a mode of several chunks"),
])
def test_a_group_or_mode_a_multi_chunk_plan_cannot_run_is_one_line(tmp_path, mode, options, line):
    from click.testing import CliRunner

    from pdtool.cli import cli

    _, path = chunked_plan(tmp_path, mode, 2)
    result = CliRunner().invoke(cli, ["train", str(path), "--steps", "1", *options])
    assert result.exit_code == 1 and result.stderr.strip() == f"pd: error: {line}"
