"""Evaluation through the pipeline (`pd train --eval-every N`, `--evaluate`): the held-out split
runs forward through the stages, and its loss and accuracy equal one process's on the same
weights and samples."""
import csv
import dataclasses

import pytest
import torch
from click.testing import CliRunner

from helpers import config_for, merged, plan_with

from pdtool.artifacts.profile import ModelRef
from pdtool.cli import cli
from pdtool.model.build import initial_model
from pdtool.model.data import dataset_source, held_out
from pdtool.runtime.launcher.job import prepare
from pdtool.runtime.launcher.session import run
from pdtool.runtime.run import OptimizerConfig

# dropout: evaluation runs in eval mode, so one process must too to agree
DROPOUT = ModelRef("toymodels:dropout_classifier", {"hidden": 32, "dropout": 0.5})
MLP = ModelRef("pdtool.zoo:mlp", {"in_features": 64, "hidden": 32, "depth": 3, "classes": 10})
BATCH = 64


def one_process_scores(ref, weights, batches, seed=0):
    """Mean loss and accuracy of the whole model holding `weights`, in eval mode, on the held-out
    minibatches the pipeline evaluates (the first `batches` of the split, shuffled by the seed)."""
    bundle = initial_model(ref, seed)
    bundle.module.load_state_dict(weights, strict=False)
    bundle.module.eval()
    source = dataset_source(held_out("digits"), BATCH, seed, name="held-out")
    loss = correct = total = 0
    with torch.no_grad():
        for i in range(batches):
            inputs, target = source.batch(i)
            output = bundle.module(*inputs)
            loss += float(bundle.loss_fn(output, target)) * target.shape[0]
            correct += int((output.argmax(dim=-1) == target).sum())
            total += target.shape[0]
    return loss / total, correct / total, total


@pytest.mark.parametrize("mode, split", [("flush", [((0, 0), 2), ((1, 2), 1)]), ("pipedream", [((0, 1), 1), ((2, 2), 1)])],
                         ids=["flush 2-1", "pipedream 1-1"])
def test_the_pipelines_held_out_scores_are_one_process_scores_on_its_weights(tmp_path, mode, split):
    ref = DROPOUT
    plan, path = plan_with(tmp_path, split, mode=mode, ref=ref, batch_size=BATCH)
    config = config_for(path, steps=4, data="digits", evaluate=True, eval_every=2,
                        optimizer=OptimizerConfig(name="sgd", lr=0.1, momentum=0.5, weight_decay=0.0))
    job = prepare(plan, config)
    assert job.config.eval_batches == 360 // BATCH
    result = run(job.config)
    assert sorted(result.evals) == [2, 4]
    held_loss, accuracy, samples = result.evals[4][:3]
    _, weights = merged(result.reports)
    expected = one_process_scores(ref, weights, job.config.eval_batches)
    assert (held_loss, accuracy, samples) == pytest.approx(expected, rel=1e-5)
    # evaluating changes no training number: the same run without it (flush drains anyway)
    if mode == "flush":
        plain = run(prepare(plan, dataclasses.replace(config, evaluate=False, eval_every=None)).config)
        assert plain.losses == pytest.approx(result.losses, rel=1e-6)


def test_pd_train_eval_every_writes_held_out_figures_to_the_metrics_and_the_output(tmp_path, capfd):
    _, path = plan_with(tmp_path, [((0, 1), 1), ((2, 3), 1)], mode="flush", ref=MLP, batch_size=BATCH)
    metrics = tmp_path / "m.csv"
    result = CliRunner().invoke(cli, ["train", str(path), "--data", "digits", "--steps", "6", "--eval-every", "3",
                                      "--evaluate", "--metrics", str(metrics), "--lr", "0.05"], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    progress = capfd.readouterr().err  # the last stage's worker writes it on the job's stderr
    assert "step 3: held-out loss" in progress and "step 6: held-out loss" in progress
    assert "held-out accuracy:" in result.stdout and f"of {360 // BATCH * BATCH} samples" in result.stdout
    rows = list(csv.DictReader(metrics.open()))
    assert [r["step"] for r in rows if r["eval_loss"]] == ["3", "6"]
    assert all(0.0 <= float(r["eval_accuracy"]) <= 1.0 for r in rows if r["eval_loss"])


def test_eval_every_must_fall_between_the_steps_of_replicated_stages(tmp_path):
    _, path = plan_with(tmp_path, [((0, 1), 1), ((2, 3), 2)], mode="pipedream", ref=MLP, batch_size=BATCH)
    result = CliRunner().invoke(cli, ["train", str(path), "--data", "digits", "--steps", "4", "--eval-every", "1"])
    assert result.exit_code == 1 and "--eval-every 1" in result.stderr and "use --eval-every 2" in result.stderr
