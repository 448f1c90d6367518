"""Several stages (chunks) per worker, the schedule layer (issue 37): placements, Megatron's
interleaved 1F1B generated, lowered (a worker hands the tensors between its own chunks to
itself), validated and simulated, with the bubble of the SC'21 paper's closed form."""
from pathlib import Path

import pytest

from pdtool.errors import ScheduleError
from pdtool.schedule import Schedule, generate, lower, peak_versions, rules, stash_depth, validate
from pdtool.schedule.placement import LOOPED, V, chunks, looped, make, shape_of, v_shape
from pdtool.sim.simulate import simulate
from test_simulate import make as make_plan


def test_the_two_placements():
    assert looped(8, 4) == (0, 1, 2, 3, 0, 1, 2, 3) and chunks(looped(8, 4), 1) == (1, 5)
    assert v_shape(8) == (0, 1, 2, 3, 3, 2, 1, 0) and chunks(v_shape(8), 0) == (0, 7)
    assert shape_of(looped(6, 3)) == LOOPED and shape_of(v_shape(6)) == V and shape_of((0, 0, 1, 1)) is None
    assert make(V, 4, 2) == (0, 1, 1, 0)
    with pytest.raises(ScheduleError, match="must be a multiple of the workers"):
        looped(6, 4)
    with pytest.raises(ScheduleError, match="needs an even number of stages"):
        v_shape(5)


def test_interleaved_is_megatrons_order_and_hands_over_in_the_worker():
    s = generate("interleaved", (1,) * 4, 4, 4, placement=looped(4, 2))
    validate(s)
    # p = 2, v = 2, m = 4: worker 0 warms up 2(p - 1) + (v - 1)p = 4 forwards, chunk by chunk in rounds of p
    assert " ".join(map(str, s.workers[0])) == ("0F0 0F1 2F0 2F1 0F2 2B0 0F3 2B1 2F2 0B0 2F3 0B1 2B2 2B3 0B2 0B3 "
                                                "0U 2U")
    assert s.label(1) == "w1 s1,3r0" and s.stages_of(1) == (1, 3)
    assert Schedule.from_text(s.to_text()) == s
    assert stash_depth(s, 0) == 4 and set(peak_versions(s).values()) == {1}
    # looped on one worker: every boundary is in the worker, so nothing is sent at all
    one = lower(generate("interleaved", (1, 1), 2, 1, placement=looped(2, 1)))
    assert {op.kind for op in one.workers[0]} == {"F", "B", "allreduce", "step"}
    # on two workers every boundary crosses between them: a message each way per boundary and microbatch
    two = lower(s)
    assert sum(op.kind == "send" for ops in two.workers for op in ops) == 2 * 3 * 4


@pytest.mark.parametrize("workers", [2, 3, 4])
@pytest.mark.parametrize("chunks_per_worker", [2, 3, 4])
@pytest.mark.parametrize("rounds", [1, 2, 3])
def test_every_interleaved_schedule_is_sound(workers, chunks_per_worker, rounds):
    group = rounds * workers
    validate(generate("interleaved", (1,) * (workers * chunks_per_worker), 2 * group, group,
                      placement=looped(workers * chunks_per_worker, workers)))


def test_what_a_placement_needs_is_one_line():
    with pytest.raises(ScheduleError, match=r"mode 'interleaved' runs several stages .* needs their placement"):
        generate("interleaved", (1, 1, 1, 1), 4, 2)
    with pytest.raises(ScheduleError, match=r"needs the looped placement of 4 stages on 2 workers \(\(0, 1, 0, 1\)\), "
                                            r"but the stages are placed \(0, 1, 1, 0\) \(v\)"):
        generate("interleaved", (1, 1, 1, 1), 4, 2, placement=v_shape(4))
    with pytest.raises(ScheduleError, match=r"group=3 for mode 'interleaved' on 2 workers: .* multiple of 2; use 2 or 4"):
        generate("interleaved", (1, 1, 1, 1), 6, 3, placement=looped(4, 2))
    with pytest.raises(ScheduleError, match="chunks are not replicated here"):
        generate("interleaved", (2, 1, 1, 1), 4, 2, placement=looped(4, 2))
    with pytest.raises(ScheduleError, match="runs one stage per worker"):
        generate("flush", (1, 1, 1, 1), 4, 2, placement=looped(4, 2))


def test_a_local_handover_out_of_order_is_one_line():
    s = generate("interleaved", (1, 1), 1, 1, placement=looped(2, 1))
    swapped = (s.workers[0][1], s.workers[0][0]) + s.workers[0][2:]
    with pytest.raises(ScheduleError, match=r"w0 s0,1r0: 1F0 \(action 0\) needs what 0F0 \(action 1\) of this same "
                                            r"worker makes; run 0F0 first"):
        validate(Schedule(mode="interleaved", replicas=(1, 1), minibatches=1, group=1, workers=(swapped,),
                          placement=(0, 0)))


@pytest.mark.parametrize("workers, chunks_per_worker, group", [(2, 2, 4), (4, 2, 8), (4, 4, 8), (3, 2, 6), (3, 3, 9)])
def test_the_simulated_bubble_is_the_closed_form(workers, chunks_per_worker, group):
    """Uniform stages, free links: a batch takes m v (f + b) + (p - 1)(f + b), the bubble (p - 1) / (v m)
    of the ideal time (Narayanan et al. SC'21, section 2.2.1), within 2%."""
    stages = workers * chunks_per_worker
    f, b = 1.0 / chunks_per_worker, 2.0 / chunks_per_worker  # a worker's share of the model is the same whatever v
    plan = make_plan([(f, b, 1)] * stages, levels=[(stages, 1e15)])
    result = simulate(plan, "interleaved", minibatches=group, group=group, placement=looped(stages, workers))
    ideal = group * chunks_per_worker * (f + b)
    bubble = (result.makespan_ms - ideal) / ideal
    assert bubble == pytest.approx((workers - 1) / (chunks_per_worker * group), rel=0.02, abs=1e-9)
    assert set(result.busy_ms) == set(range(workers)) and result.peak_in_flight[0] >= result.peak_in_flight[workers - 1]


def test_interleaving_shortens_the_batch_it_simulates():
    flat = make_plan([(1.0, 2.0, 1)] * 4, levels=[(4, 1e15)])
    four = simulate(flat, "flush", minibatches=8, group=8)
    halves = make_plan([(0.5, 1.0, 1)] * 8, levels=[(8, 1e15)])
    interleaved = simulate(halves, "interleaved", minibatches=8, group=8, placement=looped(8, 4))
    assert interleaved.makespan_ms < four.makespan_ms
    assert rules("interleaved").placement == LOOPED


def _uniform(stages, f, b, w):
    """A plan of `stages` equal stages whose backward is b (input gradients) + w (weight gradients)."""
    import dataclasses

    plan = make_plan([(f, b + w, 1)] * stages, levels=[(stages, 1e15)])
    return dataclasses.replace(plan, stages=tuple(dataclasses.replace(s, wgrad_ms=w) for s in plan.stages))


def test_zbv_is_torchs_order_on_the_v():
    s = generate("zbv", (1,) * 4, 4, 4, placement=v_shape(4))
    validate(s)
    # torch's ScheduleZBVZeroBubble._calculate_single_rank_operations for 2 ranks, 4 microbatches (torch's I is B here)
    assert " ".join(map(str, s.workers[1])) == ("1F0 2F0 1F1 2F1 2B0 2W0 1F2 1B0 1W0 2F2 2B1 2W1 1F3 1B1 1W1 2F3 2B2 "
                                                "2W2 1B2 2B3 1B3 1W2 2W3 1W3 1U 2U")
    assert s.stages_of(0) == (0, 3) and rules("zbv").split


@pytest.mark.parametrize("workers", [1, 2, 3, 4, 6])
def test_every_zbv_schedule_is_sound(workers):
    for group in range(1, 3 * workers + 2):
        validate(generate("zbv", (1,) * (2 * workers), 2 * group, group, placement=v_shape(2 * workers)))


@pytest.mark.parametrize("workers, group", [(2, 4), (4, 8), (4, 16), (8, 16)])
def test_zbv_with_equal_f_b_w_reaches_the_fill_bound_at_1f1bs_memory(workers, group):
    """With F = B = W per chunk, ZB-V idles only where it must: the last worker's first forward waits
    (p - 1) F for the pipeline to fill, and nothing else (Qi et al. section 6: zero bubble); its
    activations in flight stay within 1F1B's: 2p chunk-microbatches, p stage-microbatches."""
    plan = _uniform(2 * workers, 1.0, 1.0, 1.0)
    result = simulate(plan, "zbv", minibatches=group, group=group, placement=v_shape(2 * workers))
    ideal = group * 2 * 3.0
    assert result.makespan_ms == pytest.approx(ideal + (workers - 1) * 1.0, rel=1e-9)
    assert max(result.peak_in_flight.values()) <= 2 * workers
    one_f_one_b = simulate(_uniform(workers, 2.0, 2.0, 2.0), "zb", minibatches=group, group=group)
    assert result.makespan_ms < one_f_one_b.makespan_ms


def _torchs_order(schedule_class, workers, group, rank):
    """torch.distributed.pipelining's own action list for `rank` (its I is pdtool's split B, its full
    backward pdtool's whole B, an overlapped F and B the two one after the other), as "<stage><kind><mb>"."""
    from types import SimpleNamespace

    shell = SimpleNamespace(pp_group_size=workers, _n_microbatches=group, num_stages=2 * workers)
    names = {"F": "F", "I": "B", "B": "B", "W": "W"}
    found = []
    for action in schedule_class._calculate_single_rank_operations(shell, rank):
        if action is None:
            continue
        for one in action.sub_actions or (action,):
            found.append(f"{one.stage_index}{names[one.computation_type.value]}{one.microbatch_index}")
    return found


@pytest.mark.parametrize("mode, torch_class", [("zbv", "ScheduleZBVZeroBubble"), ("dualpipev", "ScheduleDualPipeV")])
@pytest.mark.parametrize("workers", [1, 2, 3, 4, 5])
def test_the_v_orders_are_torchs(mode, torch_class, workers):
    """pdtool writes these orders itself (pure Python, no torch in the schedule package); torch 2.13's
    schedules are the oracle: the same actions in the same order on every rank, for every group torch takes."""
    from torch.distributed.pipelining import schedules

    low = 2 * workers if rules(mode).group_stages else 1
    for group in range(low, 4 * workers + 2):
        s = generate(mode, (1,) * (2 * workers), group, group, placement=v_shape(2 * workers))
        for rank in range(workers):
            ours = [str(a) for a in s.workers[rank] if a.kind != "U"]
            assert ours == _torchs_order(getattr(schedules, torch_class), workers, group, rank), (group, rank)


def test_dualpipev_needs_a_group_of_the_stages_and_splits_some_backwards():
    with pytest.raises(ScheduleError, match=r"group=3 for mode 'dualpipev' on 4 stages: .* use a group >= 4"):
        generate("dualpipev", (1,) * 4, 3, 3, placement=v_shape(4))
    s = generate("dualpipev", (1,) * 8, 8, 8, placement=v_shape(8))
    validate(s)
    whole = [a for ops in s.workers for a in ops if a.kind == "B"]
    split = [a for ops in s.workers for a in ops if a.kind == "W"]
    assert 0 < len(split) < len(whole)
    ops = lower(s).workers
    assert sum(op.kind == "B" and not op.weights for w in ops for op in w) == len(split)


@pytest.mark.parametrize("mode, shape, workers", [("interleaved", "looped", 2), ("interleaved", "looped", 4),
                                                  ("zbv", "v", 2), ("zbv", "v", 4), ("dualpipev", "v", 3)])
def test_the_steady_state_is_the_event_simulation(mode, shape, workers):
    """Unequal stages and a slow link: the period graph of one batch (`sim.steady`) gives the event
    simulation's time per minibatch over many batches within 2%."""
    from pdtool.sim.steady import steady_state

    stages = 2 * workers
    times = [(1.0 + 0.3 * (s % 3), 2.0 + 0.5 * (s % 2), 1, 0, 40_000) for s in range(stages)]
    import dataclasses

    plan = make_plan(times, levels=[(stages, 2e7)])
    plan = dataclasses.replace(plan, stages=tuple(dataclasses.replace(s, wgrad_ms=s.bwd_ms / 2) for s in plan.stages))
    placement = make(shape, stages, workers)
    group = 2 * stages
    steady = steady_state(plan, mode, group=group, placement=placement)
    long = simulate(plan, mode, minibatches=8 * group, group=group, placement=placement)
    assert steady is not None
    assert steady.time_per_minibatch_ms == pytest.approx(long.time_per_minibatch_ms, rel=0.02)


def _chunked_plan(mode="interleaved", ranks=((0,), (1,), (0,), (1,))):
    return make_plan([(1.0, 2.0, 1, 0, 4000)] * len(ranks), levels=[(max(max(r) for r in ranks) + 1, 1e9)],
                     mode=mode, ranks=ranks)


def test_a_plan_puts_several_stages_on_a_worker_where_its_mode_places_them(tmp_path):
    from pdtool.artifacts.plan import Plan
    from pdtool.sim.steady import steady_state

    plan = _chunked_plan()
    assert plan.placement == (0, 1, 0, 1) and plan.used_ranks == (0, 1) and plan.schema == "pdtool.plan/2"
    path = tmp_path / "chunks.plan.json"
    plan.save(path)
    again = Plan.load(path)
    assert again == plan
    result = simulate(again, group=4)  # the plan's placement: no argument needed
    assert set(result.busy_ms) == {0, 1} and {e.stage for e in result.events if e.rank == 0} == {0, 2}
    assert steady_state(again, group=4).time_per_minibatch_ms == pytest.approx(
        simulate(again, minibatches=32, group=4).time_per_minibatch_ms, rel=0.02)
    v = _chunked_plan("zbv", ((0,), (1,), (1,), (0,)))
    assert v.placement == (0, 1, 1, 0) and simulate(v, group=4).mode == "zbv"
    assert plan.untrainable() is None  # pd train runs it (tests/dist/test_chunks_reference.py)


@pytest.mark.parametrize("mode, ranks, message", [
    ("flush", ((0,), (1,), (0,), (1,)), r"stages\[2\]: rank 0 is also in stages\[0\]; give every rank to one stage only"),
    ("interleaved", ((0,), (1,), (1,), (0,)), r"places the stages looped over the workers, but the stages' ranks place "
                                              r"them 0, 1, 1, 0 \(v\)"),
    ("zbv", ((0,), (1,), (0,), (1,)), r"places the stages v over the workers, but .* 0, 1, 0, 1 \(looped\)"),
    ("interleaved", ((0, 2), (1,), (0,), (1,)), r"stages\[0\]: 2 ranks: mode 'interleaved' .* does not replicate them"),
])
def test_a_plan_whose_chunks_do_not_suit_its_mode_is_one_line(mode, ranks, message):
    from pdtool.errors import ArtifactError

    with pytest.raises(ArtifactError, match=message):
        _chunked_plan(mode, ranks)


def test_pd_show_and_the_picture_give_each_worker_its_chunks(tmp_path):
    from pdtool.views.render import STAGE_COLOURS, plan_graph
    from pdtool.views.show import plan_table, simulation_table
    from test_plan import chain_profile

    plan = _chunked_plan()
    text = plan_table(plan)
    assert "chunks       looped placement, 2 stages on each worker: rank 0 holds stages 0, 2; rank 1 holds stages 1, 3" \
        in text
    sim = simulation_table(simulate(plan, group=4), plan)
    assert "2 workers in 4 stages, 2 on each worker (interleaved's placement)" in sim
    assert [line.split()[:2] for line in sim.splitlines()[-2:]] == [["0", "0,2"], ["1", "1,3"]]
    import dataclasses

    from pdtool.artifacts.cluster import parse_cluster
    from pdtool.planner import make_plan as plan_for

    profile = chain_profile([1.0] * 4, [1000] * 4, [4000] * 4)
    straight = plan_for(profile, parse_cluster("4x1GB/s"), straight=True, mode="flush")
    assert len(straight.stages) == 4
    chunked = dataclasses.replace(straight, mode="interleaved", stages=tuple(
        dataclasses.replace(stage, ranks=(s % 2,)) for s, stage in enumerate(straight.stages)))
    source = plan_graph(chunked, profile).source
    # stages 0 and 2 (rank 0) share a colour, 1 and 3 (rank 1) another
    assert source.count(f'fillcolor="{STAGE_COLOURS[0]}"') == 2 and source.count(f'fillcolor="{STAGE_COLOURS[1]}"') == 2
    assert "chunk 2 of rank 0" in source and "chunk 1 of rank 1" in source


def test_plans_written_as_pdtool_plan_1_read_as_they_were(tmp_path):
    """Every command reads a plan of the format before (every rank in one stage) as it was."""
    import json

    from click.testing import CliRunner

    from pdtool.artifacts.plan import Plan
    from pdtool.cli import cli

    plan = make_plan([(1.0, 2.0, 1, 0, 4000)] * 2, levels=[(2, 1e9)], mode="flush")
    path = tmp_path / "old.plan.json"
    plan.save(path)
    data = json.loads(path.read_text())
    assert data["schema"] == "pdtool.plan/2"
    data["schema"] = "pdtool.plan/1"
    path.write_text(json.dumps(data))
    assert Plan.load(path).stages == plan.stages
    for command in (["simulate", str(path)], ["show", str(path)]):
        result = CliRunner().invoke(cli, command)
        assert result.exit_code == 0, result.output


def test_a_worker_of_several_stages_needs_the_memory_of_all_its_chunks():
    from pdtool.memory import memory_model

    plan = make_plan([(1.0, 2.0, 1, 1_000_000, 4000)] * 4, levels=[(2, 1e9)], mode="interleaved",
                     ranks=((0,), (1,), (0,), (1,)))
    model = memory_model(None, 1, "fp32", "interleaved", False, False)
    result = simulate(plan, group=4)
    needs = model.per_worker(plan, result)
    one = model.stage_terms(plan.stages[0], 1, 1)
    assert set(needs) == {0, 1} and needs[0] > 2 * one["weights"]  # both chunks' weights, at least


def test_pd_trains_memory_prediction_counts_every_chunk_of_a_worker():
    from pdtool.sim.prediction import planned_memory

    plan = make_plan([(1.0, 2.0, 1, 1_000_000, 4000)] * 4, levels=[(2, 1e9)], mode="interleaved",
                     ranks=((0,), (1,), (0,), (1,)))
    planned = planned_memory(plan, None, 4, "sgd")
    assert set(planned) == {0, 1}
    assert planned[0]["weights"] == 2 * 1_000_000  # stages 0 and 2, one version each


def test_pd_plan_cuts_the_layers_into_chunks_and_places_them():
    """`pd plan --virtual-stages`: the best straight cut into v * p stages, placed as the mode places
    them, predicted by the steady state of one batch on the real workers; faster than the straight
    pipeline of one stage a worker on the shipped GPT."""
    from pathlib import Path

    from pdtool.artifacts.cluster import parse_cluster
    from pdtool.artifacts.profile import Profile
    from pdtool.planner import make_plan as plan_of
    from pdtool.planner.chunks import make_chunked_plan
    from pdtool.sim.steady import steady_state

    profile = Profile.load(Path(__file__).resolve().parents[2] / "profiles" / "gpt-small.profile.json")
    cluster = parse_cluster("4x10GB/s")
    straight = plan_of(profile, cluster, straight=True, mode="flush")
    for mode, shape in (("interleaved", "looped"), ("zbv", "v"), ("dualpipev", "v")):
        plan = make_chunked_plan(profile, cluster, chunks=2, mode=mode)
        assert len(plan.stages) == 8 and plan.placement == make(shape, 8, 4) and plan.used_ranks == (0, 1, 2, 3)
        assert plan.predicted.expected_ms == pytest.approx(steady_state(plan).time_per_minibatch_ms, rel=1e-5)
        assert plan.predicted.expected_ms < straight.predicted.expected_ms
        assert plan.untrainable() is None


@pytest.mark.parametrize("cluster, chunks, mode, message", [
    ("4x10GB/s", 3, "zbv", "mode zbv places 2 stages on each worker in a V; use --virtual-stages 2"),
    ("4x10GB/s", 2, "flush", "which mode 'flush' does not run; use --mode interleaved, zbv or dualpipev"),
    ("4x10GB/s", 16, "interleaved", "the model cannot be cut into 64 stages (16 on each of 4 workers): its 31 layers"),
])
def test_what_pd_plan_cannot_cut_into_chunks_is_one_line(cluster, chunks, mode, message):
    from pathlib import Path

    from pdtool.artifacts.cluster import parse_cluster
    from pdtool.artifacts.profile import Profile
    from pdtool.errors import PlanError
    from pdtool.planner.chunks import make_chunked_plan

    profile = Profile.load(Path(__file__).resolve().parents[2] / "profiles" / "gpt-small.profile.json")
    with pytest.raises(PlanError, match=message.replace("(", r"\(").replace(")", r"\)")):
        make_chunked_plan(profile, parse_cluster(cluster), chunks=chunks, mode=mode)


def test_pd_plan_searches_the_chunks_of_a_mode_of_chunks_without_virtual_stages(tmp_path):
    from pathlib import Path

    from click.testing import CliRunner

    from pdtool.cli import cli

    profile = str(Path(__file__).resolve().parents[2] / "profiles" / "gpt-small.profile.json")
    result = CliRunner().invoke(cli, ["plan", profile, "-c", "4x10GB/s", "--mode", "interleaved",
                                      "-o", str(tmp_path / "p.json")])
    assert result.exit_code == 0, result.stderr
    assert "interleaved v=2" in result.stderr and "interleaved v=4" in result.stderr  # --virtual-stages auto
    made = CliRunner().invoke(cli, ["plan", profile, "-c", "4x10GB/s", "--mode", "zbv", "--virtual-stages", "2",
                                    "-o", str(tmp_path / "q.json")])
    assert made.exit_code == 0 and "8 stages (zbv)" in made.stderr and "family" not in made.stderr


def test_chunks_plan_on_a_cluster_of_two_levels():
    """The cut is made at the slowest link; the steady state charges each message on its own link."""
    from pathlib import Path

    from pdtool.artifacts.cluster import parse_cluster
    from pdtool.artifacts.profile import Profile
    from pdtool.planner.chunks import make_chunked_plan
    from pdtool.sim.steady import steady_state

    profile = Profile.load(Path(__file__).resolve().parents[2] / "profiles" / "gpt-small.profile.json")
    fast = make_chunked_plan(profile, parse_cluster("4x10GB/s,2x10GB/s"), chunks=2, mode="interleaved")
    slow = make_chunked_plan(profile, parse_cluster("4x10GB/s,2x100MB/s"), chunks=2, mode="interleaved")
    assert len(fast.stages) == 16 and fast.used_ranks == tuple(range(8))
    assert slow.predicted.expected_ms == pytest.approx(steady_state(slow).time_per_minibatch_ms, rel=1e-5)
    assert slow.predicted.expected_ms > fast.predicted.expected_ms  # the servers' link is charged


SHIPPED = sorted(Path(__file__).resolve().parents[2].glob("profiles/**/*.profile.json"))


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["interleaved", "zbv", "dualpipev"])
@pytest.mark.parametrize("path", SHIPPED, ids=[p.name.split(".")[0] for p in SHIPPED])
def test_the_steady_state_is_the_event_simulation_on_every_shipped_profile(path, mode):
    """pd plan --virtual-stages 2 on 4 workers at 10 GB/s: the plan's prediction (the steady state of
    one batch) is the event simulation of 8 batches within 2%."""
    from pdtool.artifacts.cluster import parse_cluster
    from pdtool.artifacts.profile import Profile
    from pdtool.errors import PlanError
    from pdtool.planner.chunks import make_chunked_plan

    try:
        plan = make_chunked_plan(Profile.load(path), parse_cluster("4x10GB/s"), chunks=2, mode=mode)
    except PlanError as error:  # a model whose layers cannot fill 8 stages
        assert "cannot be cut into 8 stages" in str(error) or "at most" in str(error)
        return
    group = plan.run().group
    long = simulate(plan, minibatches=8 * group)
    assert plan.predicted.expected_ms == pytest.approx(long.time_per_minibatch_ms, rel=0.02)
