"""The runtime's message protocol, replayed on every generated schedule with blocking sends.

`runtime.worker._run` posts the receives of its next messages ahead (`runtime.comm.Prefetch`), and
`runtime.comm.Link.send` waits for a link's oldest unconfirmed message once `window` are
pending; a send completes only when the peer has posted its receive (gloo). The replay runs
each worker's action list as a coroutine under those rules, with the replicas' all-reduce at
every step, tied-weight all-reduces among sharing stages (flush, gpipe), the final flush of
sends and a barrier, and asserts that every worker finishes."""
from collections import deque
from itertools import product

import pytest

from pdtool.runtime.comm import Prefetch, receive_of
from pdtool.schedule import default_group, generate, stash_depth

LAYOUTS = [(1, 1), (2, 1), (1, 2), (2, 2), (3, 1), (1, 3, 1), (1, 1, 1, 1), (2, 1, 1)]


def replay(schedule, window, ties=()):
    """None when every worker finishes, else {worker label: what it waits for}."""
    reps = schedule.replicas
    ranks, start = [], 0
    for r in reps:
        ranks.append(tuple(range(start, start + r)))
        start += r
    peer = lambda stage, b: ranks[stage][b % reps[stage]]  # noqa: E731
    posted, sent = set(), set()
    members = {("world",): tuple(range(start))}
    members.update({("stage", s): ranks[s] for s in range(len(reps)) if reps[s] > 1})
    members.update({("tie", t): tuple(r for s in t for r in ranks[s]) for t in ties})
    entered = {g: dict.fromkeys(m, 0) for g, m in members.items()}

    def worker(rank):
        s, _ = schedule.position(rank)
        last = s == len(reps) - 1
        actions = schedule.workers[rank]
        queues = {}

        def post(action):  # what runtime.worker posts, as it decides it
            if receive_of(action, len(reps)) is not None:
                posted.add((rank, action.kind, action.minibatch))

        def confirm(dst, kind, queue, keep):
            while len(queue) > keep:
                while (dst, kind, queue[0]) not in posted:
                    yield ("send", dst, kind, queue[0])
                queue.popleft()

        def send(dst, kind, b):
            sent.add((dst, kind, b))
            queue = queues.setdefault((dst, kind), deque())
            queue.append(b)
            yield from confirm(dst, kind, queue, window)

        def collective(group):
            entered[group][rank] += 1
            while min(entered[group].values()) < entered[group][rank]:
                yield ("collective", group)

        prefetch = Prefetch(actions, len(reps), window)
        for i, action in enumerate(actions):
            for ahead in prefetch.before(i):
                post(ahead)
            b = action.minibatch
            if action.kind == "F":
                while s > 0 and (rank, "F", b) not in sent:
                    yield ("receive", "F", b)
                if not last:
                    yield from send(peer(s + 1, b), "F", b)
            elif action.kind == "B":
                while not last and (rank, "B", b) not in sent:
                    yield ("receive", "B", b)
                if s > 0:
                    yield from send(peer(s - 1, b), "B", b)
            else:
                if reps[s] > 1:
                    yield from collective(("stage", s))
                for t in sorted(ties):
                    if s in t:
                        yield from collective(("tie", t))
        for (dst, kind), queue in queues.items():
            yield from confirm(dst, kind, queue, 0)
        yield from collective(("world",))

    running = {rank: worker(rank) for rank in range(start)}
    waiting = {}
    while running:
        moved = False
        for rank in list(running):
            try:
                what = next(running[rank])
            except StopIteration:
                del running[rank]
                moved = True
                continue
            moved |= waiting.get(rank) != what
            waiting[rank] = what
        if not moved:
            return {schedule.label(rank): waiting[rank] for rank in running}
    return None


def schedules():
    for mode, reps in product(("pipedream", "vsync", "2bw", "flush", "gpipe"), LAYOUTS):
        if mode in ("pipedream", "vsync"):
            yield generate(mode, reps, 6 * reps[0])
        else:
            for group in (default_group(reps), 2 * default_group(reps)):
                yield generate(mode, reps, 2 * group, group)


@pytest.mark.parametrize("schedule", list(schedules()), ids=lambda s: f"{s.mode} {s.replicas} g{s.group}")
def test_no_generated_schedule_deadlocks_with_the_runtimes_window_or_a_window_of_one(schedule):
    runtime_window = max(stash_depth(schedule, s) for s in range(schedule.stages))
    for window in sorted({1, runtime_window}):
        assert replay(schedule, window) is None, (window, replay(schedule, window))
    if schedule.mode in ("flush", "gpipe") and schedule.stages > 1:
        ties = ((0, schedule.stages - 1),)  # an embedding tied to the output head
        assert replay(schedule, runtime_window, ties) is None


def test_the_replay_finds_a_deadlock_when_sends_wait_for_their_receive():
    """Window 0 (a send waits for its own receive, and a worker posts only the next receive of
    each direction) deadlocks a replicated last stage: stage 0 waits for minibatch 4's gradient
    from replica 0, which waits in the all-reduce for replica 1, which waits for stage 0 to take
    minibatch 5's gradient, whose receive stage 0 posts only after minibatch 4's."""
    stuck = replay(generate("pipedream", (1, 2), 6), 0)
    assert stuck == {"w0 s0r0": ("receive", "B", 4), "w1 s1r0": ("collective", ("stage", 1)),
                     "w2 s1r1": ("send", 0, "B", 5)}


def test_receives_are_posted_ahead_per_direction_in_action_order():
    schedule = generate("pipedream", (1, 1), 8)
    actions = schedule.workers[1]  # the last stage: only activations arrive, for its forwards
    forwards = [a for a in actions if a.kind == "F"]
    ahead = Prefetch(actions, 2, window=2)
    assert ahead.before(0) == forwards[:3]
    assert ahead.before(1) == forwards[1:4]  # F0 is action 0
    first = schedule.workers[0]  # stage 0: only gradients arrive, for its backwards
    backwards = [a for a in first if a.kind == "B"]
    assert Prefetch(first, 2, window=1).before(0) == backwards[:2]
