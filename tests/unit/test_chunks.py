"""Several stages (chunks) per worker, the schedule layer (issue 37): placements, Megatron's
interleaved 1F1B generated, lowered (a worker hands the tensors between its own chunks to
itself), validated and simulated, with the bubble of the SC'21 paper's closed form."""
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
@pytest.mark.parametrize("chunks_per_worker", [1, 2, 4])
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


@pytest.mark.parametrize("workers, chunks_per_worker, group", [(2, 2, 4), (4, 2, 8), (4, 4, 8), (3, 2, 6), (4, 1, 8)])
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
