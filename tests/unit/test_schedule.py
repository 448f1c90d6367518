"""Schedules: generation per mode, text form, validator, weight versions."""
import dataclasses
import math

import pytest

from pdtool.errors import ScheduleError
from pdtool.schedule import (
    FLUSH_MODES, MODES, SPLIT_MODES, Action, Schedule, default_group, generate, peak_versions, stash_depth, validate,
    warmup_forwards,
)

PATTERNS = [(1,), (2,), (1, 1), (2, 1), (1, 2), (3, 1), (2, 2), (1, 1, 1), (1, 1, 1, 1), (2, 1, 1)]


def lines(schedule: Schedule) -> list[str]:
    """Every worker's actions as one string, e.g. "0F0 0F1 0B0 0U"."""
    return [" ".join(map(str, actions)) for actions in schedule.workers]


def edit(schedule: Schedule, rank: int, text: str) -> Schedule:
    """`schedule` with worker `rank`'s actions replaced by `text`."""
    workers = list(schedule.workers)
    workers[rank] = tuple(Action.parse(a) for a in text.split())
    return dataclasses.replace(schedule, workers=tuple(workers))


def forward_versions(schedule: Schedule, stage: int) -> list[int]:
    table = schedule.versions()
    return [table[("F", stage, b)] for b in range(schedule.minibatches)]


# ----- actions and text ------------------------------------------------------------------------
@pytest.mark.parametrize("text, action", [
    ("0F3", Action("F", 0, 3)), ("1B3", Action("B", 1, 3)), ("1W3", Action("W", 1, 3)), ("0U", Action("U", 0)), ("12F105", Action("F", 12, 105)),
])
def test_action_text_round_trip(text, action):
    assert Action.parse(text) == action
    assert str(action) == text


@pytest.mark.parametrize("text", ["", "F3", "0X3", "0F", "0U3", "-1F2", "0 F3", "0f3", "1B3x"])
def test_action_parse_rejects_bad_text(text):
    with pytest.raises(ScheduleError, match=r"bad action .*expected <stage>F<minibatch>.*e\.g\. 0F3, 1B3, 1W3, 0U"):
        Action.parse(text)


def test_action_rejects_bad_fields():
    with pytest.raises(ScheduleError, match="kind 'X' is unknown"):
        Action("X", 0, 1)
    with pytest.raises(ScheduleError, match="takes no minibatch"):
        Action("U", 0, 1)
    with pytest.raises(ScheduleError, match="needs a minibatch index"):
        Action("F", 0)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("replicas", [(1, 1, 1, 1), (3, 1), (2,)])
def test_schedule_text_round_trip(mode, replicas):
    schedule = generate(mode, replicas, 12 if mode in ("pipedream", "vsync") else 4 * default_group(replicas))
    text = schedule.to_text()
    assert Schedule.from_text(text) == schedule
    assert text.splitlines()[0] == (f"schedule mode={mode} replicas={','.join(map(str, replicas))} "
                                    f"minibatches={schedule.minibatches} group={schedule.group}")
    assert text.splitlines()[1].startswith("w0 s0r0: 0F0 ")


@pytest.mark.parametrize("text, message", [
    ("", "schedule text is empty"),
    ("plan mode=flush replicas=1 minibatches=1 group=1\nw0 s0r0: 0F0 0B0 0U", "line 1: expected 'schedule mode="),
    ("schedule mode=flush replicas=1 minibatches=1\nw0 s0r0: 0F0 0B0 0U", "line 1: expected 'schedule mode="),
    ("schedule mode=flush replicas=a minibatches=1 group=1\nw0 s0r0: 0F0 0B0 0U", "must be integers"),
    ("schedule mode=flush replicas=1 minibatches=1 group=1\nw0 s0: 0F0 0B0 0U", r"line 2: expected 'w<rank>"),
    ("schedule mode=flush replicas=1,1 minibatches=1 group=1\nw1 s0r0: 0F0 0B0 0U", "w1 out of order"),
    ("schedule mode=flush replicas=2 minibatches=2 group=2\nw0 s0r0: 0F0 0B0 0U\nw1 s1r0: 0F1 0B1 0U",
     r"line 3: w1 is w1 s0r1 for replicas \(2,\), not s1r0"),
    ("schedule mode=flush replicas=1 minibatches=1 group=1\nw0 s0r0: 0F0 0Q0 0U", "bad action '0Q0'"),
    ("schedule mode=flush replicas=1,1 minibatches=1 group=1\nw0 s0r0: 0F0 0B0 0U", "has 1 workers but .* need 2"),
])
def test_from_text_rejects_bad_text(text, message):
    with pytest.raises(ScheduleError, match=message):
        Schedule.from_text(text)


def test_ranks_are_stage_major():
    schedule = generate("pipedream", (2, 1, 3), 6)
    assert [schedule.position(r) for r in range(6)] == [(0, 0), (0, 1), (1, 0), (2, 0), (2, 1), (2, 2)]
    assert [schedule.rank(*schedule.position(r)) for r in range(6)] == list(range(6))
    assert [schedule.replica_of(2, b) for b in range(6)] == [0, 1, 2, 0, 1, 2]
    with pytest.raises(ScheduleError, match="no worker s1r1"):
        schedule.rank(1, 1)
    with pytest.raises(ScheduleError, match="rank 6 is out of range"):
        schedule.position(6)


# ----- exact schedules -------------------------------------------------------------------------
def test_pipedream_straight_four_stages():
    assert lines(generate("pipedream", (1, 1, 1, 1), 8)) == [
        "0F0 0F1 0F2 0F3 0B0 0U 0F4 0B1 0U 0F5 0B2 0U 0F6 0B3 0U 0F7 0B4 0U 0B5 0U 0B6 0U 0B7 0U",
        "1F0 1F1 1F2 1B0 1U 1F3 1B1 1U 1F4 1B2 1U 1F5 1B3 1U 1F6 1B4 1U 1F7 1B5 1U 1B6 1U 1B7 1U",
        "2F0 2F1 2B0 2U 2F2 2B1 2U 2F3 2B2 2U 2F4 2B3 2U 2F5 2B4 2U 2F6 2B5 2U 2F7 2B6 2U 2B7 2U",
        "3F0 3B0 3U 3F1 3B1 3U 3F2 3B2 3U 3F3 3B3 3U 3F4 3B4 3U 3F5 3B5 3U 3F6 3B6 3U 3F7 3B7 3U",
    ]


def test_pipedream_replicated_three_one():
    # Stage 0 steps once per round of 3 minibatches (0-2, 3-5, 6-7); replica 2 has no minibatch
    # in the last, partial round and joins its all-reduce with a final U.
    assert lines(generate("pipedream", (3, 1), 8)) == [
        "0F0 0F3 0B0 0U 0F6 0B3 0U 0B6 0U",
        "0F1 0F4 0B1 0U 0F7 0B4 0U 0B7 0U",
        "0F2 0F5 0B2 0U 0B5 0U 0U",
        "1F0 1B0 1U 1F1 1B1 1U 1F2 1B2 1U 1F3 1B3 1U 1F4 1B4 1U 1F5 1B5 1U 1F6 1B6 1U 1F7 1B7 1U",
    ]


def test_gpipe_and_flush_two_stages_four_microbatches():
    assert lines(generate("gpipe", (1, 1), 4, group=4)) == [
        "0F0 0F1 0F2 0F3 0B0 0B1 0B2 0B3 0U",
        "1F0 1F1 1F2 1F3 1B0 1B1 1B2 1B3 1U",
    ]
    assert lines(generate("flush", (1, 1), 4, group=4)) == [
        "0F0 0F1 0B0 0F2 0B1 0F3 0B2 0B3 0U",
        "1F0 1B0 1F1 1B1 1F2 1B2 1F3 1B3 1U",
    ]
    assert lines(generate("flush", (1, 1), 8, group=4))[1] == (
        "1F0 1B0 1F1 1B1 1F2 1B2 1F3 1B3 1U 1F4 1B4 1F5 1B5 1F6 1B6 1F7 1B7 1U")


def test_2bw_steps_every_group():
    assert lines(generate("2bw", (1, 1), 6, group=2)) == [
        "0F0 0F1 0B0 0F2 0B1 0U 0F3 0B2 0F4 0B3 0U 0F5 0B4 0B5 0U",
        "1F0 1B0 1F1 1B1 1U 1F2 1B2 1F3 1B3 1U 1F4 1B4 1F5 1B5 1U",
    ]


@pytest.mark.parametrize("replicas, expected", [((1, 1, 1, 1), [3, 2, 1, 0]), ((3, 1), [1, 0]), ((1, 2), [2, 0]),
                                                ((2, 2), [1, 0]), ((2,), [0])])
def test_warmup_counts(replicas, expected):
    assert [warmup_forwards(replicas, s) for s in range(len(replicas))] == expected
    schedule = generate("pipedream", replicas, 24)
    for rank, actions in enumerate(schedule.workers):
        kinds = [a.kind for a in actions]
        assert kinds.index("B") == expected[schedule.position(rank)[0]] + 1  # warm-up, then one F, then B


# ----- the validator ---------------------------------------------------------------------------
def _grid():
    for replicas in PATTERNS:
        for mode in MODES:
            groups = [1] if mode in ("pipedream", "vsync") else {default_group(replicas), default_group(replicas) + 1}
            if mode in FLUSH_MODES:
                groups |= {1, 2}
            for group in sorted(groups):
                for minibatches in range(1, 13):
                    if mode in ("pipedream", "vsync") or minibatches % group == 0:
                        yield mode, replicas, minibatches, group


def test_validator_accepts_every_generated_schedule():
    count = 0
    for mode, replicas, minibatches, group in _grid():
        schedule = generate(mode, replicas, minibatches, group)
        validate(schedule)
        table = schedule.versions()
        assert all(table[("B", s, b)] == table[("F", s, b)] for s in range(len(replicas)) for b in range(minibatches))
        if mode in SPLIT_MODES:
            assert all(table[("W", s, b)] == table[("F", s, b)] for s in range(len(replicas)) for b in range(minibatches))
        if mode == "2bw":
            assert max(peak_versions(schedule).values()) <= 2, (replicas, minibatches, group)
        count += 1
    assert count > 600


def test_generate_rejects_bad_parameters():
    cases = [
        (("sync", (1, 1), 4), "unknown schedule mode 'sync'; use one of pipedream, vsync, 2bw, flush, gpipe"),
        (("pipedream", (), 4), r"replicas \(\) is empty"),
        (("pipedream", (1, 0), 4), r"replicas \(1, 0\): stage 1 has 0 replicas"),
        (("pipedream", (1, 1), 0), "minibatches=0; the run needs"),
        (("pipedream", (1, 1), 4, 2), "group=2 does not apply to mode 'pipedream'"),
        (("flush", (1, 1), 4, 0), "group=0"),
        (("2bw", (1, 1, 1), 6, 2), "group=2 is too small for mode '2bw' .* pass group >= 3"),
        (("2bw", (3, 1), 4, 2), r"group=2 is too small for mode '2bw' on replicas \(3, 1\).* pass group >= 3"),
        (("flush", (1, 1), 10, 4), "minibatches=10 is not a multiple of group=4 for mode 'flush'.* use 8 or 12"),
        (("gpipe", (1, 1), 3, 4), "minibatches=3 is not a multiple of group=4 .* use 4,"),
    ]
    for args, message in cases:
        with pytest.raises(ScheduleError, match=message):
            generate(*args)


def test_default_group():
    assert generate("flush", (1, 1, 1), 6).group == 3
    assert default_group((3, 1)) == 3 and default_group((1, 2)) == 2 and default_group((2,)) == 1


PD2 = generate("pipedream", (1, 1), 4)  # 0F0 0F1 0B0 0U 0F2 0B1 0U 0F3 0B2 0U 0B3 0U / 1F0 1B0 1U ...


@pytest.mark.parametrize("schedule, message", [
    (edit(PD2, 1, "1F0 1B0 1U 1F1 1B1 1U 1F2 1B2 1U 1F3 1U"),
     r"^w1 s1r0: the backward 1B3 of minibatch 3 is missing"),
    (edit(PD2, 1, "1F0 1B0 1U 1B1 1F1 1U 1F2 1B2 1U 1F3 1B3 1U"),
     r"^w1 s1r0: 1B1 \(action 3\) comes before its forward 1F1 \(action 4\); run the forward first$"),
    (edit(PD2, 0, "0F0 0F1 0B0 0U 0F2 0B1 0U 0F2 0F3 0B2 0U 0B3 0U"),
     r"^w0 s0r0: 0F2 appears twice \(actions 4 and 7\)"),
    (edit(PD2, 1, "1F0 1F1 1B0 1U 1B1 1U 1F2 1B2 1U 1F3 1B3 1U"),
     r"^w1 s1r0: 2 minibatches in flight after 1F1 \(0, 1\), but mode 'pipedream' lets stage 1 hold at most 1"),
    (edit(PD2, 1, "1F0 1B0 1F1 1B1 1U 1U 1F2 1B2 1U 1F3 1B3 1U"),
     r"^w1 s1r0: 1B1 comes after 0 optimizer steps, but minibatch 1 belongs to step group 1"),
    (edit(PD2, 1, "1F0 1B0 1U 1F1 1B1 1U 1F2 1B2 1U 1F3 1B3"),
     r"^w1 s1r0: 3 optimizer steps, but mode 'pipedream' with 4 minibatches, 1 per step on stage 1, needs 4"),
    (edit(PD2, 1, "1F0 1B0 1U 1F1 1B1 1U 1F2 1B2 1U 0F3 1B3 1U"),
     r"^w1 s1r0: 0F3 is an action of stage 0, but this worker runs stage 1"),
    (edit(PD2, 1, "1F0 1B0 1U 1F1 1B1 1U 1F2 1B2 1U 1F3 1B3 1U 1F4 1B4 1U"),
     r"^w1 s1r0: 1F4 names minibatch 4, but the run has 4 \(0\.\.3\)"),
])
def test_validator_rejects_broken_schedules(schedule, message):
    with pytest.raises(ScheduleError, match=message) as info:
        validate(schedule)
    assert "\n" not in str(info.value)


def test_validator_rejects_wrong_replica():
    base = generate("pipedream", (2, 1), 4)  # w0 runs 0 and 2, w1 runs 1 and 3
    broken = edit(edit(base, 0, " ".join(map(str, base.workers[1]))), 1, " ".join(map(str, base.workers[0])))
    with pytest.raises(ScheduleError, match=r"^w0 s0r0: 0F1 runs on replica 0 of stage 0, but minibatch 1 belongs to "
                                            r"replica 1 \(1 mod 2\); move it to w1 s0r1$"):
        validate(broken)


def test_validator_rejects_unequal_steps_of_replicas():
    base = generate("pipedream", (2, 1), 4)
    broken = edit(base, 1, "0F1 0F3 0B1 0U 0B3")
    with pytest.raises(ScheduleError, match=r"^w1 s0r1: 1 optimizer steps, but w0 s0r0 has 2; the replicas of stage 0 "
                                            "all-reduce and step together"):
        validate(broken)


def test_validator_reports_deadlock():
    # Stage 1 starts with the forward of 1, which stage 0 only runs after the backward of 0,
    # which needs stage 1's backward of 0: a cycle, with every stash depth respected.
    base = generate("pipedream", (1, 1, 1), 3)
    broken = edit(edit(base, 0, "0F0 0B0 0U 0F1 0B1 0U 0F2 0B2 0U"), 1, "1F1 1F0 1B0 1U 1B1 1U 1F2 1B2 1U")
    with pytest.raises(ScheduleError, match=r"^deadlock after 1 of 27 actions: w0 s0r0 at 0B0 waits for 1B0; "
                                            r"w1 s1r0 at 1F1 waits for 0F1; w2 s2r0 at 2F0 waits for 1F0; reorder"):
        validate(broken)


def test_validator_reports_deadlock_at_a_collective_step():
    # Replica 1 of stage 1 wants the forward of 5 (batch 1) before its backward of 3 and the
    # batch-0 all-reduce; stage 0 runs that forward only after the backward of 3.
    base = generate("gpipe", (1, 2), 8, group=4)
    assert lines(base)[2] == "1F1 1F3 1B1 1B3 1U 1F5 1F7 1B5 1B7 1U"
    broken = edit(base, 2, "1F1 1F3 1B1 1F5 1B3 1U 1F7 1B5 1B7 1U")
    with pytest.raises(ScheduleError, match=r"^deadlock after 14 of 38 actions: w0 s0r0 at 0B3 waits for 1B3; "
                                            r"w1 s1r0 at 1U waits for the other replicas' step 1; "
                                            r"w2 s1r1 at 1F5 waits for 0F5; reorder"):
        validate(broken)


def test_validator_accepts_hand_written_gpipe_with_backwards_in_reverse():
    text = ("schedule mode=gpipe replicas=1,1 minibatches=4 group=2\n"
            "w0 s0r0: 0F0 0F1 0B1 0B0 0U 0F2 0F3 0B3 0B2 0U\n"
            "w1 s1r0: 1F0 1F1 1B1 1B0 1U 1F2 1F3 1B3 1B2 1U\n")
    validate(Schedule.from_text(text))


def test_validator_rejects_flush_forward_on_the_old_version():
    base = generate("flush", (1, 1), 4, group=2)
    assert lines(base)[0] == "0F0 0F1 0B0 0B1 0U 0F2 0F3 0B2 0B3 0U"
    broken = edit(base, 0, "0F0 0F1 0B0 0B1 0F2 0U 0F3 0B2 0B3 0U")
    with pytest.raises(ScheduleError, match=r"^w0 s0r0: 0F2 runs on version 0, but mode 'flush' runs batch 1 "
                                            r"\(microbatches 2\.\.3\) on version 1"):
        validate(broken)


# ----- weight versions -------------------------------------------------------------------------
def test_pipedream_versions_table():
    # Stage s of a d-stage pipeline runs b on version b - (d - 1 - s): the updates of all but the
    # minibatches still in flight downstream (PipeDream SOSP'19 section 3.3).
    schedule = generate("pipedream", (1, 1, 1), 5)
    assert [forward_versions(schedule, s) for s in range(3)] == [
        [0, 0, 0, 1, 2],
        [0, 0, 1, 2, 3],
        [0, 1, 2, 3, 4],
    ]
    table = schedule.versions()
    assert all(table[("B", s, b)] == table[("F", s, b)] for s in range(3) for b in range(5))
    big = generate("pipedream", (1, 1, 1, 1), 12)
    for s in range(4):
        assert forward_versions(big, s) == [max(0, b - (3 - s)) for b in range(12)]


def test_pipedream_versions_on_replicated_stage():
    schedule = generate("pipedream", (3, 1), 8)
    # each replica has two minibatches in flight before the round-0 all-reduce: 0..5 on version 0
    assert forward_versions(schedule, 0) == [0, 0, 0, 0, 0, 0, 1, 1]
    assert forward_versions(schedule, 1) == list(range(8))


@pytest.mark.parametrize("replicas", [(1, 1, 1), (1, 1, 1, 1), (2, 1), (3, 1), (1, 2), (2, 1, 1)])
def test_vsync_every_stage_sees_the_same_staleness(replicas):
    schedule = generate("vsync", replicas, 12)
    table = schedule.versions()
    for b in range(12):
        # k: the minibatches whose updates stage 0's version of b holds (r_0 per step); every
        # stage runs b on its newest version holding no update from a minibatch >= k.
        k = min(12, table[("F", 0, b)] * replicas[0])
        for s, r in enumerate(replicas):
            assert table[("F", s, b)] * r <= k < (table[("F", s, b)] + 1) * r, (b, s, k)
    straight = generate("vsync", (1, 1, 1), 5)
    assert [forward_versions(straight, s) for s in range(3)] == [[0, 0, 0, 1, 2]] * 3


@pytest.mark.parametrize("mode", FLUSH_MODES)
def test_flush_and_gpipe_run_batch_t_on_version_t(mode):
    for replicas in [(1, 1, 1), (2, 1), (1, 2)]:
        schedule = generate(mode, replicas, 12, group=3)
        for s in range(len(replicas)):
            assert forward_versions(schedule, s) == [b // 3 for b in range(12)]
        assert set(peak_versions(schedule).values()) == {1}


def test_2bw_versions_change_every_group_with_one_step_delay():
    # arXiv 2006.09503 section 3.1: batch t (microbatches 3t..3t+2) runs on W(t-1) at every stage.
    schedule = generate("2bw", (1, 1, 1), 12, group=3)
    for s in range(3):
        assert forward_versions(schedule, s) == [max(0, b // 3 - 1) for b in range(12)]
    assert peak_versions(schedule) == {0: 2, 1: 2, 2: 2}
    for actions in schedule.workers:  # in flight on a worker: never more than two versions
        table, flight = schedule.versions(), set()
        for action in actions:
            if action.kind == "F":
                flight.add(action.minibatch)
            elif action.kind == "B":
                flight.discard(action.minibatch)
            assert len({table[("F", action.stage, b)] for b in flight}) <= 2


def test_peak_versions():
    assert peak_versions(generate("pipedream", (1, 1, 1, 1), 8)) == {0: 4, 1: 3, 2: 2, 3: 1}
    assert peak_versions(generate("pipedream", (1, 1, 1, 1), 2)) == {0: 2, 1: 2, 2: 2, 3: 1}
    assert peak_versions(generate("vsync", (1, 1, 1, 1), 8)) == {0: 4, 1: 4, 2: 4, 3: 4}
    assert peak_versions(generate("pipedream", (3, 1), 8)) == {0: 2, 1: 2, 2: 2, 3: 1}
    assert peak_versions(generate("flush", (1, 1), 4)) == {0: 1, 1: 1}


def test_stash_depth():
    straight = generate("pipedream", (1, 1, 1, 1), 8)
    assert [stash_depth(straight, s) for s in range(4)] == [4, 3, 2, 1]
    short = generate("pipedream", (1, 1, 1, 1), 2)
    assert [stash_depth(short, s) for s in range(4)] == [2, 2, 2, 1]
    assert [stash_depth(generate("pipedream", (3, 1), 8), s) for s in range(2)] == [2, 1]
    assert [stash_depth(generate("flush", (1, 1), 8, group=4), s) for s in range(2)] == [2, 1]
    assert [stash_depth(generate("gpipe", (1, 1), 8, group=4), s) for s in range(2)] == [4, 4]
    assert [stash_depth(generate("gpipe", (2, 1), 8, group=4), s) for s in range(2)] == [2, 4]
    assert [stash_depth(generate("2bw", (1, 1, 1), 6), s) for s in range(3)] == [3, 2, 1]
    with pytest.raises(ScheduleError, match="stage 4 is out of range"):
        stash_depth(straight, 4)


def test_validator_rejects_messages_received_out_of_order():
    # Sound for gloo (tags), not for NCCL, which matches messages between two ranks by order.
    text = ("schedule mode=gpipe replicas=1,1 minibatches=4 group=2\n"
            "w0 s0r0: 0F0 0F1 0B0 0B1 0U 0F2 0F3 0B2 0B3 0U\n"
            "w1 s1r0: 1F0 1F1 1B1 1B0 1U 1F2 1F3 1B2 1B3 1U\n")
    with pytest.raises(ScheduleError, match=r"^w0 s0r0 receives the gradients of w1 s1r0 in the order \[0, 1, 2, 3\] "
                                            r"but they are sent in the order \[1, 0, 2, 3\]; order the B actions"):
        validate(Schedule.from_text(text))


def test_zb_splits_every_backward_and_keeps_the_later_stages_ws_for_the_drain():
    """ZB-H1 on 4 stages, one batch of 4: stage s runs a W after each B from its (s+1)-th B on,
    the rest at the end of the batch; every W follows its B, and the step follows every W."""
    schedule = generate("zb", (1, 1, 1, 1), 4)
    validate(schedule)
    assert [str(a) for a in schedule.workers[0]] == "0F0 0F1 0F2 0F3 0B0 0W0 0B1 0W1 0B2 0W2 0B3 0W3 0U".split()
    assert [str(a) for a in schedule.workers[3]] == "3F0 3B0 3F1 3B1 3F2 3B2 3F3 3B3 3W0 3W1 3W2 3W3 3U".split()
    assert [stash_depth(schedule, s) for s in range(4)] == [4, 4, 4, 4]  # held from F to W: warm-up + 1 + lag


def test_zb2_doubles_the_warm_up_and_the_lag_to_fill_the_start_of_a_batch_too():
    """ZB-H2 on 2 stages, batches of 4: stage 0 runs 3 forwards before its first backward (zb: 2),
    stage 1 keeps 2 Ws back (zb: 1); both hold 2p - 1 = 3 minibatches (zb: p = 2)."""
    h1, h2 = generate("zb", (1, 1), 8, 4), generate("zb2", (1, 1), 8, 4)
    validate(h2)
    assert [str(a) for a in h1.workers[1][:13]] == "1F0 1B0 1F1 1B1 1W0 1F2 1B2 1W1 1F3 1B3 1W2 1W3 1U".split()
    assert [str(a) for a in h2.workers[0][:13]] == "0F0 0F1 0F2 0B0 0W0 0F3 0B1 0W1 0B2 0W2 0B3 0W3 0U".split()
    assert [str(a) for a in h2.workers[1][:13]] == "1F0 1B0 1F1 1B1 1F2 1B2 1W0 1F3 1B3 1W1 1W2 1W3 1U".split()
    assert [stash_depth(h1, s) for s in range(2)] == [2, 2]
    assert [stash_depth(h2, s) for s in range(2)] == [3, 3]
    assert [warmup_forwards((1, 1), s, "zb2") for s in range(2)] == [2, 0]


@pytest.mark.parametrize("schedule, message", [
    (Schedule.from_text("schedule mode=flush replicas=1 minibatches=1 group=1\nw0 s0r0: 0F0 0B0 0W0 0U"),
     r"0W0 is a weight-gradient action, but mode 'flush' runs whole backwards"),
    (Schedule.from_text("schedule mode=zb replicas=1 minibatches=1 group=1\nw0 s0r0: 0F0 0B0 0U"),
     r"the weight gradients 0W0 of minibatch 0 is missing"),
    (Schedule.from_text("schedule mode=zb replicas=1 minibatches=1 group=1\nw0 s0r0: 0F0 0W0 0B0 0U"),
     r"0W0 \(action 1\) comes before its backward 0B0 \(action 2\); run the backward first"),
    (Schedule.from_text("schedule mode=zb replicas=1 minibatches=1 group=1\nw0 s0r0: 0F0 0B0 0U 0W0"),
     r"0W0 comes after 1 optimizer steps"),
])
def test_validator_checks_weight_gradient_actions(schedule, message):
    with pytest.raises(ScheduleError, match=message):
        validate(schedule)


# ----- drains: where a checkpoint resumes exactly ------------------------------------------------
def _step_groups(mode, replicas, group):
    """Every stage's minibatches per step: r_s in pipedream and vsync, m otherwise."""
    return replicas if mode in ("pipedream", "vsync") else (group,)


def _drained_grid():
    for replicas in PATTERNS:
        for mode in MODES:
            group = 1 if mode in ("pipedream", "vsync") else default_group(replicas)
            unit = math.lcm(*_step_groups(mode, replicas, group))
            for drain in (unit, 2 * unit, 3 * unit):
                for minibatches in range(group, 4 * unit + 2, group):
                    yield mode, replicas, minibatches, group, drain


def shifted(schedule: Schedule, offset: int) -> list[tuple[Action, ...]]:
    """Every worker's actions with `offset` added to their minibatch ids."""
    return [tuple(a if a.kind == "U" else Action(a.kind, a.stage, a.minibatch + offset) for a in actions)
            for actions in schedule.workers]


def test_validator_accepts_every_drained_schedule():
    count = 0
    for mode, replicas, minibatches, group, drain in _drained_grid():
        schedule = generate(mode, replicas, minibatches, group, drain_every=drain)
        validate(schedule)
        table = schedule.versions()
        assert all(table[("B", s, b)] == table[("F", s, b)] for s in range(len(replicas)) for b in range(minibatches))
        undrained = generate(mode, replicas, minibatches, group)
        peaks, before = peak_versions(schedule), peak_versions(undrained)
        assert all(peaks[rank] <= before[rank] for rank in peaks), (mode, replicas, minibatches, drain)
        if mode == "2bw":
            assert max(peaks.values()) <= 2
        count += 1
    assert count > 1000


def test_a_drained_schedule_is_the_concatenation_of_its_segments():
    """With drains every D minibatches, a worker's actions are those of the schedules of each
    segment, their minibatch ids shifted by the segment's start: a run resumed at a drain runs
    exactly what the uninterrupted run would have. (Round robin gives a minibatch the same
    replica in both when D is a multiple of every r_s, as it always is in pipedream and vsync.)"""
    count = 0
    for mode, replicas, minibatches, group, drain in _drained_grid():
        if drain % math.lcm(*replicas):
            continue
        whole = generate(mode, replicas, minibatches, group, drain_every=drain)
        parts = [shifted(generate(mode, replicas, min(drain, minibatches - start), group), start)
                 for start in range(0, minibatches, drain)]
        assert [sum((part[rank] for part in parts), ()) for rank in range(sum(replicas))] == list(whole.workers)
        count += 1
    assert count > 800


def test_drains_in_each_mode_and_the_versions_after_them():
    assert lines(generate("pipedream", (1, 1), 4, drain_every=2)) == [
        "0F0 0F1 0B0 0U 0B1 0U 0F2 0F3 0B2 0U 0B3 0U",
        "1F0 1B0 1U 1F1 1B1 1U 1F2 1B2 1U 1F3 1B3 1U",
    ]
    pipedream = generate("pipedream", (1, 1, 1), 8, drain_every=4)
    assert forward_versions(pipedream, 0) == [0, 0, 0, 1, 4, 4, 4, 5]  # after the drain: the newest, 4
    vsync = generate("vsync", (1, 1, 1), 10, drain_every=5)
    assert [forward_versions(vsync, s) for s in range(3)] == [[0, 0, 0, 1, 2, 5, 5, 5, 6, 7]] * 3
    # 2bw: batch t runs on version t-1, but the first batch after a drain on the newest, t
    two = generate("2bw", (1, 1, 1), 12, group=3, drain_every=6)
    assert [forward_versions(two, s) for s in range(3)] == [[0] * 6 + [2] * 6] * 3
    for mode in FLUSH_MODES:  # these drain before every step already
        assert generate(mode, (2, 1), 12, 3, drain_every=6) == generate(mode, (2, 1), 12, 3)


@pytest.mark.parametrize("args, drain, message", [
    (("pipedream", (1, 2), 8), 3, r"drain_every=3 .* positive multiple of 2 \(the stages step every 1, 2 minibatches\)"),
    (("vsync", (2, 3), 12), 4, r"multiple of 6"),
    (("2bw", (1, 1), 8, 2), 3, r"drain_every=3 minibatches for mode '2bw' .* multiple of 2"),
    (("pipedream", (1, 1), 8), 0, r"drain_every=0 .* positive multiple of 1"),
    (("flush", (1, 1), 8, 2), True, r"drain_every=True"),
])
def test_generate_rejects_a_drain_inside_a_step(args, drain, message):
    with pytest.raises(ScheduleError, match=message):
        generate(*args, drain_every=drain)
