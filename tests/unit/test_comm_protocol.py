"""The runtime's message protocol, replayed on every generated schedule with blocking sends.

Each worker runs its lowered ops (`schedule.lower`, what `runtime.worker._run` executes) as a
coroutine under the runtime's rules: receives are posted ahead (`runtime.worker.comm.Prefetch`);
`runtime.worker.comm.Link.send` waits for a link's oldest unconfirmed message once `window` are
pending, and a send completes only when the peer has posted its receive (gloo; over shared
memory, `runtime.worker.shm`, only when the peer takes the message: `JustInTime`); the k-th op of
a collective (the replicas' all-reduce, a tied-weight all-reduce) waits for every member's
k-th. Then the final flush of sends and a barrier. The replay asserts that every worker finishes."""
from collections import deque
from itertools import product

import pytest

from pdtool.runtime.worker.comm import Prefetch
from pdtool.schedule import ACTIVATION, FLUSH_MODES, GRADIENT, MODES, default_group, generate, lower, stash_depth
from pdtool.schedule.lower import collective_key, message

LAYOUTS = [(1, 1), (2, 1), (1, 2), (2, 2), (3, 1), (1, 3, 1), (1, 1, 1, 1), (2, 1, 1)]


class JustInTime:
    """A worker that posts each receive only when it needs the message (not the runtime's rule)."""

    def __init__(self, ops, window):  # noqa: ARG002 - Prefetch's signature
        self.ops = ops

    def before(self, i):
        return [self.ops[i]] if self.ops[i].kind == "recv" else []


LINKS = "links"  # replay's window: each direction of each link its own, as the runtime sets them (`Lowered.windows`)


def replay(schedule, window, ties=(), posting=Prefetch):
    """None when every worker finishes, else {worker label: what it waits for}. `posting`: which
    receives a worker posts before each op (the runtime's `Prefetch`, or `JustInTime`); `window`:
    one number for every link, or `LINKS`."""
    low = lower(schedule, ties)
    workers = len(low.workers)
    posted, sent = set(), set()
    entered: dict[tuple, dict[int, int]] = {}  # (collective key, k) -> members arrived

    def worker(rank):
        ops = low.workers[rank]
        queues, met = {}, {}

        def confirm(queue, keep):
            while len(queue) > keep:
                while queue[0] not in posted:
                    yield ("send",) + queue[0][1:]
                queue.popleft()

        def collective(key, group):
            count = met.get(key, 0)
            met[key] = count + 1
            arrived = entered.setdefault((key, count), set())
            arrived.add(rank)
            while len(arrived) < len(group):
                yield ("collective", key[0], count)

        windows = low.windows(rank) if window == LINKS else None
        prefetch = posting(ops, windows or window)
        for i, op in enumerate(ops):
            for ahead in prefetch.before(i):
                posted.add(message(ahead, rank))
            if op.kind == "recv":
                while message(op, rank) not in sent:
                    yield ("receive", op.direction, op.minibatch)
            elif op.kind == "send":
                key = message(op, rank)
                sent.add(key)
                queue = queues.setdefault((op.peer, op.direction), deque())
                queue.append(key)
                yield from confirm(queue, windows[(op.peer, op.direction)] if windows else window)
            elif op.kind in ("allreduce", "tie"):
                yield from collective(collective_key(op), op.group)
        for queue in queues.values():
            yield from confirm(queue, 0)
        yield from collective(("world",), range(workers))

    running = {rank: worker(rank) for rank in range(workers)}
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
    for mode, reps in product(MODES, LAYOUTS):
        if mode in ("pipedream", "vsync"):
            yield generate(mode, reps, 6 * reps[0])
        else:
            for group in (default_group(reps), 2 * default_group(reps)):
                yield generate(mode, reps, 2 * group, group)


@pytest.mark.parametrize("schedule", list(schedules()), ids=lambda s: f"{s.mode} {s.replicas} g{s.group}")
def test_no_generated_schedule_deadlocks_with_the_runtimes_windows_the_largest_or_a_window_of_one(schedule):
    largest = max(stash_depth(schedule, s) for s in range(schedule.stages))
    for window in [LINKS] + sorted({1, largest}):
        assert replay(schedule, window) is None, (window, replay(schedule, window))
    if schedule.mode in FLUSH_MODES and schedule.stages > 1:
        ties = ((0, schedule.stages - 1),)  # an embedding tied to the output head
        assert replay(schedule, LINKS, ties) is None


@pytest.mark.parametrize("schedule", list(schedules()), ids=lambda s: f"{s.mode} {s.replicas} g{s.group}")
def test_no_generated_schedule_deadlocks_over_shared_memory_rings(schedule):
    """A ring (`runtime.worker.shm`) frees a slot only when the receiver takes the message, at its recv
    op: receives posted just in time, with the runtime's windows as the rings' slots (or 1)."""
    for window in (LINKS, 1):
        assert replay(schedule, window, posting=JustInTime) is None
    if schedule.mode in FLUSH_MODES and schedule.stages > 1:
        assert replay(schedule, LINKS, ((0, schedule.stages - 1),), posting=JustInTime) is None


def test_the_replay_finds_a_deadlock_when_sends_wait_for_their_receive():
    """Window 0 (a send waits for its own receive) with receives posted only when needed
    deadlocks the simplest pipeline: stage 0 waits for stage 1 to take minibatch 1's activations,
    while stage 1 waits for stage 0 to take minibatch 0's gradient. The runtime's posting ahead
    (`Prefetch`) avoids it even with window 0; a window of 1 avoids it even without posting ahead."""
    schedule = generate("pipedream", (1, 1), 6)
    assert replay(schedule, 0, posting=JustInTime) == {"w0 s0r0": ("send", 1, ACTIVATION, 1, 0),
                                                       "w1 s1r0": ("send", 0, GRADIENT, 0, 0)}
    assert replay(schedule, 0) is None
    assert replay(schedule, 1, posting=JustInTime) is None


def test_receives_are_posted_ahead_per_direction_in_action_order():
    low = lower(generate("pipedream", (1, 1), 8))
    ops = low.workers[1]  # the last stage: only activations arrive, for its forwards
    receives = [op for op in ops if op.kind == "recv"]
    assert [op.direction for op in receives] == [ACTIVATION] * 8
    ahead = Prefetch(ops, window=2)
    assert ahead.before(0) == receives[:3]
    assert ahead.before(1) == receives[1:4]  # recv 0 is op 0
    first = low.workers[0]  # stage 0: only gradients arrive, for its backwards
    assert Prefetch(first, window=1).before(0) == [op for op in first if op.kind == "recv"][:2]


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("window", [0, 1, 3])
def test_what_the_worker_posts_before_each_op_covers_the_window_and_posts_each_receive_once(mode, window):
    replicas = (2, 1) if mode in ("pipedream", "vsync") else (1, 1, 1)
    schedule = generate(mode, replicas, 12) if mode in ("pipedream", "vsync") else generate(mode, replicas, 12, 3)
    for ops in lower(schedule).workers:
        ahead = Prefetch(ops, window)
        posted = []
        for i in range(len(ops)):
            posted += ahead.fresh[i]
            assert all(any(p is op for p in posted) for op in ahead.before(i))  # the whole window is posted
        receives = [op for op in ops if op.kind == "recv"]
        assert len(posted) == len(receives) and all(any(p is op for p in posted) for op in receives)


def test_each_direction_of_a_link_keeps_as_many_messages_as_its_deeper_end_holds_in_flight():
    low = lower(generate("pipedream", (1, 1, 1, 1), 12))
    assert low.windows(0) == {(1, ACTIVATION): 4, (1, GRADIENT): 4}
    assert low.windows(2) == {(1, ACTIVATION): 3, (1, GRADIENT): 3, (3, ACTIVATION): 2, (3, GRADIENT): 2}
    ahead = Prefetch(low.workers[3], low.windows(3))
    assert ahead.counts == {ACTIVATION: 3}  # the last stage posts its next 2 + 1 receives of activations
    replicated = lower(generate("pipedream", (2, 1), 12))
    assert replicated.windows(2) == {(0, ACTIVATION): 2, (0, GRADIENT): 2, (1, ACTIVATION): 2, (1, GRADIENT): 2}
