"""The reference executor: every worker of a schedule in one process, plain tensors.

A test oracle for the distributed runtime (docs/schedules.md): it runs the same
`StageWorker`s on the same schedule, but with messages in dictionaries and the replicas'
all-reduce as a plain sum, in any order that respects the data dependencies. Whatever the
runtime adds (processes, point-to-point messages, process groups, routing) must not change
a single number.

Its independence: it reads the schedule's actions (F, B, W, U), not the lowered ops the runtime
executes (`pdtool.schedule.lower`). Which worker's output a forward or backward takes, and
which workers step together (a stage's replicas, joined with the stages it shares a parameter
with), it works out here on its own from the stages and the schedule's positions. So a wrong
peer, link, collective group or tie set in the lowering shows as a mismatch or a deadlock of
the runtime against this, not as an agreement. A worker of several stages (a schedule with a
placement) runs one `StageWorker` a stage, each action on its stage's, and hands its chunks'
tensors over in the process like any other. It shares with the runtime only `StageWorker`
(the numbers of one stage), which `dist/oracle.py` checks against plain training on its own.
It lives with the tests: nothing in pdtool runs it.
"""
from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any, Callable

import torch

from pdtool.errors import ScheduleError
from pdtool.runtime.worker.executor import StageWorker
from pdtool.runtime.run import OptimizerConfig
from pdtool.schedule import Schedule


@dataclass
class ReferenceRun:
    """What a reference run gives: loss per minibatch, the final weights by qualified name
    (of replica 0 of each stage), and the most stashed weight versions each rank held."""

    losses: dict[int, float]
    weights: dict[str, torch.Tensor]
    peak_versions: dict[int, int]


def run_reference(stages: list, schedule: Schedule, optimizer: OptimizerConfig,
                  loss_fn: Callable[[Any, Any], torch.Tensor], batch: Callable[[int], tuple],
                  prepare: Callable[[StageWorker], None] | None = None, seed: int = 0, first: int = 0,
                  no_decay: frozenset = frozenset(), model_parameters: int | None = None,
                  precision: str = "fp32", recompute: tuple[bool, ...] = ()) -> ReferenceRun:
    """Run `schedule` on `stages` (from `model.stages.build_stages`); `batch(b)` gives
    minibatch b as (inputs tuple, target). The stages' modules are copied per replica;
    `prepare(worker)`, if given, runs on every worker before the first action (e.g. to
    restore a checkpoint, as a resumed run does). `seed` and `first` (the first minibatch of a
    resumed run) seed every forward's random numbers as the runtime does (`StageWorker`).
    `no_decay`, `model_parameters` and `precision` as `StageWorker` takes them; `recompute[s]`, stage
    s's activation recomputation (the plan's). With
    --clip-grad-norm or fp16 in a mode whose stages step together, every stage steps together, on
    the whole model's norm (computed here from the parameters' gradients, each parameter once)."""
    workers: dict[tuple[int, int], StageWorker] = {}  # (stage, replica) -> its worker
    for s, stage in enumerate(stages):
        for i in range(schedule.replicas[s]):
            replica = copy.deepcopy(stage)
            workers[(s, i)] = StageWorker(stage=replica, schedule=schedule, replica=i, optimizer=optimizer,
                                          loss_fn=loss_fn if s == len(stages) - 1 else None, seed=seed, first=first,
                                          no_decay=no_decay, model_parameters=model_parameters, precision=precision,
                                          recompute=s < len(recompute) and recompute[s])
            if prepare is not None:
                prepare(workers[(s, i)])
    ranks = range(schedule.worker_count)
    replica_of = {rank: 0 if schedule.placement else schedule.position(rank)[1] for rank in ranks}
    # stages whose steps happen together: a stage's replicas, joined with every stage it shares a
    # parameter with (tied weights: the copies' gradients are added before the step, as in `runtime.worker.tied`)
    together = {s: {s} for s in range(len(stages))}
    for stage in stages:
        for users in stage.tied.values():
            joined = set().union(*(together[u] for u in users))
            for u in joined:
                together[u] = joined
    whole_norm = ((optimizer.clip_grad_norm is not None or precision == "fp16") and not schedule.rules.per_round
                  and len(stages) > 1)
    if whole_norm:
        together = {s: set(range(len(stages))) for s in range(len(stages))}
    steps_done = {rank: 0 for rank in ranks}
    activations: dict[tuple[int, int], tuple[dict, Any]] = {}  # (stage, b) -> outputs of stage, target
    gradients: dict[tuple[int, int], dict] = {}                # (stage, b) -> gradients of stage's outputs
    position = {rank: 0 for rank in ranks}
    last = len(stages) - 1

    def ready(rank: int) -> bool:
        action = schedule.workers[rank][position[rank]]
        if action.kind == "F":
            return action.stage == 0 or (action.stage - 1, action.minibatch) in activations
        if action.kind == "B":
            return action.stage == last or (action.stage, action.minibatch) in gradients
        if action.kind == "W":
            return True  # its worker's B ran before it
        peers = [schedule.rank(s, i) for s in together[action.stage] for i in range(schedule.replicas[s])]
        return all(position[p] < len(schedule.workers[p]) and schedule.workers[p][position[p]].kind == "U"
                   and steps_done[p] == steps_done[rank] for p in peers)

    while any(position[r] < len(schedule.workers[r]) for r in ranks):
        progressed = False
        for rank in ranks:
            if position[rank] >= len(schedule.workers[rank]) or not ready(rank):
                continue
            action = schedule.workers[rank][position[rank]]
            s, b = action.stage, action.minibatch
            worker = workers[(s, replica_of[rank])]
            if action.kind == "F":
                if s == 0:
                    inputs, target = batch(b)
                    values = dict(zip(stages[0].inputs, inputs))
                else:
                    values, target = activations.pop((s - 1, b))
                out = worker.forward(b, values, target)
                if s < last:
                    activations[(s, b)] = (out, target)
                position[rank] += 1
            elif action.kind == "B":
                grads = worker.backward(b, None if s == last else gradients.pop((s, b)))
                if s > 0:
                    gradients[(s - 1, b)] = grads
                position[rank] += 1
            elif action.kind == "W":
                worker.weight_backward(b)
                position[rank] += 1
            else:
                joined = sorted(together[s])
                for t in joined:
                    peers = [workers[(t, i)] for i in range(schedule.replicas[t])]
                    total = sum(p.stepper.gradient_buffer() for p in peers) if len(peers) > 1 else None
                    for p in peers:
                        p.stepper.mean_gradients(None if total is None else (lambda buffer, total=total: buffer.copy_(total)))
                _add_tied_gradients([workers[(t, i)] for t in joined for i in range(schedule.replicas[t])])
                norm = _norm([workers[(t, 0)] for t in joined]) if whole_norm else None
                for t in joined:
                    for i in range(schedule.replicas[t]):
                        workers[(t, i)].stepper.finish_step(norm)
                        position[schedule.rank(t, i)] += 1
                        steps_done[schedule.rank(t, i)] += 1
            progressed = True
        if not progressed:
            raise ScheduleError("the reference executor is stuck: the schedule deadlocks")
    losses: dict[int, float] = {}
    weights: dict[str, torch.Tensor] = {}
    peaks: dict[int, int] = {}
    for (s, i), worker in workers.items():
        losses.update(worker.losses)
        if worker.replica == 0:
            for name, p in worker.stage.module.named_parameters():
                weights[worker.stage.param_names[name]] = p.detach().clone()
        rank = schedule.rank(s, i)
        peaks[rank] = max(peaks.get(rank, 0), worker.peak_versions)
    return ReferenceRun(losses, weights, peaks)


def _norm(workers: list[StageWorker]) -> float:
    """The gradient norm of the whole model: every parameter once (by its whole-model name)."""
    grads = {}
    for worker in workers:
        worker.stepper.unscale()  # fp16: the gradients without the loss scale
        for name, p in worker.stage.module.named_parameters():
            if p.grad is not None:
                grads.setdefault(worker.stage.param_names[name], p.grad)
    return float(torch.sqrt(sum((g.double() ** 2).sum() for g in grads.values())))


def _add_tied_gradients(workers: list[StageWorker]) -> None:
    """Every copy of a tied parameter gets the sum over its stages of each stage's mean gradient
    (what `runtime.worker.tied` all-reduces: each replica adds its gradient / its stage's replicas)."""
    sums: dict[str, torch.Tensor] = {}
    for worker in workers:
        params = dict(worker.stage.module.named_parameters())
        for name in worker.stage.tied:
            p = params[name]
            grad = (p.grad if p.grad is not None else torch.zeros_like(p)) / worker.schedule.replicas[worker.index]
            whole = worker.stage.param_names[name]
            sums[whole] = grad if whole not in sums else sums[whole] + grad
    for worker in workers:
        params = dict(worker.stage.module.named_parameters())
        for name in worker.stage.tied:
            params[name].grad = sums[worker.stage.param_names[name]].clone()
