"""`--shard optimizer` and `--shard gradients` (issue 38) in the plan file, the memory and cost models, the planner, the
simulator and the views: no worker starts here (tests/dist/test_shard.py runs them)."""
import dataclasses
import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from pdtool.artifacts.cluster import parse_cluster
from pdtool.artifacts.plan import Plan
from pdtool.artifacts.profile import Profile
from pdtool.cli import cli
from pdtool.errors import ArtifactError, PlanError
from pdtool.memory import Memory, memory_model
from pdtool.planner import make_plan
from pdtool.sim.simulate import allreduce_ms
from pdtool.views.show import plan_table
from test_plan import chain_profile

ROOT = Path(__file__).resolve().parents[2]
GPT = Profile.load(str(ROOT / "profiles" / "gpt-small.profile.json"))


def test_sharing_divides_the_optimizer_state_and_nothing_else():
    memory = Memory(limit=float("inf"), optimizer_slots=2, step_temporaries=2.0)
    alone = memory.terms(1000.0, 10.0, in_flight=1, largest=100.0)
    shared = memory.terms(1000.0, 10.0, in_flight=1, largest=100.0, sharing=4)
    assert alone["optimizer"] == 2000.0 and shared["optimizer"] == 500.0
    assert {k: v for k, v in alone.items() if k != "optimizer"} == \
        {k: v for k, v in shared.items() if k != "optimizer"}  # the weights are gathered in place
    assert memory_model(None, 2, "fp32", shard="optimizer").sharing(4) == 4 and memory.sharing(4) == 1


def test_a_sharded_data_parallel_plan_needs_less_memory_and_prices_the_all_gather():
    cluster = parse_cluster("4x10GB/s")
    plain = make_plan(GPT, cluster, data_parallel=True, optimizer_slots=2)
    shard = make_plan(GPT, cluster, data_parallel=True, optimizer_slots=2, shard="optimizer")
    [p], [s] = plain.stages, shard.stages
    assert (p.shard, s.shard) == ("none", "optimizer")
    # the optimizer state (2 x the parameters) is shared by 4 replicas: 1.5 x the parameters less per worker
    assert p.memory_bytes - s.memory_bytes == pytest.approx(1.5 * p.param_bytes, rel=1e-6)
    # one ring all-reduce moves 2 (r-1)/r of the parameters, the all-gather (r-1)/r more
    assert allreduce_ms(shard, 0) - s.reduce_ms == pytest.approx(1.5 * (allreduce_ms(plain, 0) - p.reduce_ms))
    assert s.allreduce_ms == pytest.approx(1.5 * p.allreduce_ms)
    assert shard.predicted.simulated_ms > plain.predicted.simulated_ms  # the gather costs time, not memory


def test_a_limit_no_unsharded_plan_fits_gets_a_sharded_plan_that_fits():
    # a layer of 100 MB of parameters, AdamW (2 slots), flush: on one worker it needs its weights, gradient, 200 MB of
    # state and 200 MB of step temporaries (600 MB); replicated, each replica also keeps the flat buffer it all-reduces
    # the gradient in (700 MB); shared by 4 replicas, 50 MB of state (550 MB; by 3, 567 MB)
    profile = chain_profile([4.0], [100e6], [1e3])
    cluster = parse_cluster("4x10GB/s", memory="560MB")
    with pytest.raises(PlanError, match="no plan fits"):
        make_plan(profile, cluster, optimizer_slots=2, recompute="none", mode="flush")
    plan = make_plan(profile, cluster, optimizer_slots=2, recompute="none", mode="flush", shard="optimizer")
    assert [(s.replicas, s.shard) for s in plan.stages] == [(4, "optimizer")]
    assert all(s.memory_bytes == pytest.approx(550e6, rel=1e-4) for s in plan.stages)  # and a few kB of messages
    table = plan_table(plan)
    assert "shard        each replica of a stage marked optimizer" in table and "optimizer" in table


def test_the_plan_records_the_shard_only_where_it_shards(tmp_path):
    plain = make_plan(GPT, parse_cluster("4x10GB/s"), data_parallel=True)
    assert "shard" not in plain.to_json()["stages"][0]  # plans without sharding are written as before
    shard = plain.with_shard("optimizer")
    path = tmp_path / "s.json"
    shard.save(path)
    assert Plan.load(str(path)).stages[0].shard == "optimizer"
    assert plain.with_shard(None) is plain


def test_a_shard_on_a_stage_without_replicas_is_refused_when_the_plan_is_read(tmp_path):
    data = make_plan(GPT, parse_cluster("2x10GB/s"), straight=True).to_json()
    data["stages"][0]["shard"] = "optimizer"
    path = tmp_path / "p.json"
    path.write_text(json.dumps(data))
    with pytest.raises(ArtifactError, match="shard is optimizer but the stage has one replica"):
        Plan.load(str(path))
    data["stages"][0]["shard"] = "everything"
    path.write_text(json.dumps(data))
    with pytest.raises(ArtifactError, match="shard"):
        Plan.load(str(path))


def test_pd_plan_shard_writes_it_and_refuses_it_with_straight(tmp_path):
    out = tmp_path / "p.json"
    profile = str(ROOT / "profiles" / "gpt-small.profile.json")
    result = CliRunner().invoke(cli, ["plan", profile, "-c", "4x10GB/s", "--data-parallel", "--shard", "optimizer",
                                      "-o", str(out)])
    assert result.exit_code == 0, result.output
    assert Plan.load(str(out)).stages[0].shard == "optimizer"
    assert "--shard optimizer" in Plan.load(str(out)).command
    out.unlink()
    result = CliRunner().invoke(cli, ["plan", profile, "-c", "4x10GB/s", "--straight", "--shard", "optimizer",
                                      "-o", str(out)])
    assert result.exit_code != 0 and "--straight plans no replicas" in result.output and not out.exists()
    result = CliRunner().invoke(cli, ["plan", profile, "-c", "4x10GB/s", "--mode", "zbv", "--virtual-stages", "2",
                                      "--shard", "auto", "-o", str(out)])
    assert result.exit_code != 0 and "plans chunks without replicas" in result.output and not out.exists()


@pytest.mark.parametrize("mode", ["pipedream", "flush"])
def test_the_steady_state_of_a_sharded_plan_is_its_simulation_and_it_steps_a_share(mode):
    from pdtool.sim.simulate import simulate
    from pdtool.sim.steady import steady_state

    plan = make_plan(GPT, parse_cluster("4x10GB/s"), simulate=False, shard="optimizer", mode=mode, optimizer_slots=2)
    replicated = [s for s in plan.stages if s.replicas > 1]
    assert replicated and all(s.step_ms == pytest.approx(s.update_ms / s.replicas) for s in replicated)
    assert steady_state(plan, mode).time_per_minibatch_ms == pytest.approx(
        simulate(plan, mode).time_per_minibatch_ms, rel=0.02)


def test_auto_shards_a_stage_exactly_where_it_fits_the_limit_only_so():
    profile = chain_profile([4.0], [100e6], [1e3])  # as above: 700 MB a replica unsharded, 550 MB sharded over 4
    # no limit, or one that fits unsharded: nothing shards (the gather only costs time)
    for memory in (None, "750MB"):
        plan = make_plan(profile, parse_cluster("4x10GB/s", memory=memory), optimizer_slots=2, recompute="none",
                         mode="flush", shard="auto")
        assert all(s.shard == "none" for s in plan.stages)
    # a limit only sharded stages fit: each replicated stage shards, and the plan is the sharded one's
    cluster = parse_cluster("4x10GB/s", memory="560MB")
    auto = make_plan(profile, cluster, optimizer_slots=2, recompute="none", mode="flush", shard="auto")
    every = make_plan(profile, cluster, optimizer_slots=2, recompute="none", mode="flush", shard="optimizer")
    assert [(s.layers, s.replicas, s.shard, s.memory_bytes, s.allreduce_ms, s.time_ms) for s in auto.stages] == \
        [(s.layers, s.replicas, s.shard, s.memory_bytes, s.allreduce_ms, s.time_ms) for s in every.stages]
    assert auto.predicted.time_ms == every.predicted.time_ms  # the sharded stages' figures count their gather
    assert all(s.shard == "optimizer" for s in auto.stages)


def test_auto_shards_only_the_stages_that_need_it():
    """A first layer of 300 MB of parameters and two light ones under 1.7 GB a worker with AdamW: the
    stage of the first layer fits only sharded over 4 replicas (weights 300, a gradient and its reduce
    buffer 600, state 150, step temporaries 600; they then pay the gather), the light stage stays
    unsharded with replicas as without them; a single worker cannot shard."""
    from pdtool.planner.costmodel import ChainCosts, DefaultModel
    from pdtool.planner.partition import Solver

    profile = chain_profile([4.0, 4.0, 4.0], [300e6, 1e6, 1e6], [1e3, 1e3, 1e3])
    solver = Solver(ChainCosts.from_profile(profile), [4], [10e9], DefaultModel(),
                    memory=memory_model(1.7e9, 2, "fp32", "flush"), shard="auto")

    def place(k, j, r):
        where = dict(level=0, context=(0, 1), r=r, before=0, first=k == 0, final=False)
        return solver.shards(**where, k=k, j=j), float(solver._stage(0, (0, 1), r, 0, k == 0, False)[k, j])

    assert place(0, 1, 1) == ("none", float("inf"))  # layer 0 on one worker: does not fit
    assert place(0, 1, 2) == ("none", float("inf"))  # 2 replicas: 1.8 GB sharded
    shard, time = place(0, 1, 4)
    assert shard == "optimizer" and time == pytest.approx(
        DefaultModel(sync_scale=1.5).stage_times(solver.states.cut, solver.compute, solver.params, 4, 10e9, 1, True,
                                                  True)[0, 1])
    assert place(1, 3, 2)[0] == "none" and place(1, 3, 1)[0] == "none"  # the light layers fit as they are


# ----- --shard gradients (ZeRO stage 2): a slice of the gradients, reduced after every backward ----------------------
def test_gradient_sharing_keeps_a_slice_and_two_buckets():
    from pdtool.memory import GRADIENT_BUCKET_BYTES

    memory = Memory(limit=float("inf"), optimizer_slots=2, step_temporaries=2.0)
    optimizer = memory.terms(1e9, 10.0, in_flight=1, largest=1e8, sharing=4, shard="optimizer")
    gradients = memory.terms(1e9, 10.0, in_flight=1, largest=1e8, sharing=4, shard="gradients")
    assert optimizer["gradients"] == 1e9 and gradients["gradients"] == 1e9 / 4 + 2 * 1e8  # a layer above a bucket
    small = memory.terms(1e9, 10.0, in_flight=1, largest=1e5, sharing=4, shard="gradients")
    assert small["gradients"] == 1e9 / 4 + 2 * GRADIENT_BUCKET_BYTES
    assert {k: v for k, v in gradients.items() if k != "gradients"} == \
        {k: v for k, v in optimizer.items() if k != "gradients"}
    # a split backward's W makes every weight gradient of a backward at once
    split = memory_model(None, 2, "fp32", "zb", shard="gradients")
    assert split.terms(1e9, 10.0, in_flight=1, largest=1e5, sharing=4)["gradients"] == \
        1e9 / 4 + 1e9 + GRADIENT_BUCKET_BYTES
    assert memory_model(None, 2, "fp32", "flush", shard="auto").shard == "none"


def test_a_gradient_sharded_plan_needs_less_memory_and_prices_a_reduce_after_every_backward():
    from pdtool.memory import GRADIENT_BUCKET_BYTES
    from pdtool.sim.simulate import backward_reduce_ms, simulate
    from pdtool.sim.steady import steady_state

    cluster = parse_cluster("4x10GB/s")
    optimizer = make_plan(GPT, cluster, data_parallel=True, optimizer_slots=2, shard="optimizer", mode="flush")
    gradients = make_plan(GPT, cluster, data_parallel=True, optimizer_slots=2, shard="gradients", mode="flush")
    [o], [g] = optimizer.stages, gradients.stages
    assert g.shard == "gradients" and g.param_bytes > 3 * GRADIENT_BUCKET_BYTES
    transient = 2 * max(GRADIENT_BUCKET_BYTES, g.largest_layer_bytes)
    # the optimizer's shard keeps a gradient and the flat buffer it all-reduces in, the gradients' 1/4 and two buckets
    assert o.memory_bytes - g.memory_bytes == pytest.approx(1.75 * g.param_bytes - transient, rel=1e-6)
    # the step only gathers (half an all-reduce); every backward all-reduces the gradients
    assert allreduce_ms(gradients, 0) == pytest.approx((allreduce_ms(optimizer, 0) - o.reduce_ms) / 3)
    assert backward_reduce_ms(gradients, 0) == pytest.approx(2 * (allreduce_ms(optimizer, 0) - o.reduce_ms) / 3
                                                             + g.reduce_ms)
    slower = simulate(gradients, group=8).time_per_minibatch_ms - simulate(optimizer, group=8).time_per_minibatch_ms
    # 8 microbatches on 4 replicas: 2 reduces each a step, where the optimizer's shard all-reduces once
    assert slower == pytest.approx((2 * backward_reduce_ms(gradients, 0) - (allreduce_ms(optimizer, 0)
                                    - allreduce_ms(gradients, 0))) / 8, rel=0.05)
    for mode in ("flush", "pipedream"):
        plan = make_plan(GPT, cluster, simulate=False, shard="gradients", mode=mode, optimizer_slots=2)
        assert plan.reduce_each and steady_state(plan, mode).time_per_minibatch_ms == pytest.approx(
            simulate(plan, mode).time_per_minibatch_ms, rel=0.02)
    assert "shard        each replica of a stage marked gradients" in plan_table(gradients)


def test_the_lowering_reduces_after_each_weight_gradient_and_pads_the_replica_with_fewer():
    from pdtool.schedule import generate
    from pdtool.schedule.lower import lower

    schedule = generate("zb", (1, 2), 3, 3)  # stage 1's replicas run 2 and 1 of the 3 microbatches
    lowered = lower(schedule, reduce_each=(1,)).workers
    first, second = (" ".join(map(str, ops)) for ops in lowered[1:])
    assert "1W0 1reduce" in first and "1W2 1reduce" in first and first.count(" 1reduce") == 2
    assert "1W1 1reduce" in second and second.count(" 1reduce") == 2  # one empty, before its step's all-reduce
    empty = [op for op in lowered[2] if op.kind == "reduce" and not op.weights]
    assert len(empty) == 1 and lowered[2][lowered[2].index(empty[0]) + 1].kind == "allreduce"
    # a B that computes the weight gradients reduces them before it sends the input gradients on
    ops = " ".join(map(str, lower(generate("flush", (1, 2), 2, 2), reduce_each=(1,)).workers[1]))
    assert "1B0 1reduce send>0" in ops
    assert not any(op.kind == "reduce" for w in lower(schedule).workers for op in w)  # only where asked


def test_a_schedule_that_deadlocks_once_replicas_reduce_after_every_backward_is_one_line():
    from pdtool.errors import ScheduleError
    from pdtool.schedule import Schedule, validate
    from pdtool.schedule.check import check_reduce_each
    from pdtool.schedule.core import Action

    def actions(text):
        return tuple(Action.parse(a) for a in text.split())

    # stage 0 runs F1 only after B0, whose gradient stage 1's replica 0 sends only after its reduce with replica 1's
    # B1, which needs F1: sound unsharded, a deadlock when the replicas reduce after every backward
    schedule = Schedule(mode="flush", replicas=(1, 2), minibatches=4, group=4, workers=(
        actions("0F0 0B0 0F1 0B1 0F2 0B2 0F3 0B3 0U"), actions("1F0 1B0 1F2 1B2 1U"), actions("1F1 1B1 1F3 1B3 1U")))
    validate(schedule)
    with pytest.raises(ScheduleError, match="deadlock.*waits for the other replicas' backward 1 to reduce"):
        check_reduce_each(schedule, (1,))


def test_pd_plan_shard_gradients_writes_it(tmp_path):
    out = tmp_path / "p.json"
    profile = str(ROOT / "profiles" / "gpt-small.profile.json")
    result = CliRunner().invoke(cli, ["plan", profile, "-c", "4x10GB/s", "--data-parallel", "--shard", "gradients",
                                      "--optimizer", "adamw", "-o", str(out)])
    assert result.exit_code == 0, result.output
    plan = Plan.load(str(out))
    assert plan.stages[0].shard == "gradients" and plan.reduce_each == (0,) and plan.sharding_refusal() is None
    # pd show: each worker's memory by term, with the optimizer the plan recorded (AdamW: 2 x the parameters / 4)
    assert plan.optimizer == "adamw"
    table = plan_table(plan)
    assert "memory per worker by term (--optimizer adamw" in table
    params = plan.stages[0].param_bytes
    row = table.split("memory per worker by term")[1].splitlines()[3].split()
    assert float(row[4]) == pytest.approx(2 * params / 4 / 2**20, abs=0.06)  # optimizer MiB
    assert float(row[3]) == pytest.approx((params / 4 + 2 * 4 * 2**20) / 2**20, abs=0.06)  # gradients: slice, 2 buckets
    assert "memory per worker by term" not in plan_table(dataclasses.replace(plan, optimizer=None))  # older plans


def test_auto_shards_the_gradients_where_only_that_fits():
    """Twelve layers of 10 MB of parameters on 2 workers with AdamW under 360 MB: one stage of all of them fits
    neither unsharded (weights 120, gradients and the reduce buffer 240, state 240, step temporaries 20: 620 MB)
    nor with its optimizer state sharded (500 MB); with its gradients sharded too (60 MB and two 10 MB buckets,
    80 MB: 340 MB) it does, and auto takes that, the least sharding that fits."""
    from pdtool.planner.costmodel import ChainCosts, DefaultModel
    from pdtool.planner.partition import Solver

    profile = chain_profile([1.0] * 12, [10e6] * 12, [1e3] * 12)
    solver = Solver(ChainCosts.from_profile(profile), [2], [10e9], DefaultModel(),
                    memory=memory_model(360e6, 2, "fp32", "flush"), shard="auto")
    where = dict(level=0, context=(0, 1), r=2, before=0, first=True, final=True)
    assert solver.shards(**where, k=0, j=12) == "gradients"
    assert float(solver._stage(0, (0, 1), 2, 0, True, True)[0, 12]) < float("inf")
    assert solver.shards(**where, k=0, j=6) == "none"  # half the layers fit unsharded


def test_pipedream_with_a_replicated_middle_stage_deadlocks_past_its_warm_up_and_is_refused():
    """pipedream on replicas (1, 3, 1) runs 2 minibatches without a deadlock and deadlocks from the 6th on once the
    middle stage's replicas reduce after every backward: the check runs past the warm-up of every round. A stage
    without parameters has nothing to reduce."""
    import dataclasses

    from pdtool.schedule import generate
    from pdtool.schedule.check import check_reduce_each
    from pdtool.errors import ScheduleError

    check_reduce_each(generate("pipedream", (1, 3, 1), 2, 1), (1,))
    with pytest.raises(ScheduleError, match="deadlock"):
        check_reduce_each(generate("pipedream", (1, 3, 1), 6, 1), (1,))
    straight = make_plan(chain_profile([1.0] * 3, [1e6] * 3, [1e3] * 3), parse_cluster("5x10GB/s"), straight=True,
                         mode="pipedream", simulate=False)
    stages = tuple(dataclasses.replace(s, ranks=ranks, shard="gradients" if len(ranks) > 1 else "none")
                   for s, ranks in zip(straight.stages, [(0,), (1, 2, 3), (4,)]))
    plan = dataclasses.replace(straight, stages=stages)
    assert plan.reduce_check_steps() >= 6 and "deadlock" in plan.sharding_refusal()
    assert "deadlock" in plan.sharding_refusal() and plan.with_shard("optimizer").sharding_refusal() \
        is None
    weightless = dataclasses.replace(plan, stages=(stages[0], dataclasses.replace(stages[1], param_bytes=0), stages[2]))
    assert weightless.reduce_each == () and weightless.sharding_refusal() is None


def test_auto_plans_again_without_sharded_gradients_where_they_are_refused(monkeypatch):
    """--shard auto's pick shards gradients (then parameters) that the schedule or a tied weight would refuse:
    planned again without them (here nothing else fits: one line), never a plan pd plan or pd train then refuse."""
    profile = chain_profile([1.0] * 12, [10e6] * 12, [1e3] * 12)
    cluster = parse_cluster("2x10GB/s", memory="360MB")  # as test_auto_shards_the_gradients_where_only_that_fits
    plan = make_plan(profile, cluster, optimizer_slots=2, recompute="none", mode="flush", data_parallel=True,
                     shard="auto")
    assert [s.shard for s in plan.stages] == ["gradients"]
    monkeypatch.setattr(Plan, "sharding_refusal",
                        lambda self, schedule=None, kinds=("gradients", "parameters"):
                        "refused" if any(s.shard in kinds for s in self.stages) else None)
    said = []
    with pytest.raises(PlanError, match="no plan fits"):
        make_plan(profile, cluster, optimizer_slots=2, recompute="none", mode="flush", data_parallel=True,
                  shard="auto", say=said.append)
    # without sharded gradients, sharded parameters fit (and are refused too): planned again without either
    assert said == ["--shard auto: refused; planning again without sharded gradients",
                    "--shard auto: refused; planning again without sharded parameters"]
    roomy = parse_cluster("2x10GB/s", memory="510MB")  # the optimizer's shard fits (500 MB): that, and no line
    assert [s.shard for s in make_plan(profile, roomy, optimizer_slots=2, recompute="none", mode="flush",
                                        data_parallel=True, shard="auto").stages] == ["optimizer"]


def test_parameter_sharing_keeps_a_slice_of_everything_and_two_gathered_layers():
    """--shard parameters (ZeRO stage 3): each of r replicas keeps 1/r of the weights, gradients and optimizer
    state, and two layers' weights gathered (a unit's, and the next one's gather) and two of gradients (a unit's,
    and the buffer it is reduce-scattered from); where the mode splits its backward the weights stay gathered from
    the step's first forward to the step and the gradients accumulate whole."""
    whole = memory_model(None, 2, "fp32", "flush").terms(120.0, 0.0, 1, largest=10.0, sharing=4, shard="parameters",
                                                         replicas=4)
    assert (whole["weights"], whole["gradients"], whole["optimizer"]) == (30 + 20, 30 + 20, 60)
    split = memory_model(None, 2, "fp32", "zb").terms(120.0, 0.0, 1, largest=10.0, sharing=4, shard="parameters",
                                                      replicas=4)
    assert (split["weights"], split["gradients"], split["optimizer"]) == (30 + 120, 30 + 120 + 10, 60)


def test_auto_shards_the_parameters_where_only_that_fits():
    """The twelve 10 MB layers of test_auto_shards_the_gradients_where_only_that_fits on 2 workers: sharded
    gradients need 340 MB, sharded parameters 300 (weights 60 + two gathered layers, gradients likewise, state
    120, step temporaries 20): under 320 MB auto shards the parameters, the only choice that fits; the simulator
    prices their gathers (a slower step than sharded gradients')."""
    from pdtool.planner.costmodel import ChainCosts, DefaultModel
    from pdtool.planner.partition import Solver

    model = memory_model(320e6, 2, "fp32", "flush")
    need = {kind: model.need(120e6, 12e3, 1, largest=10e6, sharing=2, shard=kind, replicas=2)
            for kind in ("gradients", "parameters")}
    assert need["parameters"] <= 320e6 < need["gradients"], need
    profile = chain_profile([1.0] * 12, [10e6] * 12, [1e3] * 12)
    solver = Solver(ChainCosts.from_profile(profile), [2], [10e9], DefaultModel(), memory=model, shard="auto")
    where = dict(level=0, context=(0, 1), r=2, before=0, first=True, final=True)
    assert solver.shards(**where, k=0, j=12) == "parameters"
    # (a group of 2, one minibatch a replica: in data parallelism the default group of 1 leaves a replica idle, which
    # sharded parameters refuse: auto plans again without them, and nothing fits)
    said = []
    with pytest.raises(PlanError, match="no plan fits"):
        make_plan(profile, parse_cluster("2x10GB/s", memory="320MB"), optimizer_slots=2, recompute="none",
                  mode="flush", data_parallel=True, shard="auto", say=said.append)
    assert said[0].startswith("--shard auto: --shard parameters: the replicas of stage 0 run their actions in "
                              "different orders")
    plan = make_plan(profile, parse_cluster("2x10GB/s", memory="320MB"), optimizer_slots=2, recompute="none",
                     mode="flush", data_parallel=True, shard="auto", group=2)
    assert [s.shard for s in plan.stages] == ["parameters"] and plan.reduce_each == (0,)
    assert plan.sharding_refusal() is None
    # asked for explicitly, the group is rounded up to the replicas
    said = []
    plan = make_plan(profile, parse_cluster("2x10GB/s", memory="320MB"), optimizer_slots=2, recompute="none",
                     mode="flush", data_parallel=True, shard="parameters", say=said.append)
    assert plan.group == 2 and said == ["--shard parameters: planning again with 2 microbatches a step (--group), a "
                                        "multiple of the sharded stages' replicas (2), so that each replica runs as many"]
    from pdtool.sim.simulate import allreduce_ms, backward_reduce_ms

    gradients = plan.with_shard("gradients")
    assert backward_reduce_ms(plan, 0) > backward_reduce_ms(gradients, 0) and allreduce_ms(plan, 0) < allreduce_ms(
        gradients, 0)


def test_an_exported_graphs_sharded_parameters_are_gathered_a_stage_at_a_time():
    """torch.export's stage graphs read every weight by attribute, not through its module, so FSDP gathers the
    stage as one unit: the memory model counts the whole stage gathered (weights and gradients) for such a
    profile's plans, two layers for an fx profile's."""
    fx = memory_model(None, 2, "fp32", "flush", method="fx").terms(120.0, 0.0, 1, largest=10.0, sharing=4,
                                                                   shard="parameters", replicas=4)
    exported = memory_model(None, 2, "fp32", "flush", method="export").terms(120.0, 0.0, 1, largest=10.0, sharing=4,
                                                                             shard="parameters", replicas=4)
    assert (fx["weights"], exported["weights"], exported["gradients"]) == (30 + 20, 30 + 120, 30 + 120)
