"""The simulator: bubbles, steady state, replicas, transfers, memory, invariants, trace."""
import dataclasses
import json
import math

import pytest

from pdtool.artifacts.cluster import Cluster, Level, parse_cluster
from pdtool.planner.costmodel import Memory
from pdtool.errors import ScheduleError
from pdtool.artifacts.plan import Plan, PlanStage, Prediction, ProfileRef
from pdtool.planner import make_plan
from pdtool.schedule import MODES, copies_per_step, default_group, generate, peak_versions, stash_copies
from pdtool.sim.simulate import allreduce_ms, default_minibatches, link_bandwidth, link_latency, simulate, steady_state_ms
from pdtool.sim.steady import steady_state
from pdtool.views.trace import chrome_trace, write_trace
from test_plan import chain_profile

FAST = ((64, 1e18),)  # one server, transfers take ~0


def make(stages, levels=FAST, mode="pipedream", ranks=None, batch=32):
    """A hand-made plan. `stages`: (fwd_ms, bwd_ms, replicas[, param_bytes[, out_bytes]]) each; one
    layer per stage; in_bytes follow from the previous stage's out_bytes; activation_bytes 1000 * (s + 1)."""
    specs = [tuple(s) + (0, 0)[len(s) - 3:] for s in stages]
    given = list(ranks) if ranks else None
    built, next_rank = [], 0
    for s, (fwd, bwd, r, params, out) in enumerate(specs):
        if given:
            these = tuple(given[s])
        else:
            these, next_rank = tuple(range(next_rank, next_rank + r)), next_rank + r
        built.append(
            PlanStage(layers=(s,), first_name=f"l{s}", last_name=f"l{s}", ranks=these, in_flight=1, fwd_ms=fwd,
                      bwd_ms=bwd, param_bytes=params, in_bytes=specs[s - 1][4] if s else 0,
                      out_bytes=out if s < len(specs) - 1 else 0, activation_bytes=1000 * (s + 1),
                      compute_ms=fwd + bwd, allreduce_ms=0.0, transfer_ms=0.0, time_ms=fwd + bwd, memory_bytes=0)
        )
    return Plan(
        profile=ProfileRef(sha256="0" * 64, fingerprint="f" * 64, model=None, batch_size=batch, layers=len(specs),
                           method="pipedream", granularity="module", depth=None),
        cluster=Cluster(tuple(Level(c, float(bw)) for c, bw in levels)),
        cost_model="pdtool",
        straight=False,
        mode=mode,
        stages=tuple(built),
        groups=(),
        predicted=Prediction(time_ms=max(f + b for f, b, *_ in specs), bottleneck="stage 0 compute",
                             single_worker_ms=1.0, data_parallel_ms=1.0),
        command="",
        pdtool_version="0",
    )


def by_name(result):
    return {(e.rank, e.name): e for e in result.events if e.kind != "U"}


# ----- bubbles and steady state ------------------------------------------------------------------
@pytest.mark.parametrize("mode", ["gpipe", "flush"])
@pytest.mark.parametrize("p, m", [(2, 2), (2, 4), (3, 5), (4, 4), (4, 8), (5, 16)])
def test_one_batch_of_gpipe_or_flush_has_the_textbook_bubble(mode, p, m):
    result = simulate(make([(1.0, 2.0, 1)] * p), mode, minibatches=m, group=m)
    assert result.bubble_fraction == pytest.approx((p - 1) / (m + p - 1))
    assert result.makespan_ms == pytest.approx((m + p - 1) * 3.0)


def test_pipedream_on_equal_stages_fills_the_pipeline():
    plan = make([(1.0, 2.0, 1)] * 4)
    result = simulate(plan, minibatches=200)
    assert result.bubble_fraction < 0.05
    assert result.time_per_minibatch_ms == pytest.approx(3.0)
    assert result.samples_per_s == pytest.approx(32 / 3.0e-3)
    assert simulate(plan, minibatches=400).bubble_fraction < result.bubble_fraction < simulate(
        plan, minibatches=50).bubble_fraction


@pytest.mark.parametrize("slow", [0, 2, 3])
@pytest.mark.parametrize("mode", ["pipedream", "vsync", "2bw"])
def test_the_slowest_stage_sets_the_steady_state(slow, mode):
    stages = [(1.0, 2.0, 1)] * 4
    stages[slow] = (2.0, 4.0, 1)
    result = simulate(make(stages), mode, minibatches=120)
    assert result.time_per_minibatch_ms == pytest.approx(6.0)


def test_flush_pays_fill_and_drain_every_batch():
    result = simulate(make([(1.0, 2.0, 1)] * 4), "flush", minibatches=32, group=8)
    assert result.time_per_minibatch_ms == pytest.approx((8 + 3) * 3.0 / 8)


# ----- replicas and all-reduce -------------------------------------------------------------------
def test_a_replicated_stage_halves_its_time():
    alone = simulate(make([(2.0, 4.0, 1), (1.0, 2.0, 1)]), minibatches=120)
    assert alone.time_per_minibatch_ms == pytest.approx(6.0)
    replicated = simulate(make([(2.0, 4.0, 2), (1.0, 2.0, 1)]), minibatches=120)
    assert replicated.time_per_minibatch_ms == pytest.approx(3.0)
    assert set(replicated.busy_ms) == {0, 1, 2}


def test_all_reduce_takes_a_ring_time_on_finite_bandwidth_and_blocks_the_replicas():
    plan = make([(2.0, 4.0, 2, 4_000_000), (1.0, 2.0, 1)], levels=((4, 1e9),))
    assert allreduce_ms(plan, 0) == pytest.approx(2 * (2 - 1) / 2 * 4e6 / 1e9 * 1e3)  # 4 ms
    assert allreduce_ms(plan, 1) == 0.0
    result = simulate(plan, minibatches=120)
    steps = [e for e in result.events if e.kind == "U" and e.stage == 0]
    assert all(e.end_ms - e.start_ms == pytest.approx(4.0) for e in steps)
    for k in range(10):  # the k-th step of both replicas is one collective
        a, b = [e for e in steps if e.rank == 0][k], [e for e in steps if e.rank == 1][k]
        assert a.start_ms == b.start_ms
    assert result.time_per_minibatch_ms == pytest.approx((6.0 + 4.0) / 2)  # one round of 2 per step
    free = simulate(make([(2.0, 4.0, 2, 4_000_000), (1.0, 2.0, 1)]), minibatches=120)
    assert free.time_per_minibatch_ms == pytest.approx(3.0)


def test_all_reduce_adds_the_workers_own_passes_over_the_gradients_on_replicated_stages_only():
    plan = make([(2.0, 4.0, 2, 4_000_000), (1.0, 2.0, 1)], levels=((4, 1e9),))
    first, second = plan.stages
    plan = dataclasses.replace(plan, stages=(dataclasses.replace(first, reduce_ms=1.5),
                                             dataclasses.replace(second, reduce_ms=1.5)))
    assert allreduce_ms(plan, 0) == pytest.approx(4.0 + 1.5)  # link time + flatten, add, divide
    assert allreduce_ms(plan, 1) == 0.0  # one replica: no all-reduce at all
    assert simulate(plan, minibatches=120).time_per_minibatch_ms == pytest.approx((6.0 + 5.5) / 2)


def test_link_bandwidth_is_that_of_the_level_where_ranks_part():
    plan = make([(1.0, 1.0, 1)], levels=((4, 12e9), (2, 1e9), (2, 1e8)))
    assert link_bandwidth(plan, 0, 3) == 12e9
    assert link_bandwidth(plan, 3, 4) == 1e9
    assert link_bandwidth(plan, 0, 7) == 1e9
    assert link_bandwidth(plan, 1, 9) == 1e8
    assert link_bandwidth(plan, 5, 5) == float("inf")
    wide = make([(1.0, 1.0, 3, 3_000_000)], levels=((2, 1e10), (2, 1e9)), ranks=[(0, 1, 2)])
    assert allreduce_ms(wide, 0) == pytest.approx(2 * 2 / 3 * 3e6 / 1e9 * 1e3)  # the slowest link rules


# ----- transfers ---------------------------------------------------------------------------------
def test_transfers_delay_the_next_stage_and_queue_on_their_link():
    plan = make([(1.0, 2.0, 1, 0, 5_000_000), (1.0, 2.0, 1)], levels=((2, 1e9),))  # 5 ms per message
    result = simulate(plan, "gpipe", minibatches=4, group=4)
    events = by_name(result)
    for b in range(4):  # forwards leave stage 0 every 1 ms, but the link takes 5 ms each, one at a time
        assert events[(1, f"1F{b}")].start_ms == pytest.approx(1.0 + 5.0 * (b + 1))
        assert events[(0, f"0B{b}")].start_ms >= events[(1, f"1B{b}")].end_ms + 5.0 - 1e-9
    first = events[(0, "0B0")]
    assert first.start_ms == pytest.approx(events[(1, "1B0")].end_ms + 5.0)
    sends = [t for t in result.transfers if t.src == 0]
    assert [t.name for t in sends] == ["0F0", "0F1", "0F2", "0F3"] and all(t.bytes == 5_000_000 for t in sends)
    assert all(a.end_ms == pytest.approx(b.start_ms) for a, b in zip(sends, sends[1:]))


def test_latency_delays_each_message_without_holding_its_link():
    plain = make([(1.0, 2.0, 1, 0, 5_000_000), (1.0, 2.0, 1)], levels=((2, 1e9),))  # 5 ms per message
    slow = dataclasses.replace(plain, cluster=Cluster((Level(2, 1e9, 0.003),)))  # + 3 ms one way
    assert link_latency(slow, 0, 1) == 0.003 and link_latency(slow, 1, 1) == 0.0
    events, transfers = by_name(simulate(slow, "gpipe", minibatches=4, group=4)), simulate(slow, "gpipe", 4, 4).transfers
    for b in range(4):  # the link still carries a message every 5 ms; each arrives 3 ms after it leaves the link
        assert events[(1, f"1F{b}")].start_ms == pytest.approx(1.0 + 5.0 * (b + 1) + 3.0)
    assert events[(0, "0B0")].start_ms == pytest.approx(events[(1, "1B0")].end_ms + 5.0 + 3.0)
    sends = [t for t in transfers if t.src == 0]
    assert all(a.end_ms == pytest.approx(b.start_ms) for a, b in zip(sends, sends[1:]))


def test_a_ring_all_reduce_waits_for_the_latency_at_each_of_its_steps():
    plan = make([(2.0, 4.0, 3, 3_000_000)], levels=((3, 1e9),))
    plan = dataclasses.replace(plan, cluster=Cluster((Level(3, 1e9, 1e-4),)))
    assert allreduce_ms(plan, 0) == pytest.approx(2 * 2 / 3 * 3e6 / 1e9 * 1e3 + 2 * 2 * 0.1)


def test_a_slower_level_between_stages_costs_more():
    levels = ((2, 1e10), (2, 1e8))
    near = simulate(make([(1.0, 2.0, 1, 0, 1_000_000), (1.0, 2.0, 1)], levels, ranks=[(0,), (1,)]), minibatches=40)
    far = simulate(make([(1.0, 2.0, 1, 0, 1_000_000), (1.0, 2.0, 1)], levels, ranks=[(0,), (2,)]), minibatches=40)
    assert far.time_per_minibatch_ms > near.time_per_minibatch_ms
    first = by_name(far)
    assert first[(2, "1F0")].start_ms == pytest.approx(1.0 + 1e6 / 1e8 * 1e3)


def with_host_copies(plan, ms_per_mib):
    return dataclasses.replace(plan, profile=dataclasses.replace(plan.profile, message_ms_per_mib=ms_per_mib))


def test_a_message_costs_its_sender_and_a_busy_receiver_the_host_copy_time():
    mib = 2 ** 20
    plan = make([(1.0, 2.0, 1, 0, mib), (2.0, 2.0, 1)])  # 1 MiB of activations and gradients, a free link
    free = by_name(simulate(plan, "gpipe", minibatches=2, group=2))
    assert (free[(0, "0F1")].start_ms, free[(1, "1F0")].start_ms, free[(1, "1F1")].start_ms) == pytest.approx(
        (1.0, 1.0, 3.0))
    copies = by_name(simulate(with_host_copies(plan, 0.25), "gpipe", minibatches=2, group=2))
    assert copies[(0, "0F1")].start_ms == pytest.approx(1.25)  # stage 0 wrote 0F0's 1 MiB before its next forward
    assert copies[(1, "1F0")].start_ms == pytest.approx(1.25)  # there once written; read while stage 1 waited
    assert copies[(1, "1F1")].start_ms == pytest.approx(3.5)   # arrived at 2.5 while 1F0 ran: its read costs 1F1
    assert copies[(1, "1B0")].start_ms == pytest.approx(5.5)   # the last stage's backward: nothing to read
    assert copies[(1, "1B1")].start_ms == pytest.approx(7.5 + 0.25)  # wrote 1B0's input gradient first
    assert copies[(0, "0B0")].start_ms == pytest.approx(7.75)  # stage 0 waited for it: the read is free
    assert copies[(0, "0B1")].start_ms == pytest.approx(10.0)  # written at 10.0; read while 0B0 ran (to 9.75)


def test_host_copies_are_charged_only_as_the_profile_measured_them():
    plan = make([(1.0, 2.0, 1, 0, 2 ** 20), (1.0, 2.0, 1)])
    assert plan.profile.message_ms_per_mib == 0.0  # e.g. PipeDream's graph.txt profiles, GPU profiles
    slower = simulate(with_host_copies(plan, 0.5), minibatches=60).time_per_minibatch_ms
    assert slower == pytest.approx(simulate(plan, minibatches=60).time_per_minibatch_ms + 2 * 0.5)  # a send, a read
    assert simulate(with_host_copies(make([(1.0, 2.0, 1)]), 0.5), minibatches=20).time_per_minibatch_ms == (
        pytest.approx(3.0))  # one stage: no messages


# ----- memory ------------------------------------------------------------------------------------
def test_memory_needs_count_the_versions_and_minibatches_the_schedule_holds():
    from pdtool.planner.costmodel import Memory as PlannerMemory

    plan = make([(1.0, 2.0, 1, 1000), (1.0, 2.0, 1, 1000)])  # activation_bytes 1000 and 2000
    model = PlannerMemory(limit=float("inf"))
    pipedream = model.per_worker(plan, simulate(plan, minibatches=20))
    assert pipedream == {0: model.need(1000, 1000, 2), 1: model.need(1000, 2000, 1)} == {0: 6000, 1: 5000}
    gpipe = PlannerMemory(limit=float("inf"), optimizer_slots=2).per_worker(
        plan, simulate(plan, "gpipe", minibatches=8, group=4)
    )
    assert gpipe == {0: 1000 * (1 + 1 + 2) + 4 * 1000, 1: 1000 * (1 + 1 + 2) + 4 * 2000}


def test_peak_in_flight_is_the_plans_in_flight_under_pipedream():
    plan = make_plan(chain_profile([10.0] * 8, [4e8] * 8, [1e3] * 8), parse_cluster("4x1GB/s"))
    result = simulate(plan)
    assert [result.peak_in_flight[s.ranks[0]] for s in plan.stages] == [s.in_flight for s in plan.stages] == [4, 3, 2, 1]
    assert result.peak_activation_bytes == {s.ranks[0]: s.in_flight * s.activation_bytes for s in plan.stages}


def test_peak_memory_on_replicated_stages_and_versions_come_from_the_schedule():
    plan = make([(2.0, 4.0, 2), (1.0, 2.0, 1)])
    result = simulate(plan, minibatches=20)
    assert result.peak_in_flight == {0: 2, 1: 2, 2: 1} == {
        r: Memory.in_flight(3, 2 * s, st.replicas) for s, st in enumerate(plan.stages) for r in st.ranks}
    assert result.peak_activation_bytes == {0: 2000, 1: 2000, 2: 2000}
    assert result.peak_versions == peak_versions(generate("pipedream", (2, 1), 20))
    gpipe = simulate(make([(1.0, 1.0, 1)] * 2), "gpipe", minibatches=8, group=4)
    assert gpipe.peak_in_flight == {0: 4, 1: 4}


# ----- invariants --------------------------------------------------------------------------------
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("replicas, ranks", [
    ((1, 1, 1, 1), [(3,), (1,), (0,), (2,)]),
    ((2, 1), [(2, 0), (1,)]),
    ((1, 2, 1), [(0,), (1, 2), (3,)]),
])
def test_every_action_runs_once_without_overlap_and_after_its_inputs(mode, replicas, ranks):
    stages = [(1.0 + s, 2.0, r, 1_000_000, 2_000_000) for s, r in enumerate(replicas)]
    plan = make(stages, levels=((2, 1e10), (2, 1e9)), mode=mode, ranks=ranks)
    result = simulate(plan)
    group = 1 if mode in ("pipedream", "vsync") else default_group(replicas)
    schedule = generate(mode, replicas, result.minibatches, group)
    assert result.mode == mode and result.group == group and result.minibatches == default_minibatches(sum(replicas), group)
    expected = sorted((plan.stages[s].ranks[i], str(a)) for w, acts in enumerate(schedule.workers)
                      for a in acts for s, i in [schedule.position(w)] if a.kind != "U")
    assert sorted((e.rank, e.name) for e in result.events if e.kind != "U") == expected
    for rank in result.busy_ms:
        mine = sorted((e.start_ms, e.end_ms) for e in result.events if e.rank == rank)
        assert all(a[1] <= b[0] + 1e-9 for a, b in zip(mine, mine[1:]))
    ends = {(e.kind, e.stage, e.minibatch): e for e in result.events if e.kind != "U"}
    for (kind, s, b), e in ends.items():
        if kind == "F" and s > 0:
            assert e.start_ms >= ends[("F", s - 1, b)].end_ms + 2e6 / 1e10 * 1e3 - 1e-9
        if kind == "B" and s < len(replicas) - 1:
            assert e.start_ms >= ends[("B", s + 1, b)].end_ms + 2e6 / 1e10 * 1e3 - 1e-9
        if kind == "B":
            assert e.start_ms >= ends[("F", s, b)].end_ms - 1e-9
    assert result.makespan_ms == pytest.approx(max(e.end_ms for e in result.events))
    acting = sum(result.busy_ms.values()) + sum(e.end_ms - e.start_ms for e in result.events if e.kind == "U")
    assert result.bubble_fraction == pytest.approx(1 - acting / (len(result.busy_ms) * result.makespan_ms))
    assert set(result.peak_versions) == set(result.peak_in_flight) == {r for rs in ranks for r in rs}
    # without its events and transfers (the planner's ranking), every figure is the same
    assert simulate(plan, events=False) == dataclasses.replace(result, events=(), transfers=())
    assert result.events and result.transfers


# ----- defaults and errors -----------------------------------------------------------------------
def test_defaults_come_from_the_plan_and_the_schedule():
    plan = make([(1.0, 2.0, 1)] * 3, mode="flush")
    result = simulate(plan)
    assert (result.mode, result.group, result.minibatches) == ("flush", 3, 48)
    assert default_minibatches(4, 1) == 64 and default_minibatches(4, 24) == 96 and default_minibatches(3, 5) == 50
    assert simulate(plan, "gpipe", group=5).minibatches == 50


@pytest.mark.parametrize("kwargs, fragment", [
    ({"mode": "nope"}, "unknown schedule mode 'nope'"),
    ({"minibatches": 0}, "minibatches=0"),
    ({"group": 2}, "group=2 does not apply to mode 'pipedream'"),
    ({"mode": "2bw", "group": 2}, "group=2 is too small for mode '2bw'"),
    ({"mode": "flush", "minibatches": 10}, "not a multiple of group=4"),
    ({"mode": "gpipe", "group": 0}, "group=0"),
])
def test_bad_parameters_are_one_schedule_error(kwargs, fragment):
    with pytest.raises(ScheduleError, match=fragment) as info:
        simulate(make([(1.0, 2.0, 1)] * 4), **kwargs)
    assert "\n" not in str(info.value)


def test_steady_state_estimator():
    assert steady_state_ms({b: 3.0 * b + 10 for b in range(20)}, 20) == pytest.approx(3.0)
    # a staircase of 4 finishing together every 8 ms is 2 ms per minibatch when sampled by rounds
    assert steady_state_ms({b: 8.0 * (b // 4 + 1) for b in range(40)}, 40, period=4) == pytest.approx(2.0)
    # the drain (last minibatches finishing faster) is left out
    times = {b: 3.0 * b for b in range(30)} | {b: 87.0 + (b - 29) for b in range(30, 34)}
    assert steady_state_ms(times, 34, tail=4) == pytest.approx(3.0)
    assert steady_state_ms({0: 5.0}, 1) == 5.0  # a single period: the average, fill included


# ----- trace -------------------------------------------------------------------------------------
def test_chrome_trace_has_a_named_track_per_rank_and_the_actions(tmp_path):
    plan = make([(1.0, 2.0, 2, 1000, 1_000_000), (1.0, 2.0, 1)], levels=((4, 1e9),), ranks=[(1, 2), (0,)])
    result = simulate(plan, minibatches=8)
    trace = chrome_trace(result, plan)
    json.dumps(trace, allow_nan=False)
    names = {e["tid"]: e["args"]["name"] for e in trace["traceEvents"] if e["name"] == "thread_name" and e["pid"] == 0}
    assert names == {1: "rank 1: stage 0 replica 0", 2: "rank 2: stage 0 replica 1", 0: "rank 0: stage 1 replica 0"}
    actions = [e for e in trace["traceEvents"] if e["ph"] == "X" and e["pid"] == 0]
    assert sorted((e["tid"], e["name"]) for e in actions) == sorted((e.rank, e.name) for e in result.events)
    assert {"0F3", "1B3", "0U", "1U"} <= {e["name"] for e in actions}
    f3 = next(e for e in actions if e["name"] == "1F3")
    assert f3["ts"] == pytest.approx(by_name(result)[(0, "1F3")].start_ms * 1e3) and f3["dur"] == pytest.approx(1e3)
    assert trace["displayTimeUnit"] == "ms"
    assert trace["otherData"]["mode"] == "pipedream" and trace["otherData"]["minibatches"] == 8
    assert trace["otherData"]["predicted_time_per_minibatch_ms"] == result.time_per_minibatch_ms
    sends = [e for e in trace["traceEvents"] if e["ph"] == "X" and e["pid"] == 1]
    assert len(sends) == len(result.transfers) > 0
    out = tmp_path / "t.json"
    write_trace(out, trace)
    assert json.loads(out.read_text()) == json.loads(json.dumps(trace))


def test_optimizer_steps_and_data_making_are_charged():
    import dataclasses

    plan = make([(1.0, 2.0, 1), (1.0, 2.0, 1)])
    first, second = plan.stages
    plan = dataclasses.replace(plan, stages=(dataclasses.replace(first, update_ms=0.5, data_ms=0.25),
                                             dataclasses.replace(second, update_ms=0.5)))
    result = simulate(plan, minibatches=200)
    assert result.time_per_minibatch_ms == pytest.approx(3.0 + 0.5 + 0.25)  # stage 0 is the slower one now
    steps = [e for e in result.events if e.kind == "U"]
    assert steps and all(e.end_ms - e.start_ms == pytest.approx(0.5) for e in steps)


def test_the_parting_levels_of_a_rank_set_are_those_of_its_pairs():
    import random

    from pdtool.sim.simulate import _parting_level, _parting_levels

    rng = random.Random(0)
    plan = make_plan(chain_profile([1.0] * 4, [1000] * 4, [10] * 4), parse_cluster("4x10GB/s,3x1GB/s,2x100MB/s"),
                     simulate=False)
    for _ in range(200):
        ranks = rng.sample(range(24), rng.randint(2, 6))
        pairs = {id(_parting_level(plan, x, y)) for x in ranks for y in ranks if x != y}
        assert {id(level) for level in _parting_levels(plan, ranks)} == pairs, ranks


def test_weight_stashings_copies_are_charged_to_the_steps_before_which_the_runtime_copies():
    """A stage that holds a minibatch across its step (pipedream's stage 0 of 2) copies its
    weights once per step, the last stage never (its minibatches are done before their step), the
    flushing modes never: the profile's `copy_ms_per_mib` times the stage's parameters, added to
    the step; the steady state agrees."""
    mib = 2 ** 20
    plan = make([(1.0, 2.0, 1, 4 * mib), (1.0, 2.0, 1, 4 * mib)])
    copying = dataclasses.replace(plan, profile=dataclasses.replace(plan.profile, copy_ms_per_mib=0.125))
    before = simulate(plan, minibatches=200)
    after = simulate(copying, minibatches=200)
    assert after.time_per_minibatch_ms == pytest.approx(before.time_per_minibatch_ms + 4 * 0.125)  # stage 0's copy
    steps = {rank: sorted({round(e.end_ms - e.start_ms, 6) for e in after.events[200:-200] if e.kind == "U" and
                           e.rank == rank}) for rank in (0, 1)}
    assert steps == {0: [0.5], 1: [0.0]}
    assert steady_state(copying).time_per_minibatch_ms == pytest.approx(after.time_per_minibatch_ms, rel=1e-3)
    assert simulate(copying, "flush", minibatches=64, group=8).time_per_minibatch_ms == pytest.approx(
        simulate(plan, "flush", minibatches=64, group=8).time_per_minibatch_ms)


@pytest.mark.parametrize("mode", ["pipedream", "vsync", "2bw", "flush"])
@pytest.mark.parametrize("replicas", [(1,), (1, 1), (1, 1, 1, 1), (2, 1), (1, 2), (3, 1, 2), (8, 6, 2)])
def test_the_steady_states_copies_per_step_are_the_schedules(mode, replicas):
    """`copies_per_step` (the steady state's rule) against `stash_copies` (what the runtime copies
    and the simulator charges) on a long schedule: the same share of every stage's steps, up to
    the warm-up and drain."""
    whole = math.lcm(*replicas)  # every replica steps after whole minibatches of its own
    group = -(-default_group(replicas) // whole) * whole if mode == "2bw" else 8 if mode == "flush" else None
    schedule = generate(mode, replicas, 96 * max(replicas), group=group)
    table = schedule.versions()
    for stage in range(len(replicas)):
        actions = schedule.workers[schedule.rank(stage, 0)]
        steps = sum(1 for a in actions if a.kind == "U" and a.stage == stage)
        copies = len(stash_copies(table, actions, stage))
        assert abs(copies - copies_per_step(mode, replicas, stage) * steps) <= len(replicas) + 1, (stage, copies, steps)
