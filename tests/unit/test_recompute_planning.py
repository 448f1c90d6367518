"""Activation recomputation in the planner's memory and cost models, the simulator and the views."""
import dataclasses

import pytest

from pdtool.artifacts.cluster import parse_cluster
from pdtool.artifacts.profile import Profile
from pdtool.errors import PlanError
from pdtool.planner import make_plan
from pdtool.planner.costmodel import Memory
from pdtool.sim.simulate import simulate
from pdtool.views.render import plan_graph
from pdtool.views.show import plan_table
from test_plan import chain_profile

GPT = "profiles/gpt-small.profile.json"


def test_a_recomputing_stage_keeps_its_input_per_minibatch_and_one_whole_set():
    memory = Memory(limit=float("inf"), optimizer_slots=2, copies=0.5)
    kept = memory.terms(100.0, 40.0, in_flight=3)
    again = memory.terms(100.0, 40.0, in_flight=3, recompute=10.0)
    assert kept["activations"] == 3 * 40.0 and again["activations"] == 2 * 10.0 + 40.0
    assert kept["compute copies"] == 3 * 50.0 and again["compute copies"] == 50.0  # autocast caches nothing without grad
    assert {k: v for k, v in kept.items() if k not in ("activations", "compute copies")} == \
        {k: v for k, v in again.items() if k not in ("activations", "compute copies")}  # weight versions stay


def _limits(profile: Profile, cluster: str):
    """The per-worker need of the fastest plan without a limit, and the plans at fractions of it."""
    free = make_plan(profile, parse_cluster(cluster), recompute="none", simulate=False)
    return max(s.memory_bytes for s in free.stages)


def test_auto_recomputes_only_the_stages_that_do_not_fit_otherwise():
    profile = Profile.load(GPT)
    need = _limits(profile, "4x12GB/s")
    limit = int(need * 0.45)
    memory = parse_cluster("4x12GB/s", f"{limit}B")
    with pytest.raises(PlanError, match="--recompute auto"):
        make_plan(profile, memory, recompute="none")
    plan = make_plan(profile, memory)  # auto is the default
    assert all(s.memory_bytes <= limit for s in plan.stages)
    assert any(s.recompute for s in plan.stages) and not all(s.recompute for s in plan.stages)
    for stage in plan.stages:
        single = Memory(limit=limit, optimizer_slots=1).need(stage.param_bytes, stage.activation_bytes, stage.in_flight,
                                       cut=(stage.in_bytes, stage.out_bytes), replicas=stage.replicas)
        assert (single > limit) == stage.recompute  # recomputes exactly where keeping would not fit
        again = sum(profile.layers[i].fwd_ms for i in stage.layers) if stage.recompute else 0.0
        if stage.replicas == 1:
            assert stage.compute_ms == pytest.approx(stage.fwd_ms + stage.bwd_ms + again, rel=1e-5)  # plans keep 6 digits


def test_without_a_limit_auto_is_none_and_all_recomputes_every_stage_at_its_cost():
    profile = Profile.load(GPT)
    cluster = parse_cluster("4x12GB/s")
    none, auto = (make_plan(profile, cluster, recompute=r) for r in ("none", "auto"))
    assert none.to_json() == auto.to_json() and not any(s.recompute for s in none.stages)
    every = make_plan(profile, cluster, recompute="all", straight=True)
    assert all(s.recompute for s in every.stages)
    for stage in every.stages:
        assert stage.compute_ms == pytest.approx(2 * stage.fwd_ms + stage.bwd_ms, rel=1e-5)
    assert make_plan(profile, cluster, recompute="none", straight=True).predicted.time_ms < every.predicted.time_ms


def test_the_simulator_runs_a_recomputing_stages_forward_again_in_each_backward():
    profile = chain_profile([3.0, 3.0], [1000, 1000], [10, 10])
    plan = make_plan(profile, parse_cluster("1x1GB/s"), recompute="none", simulate=False)
    again = dataclasses.replace(plan, stages=tuple(dataclasses.replace(s, recompute=True) for s in plan.stages))
    kept, redone = simulate(plan, minibatches=8), simulate(again, minibatches=8)
    forward = sum(s.fwd_ms for s in plan.stages)
    assert redone.time_per_minibatch_ms == pytest.approx(kept.time_per_minibatch_ms + forward)


def test_the_simulator_counts_a_recomputing_stages_stash_as_inputs_and_one_whole_set():
    profile = chain_profile([3.0] * 4, [1000] * 4, [100] * 4)
    plan = make_plan(profile, parse_cluster("2x1GB/s"), recompute="none", straight=True, simulate=False)
    again = dataclasses.replace(plan, stages=tuple(dataclasses.replace(s, recompute=True) for s in plan.stages))
    kept, redone = simulate(plan), simulate(again)
    first = plan.stages[0]
    held = kept.peak_in_flight[first.ranks[0]]
    assert held == 2 and kept.peak_activation_bytes[first.ranks[0]] == 2 * first.activation_bytes
    assert redone.peak_activation_bytes[first.ranks[0]] == first.in_bytes + first.activation_bytes


def test_show_and_the_picture_mark_recomputing_stages():
    profile = Profile.load(GPT)
    plan = make_plan(profile, parse_cluster("4x12GB/s", f"{int(_limits(profile, '4x12GB/s') * 0.55)}B"))
    table = plan_table(plan)
    header = next(line for line in table.splitlines() if line.strip().startswith("stage"))
    assert "recompute" in header and "yes" in table and "runs its forward again" in table
    source = plan_graph(plan, profile).source
    assert source.count("recomputes its activations") == sum(s.recompute for s in plan.stages)
    plain = make_plan(profile, parse_cluster("4x12GB/s"))
    assert "recompute" not in plan_table(plain) and "recomputes" not in plan_graph(plain, profile).source


@pytest.mark.parametrize("mode", ["flush", "gpipe", "zb", "2bw"])
def test_a_plans_memory_counts_the_weight_versions_its_mode_keeps(mode):
    """Issue 35 item 9: the dynamic program counted PipeDream's stashed versions (one per minibatch in flight) in
    every mode, so a 4-stage flush plan said stage 0 needs twice what pd train plans for it, and --memory ruled
    out flush, gpipe and zb plans that fit. The plan's figure is pd train's (`prediction.planned_memory`)."""
    from pdtool.sim.prediction import planned_memory

    profile = chain_profile([10] * 8, [64 * 2**20] * 8, [2**20] * 8)  # weights dominate: 64 MiB a layer
    plan = make_plan(profile, parse_cluster("4x10GB/s"), straight=True, mode=mode)
    planned = planned_memory(plan, None, None, "sgd")
    assert [s.memory_bytes for s in plan.stages] == [sum(planned[s.ranks[0]].values()) for s in plan.stages]
    pipedream = make_plan(profile, parse_cluster("4x10GB/s"), straight=True, mode="pipedream")
    assert plan.stages[0].memory_bytes < pipedream.stages[0].memory_bytes  # stage 0 keeps 4 versions there
    limit = f"{int(plan.stages[0].memory_bytes * 1.05)}B"  # fits this mode's plan, not PipeDream's stashing
    fitted = make_plan(profile, parse_cluster("4x10GB/s", limit), straight=True, mode=mode)
    assert len(fitted.stages) == 4
    with pytest.raises(PlanError, match="no plan fits"):
        make_plan(profile, parse_cluster("4x10GB/s", limit), straight=True, mode="pipedream", recompute="none")


def test_a_worker_past_the_plans_memory_limit_says_so():
    """Issue 35 item 19: a worker whose measured peak passed the plan's --memory said only "1.8x the plan"."""
    from types import SimpleNamespace

    from pdtool.runtime.run import RunConfig
    from pdtool.views.summary import memory_lines

    profile = chain_profile([10] * 4, [2**20] * 4, [2**10] * 4)
    plan = make_plan(profile, parse_cluster("2x10GB/s", "64MiB"), straight=True, mode="flush")
    config = RunConfig(plan_path="p.json", steps=2, mode="flush")
    base = 100 * 2**20
    reports = {rank: SimpleNamespace(stage=s, rank=rank, rings=0, memory={"base": base, "peak": base + beyond,
                                                                 "training": base + beyond})
               for s, (rank, beyond) in enumerate([(0, 80 * 2**20), (1, 5 * 2**20)])}
    lines = memory_lines(SimpleNamespace(reports=reports), plan, config)
    over = [line for line in lines if "passes the" in line]
    assert len(over) == 1 and over[0].startswith("  - stage 0: its peak (80 MiB beyond its start) passes the 64 MiB")
