"""The simulator: run a plan's schedule on the profile's costs, in simulated time.

One of the three interpreters of a schedule. It predicts time per minibatch, bubbles and memory
at any cluster size, without processes. Pure: standard library and pdtool's own modules.

The model (all times in ms):
- Workers. The plan's stage s replica i is schedule rank (s, i) and runs on plan rank
  `plan.stages[s].ranks[i]`; results are keyed by plan ranks. Every worker runs its action list
  in order, one action at a time, each as soon as its worker is free and its input is there.
- Compute. `F` of stage s takes the stage's `fwd_ms`, `B` its `bwd_ms` (in mode `zb`, B its
  `bwd_ms - wgrad_ms` and W its `wgrad_ms`) (one minibatch on one
  worker, as profiled; a stage that recomputes, `plan.stages[s].recompute`, runs its forward again
  in each B: `fwd_ms` more); `F` on stage 0 also makes its minibatch (`data_ms`). Within a worker,
  `B` of b follows `F` of b by the schedule's order.
- Transfers. `F` of b on stage s > 0 needs `F` of b on stage s-1 and then its activations,
  `out_bytes` of stage s-1, sent to it; `B` of b on stage s < last needs `B` of b on stage s+1
  and then its gradient, `in_bytes` of stage s+1, sent back. A message occupies its link for
  bytes / bandwidth and arrives the level's latency after that, where bandwidth and latency are
  those of the cluster level at which the two ranks part (`link_bandwidth`, `link_latency`).
  Sends are asynchronous (the sender computes on) but every directed link (rank x -> rank y)
  carries one message at a time: messages queue on it in the order they are sent (FIFO). Links
  are independent of one another: a rank's messages to two different ranks do not contend.
- Host copies. A message also costs CPU at both ends: the profile's `message_ms_per_mib` per MiB
  (writing it into a socket, reading it out). The sender pays it right after the send, before
  its next action, and the message is not there before it is written; the receiver pays it at
  the receive unless it spent at least that long waiting for the message (the read overlaps
  the transfer, and steals from the receiver's compute only where it was busy).
- Steps. `U` on an unreplicated stage is the local optimizer step: the stage's `update_ms` (its
  share of the profiled optimizer step). On a stage with r > 1 replicas, the k-th `U` of every
  replica is one collective: all start together when the last replica arrives, and it lasts a
  ring all-reduce, 2 (r - 1) / r * param_bytes / B + 2 (r - 1) L with B the slowest link among
  the replicas' ranks and L the longest latency, plus the worker's own passes over the gradients (flatten, add, divide: the stage's
  `reduce_ms`), then the optimizer step (`PlanStage.step_ms`; a stage that shards its optimizer
  steps 1/r of it, then gathers the weights: `allreduce_ms`; one that shards its gradients
  all-reduces them after each backward instead, `reduce_ms`, every replica's k-th together, and
  its step only gathers). It is not
  overlapped with computation (the replicas wait for it), so a replicated stage costs
  (compute + all-reduce) / r per minibatch here, where the planner's default cost model charges
  max(compute, all-reduce) / r: the simulator is the pessimistic side of that comparison.
  All-reduces use links of their own, not those of pipeline messages.
- Weight copies. Where a later action still uses the version a step replaces (weight stashing:
  pipedream, vsync and 2bw on every stage that holds a minibatch across its step), the worker
  copies its stage's parameters before the step (`schedule.stash_copies`, what the runtime's
  `VersionStore` copies): their bytes at the profile's `copy_ms_per_mib`, added to the step.
"""
from __future__ import annotations

from collections import deque
from functools import lru_cache
from dataclasses import dataclass
from typing import Sequence

from ..errors import ScheduleError
from ..artifacts.plan import MS_PER_S, SYNC_SCALE, Plan
from ..schedule import Schedule, generate, peak_versions, stash_copies, stash_depth, step_group
from ..schedule.lower import ACTIVATION, COLLECTIVES, Op, collective_key, lower, message

MIB = 2 ** 20

__all__ = ["SimEvent", "SimResult", "SimTransfer", "allreduce_ms", "backward_reduce_ms", "default_minibatches",
           "link_bandwidth",
           "link_latency",
           "simulate", "simulate_schedule", "steady_state_ms"]



@dataclass(frozen=True, kw_only=True)
class SimEvent:
    """One action of one worker in simulated time: plan rank `rank`, `name` the action's compact
    text ("0F3", "1B3", "0U"), `kind` "F", "B" or "U", its `stage` and `minibatch` (None for U),
    `start_ms`/`end_ms` from the start of the run. A `U` of a replicated stage spans its all-reduce."""

    rank: int
    name: str
    kind: str
    stage: int
    minibatch: int | None
    start_ms: float
    end_ms: float


@dataclass(frozen=True, kw_only=True)
class SimTransfer:
    """One message on the directed link `src` -> `dst` (plan ranks): the output of action `name`
    ("0F3": stage 0's activations of minibatch 3, going to stage 1; "2B3": stage 2's input
    gradient of minibatch 3, going to stage 1), `bytes` long, on the link from `start_ms` to `end_ms`."""

    src: int
    dst: int
    name: str
    bytes: int
    start_ms: float
    end_ms: float


@dataclass(frozen=True, kw_only=True)
class SimResult:
    """What a simulated run predicts. Times in ms, per-rank dicts keyed by plan rank.

    `makespan_ms` runs from the first start to the last end. `time_per_minibatch_ms` is the
    steady-state period (`steady_state_ms`); `samples_per_s` is the profile's batch size over it.
    `bubble_fraction` is the workers' idle share: 1 - (time in any action, U with its all-reduce
    included) / (workers * makespan). `busy_ms` is each worker's F, B and W time.
    `peak_versions` (from the schedule) is the most weight versions a worker holds at once;
    `peak_in_flight` the most minibatches it holds between the start of a forward and the end of
    its backward (its W, where there is one); `peak_activation_bytes` that times the stage's
    `activation_bytes`. `events` are all actions, by start time; `transfers` all messages.
    """

    mode: str
    minibatches: int
    group: int
    makespan_ms: float
    time_per_minibatch_ms: float
    samples_per_s: float
    bubble_fraction: float
    busy_ms: dict[int, float]
    peak_versions: dict[int, int]
    peak_in_flight: dict[int, int]
    peak_activation_bytes: dict[int, int]
    events: tuple[SimEvent, ...]
    transfers: tuple[SimTransfer, ...] = ()


def default_minibatches(workers: int, group: int) -> int:
    """Minibatches for a steady state: max(16 * workers, 4 * group), rounded up to a multiple of group.

    The warm-up and the drain each last up to `workers` minibatches and a replicated stage may
    cycle over several rounds of its replicas, so `steady_state_ms` needs a long run; with 16
    minibatches per worker its estimate is within about 1% of the long-run limit on the
    PipeDream paper's VGG-16 plans (4 and 16 workers).
    """
    n = max(16 * workers, 4 * group)
    return -(-n // group) * group


def _parting_level(plan: Plan, x: int, y: int):
    """The cluster level at which plan ranks x != y part: units of level k hold prod(counts of
    levels below k) workers, and x and y part at the outermost level k where x // units_k !=
    y // units_k (level 0 inside one server, level 1 across servers, ...)."""
    size, level = 1, 0
    for k, lvl in enumerate(plan.cluster.levels):
        if x // size != y // size:
            level = k
        size *= lvl.count
    return plan.cluster.levels[level]


def _parting_levels(plan: Plan, ranks) -> list:
    """The cluster levels at which some two of `ranks` part (`_parting_level` of every pair, found
    without visiting the pairs: level k is one where ranks in one unit of level k + 1 lie in
    different units of level k)."""
    found, size = [], 1
    for k, lvl in enumerate(plan.cluster.levels):
        outer = size * lvl.count
        units: dict[int, set[int]] = {}
        for rank in ranks:
            units.setdefault(rank // outer if k + 1 < len(plan.cluster.levels) else 0, set()).add(rank // size)
        if any(len(inner) > 1 for inner in units.values()):
            found.append(lvl)
        size = outer
    return found


def link_bandwidth(plan: Plan, x: int, y: int) -> float:
    """Bytes/s between plan ranks x and y: the bandwidth of the level at which they part
    (`_parting_level`). Infinite for x == y."""
    return float("inf") if x == y else _parting_level(plan, x, y).bandwidth


def link_latency(plan: Plan, x: int, y: int) -> float:
    """Seconds a message from rank x to rank y takes beyond its bytes / bandwidth: the latency
    of the level at which they part. 0 for x == y."""
    return 0.0 if x == y else _parting_level(plan, x, y).latency


def allreduce_ms(plan: Plan, stage: int, mode: str | None = None) -> float:
    """One ring all-reduce of `stage`'s gradients among its replicas, in ms (0 when unreplicated):
    2 (r - 1) / r * param_bytes / B + 2 (r - 1) L, B the slowest link between two of its ranks
    and L the longest latency (a ring's 2 (r - 1) steps each wait for one), plus the stage's
    `reduce_ms` (each worker's flattening, adding and dividing of its gradients). A stage that
    shards its optimizer state (`shard`) also all-gathers its weights after the step:
    (r - 1) / r * param_bytes / B + (r - 1) L more (`artifacts.plan.SYNC_SCALE`)."""
    s = plan.stages[stage]
    if stage in plan.reduces_each(mode):  # the gradients were reduced after each backward: the gather (sharded parameters:
        return _ring_ms(plan, stage, 0 if s.shard == "parameters" else 1)  # none, each forward gathers its own)
    # ring passes over the parameters: 2 for the all-reduce, 1 more to gather (sharded parameters, kept gathered
    # through the step where the mode splits its backward: gathered once at its first forward)
    passes = 3 if s.shard == "parameters" else 2 * SYNC_SCALE[s.shard]
    return _ring_ms(plan, stage, passes) + (s.reduce_ms if s.replicas > 1 and s.param_bytes else 0.0)


def backward_reduce_ms(plan: Plan, stage: int, mode: str | None = None) -> float:
    """The all-reduce after each backward of a stage whose replicas shard their gradients
    (`REDUCES_EACH_BACKWARD`): a ring all-reduce of the parameters' gradients and the stage's
    `reduce_ms` (0 for any other stage, and unreplicated)."""
    s = plan.stages[stage]
    if stage not in plan.reduces_each(mode):
        return 0.0
    # sharded parameters: the backward's all-reduce and its gather of the weights, and the forward's gather before it
    return _ring_ms(plan, stage, 4 if s.shard == "parameters" else 2) + s.reduce_ms


def _ring_ms(plan: Plan, stage: int, passes: float) -> float:
    """`passes` ring passes over `stage`'s parameter bytes among its replicas, in ms: each
    (r - 1) / r * param_bytes / B + (r - 1) L (0 when unreplicated)."""
    s = plan.stages[stage]
    r = s.replicas
    if r == 1 or s.param_bytes == 0:
        return 0.0
    levels = _parting_levels(plan, s.ranks)
    slowest = min(level.bandwidth for level in levels)
    latency = max(level.latency for level in levels)
    return (passes * (r - 1) / r * s.param_bytes / slowest + passes * (r - 1) * latency) * MS_PER_S


def steady_state_ms(completions: dict[int, float], minibatches: int, period: int = 1, tail: int = 0,
                    start_ms: float = 0.0) -> float:
    """Time per minibatch in steady state, from stage 0's backward completion times (ms by minibatch).

    Let T(k) be when minibatches 0..k-1 have all completed (the latest of their completion
    times). The estimate is the least-squares slope of T(k) against k over the last half of the
    run, at k = k0, k0 + period, ..., k1:
    - k0 is N / 2 rounded down to a multiple of `period` (stage 0's step group: m for 2bw,
      flush and gpipe, r_0 for pipedream and vsync) and at least one period: the warm-up is
      left out;
    - k1 is N - `tail` rounded down likewise: `tail` (the most minibatches a stage holds in
      flight; 0 for the modes that flush) leaves out the drain of a run that does not flush,
      whose last minibatches finish faster once no new forwards compete.
    Sampling at whole periods makes a flushing run's T(k) exactly linear (every batch, flush
    included, takes the same time), so the slope is exact, and skips the steps of a staircase
    (r_0 replicas finishing together); a run may also settle into a cycle of several periods
    (replicated stages synchronising at their steps), which the fit averages over. On a
    long pipedream run it is the bottleneck's period. A window of fewer than two points is
    widened to k1 = N; if it still has one, there is no steady state to measure and the
    estimate is (T(N) - start_ms) / N, fill and drain included.
    """
    n = minibatches
    reached, done = [], float("-inf")
    for b in range(n):
        done = max(done, completions[b])
        reached.append(done)  # reached[k - 1] = T(k)
    k0 = max(period, (n // 2) // period * period)
    for k1 in ((n - tail) // period * period, n):
        ks = range(k0, k1 + 1, period)
        if len(ks) >= 2:
            mean_k, mean_t = sum(ks) / len(ks), sum(reached[k - 1] for k in ks) / len(ks)
            return (sum((k - mean_k) * (reached[k - 1] - mean_t) for k in ks)
                    / sum((k - mean_k) ** 2 for k in ks))
    return (reached[-1] - start_ms) / n


def simulate(plan: Plan, mode: str | None = None, minibatches: int | None = None,
             group: int | None = None, placement: Sequence[int] = (), events: bool = True) -> SimResult:
    """Simulate `minibatches` minibatches of `plan` under schedule `mode` (default: the plan's).

    `group` is the microbatches per step of 2bw, flush and gpipe (default: the schedule's
    `default_group`, the number of stages on a straight pipeline); `minibatches` defaults to
    `default_minibatches`. An unknown mode, minibatches < 1 or a group the mode refuses raise
    `ScheduleError` (the schedule's own checks).

    `placement` (a mode of several stages per worker, `schedule.placement`; default: the plan's):
    the worker of each stage; worker w then sits at the plan rank of its first stage (its links
    are that rank's).

    `events` False: the result without its `events` and `transfers` (the planner ranks thousands of
    simulations by their figures alone); every figure is the same.
    """
    replicas = tuple(s.replicas for s in plan.stages)
    run = plan.run(mode, group)
    mode, group = run.name, run.group
    if minibatches is None:  # a bad group is reported by the schedule's checks, not here
        minibatches = default_minibatches(sum(replicas), group if isinstance(group, int) and group >= 1 else 1)
    schedule, ops, keys = _program(mode, replicas, minibatches, group, tuple(placement or plan.placement),
                                   plan.reduces_each(mode))
    return _simulated(_Run(plan, schedule, ops, keys), events)


def simulate_schedule(plan: Plan, schedule: Schedule) -> SimResult:
    """Simulate a given `schedule` (its stages and placement the plan's) on the plan's costs."""
    ops = lower(schedule, reduce_each=plan.reduces_each(schedule.mode)).workers
    return _simulated(_Run(plan, schedule, ops, _message_keys(ops)), True)


def _simulated(run: "_Run", events: bool) -> SimResult:
    run.go()
    return run.result(events)


@lru_cache(maxsize=32)
def lowered(mode: str, replicas: tuple[int, ...], minibatches: int, group: int | None, placement: tuple[int, ...],
            reduce_each: tuple[int, ...]) -> tuple[Schedule, tuple[tuple[Op, ...], ...]]:
    """The schedule `generate` makes for these arguments and every worker's ops (`schedule.lower`),
    kept for the next simulation of the same shape (both are immutable): the planner simulates the
    same replicas, mode and minibatches for many candidates, plans and families, on other costs."""
    schedule = generate(mode, replicas, minibatches, group, placement=placement)
    return schedule, lower(schedule, reduce_each=reduce_each).workers


@lru_cache(maxsize=32)
def _program(mode: str, replicas: tuple[int, ...], minibatches: int, group: int | None, placement: tuple[int, ...],
             reduce_each: tuple[int, ...]):
    """`lowered`, and the key of every send's and recv's message (`_message_keys`), kept alike."""
    schedule, ops = lowered(mode, replicas, minibatches, group, placement, reduce_each)
    return schedule, ops, _message_keys(ops)


def _message_keys(ops: tuple[tuple[Op, ...], ...]) -> tuple[tuple[tuple | None, ...], ...]:
    """keys[w][i]: the message (`lower.message`) of worker w's op i where it sends or receives one."""
    return tuple(tuple(message(op, worker) if op.kind in ("send", "recv") else None for op in worker_ops)
                 for worker, worker_ops in enumerate(ops))


def worker_rank(plan: Plan, schedule: Schedule, worker: int) -> int:
    """The plan rank of schedule worker `worker`: its stage's replica's, or (several stages a
    worker) its first stage's."""
    if schedule.placement:
        return plan.stages[schedule.stages_of(worker)[0]].ranks[0]
    stage, replica = schedule.position(worker)
    return plan.stages[stage].ranks[replica]


def _compute_ms(op: Op, s) -> float:
    """The time of an F, B or W op on stage `s`: a B followed by a W computes the input
    gradients only, the W the rest of the backward."""
    if op.kind == "F":
        return s.fwd_ms + s.data_ms
    if op.kind == "W":
        return s.wgrad_ms
    again = s.fwd_ms if s.recompute else 0.0  # a recomputing stage runs its forward again first
    return again + s.bwd_ms - (0.0 if op.weights else s.wgrad_ms)


def _stashed(stage, held: int) -> int:
    """Activation bytes a worker of `stage` holds with `held` minibatches in flight: a whole set
    each, or where the stage recomputes its forward, their inputs and one whole set."""
    if stage.recompute and held:
        return (held - 1) * stage.in_bytes + stage.activation_bytes
    return held * stage.activation_bytes


def _message_bytes(op: Op, s) -> int:
    """The bytes of the message a send or recv op of stage `s` moves: activations leave a stage
    at its output and enter at its input; gradients go the other way."""
    leaving = op.kind == "send"
    return s.out_bytes if (op.direction == ACTIVATION) == leaving else s.in_bytes


def _stash_copy_ms(plan: Plan, schedule: Schedule) -> dict[tuple[int, int], float]:
    """(worker, index of one of its U actions) -> ms of the weight copy the worker makes before
    that step (`stash_copies`: a later action still needs the version it replaces), the stage's
    parameters at the profile's `copy_ms_per_mib`. None in the flushing modes, whose versions are
    all done with before their step."""
    per_mib = plan.profile.copy_ms_per_mib
    if not per_mib or schedule.rules.flushes:
        return {}
    table = schedule.versions()
    return {(worker, index): plan.stages[stage].param_bytes / MIB * per_mib
            for worker, actions in enumerate(schedule.workers) for stage in schedule.stages_of(worker)
            for index in stash_copies(table, actions, stage).values()}


class _Run:
    """The state of one simulation; `go` advances every worker through its lowered ops
    (`schedule.lower`) as far as its inputs allow."""

    def __init__(self, plan: Plan, schedule: Schedule, ops: tuple[tuple[Op, ...], ...], keys):
        self.plan, self.schedule = plan, schedule
        self.ops = ops  # every worker's lowered ops (`schedule.lower`)
        self.keys = keys  # the message of each of them that sends or receives one (`_message_keys`)
        n = len(schedule.workers)
        self.ranks = [worker_rank(plan, schedule, w) for w in range(n)]  # schedule rank -> plan rank
        self.allreduce = [allreduce_ms(plan, s, schedule.mode) for s in range(len(plan.stages))]
        self.reduce = [backward_reduce_ms(plan, s, schedule.mode) for s in range(len(plan.stages))]
        self.next = [0] * n            # index of each worker's next op
        self.free = [0.0] * n          # when each worker is free, ms
        self.began = [0.0] * n         # when the worker's current step began (its all-reduce)
        self.met = [dict() for _ in range(n)]  # collectives done: key -> count
        self.held = [0] * n            # minibatches in flight on each worker now
        self.peak_held = [0] * n
        self.stage_held = [dict.fromkeys(schedule.stages_of(w), 0) for w in range(n)]  # ... of each of its stages
        self.peak_bytes = [0] * n      # the most activation bytes each worker held
        self.arrived: dict[tuple, float] = {}                 # message key (lower.message): at its receiver
        self.link_free: dict[tuple[int, int], float] = {}     # (src, dst) schedule ranks: link idle from
        self.links: dict[tuple[int, int], tuple[float, float]] = {}  # (src, dst) plan ranks: `_link`
        self.waiting: dict[tuple, dict[int, float]] = {}      # (collective key, k): worker -> arrival
        self.events: list[tuple[float, int, int, float]] = []  # (start, worker, action index, end) of each action
        self.transfers: list[tuple[float, int, int, int, int, int, float]] = []  # (start, src, dst, worker, action
        # index, bytes, end) of each message that moves bytes
        self.todo: deque[int] = deque(range(n))
        self.queued = set(range(n))
        self.copies = _stash_copy_ms(plan, schedule)  # (worker, action index of a U) -> its weight copy's ms

    def go(self) -> None:
        while self.todo:
            worker = self.todo.popleft()
            self.queued.discard(worker)
            while self.next[worker] < len(self.ops[worker]) and self._step(worker):
                pass
        for worker, ops in enumerate(self.ops):
            if self.next[worker] < len(ops):
                action = self.schedule.workers[worker][ops[self.next[worker]].at]
                raise ScheduleError(f"simulation stalled: {self.schedule.label(worker)} waits forever at "
                                    f"{action}; run validate() on the schedule")

    def _wake(self, worker: int) -> None:
        if worker not in self.queued:
            self.queued.add(worker)
            self.todo.append(worker)

    def _step(self, worker: int) -> bool:
        """Run `worker`'s next op if it can start; False if it must wait for another worker."""
        index = self.next[worker]
        op = self.ops[worker][index]
        s = self.plan.stages[op.stage]
        if op.kind in COLLECTIVES:
            return self._collective(worker, op)
        if op.kind == "recv":
            key = self.keys[worker][index]
            if key not in self.arrived:
                return False
            self.free[worker] = max(self.free[worker] + self._copy_ms(_message_bytes(op, s)), self.arrived.pop(key))
        elif op.kind == "send":
            self._send(worker, op, _message_bytes(op, s), self.keys[worker][index])
        elif op.kind == "step":
            start, end = self.began[worker], self.free[worker] + s.step_ms + self.copies.get((worker, op.at), 0.0)
            self.events.append((start, worker, op.at, end))
            self.free[worker] = end
        else:
            start = self.free[worker]
            end = start + _compute_ms(op, s)
            change = 1 if op.kind == "F" else -1 if op.kind == "W" or op.weights else 0
            if change:
                self._hold(worker, op.stage, change)
            self.events.append((start, worker, op.at, end))
            self.free[worker] = end
        self.next[worker] += 1
        return True

    def _hold(self, worker: int, stage: int, change: int) -> None:
        """One minibatch more (or fewer) in flight on `stage` of `worker`: its peaks."""
        self.held[worker] += change
        self.peak_held[worker] = max(self.peak_held[worker], self.held[worker])
        held = self.stage_held[worker]
        held[stage] += change
        if len(held) == 1:  # one stage a worker (most plans): no sum over its stages
            now = _stashed(self.plan.stages[stage], held[stage])
        else:
            now = sum(_stashed(self.plan.stages[s], count) for s, count in held.items())
        if now > self.peak_bytes[worker]:
            self.peak_bytes[worker] = now

    def _copy_ms(self, size: int) -> float:
        """CPU ms that a message of `size` bytes costs one of its ends (the profile's host cost)."""
        return size / MIB * self.plan.profile.message_ms_per_mib

    def _send(self, worker: int, op: Op, size: int, key: tuple) -> None:
        """Queue a message on its directed link, FIFO, from when its worker is free; the worker
        computes on after writing it (`_copy_ms`)."""
        dst = op.peer
        link = (worker, dst)
        start = max(self.free[worker], self.link_free.get(link, 0.0))
        written = self.free[worker] + self._copy_ms(size)
        self.free[worker] = written
        src, to = self.ranks[worker], self.ranks[dst]
        ms_per_byte, latency_ms = self._link(src, to)
        end = max(start + size * ms_per_byte, written)
        self.link_free[link] = end
        if size:
            self.transfers.append((start, src, to, worker, op.at, size, end))
        self.arrived[key] = end + latency_ms
        self._wake(dst)

    def _link(self, src: int, to: int) -> tuple[float, float]:
        """(ms per byte, latency ms) of the link between plan ranks src and to, found once per pair."""
        found = self.links.get((src, to))
        if found is None:
            found = self.links[(src, to)] = (MS_PER_S / link_bandwidth(self.plan, src, to),
                                             link_latency(self.plan, src, to) * MS_PER_S)
        return found

    def _collective(self, worker: int, op: Op) -> bool:
        """The k-th op of a collective: every member starts when the last arrives. A replicas'
        all-reduce lasts `allreduce_ms` (0 for one replica), a reduce after a backward
        `backward_reduce_ms`; a tie takes no simulated time."""
        key = collective_key(op)
        count = self.met[worker].get(key, 0)
        arrivals = self.waiting.setdefault((key, count), {})
        arrivals[worker] = self.free[worker]
        if len(arrivals) < len(op.group):
            return False
        del self.waiting[(key, count)]
        start = max(arrivals.values())
        took = {"allreduce": self.allreduce, "reduce": self.reduce}.get(op.kind, ())
        took = took[op.stage] if took else 0.0
        for member in sorted(arrivals):
            if op.kind == "allreduce":
                self.began[member] = start
            self.free[member] = start + took
            self.met[member][key] = count + 1
            self.next[member] += 1
            if member != worker:
                self._wake(member)
        return True

    def result(self, detail: bool = True) -> SimResult:
        """The figures of the run; with `detail`, its events and transfers too."""
        plan, schedule, ranks, actions = self.plan, self.schedule, self.ranks, self.schedule.workers
        records = sorted(self.events, key=lambda item: item[:3])  # by start, worker, action
        first = min((start for start, *_ in records), default=0.0)
        makespan = max((end for *_, end in records), default=0.0) - first
        busy = {rank: 0.0 for rank in ranks}
        steps = []  # the U actions' times, in the order of the events
        completions: dict[int, float] = {}  # stage 0's minibatches: the end of their last backward part
        for start, worker, at, end in records:
            action = actions[worker][at]
            if action.kind == "U":
                steps.append(end - start)
                continue
            busy[ranks[worker]] += end - start
            if action.stage == 0 and action.kind != "F":
                completions[action.minibatch] = max(completions.get(action.minibatch, 0.0), end)
        workers = len(ranks)
        acting = sum(busy.values()) + sum(steps)
        bubble = max(0.0, 1 - acting / (workers * makespan)) if makespan > 0 else 0.0
        tail = 0 if schedule.rules.flushes else max(stash_depth(schedule, s) * r for s, r in enumerate(schedule.replicas))
        per_minibatch = steady_state_ms(completions, schedule.minibatches, step_group(schedule, 0), tail, first)
        versions = peak_versions(schedule)
        in_flight = {self.ranks[w]: self.peak_held[w] for w in range(workers)}
        activations = {self.ranks[w]: self.peak_bytes[w] for w in range(workers)}
        return SimResult(
            mode=schedule.mode, minibatches=schedule.minibatches, group=schedule.group, makespan_ms=makespan,
            time_per_minibatch_ms=per_minibatch,
            samples_per_s=plan.profile.batch_size / (per_minibatch / MS_PER_S) if per_minibatch > 0 else 0.0,
            bubble_fraction=bubble, busy_ms=busy,
            peak_versions={self.ranks[w]: versions[w] for w in range(workers)},
            peak_in_flight=in_flight, peak_activation_bytes=activations,
            events=self._events(records) if detail else (), transfers=self._transfers() if detail else ())

    def _events(self, records) -> tuple[SimEvent, ...]:
        actions = self.schedule.workers
        return tuple(SimEvent(rank=self.ranks[worker], name=str(action), kind=action.kind, stage=action.stage,
                              minibatch=action.minibatch, start_ms=start, end_ms=end)
                     for start, worker, at, end in records for action in (actions[worker][at],))

    def _transfers(self) -> tuple[SimTransfer, ...]:
        actions = self.schedule.workers
        return tuple(SimTransfer(src=src, dst=dst, name=str(actions[worker][at]), bytes=size, start_ms=start, end_ms=end)
                     for start, src, dst, worker, at, size, end in sorted(self.transfers, key=lambda t: t[:3]))
