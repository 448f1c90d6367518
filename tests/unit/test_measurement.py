"""The measured time per minibatch (`TrainResult.time_per_minibatch_ms`) from the completions
the workers report, on one machine and on one machine of several."""
from pathlib import Path

import pytest

from pdtool.artifacts.cluster import parse_cluster
from pdtool.planner import make_plan
from pdtool.artifacts.profile import Profile
from pdtool.runtime.run import TrainResult
from pdtool.runtime.run import WorkerReport


def data_parallel_plan():
    profile = Profile.load(Path(__file__).resolve().parents[2] / "profiles" / "mlp.profile.json")
    return make_plan(profile, parse_cluster("2x1TB/s"), data_parallel=True, simulate=False)


def completions(replica, every_s, count):
    """Replica `replica` of 2 completes minibatches replica, replica + 2, ... every `every_s`."""
    return {replica + 2 * i: 100.0 + every_s * i for i in range(count)}


def test_two_replicas_side_by_side_complete_a_minibatch_per_half_their_period():
    plan = data_parallel_plan()
    reports = {r: WorkerReport(rank=r, stage=0, replica=r, finished=completions(r, 0.010, 20)) for r in (0, 1)}
    result = TrainResult(plan=plan, reports=reports, wall_s=1.0, first_step=0, steps=20, per_step=2)
    assert result.time_per_minibatch_ms() == pytest.approx(5.0)


def test_a_machine_that_holds_one_replica_reports_the_jobs_time_per_minibatch():
    """Across machines, this machine sees only its replica's completions: every 10 ms, half of
    the job's minibatches; the job completes one every 5 ms."""
    plan = data_parallel_plan()
    here = {1: WorkerReport(rank=1, stage=0, replica=1, finished=completions(1, 0.010, 20))}
    result = TrainResult(plan=plan, reports=here, wall_s=1.0, first_step=0, steps=20, per_step=2)
    assert result.time_per_minibatch_ms() == pytest.approx(5.0)
