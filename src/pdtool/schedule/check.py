"""`validate`: check a schedule without running anything.

The checks run in this order, and the first broken rule raises a one-line `ScheduleError`
naming the worker ("w3 s1r0"), the action and the fix:
1. every action belongs to the worker's stage, names a minibatch of the run, and runs on its
   round-robin replica b mod r_s (1F1B-RR, PipeDream SOSP'19 section 3.2);
2. each (stage, minibatch) has exactly one forward and one backward, and in `zb`/`zb2` one W (its
   weight gradients), in no other mode any;
3. on its worker, every forward comes before its backward, and the backward before its W;
4. every worker of stage s runs `steps` U actions (so replicas step together), and the t-th U
   closes step group t: it follows the worker's backwards of group t and precedes later ones;
5. no worker ever holds more than `stash_depth` minibatches in flight (from the forward to the
   backward, or to the W where there is one);
6. no deadlock: all workers execute their lists in order; an action runs once its dependencies
   have (forward of b on stage s-1 before forward on s; backward on s+1 before backward on s;
   own forward before backward), and the k-th U of the replicas of a replicated stage is one
   collective all of them must reach; where one worker holds both stages (several stages a
   worker), the producing action comes first in its list (it hands the tensors to itself);
7. weight versions (`Schedule.versions`): no action uses a version its worker does not have
   yet; 2bw holds at most two versions per worker (arXiv 2006.09503 section 3.1); flush and
   gpipe run every microbatch of batch t on version t (gradient accumulation);
8. messages between two workers are received in the order they are sent, in each direction
   (activations forward, gradients backward): NCCL matches point-to-point messages by order,
   not by tag, so the runtime needs one FIFO per direction of every link.
"""
from __future__ import annotations

from ..errors import ScheduleError
from .modes import listed, modes_where
from .core import Action, Schedule, peak_versions, stash_depth, step_group, steps
from .lower import ACTIVATION, COLLECTIVES, collective_key, lower, message, sender_action

_MAX_LISTED = 6  # stuck workers named in a deadlock message


def validate(schedule: Schedule) -> None:
    """Raise ScheduleError (one line: which worker, which action, what is wrong) unless `schedule` is sound."""
    _check_placement(schedule)
    where = _check_once(schedule)
    _check_forward_first(schedule, where)
    _check_steps(schedule)
    _check_in_flight(schedule)
    ops = lower(schedule).workers
    _check_deadlock(schedule, ops)
    _check_versions(schedule)
    _check_link_order(schedule, ops)


def check_reduce_each(schedule: Schedule, stages) -> None:
    """Raise ScheduleError (one line) unless the replicas of every stage of `stages` can reduce
    their gradients after each backward (`lower`'s `reduce` ops, `--shard gradients`): the
    schedule stays free of deadlocks when the replicas' k-th backwards wait for one another."""
    _check_deadlock(schedule, lower(schedule, reduce_each=tuple(stages)).workers)


def check_same_order(schedule: Schedule, stages) -> None:
    """Raise ScheduleError (one line) unless the replicas of every stage of `stages` run the same
    sequence of forwards, backwards, weight-gradient passes and steps (`--shard parameters`: each
    gathers the parameters and reduce-scatters the gradients with the other replicas, in the
    order it runs them)."""
    for stage in stages:
        if schedule.replicas[stage] < 2:
            continue
        orders = [[a.kind for a in schedule.workers[schedule.rank(stage, r)] if a.stage == stage]
                  for r in range(schedule.replicas[stage])]
        for replica, order in enumerate(orders[1:], start=1):
            if order != orders[0]:
                at = next((i for i, (x, y) in enumerate(zip(order, orders[0])) if x != y), min(len(order), len(orders[0])))
                raise ScheduleError(f"the replicas of stage {stage} run their actions in different orders (replica "
                                    f"{replica}'s action {at} is {''.join(order[at:at + 1]) or 'missing'} where replica "
                                    f"0's is {''.join(orders[0][at:at + 1]) or 'missing'}); give each replica as many "
                                    "minibatches per step (a --group that is a multiple of the stage's replicas)")


def _check_placement(schedule: Schedule) -> None:
    n = schedule.minibatches
    for rank, actions in enumerate(schedule.workers):
        own = schedule.stages_of(rank)
        for action in actions:
            if action.stage not in own:
                runs = f"stage {own[0]}" if len(own) == 1 else f"stages {', '.join(map(str, own))}"
                raise ScheduleError(f"{schedule.label(rank)}: {action} is an action of stage {action.stage}, but this "
                                    f"worker runs {runs}; move it to a worker of stage {action.stage}")
            if action.kind == "U":
                continue
            if action.minibatch >= n:
                raise ScheduleError(f"{schedule.label(rank)}: {action} names minibatch {action.minibatch}, but the run "
                                    f"has {n} (0..{n - 1}); remove it or raise minibatches")
            if schedule.placement:
                continue
            stage, replica = schedule.position(rank)
            owner = schedule.replica_of(stage, action.minibatch)
            if owner != replica:
                raise ScheduleError(
                    f"{schedule.label(rank)}: {action} runs on replica {replica} of stage {stage}, but minibatch "
                    f"{action.minibatch} belongs to replica {owner} ({action.minibatch} mod {schedule.replicas[stage]}); "
                    f"move it to {schedule.label(schedule.rank(stage, owner))}")


def _check_once(schedule: Schedule) -> dict[Action, tuple[int, int]]:
    """(rank, index) of every F, B and W action, each present exactly once (W only where the mode splits)."""
    where: dict[Action, tuple[int, int]] = {}
    for rank, actions in enumerate(schedule.workers):
        for index, action in enumerate(actions):
            if action.kind == "U":
                continue
            if action.kind == "W" and not schedule.rules.split:
                raise ScheduleError(f"{schedule.label(rank)}: {action} is a weight-gradient action, but mode "
                                    f"{schedule.mode!r} runs whole backwards; remove it, or use mode "
                                    f"{listed(modes_where(split=True))}")
            if action in where:
                first_rank, first_index = where[action]
                raise ScheduleError(f"{schedule.label(rank)}: {action} appears twice (actions {first_index} and "
                                    f"{index}); each minibatch runs one {_NAMES[action.kind]} per stage, remove one")
            where[action] = (rank, index)
    for stage in range(schedule.stages):
        for minibatch in range(schedule.minibatches):
            for kind in _kinds(schedule):
                action = Action(kind, stage, minibatch)
                if action not in where:
                    owner = schedule.label(schedule.rank(stage, schedule.replica_of(stage, minibatch)))
                    raise ScheduleError(f"{owner}: the {_NAMES[kind]} {action} of minibatch {minibatch} is missing; "
                                        f"every minibatch needs one {' and one '.join(_NAMES[k] for k in _kinds(schedule))} "
                                        "on every stage")
    return where


def _kinds(schedule: Schedule) -> tuple[str, ...]:
    """What every minibatch runs on every stage (a W only where the mode splits every backward)."""
    return ("F", "B", "W") if schedule.rules.split and not schedule.rules.some_whole else ("F", "B")


def _check_forward_first(schedule: Schedule, where: dict[Action, tuple[int, int]]) -> None:
    for action, (rank, index) in where.items():
        if action.kind in ("B", "W"):
            before = Action("F" if action.kind == "B" else "B", action.stage, action.minibatch)
            if where[before][1] > index:
                raise ScheduleError(f"{schedule.label(rank)}: {action} (action {index}) comes before its "
                                    f"{_NAMES[before.kind]} {before} (action {where[before][1]}); run the {_NAMES[before.kind]} first")
        neighbour = {"F": action.stage - 1, "B": action.stage + 1}.get(action.kind)
        if neighbour is None or not 0 <= neighbour < schedule.stages:
            continue
        source = Action(action.kind, neighbour, action.minibatch)
        there, at = where[source]
        if there == rank and at > index:  # one worker holds both stages: it hands the tensors to itself
            raise ScheduleError(f"{schedule.label(rank)}: {action} (action {index}) needs what {source} (action {at}) "
                                f"of this same worker makes; run {source} first")


def _check_steps(schedule: Schedule) -> None:
    for stage in range(schedule.stages):
        ranks = [schedule.rank(stage, i) for i in range(schedule.replicas[stage])]
        counts = [sum(a.kind == "U" and a.stage == stage for a in schedule.workers[rank]) for rank in ranks]
        for rank, count in zip(ranks, counts):
            if count != counts[0]:
                raise ScheduleError(
                    f"{schedule.label(rank)}: {count} optimizer steps, but {schedule.label(ranks[0])} has {counts[0]}; "
                    f"the replicas of stage {stage} all-reduce and step together, so each needs the same number of "
                    f"{stage}U")
        size, needed = step_group(schedule, stage), steps(schedule, stage)
        if counts[0] != needed:
            raise ScheduleError(
                f"{schedule.label(ranks[0])}: {counts[0]} optimizer steps, but mode {schedule.mode!r} with "
                f"{schedule.minibatches} minibatches, {size} per step on stage {stage}, needs {needed}; "
                f"add or remove {stage}U actions")
        for rank in ranks:
            done = 0
            for action in schedule.workers[rank]:
                if action.stage != stage:
                    continue
                if action.kind == "U":
                    done += 1
                elif action.kind in ("B", "W") and done != action.minibatch // size:
                    t = action.minibatch // size
                    raise ScheduleError(
                        f"{schedule.label(rank)}: {action} comes after {done} optimizer steps, but minibatch "
                        f"{action.minibatch} belongs to step group {t} (minibatches {t * size}..{(t + 1) * size - 1}); "
                        f"the step closing group {t} must follow it and the earlier steps precede it")


def _check_in_flight(schedule: Schedule) -> None:
    for rank, actions in enumerate(schedule.workers):
        for stage in schedule.stages_of(rank):
            _check_stage_in_flight(schedule, rank, stage, [a for a in actions if a.stage == stage])


def _check_stage_in_flight(schedule: Schedule, rank: int, stage: int, actions: list[Action]) -> None:
    depth = stash_depth(schedule, stage)
    split = {a.minibatch for a in actions if a.kind == "W"}
    flight: list[int] = []
    for action in actions:
        if action.kind == "F":
            flight.append(action.minibatch)
            if len(flight) > depth:
                raise ScheduleError(
                    f"{schedule.label(rank)}: {len(flight)} minibatches in flight after {action} "
                    f"({', '.join(map(str, flight))}), but mode {schedule.mode!r} lets stage {stage} hold at most "
                    f"{depth}; run a backward before this forward")
        elif action.kind == "W" or (action.kind == "B" and action.minibatch not in split):  # its last backward part
            flight.remove(action.minibatch)


def _check_deadlock(schedule: Schedule, workers) -> None:
    """Run the lowered ops of every worker (`lower`): a send never waits, a recv waits for its
    send, the k-th op of a collective waits for every member's k-th."""
    pos = [0] * len(workers)
    sent: set[tuple] = set()
    met = [dict() for _ in workers]  # worker -> collective key -> how many it has done

    def at_collective(rank: int, key: tuple, count: int) -> bool:
        ops = workers[rank]
        return pos[rank] < len(ops) and collective_key(ops[pos[rank]]) == key and met[rank].get(key, 0) == count

    progress = True
    while progress:
        progress = False
        for rank, ops in enumerate(workers):
            while pos[rank] < len(ops):
                op = ops[pos[rank]]
                if op.kind in COLLECTIVES:
                    key, count = collective_key(op), met[rank].get(collective_key(op), 0)
                    if not all(at_collective(member, key, count) for member in op.group):
                        break
                    for member in op.group:
                        pos[member] += 1
                        met[member][key] = count + 1
                elif op.kind == "recv" and message(op, rank) not in sent:
                    break
                else:
                    if op.kind == "send":
                        sent.add(message(op, rank))
                    pos[rank] += 1
                progress = True
    stuck = [rank for rank, ops in enumerate(workers) if pos[rank] < len(ops)]
    if not stuck:
        return
    notes = []
    for rank in stuck[:_MAX_LISTED]:
        op = workers[rank][pos[rank]]
        action = schedule.workers[rank][op.at]
        count = met[rank].get(collective_key(op), 0) + 1
        reason = (sender_action(op) if op.kind == "recv" else f"the other replicas' backward {count} to reduce its "
                  "gradients" if op.kind == "reduce" else f"the other replicas' step {count}")
        notes.append(f"{schedule.label(rank)} at {action} waits for {reason}")
    more = f"; and {len(stuck) - _MAX_LISTED} more" if len(stuck) > _MAX_LISTED else ""
    total = sum(map(len, schedule.workers))
    done = sum(workers[rank][pos[rank]].at if pos[rank] < len(workers[rank]) else len(schedule.workers[rank])
               for rank in range(len(workers)))
    raise ScheduleError(f"deadlock after {done} of {total} actions: {'; '.join(notes)}{more}; "
                        "reorder the actions so that each one's dependency can run first")


def _check_versions(schedule: Schedule) -> None:
    table = schedule.versions()
    for rank, actions in enumerate(schedule.workers):
        made: dict[int, int] = {}  # stage -> its steps so far on this worker
        for action in actions:
            if action.kind == "U":
                made[action.stage] = made.get(action.stage, 0) + 1
                continue
            live = made.get(action.stage, 0)
            version = table[(action.kind, action.stage, action.minibatch)]
            if action.kind == "F" and version > live:
                raise ScheduleError(
                    f"{schedule.label(rank)}: {action} needs version {version} of stage {action.stage} under mode "
                    f"{schedule.mode!r}, but only {live} steps have run there; move it after step {version}")
            batch = action.minibatch // schedule.group
            if schedule.rules.flushes and version != batch:
                raise ScheduleError(
                    f"{schedule.label(rank)}: {action} runs on version {version}, but mode {schedule.mode!r} runs "
                    f"batch {batch} (microbatches {batch * schedule.group}..{(batch + 1) * schedule.group - 1}) on "
                    f"version {batch}; run it after step {batch} and before step {batch + 1}")
    kept = schedule.rules.versions_kept
    if kept is not None and kept > 1:  # one version: the version rule above already holds every action to it
        for rank, peak in peak_versions(schedule).items():
            if peak > kept:
                raise ScheduleError(f"{schedule.label(rank)}: holds {peak} weight versions at once, but mode "
                                    f"{schedule.mode!r} keeps at most {kept}; use a larger group (now {schedule.group}) or fewer in flight")


_NAMES = {"F": "forward", "B": "backward", "W": "weight gradients"}


def _check_link_order(schedule: Schedule, workers) -> None:
    """Per (sender, receiver, direction), the minibatches sent and received come in one order (a
    worker of several stages: (minibatch, boundary) pairs where its messages cross more than one)."""
    order: dict[str, dict[tuple[int, int, int], list]] = {"send": {}, "recv": {}}
    for rank, ops in enumerate(workers):
        for op in ops:
            if op.kind in order:
                source, dest, direction, b, joins = message(op, rank)
                order[op.kind].setdefault((source, dest, direction), []).append((b, joins) if schedule.placement else b)
    for key, sent in order["send"].items():
        received = order["recv"].get(key)
        if received != sent:
            source, dest, direction = key
            what, kind = ("activations", "F") if direction == ACTIVATION else ("gradients", "B")
            raise ScheduleError(f"{schedule.label(dest)} receives the {what} of {schedule.label(source)} in the order "
                                f"{received} but they are sent in the order {sent}; order the {kind} "
                                "actions of both workers alike")
