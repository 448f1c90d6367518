"""`lower`: a schedule made explicit, per worker, with all of its communication.

A `Schedule` lists forwards, backwards and steps; what moves between workers follows from the
plan's shape and the mode. `lower` writes it out once, as the ops each worker executes in
order, with every peer resolved:

- `F` of minibatch b on stage s: `recv` of its activations from the worker of stage s-1 that ran
  b (s > 0), the `F`, then `send` of its outputs to the worker of stage s+1 that runs b (s < last);
- `B`: `recv` of its output gradients from stage s+1 (s < last), the `B`, `send` of its input
  gradients to stage s-1 (s > 0); a `B` whose minibatch has a `W` (modes `zb`, `zb2`) computes only the
  input gradients (`Op.weights` False), and the `W` the weight gradients, with no message;
- `U`: `allreduce` of the gradients among the replicas of the stage (its `group`: one rank when
  the stage is not replicated, then it only takes the mean of the backwards since the last
  step), a `tie` per set of stages that share weights with this one (`ties`: their workers
  add the shared parameters' gradients), then `step` (the optimizer);
- on a replicated stage whose replicas reduce after every backward (`reduce_each`: `--shard
  gradients`, each keeps its slice of the sum), a `reduce` among them right after every `B` that
  computes weight gradients and every `W` (before the `B`'s send); its k-th meets the k-th of
  every other replica, so a replica that runs fewer backwards than another between two steps (a
  group that is no multiple of the replicas, a partial round) adds as many empty ones
  (`Op.weights` False: it adds zeros and counts no backward) before its step's `allreduce`.

Minibatch b runs on replica b mod r_s of every stage (1F1B-RR, PipeDream SOSP'19 section 3.2),
which resolves every peer. Where one worker holds both ends of a stage boundary (several stages a
worker, `Schedule.placement`), nothing is sent: the worker hands the tensors over to itself, and
its list must run the producing action first (`check`). The runtime (`runtime.worker.main`), the simulator, the validator's
deadlock and link-order checks and the message-protocol test all read these lists; none of them
re-derives routing or the per-mode rules. Pure standard library.

    >>> from pdtool.schedule import generate
    >>> low = lower(generate("pipedream", (1, 2), 4))
    >>> " ".join(map(str, low.workers[0][:8]))
    '0F0 send>1 0F1 send>2 0F2 send>1 recv<1 0B0'
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from .core import Schedule, stash_depth

ACTIVATION, GRADIENT = 0, 1  # what a message carries: a forward's outputs, or a backward's input gradients
COMPUTE = ("F", "B", "W")
COLLECTIVES = ("allreduce", "tie", "reduce")  # the ops that meet the same op of every other member of their group
OP_KINDS = ("recv", "send", "F", "B", "W", *COLLECTIVES, "step")


@dataclass(frozen=True, kw_only=True)
class Op:
    """One thing a worker does.

    `kind` is one of OP_KINDS; `stage` the worker's stage; `minibatch` that of an F, B, send or
    recv (None for the step's ops). A `send`/`recv` moves the `direction` (ACTIVATION or
    GRADIENT) message of `minibatch` to/from `peer` (a rank). An `allreduce`/`tie`/`reduce` is a
    collective of `group` (ranks, sorted, this worker's included); `stages` names the sharing
    stages of a `tie`. The k-th op of a collective on one worker meets the k-th op of the same
    collective (kind and group) on every other member (`collective_key`)."""

    kind: str
    stage: int
    minibatch: int | None = None
    peer: int | None = None
    direction: int | None = None
    group: tuple[int, ...] = ()
    stages: tuple[int, ...] = ()
    weights: bool = True  # a B that also computes the weight gradients (no W follows it); False: an empty reduce
    at: int = 0  # index of the schedule action (F, B or U) this op belongs to, in the worker's list

    def __str__(self) -> str:
        if self.kind in COMPUTE or self.kind == "E":  # E: a held-out minibatch's forward (`runtime.worker.evaluation`)
            return f"{self.stage}{self.kind}{self.minibatch}"
        if self.kind in ("send", "recv"):
            return f"{self.kind}{'>' if self.kind == 'send' else '<'}{self.peer}"
        return f"{self.stage}{self.kind}"


@dataclass(frozen=True)
class Lowered:
    """Every worker's ops (`workers[rank]`, ranks as in `ranks`) for `schedule`."""

    schedule: Schedule
    workers: tuple[tuple[Op, ...], ...]
    ranks: tuple[int, ...]  # schedule rank -> the rank the ops name (a plan's worker ranks)

    def index(self, rank: int) -> int:
        """The position in `workers` of the worker with rank `rank`."""
        return self.ranks.index(rank)

    def stages_of(self, rank: int) -> tuple[int, ...]:
        """The stages that the worker with rank `rank` runs."""
        return self.schedule.stages_of(self.index(rank))

    def links(self) -> list[tuple[int, int, int]]:
        """(sender, receiver, direction) of every link some message takes, sorted: the same list
        on every worker that lowers the same schedule."""
        return sorted({message(op, rank)[:3] for rank, ops in zip(self.ranks, self.workers)
                       for op in ops if op.kind == "send"})

    def windows(self, rank: int) -> dict[tuple[int, int], int]:
        """For each direction of a link of worker `rank`, keyed (peer, direction): how many of its
        messages may be unconfirmed at once (`runtime.worker.comm`): the most minibatches either end
        of the link holds in flight (`stash_depth`). Never more travel on it at once, and a worker's
        buffers then grow with its own depth, not with the deepest worker of the pipeline."""
        own = self._depth(rank)
        return {(op.peer, op.direction): max(own, self._depth(op.peer))
                for op in self.workers[self.index(rank)] if op.kind in ("send", "recv")}

    def _depth(self, rank: int) -> int:
        """The most minibatches worker `rank` holds in flight: its stage's, or all its chunks' together
        (their messages may share a direction of a link)."""
        depths = [stash_depth(self.schedule, stage) for stage in self.stages_of(rank)]
        return sum(depths) if self.schedule.placement else max(depths)

    def receiver_stage(self, op: Op) -> int:
        """The stage that receives the message of a `send`/`recv` op."""
        if op.kind == "recv":
            return op.stage
        return op.stage + 1 if op.direction == ACTIVATION else op.stage - 1


def lower(schedule: Schedule, ties: Sequence[tuple[int, ...]] = (), ranks: Sequence[int] | None = None,
          reduce_each: Sequence[int] = ()) -> Lowered:
    """The ops of every worker of `schedule`. `ties`: sets of stages that share weights (their
    workers all-reduce the shared gradients at every step). `ranks[i]`: the rank of schedule
    worker i in the ops' peers and groups (default: the schedule's own ranks). `reduce_each`:
    the replicated stages whose replicas reduce their gradients after every backward."""
    ranks = tuple(range(len(schedule.workers))) if ranks is None else tuple(ranks)
    last = schedule.stages - 1
    replicas = [tuple(ranks[schedule.rank(s, i)] for i in range(r)) for s, r in enumerate(schedule.replicas)]
    ties = sorted({tuple(sorted(t)) for t in ties if len(set(t)) > 1})
    reducing = {s: tuple(sorted(replicas[s])) for s in reduce_each if schedule.replicas[s] > 1}
    padding = {s: _padding(schedule, s) for s in reducing}  # stage -> per replica, empty reduces before each step

    def peer(stage: int, b: int) -> int:
        return replicas[stage][b % len(replicas[stage])]

    workers = []
    for index, actions in enumerate(schedule.workers):
        split = {(a.stage, a.minibatch) for a in actions if a.kind == "W"}
        ops: list[Op] = []
        for at, action in enumerate(actions):
            b, stage = action.minibatch, action.stage
            if action.kind == "F":
                if stage > 0 and peer(stage - 1, b) != ranks[index]:
                    ops.append(
                        Op(kind="recv", stage=stage, minibatch=b, peer=peer(stage - 1, b), direction=ACTIVATION, at=at)
                    )
                ops.append(Op(kind="F", stage=stage, minibatch=b, at=at))
                if stage < last and peer(stage + 1, b) != ranks[index]:
                    ops.append(
                        Op(kind="send", stage=stage, minibatch=b, peer=peer(stage + 1, b), direction=ACTIVATION, at=at)
                    )
            elif action.kind == "B":
                if stage < last and peer(stage + 1, b) != ranks[index]:
                    ops.append(
                        Op(kind="recv", stage=stage, minibatch=b, peer=peer(stage + 1, b), direction=GRADIENT, at=at)
                    )
                ops.append(Op(kind="B", stage=stage, minibatch=b, weights=(stage, b) not in split, at=at))
                if stage in reducing and (stage, b) not in split:
                    ops.append(Op(kind="reduce", stage=stage, group=reducing[stage], at=at))
                if stage > 0 and peer(stage - 1, b) != ranks[index]:
                    ops.append(
                        Op(kind="send", stage=stage, minibatch=b, peer=peer(stage - 1, b), direction=GRADIENT, at=at)
                    )
            elif action.kind == "W":
                ops.append(Op(kind="W", stage=stage, minibatch=b, at=at))
                if stage in reducing:
                    ops.append(Op(kind="reduce", stage=stage, group=reducing[stage], at=at))
            else:
                if stage in reducing:
                    own = padding[stage][schedule.position(index)[1]]
                    ops += [Op(kind="reduce", stage=stage, group=reducing[stage], weights=False, at=at)] * own.pop(0)
                ops.append(Op(kind="allreduce", stage=stage, group=tuple(sorted(replicas[stage])), at=at))
                for users in ties:
                    if stage in users:
                        group = tuple(sorted({r for s in users for r in replicas[s]}))
                        ops.append(Op(kind="tie", stage=stage, group=group, stages=users, at=at))
                ops.append(Op(kind="step", stage=stage, at=at))
        for stage in schedule.stages_of(index) if not schedule.placement else ():
            if stage in reducing:  # after the last step: as many reduces as the other replicas
                ops += [Op(kind="reduce", stage=stage, group=reducing[stage], weights=False, at=len(actions) - 1)] * \
                    padding[stage][schedule.position(index)[1]].pop(0)
        workers.append(tuple(_gradients_first(ops)) if schedule.placement else tuple(ops))
    return Lowered(schedule, tuple(workers), ranks)


def _gradients_first(ops: list[Op]) -> list[Op]:
    """A worker of several stages: in each run of step ops (its stages' U actions, one after the
    other), every stage's all-reduce, then the ties, before the first step, so that all its
    gradients are final when the whole model's norm (clipping) is measured; one tie per set of
    sharing stages, after every all-reduce (it adds the copies of all this worker's sharing stages,
    `runtime.worker.tied`)."""
    out: list[Op] = []
    run: list[Op] = []
    for op in ops + [Op(kind="F", stage=0)]:  # a sentinel closes the last run
        if op.kind in ("allreduce", "tie", "step"):
            run.append(op)
            continue
        ties = {collective_key(o): o for o in reversed(run) if o.kind == "tie"}  # the first of each set
        out += [o for o in run if o.kind == "allreduce"]  # every stage's gradients final (mean over the group)
        out += [o for o in run if o.kind == "tie" and ties[collective_key(o)] is o]  # then the copies added
        out += [o for o in run if o.kind == "step"]
        run = []
        out.append(op)
    return out[:-1]


def _padding(schedule: Schedule, stage: int) -> list[list[int]]:
    """Per replica of `stage`, before each of its steps (and at its end), the empty reduces that
    bring its backwards since the last step up to the most any replica runs there (`reduce_counts`)."""
    counts = reduce_counts(schedule, stage)
    most = [max(column) for column in zip(*counts)]
    return [[m - c for m, c in zip(most, own)] for own in counts]


def reduce_counts(schedule: Schedule, stage: int) -> list[tuple[int, ...]]:
    """The backwards that compute weight gradients (`B` without a `W`, and `W`) each replica of
    `stage` runs between its steps, as one tuple per replica (the last: after its last step)."""
    counts = []
    for i in range(schedule.replicas[stage]):
        actions = [a for a in schedule.workers[schedule.rank(stage, i)] if a.stage == stage]
        split = {a.minibatch for a in actions if a.kind == "W"}
        per, now = [], 0
        for a in actions:
            if a.kind == "U":
                per.append(now)
                now = 0
            elif a.kind == "W" or (a.kind == "B" and a.minibatch not in split):
                now += 1
        counts.append(tuple(per + [now]))
    return counts


def collective_key(op: Op) -> tuple:
    """What identifies the collective an `allreduce`/`tie`/`reduce` op takes part in (with its count)."""
    return (op.kind, op.group, op.stages)


def message(op: Op, rank: int) -> tuple[int, int, int, int, int]:
    """(sender, receiver, direction, minibatch, boundary) of the message a `send`/`recv` op of
    worker `rank` moves: a send and the recv that takes it have the same key. `boundary` is the
    lower stage of the two it joins: a worker of several stages sends one peer the messages of
    several boundaries for one minibatch."""
    sender, receiver = (rank, op.peer) if op.kind == "send" else (op.peer, rank)
    return sender, receiver, op.direction, op.minibatch, boundary(op)


def boundary(op: Op) -> int:
    """The lower stage of the two that a `send`/`recv` op's message joins."""
    below = (op.kind == "send") == (op.direction == ACTIVATION)  # leaves downward or arrives from above
    return op.stage if below else op.stage - 1


def sender_action(op: Op) -> str:
    """The action whose output a `recv` op waits for, in the schedule's text form ("0F3", "2B3")."""
    return f"{op.stage - 1}F{op.minibatch}" if op.direction == ACTIVATION else f"{op.stage + 1}B{op.minibatch}"
