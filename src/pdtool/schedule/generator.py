"""`generate`: one schedule builder for every mode.

Every worker (stage s, replica i) runs the minibatches b = i, i + r_s, i + 2 r_s, ... (1F1B-RR,
PipeDream SOSP'19 section 3.2), in one of two orders:
- 1F1B: `warmup_forwards` forwards, then strictly one forward and one backward, then the
  remaining backwards. pipedream, vsync and 2bw run it over the whole run (PipeDream SOSP'19
  section 3.2; PipeDream-2BW arXiv 2006.09503 section 3.1), or, with `drain_every`, over each
  segment of that many minibatches: the pipeline drains at every segment's end, where a
  checkpoint then holds everything the run has done and nothing in flight, so a run resumed
  there (a fresh schedule of the remaining minibatches) equals the uninterrupted one. flush runs
  1F1B inside each batch of m microbatches and drains the pipeline before the step
  (PipeDream-Flush, arXiv 2006.09503 section 3.2).
- gpipe: per batch of m, all its forwards, then all its backwards in the same order.
- zb (zero bubble, ZB-H1): flush's order with every backward split into B (input gradients,
  what the stage before waits for) and W (weight gradients, which nobody waits for): a worker
  of stage s runs W of its oldest pending minibatch after each B from its (s+1)-th on, and the
  remaining Ws at the end of the batch, where they fill the drain (`weight_lag`).
- zb2 (ZB-H2): zb with twice the warm-up forwards and twice the lag, so that the start of a
  batch is filled too, holding 2p - 1 minibatches on p stages where zb holds p.
- the modes of several stages (chunks) per worker (`interleaved`): the order of their own
  function in `chunked`, batch by batch, each batch closed by a step of every chunk of the worker.
Then the optimizer steps go in: the step closing step group t (`step_group` minibatches) comes
right after the worker's last backward of a minibatch of groups 0..t, or first of all if it has
none. On a replicated stage every replica thus runs one U per group, including groups it had no
minibatch of (with round robin, a final partial round of pipedream/vsync, or a replica that gets
no microbatch of a batch): it joins the all-reduce with no gradient of its own.
"""
from __future__ import annotations

import math
from typing import Sequence

from ..errors import ScheduleError
from . import chunked
from .core import Action, Schedule, check_parameters, step_group, steps
from .modes import ALL_FORWARD, resolve, warmup_forwards, weight_lag


def generate(mode: str, replicas: Sequence[int], minibatches: int, group: int | None = None,
             drain_every: int | None = None, placement: Sequence[int] = ()) -> Schedule:
    """The schedule of `mode` for `minibatches` minibatches on stages with `replicas` replicas each.

    `group` is m, the microbatches per optimizer step, for 2bw, flush and gpipe; it defaults to
    `default_group(replicas)` (the number of stages on a straight pipeline), and `minibatches`
    must be a multiple of it. pipedream and vsync take no group (None or 1).

    `drain_every` (minibatches; None: never) drains the pipeline after every that many
    minibatches: the schedule is then the concatenation of the schedules of its segments, minibatch
    ids shifted by the segment's start. It must be a multiple of every stage's step group (r_s in
    pipedream and vsync, m otherwise), so that no step spans two segments. flush, gpipe, zb and
    zb2 drain after every step anyway: there it changes nothing.

    `placement`: the worker of every stage, for the modes that run several stages per worker
    (`Mode.placement`; `placement.make` builds it).
    """
    if group is None:
        group = resolve(mode, mode, replicas).group
    check_parameters(mode, replicas, minibatches, group, placement)
    if placement:
        return _chunked(mode, tuple(replicas), minibatches, group, tuple(placement))
    shell = Schedule(mode=mode, replicas=tuple(replicas), minibatches=minibatches, group=group,
                     workers=tuple(() for _ in range(sum(replicas))))
    span = _batch_span(shell, drain_every)
    workers = []
    for stage, count in enumerate(shell.replicas):
        for replica in range(count):
            batches: list[list[int]] = [[] for _ in range(-(-minibatches // span))]
            for b in range(replica, minibatches, count):  # one pass: the run's length, not its square
                batches[b // span].append(b)
            order = [action for batch in batches for action in _forward_backward_order(shell, stage, batch)]
            workers.append(_with_steps(shell, stage, order))
    return Schedule(mode=mode, replicas=shell.replicas, minibatches=minibatches, group=group, workers=tuple(workers))


def _chunked(mode: str, replicas: tuple[int, ...], minibatches: int, group: int,
             placement: tuple[int, ...]) -> Schedule:
    """Every worker's order of a multi-chunk mode (`chunked.ORDERS`), batch by batch, each batch
    closed by a step of every one of the worker's stages."""
    workers = max(placement) + 1
    chunks = len(placement) // workers
    lists = []
    for worker in range(workers):
        one = chunked.ORDERS[mode](workers, chunks, group, worker)
        own = [Action("U", stage) for stage, w in enumerate(placement) if w == worker]
        order: list[Action] = []
        for start in range(0, minibatches, group):
            order += [Action(kind, stage, start + b) for kind, stage, b in one] + own
        lists.append(tuple(order))
    return Schedule(mode=mode, replicas=replicas, minibatches=minibatches, group=group, workers=tuple(lists),
                    placement=placement)


def _batch_span(shell: Schedule, drain_every: int | None) -> int:
    """Minibatches between two drains of the pipeline: m in the flush modes, `drain_every` (or the
    whole run) in pipedream, vsync and 2bw. Raises ScheduleError for a `drain_every` that is not
    a positive multiple of every stage's step group."""
    if drain_every is not None:
        sizes = sorted({step_group(shell, stage) for stage in range(shell.stages)})
        if not _is_positive(drain_every) or any(drain_every % size for size in sizes):
            raise ScheduleError(
                f"drain_every={drain_every!r} minibatches for mode {shell.mode!r} on replicas {shell.replicas}: a "
                f"drain must fall between two steps of every stage, so it must be a positive multiple of "
                f"{math.lcm(*sizes)} (the stages step every {', '.join(map(str, sizes))} minibatches)")
    if shell.rules.flushes:
        return shell.group
    return drain_every or shell.minibatches


def _forward_backward_order(shell: Schedule, stage: int, batch: list[int]) -> list[Action]:
    """F and B (and W) actions of one worker for its minibatches `batch` of one span between
    drains, before the steps go in."""
    if shell.rules.order == ALL_FORWARD:
        return [Action("F", stage, b) for b in batch] + [Action("B", stage, b) for b in batch]
    warmup = min(warmup_forwards(shell.replicas, stage, shell.mode), len(batch))
    order = [Action("F", stage, b) for b in batch[:warmup]]
    steady = [[Action("F", stage, forward), Action("B", stage, backward)]
              for forward, backward in zip(batch[warmup:], batch)]
    drain = [[Action("B", stage, b)] for b in batch[len(batch) - warmup:]]
    if shell.rules.split:
        _add_weight_gradients(steady + drain, stage, weight_lag(shell.replicas, stage, shell.mode))
    return order + [action for actions in steady + drain for action in actions]


def _add_weight_gradients(rounds: list[list[Action]], stage: int, lag: int) -> None:
    """In place: after the B of each round from round `lag` on, the W of the oldest minibatch
    whose B ran; the Ws still pending after the last round."""
    pending: list[int] = []
    for index, actions in enumerate(rounds):
        pending.append(actions[-1].minibatch)
        if index >= lag:
            actions.append(Action("W", stage, pending.pop(0)))
    if rounds:
        rounds[-1] += [Action("W", stage, b) for b in pending]


def _with_steps(shell: Schedule, stage: int, order: list[Action]) -> tuple[Action, ...]:
    """`order` with the U of step group t after the worker's last backward of groups 0..t."""
    size = step_group(shell, stage)
    last = [-1] * steps(shell, stage)  # last[t]: index in `order` of the worker's last backward of group t
    for index, action in enumerate(order):
        if action.kind in ("B", "W"):  # a step needs the weight gradients of its group
            last[action.minibatch // size] = max(last[action.minibatch // size], index)
    follows: dict[int, int] = {}  # index in `order` (-1: the start) -> how many U come right after it
    latest = -1
    for t in range(len(last)):
        latest = max(latest, last[t])
        follows[latest] = follows.get(latest, 0) + 1
    result = [Action("U", stage)] * follows.get(-1, 0)
    for index, action in enumerate(order):
        result.append(action)
        result += [Action("U", stage)] * follows.get(index, 0)
    return tuple(result)


def _is_positive(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1
