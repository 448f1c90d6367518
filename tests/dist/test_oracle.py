"""pd train's asynchronous modes against an oracle written from docs/schedules.md alone (oracle.py):
the same losses and final weights, on 2- and 3-stage plans, replicated stages included. Each run
is also checked against the reference executor (`tests/reference_executor.py`, the schedule run in one
process) and against the schedule's bound on stashed weight versions: one run, both oracles."""
import pytest
import torch

from helpers import MLP, SGD, config_for, merged, plan_with, profiled, reference
from oracle import expected_run, versions_seen

from pdtool.runtime.launcher.launch import launch
from pdtool.runtime.run import make_schedule
from pdtool.schedule import peak_versions

SPLITS = {
    "2 stages": [((0, 1), 1), ((2, 3), 1)],
    "3 stages": [((0, 0), 1), ((1, 2), 1), ((3, 3), 1)],
    "2x2 + 1": [((0, 1), 2), ((2, 3), 1)],
    "1 + 2x2 + 1": [((0, 0), 1), ((1, 2), 2), ((3, 3), 1)],
}
CASES = [(mode, split) for mode in ("pipedream", "vsync", "2bw") for split in SPLITS
         if not (mode == "2bw" and split == "1 + 2x2 + 1")]


@pytest.mark.parametrize("mode, split", CASES, ids=[f"{m} {s}" for m, s in CASES])
def test_asynchronous_modes_equal_the_readme_oracle(tmp_path, mode, split):
    plan, path = plan_with(tmp_path, SPLITS[split], mode=mode)
    group = len(SPLITS[split]) if mode == "2bw" else None  # m = the number of stages (>= d)
    steps = 5
    config = config_for(path, steps=steps, group=group)
    reports = launch(config, len(plan.used_ranks))
    losses, weights = merged(reports)
    profile = profiled(MLP, batch_size=4)  # for the layer names
    expected_losses, expected_weights = expected_run(plan, profile, MLP, steps, seed=0, lr=SGD.lr, momentum=SGD.momentum,
                                                     group=group or 1)
    assert losses == pytest.approx(expected_losses, rel=1e-5)
    assert weights.keys() == expected_weights.keys()
    for name, expected in expected_weights.items():
        torch.testing.assert_close(weights[name], expected)
    # the same run against the reference executor (the schedule the workers ran, in one process)
    run = reference(plan, config)
    assert losses == pytest.approx(run.losses, rel=1e-6)
    assert weights.keys() == run.weights.keys()
    for name, expected in run.weights.items():
        torch.testing.assert_close(weights[name], expected)
    bound = peak_versions(make_schedule(plan, config))  # docs/schedules.md's versions per worker
    assert all(report.peak_versions <= bound[rank] for rank, report in reports.items())
    assert max(report.peak_versions for report in reports.values()) >= 1  # weights were stashed


def test_the_oracles_versions_are_the_readmes_table():
    """Straight pipelines of d stages: pipedream lacks the d-s-1 minibatches ahead, vsync is d-1
    behind on every stage, 2bw one batch behind."""
    d = 4
    for b in range(12):
        assert versions_seen("pipedream", [1] * d, b, 1) == [max(0, b - (d - s - 1)) for s in range(d)]
        assert versions_seen("vsync", [1] * d, b, 1) == [max(0, b - (d - 1))] * d
        assert versions_seen("2bw", [1] * d, b, 4) == [max(0, b // 4 - 1)] * d
