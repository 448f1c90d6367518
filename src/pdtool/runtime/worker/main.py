"""One process of `pd train`: builds its stage from the plan and runs its actions.

Rank and world size come from the environment that torch.distributed's launcher sets
(`RANK`, `WORLD_SIZE`, `LOCAL_RANK`, `MASTER_ADDR`, `MASTER_PORT`). Before any process group
is made the worker checks the plan against the world size and the model's fingerprint, so a
mismatch is one clear error instead of a hang; start-up (joining the job's store, building the
stage, waiting for the others) is bounded as `runtime.peers` says. The loop over the worker's
ops is `runtime.worker.interpreter`.
"""
from __future__ import annotations

import functools
import os
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Callable

import torch
import torch.distributed as dist

from ...allocator import keep_freed_memory
from ...artifacts.plan import Plan
from ...precision import message_dtype
from ...schedule import Schedule, lower
from ...schedule.lower import Lowered, collective_key
from .comm import BoundaryTensor, Link, layout, link_groups, message_specs
from .. import peers
from .. import optimizers
from ..ties import check_mode, sets
from . import evaluation, memory, optim, parameter_shard, shm, tied
from ..device import Placement, choose
from .executor import StageWorker
from .interpreter import Context, Interpreter
from ..run import (
    RunConfig, WorkerReport, check_world, evaluation_points, make_schedule, minibatches_per_step, place, sharded,
    stages_here,
)


def worker_main(config: RunConfig, store=None) -> WorkerReport:
    """Entry point of every worker process. `store`: the job's store when this process joined it
    already (`peers.join`; a worker started by torchrun or srun, `runtime.launcher.external`)."""
    began = time.time()
    rank, world, placement = _environment(config)
    device = placement.device
    base = memory.start(device)  # before the stage is built: its peak is measured from here
    plan = Plan.load(config.plan_path)
    check_world(plan, world, config.plan_path)
    if store is None:
        store = peers.join(rank, world, config.startup_timeout_s)  # start-up: see runtime.peers
    with peers.Beacon(store, rank):
        built = _build(config, plan, rank, device)
        startup = {"began": began, "built": time.time()}
        _join_group(config, placement, store, rank, world)
        startup["joined"] = time.time()
    # On an error, no orderly teardown: the launcher records this worker's error before its
    # connections close, so the job reports it rather than a peer's "connection closed".
    ops, link, collectives, norm, replicas = _connect(config, plan, built, rank, device, store)
    workers, savers = _stage_workers(config, built, device, sharded(plan, config), replicas,
                                     [st.ranks for st in plan.stages])
    publish = peers.publisher(store, rank) if config.live else None
    context = Context(
        schedule=built.schedule,
        ops=ops,
        specs=built.specs,
        batch=_on_device(built.batch, device),
        collectives=collectives,
        link=link,
        saver=savers if len(workers) > 1 else savers.get(built.stage_index),
        first=built.first,
        show_progress=config.progress,
        batch_size=plan.profile.batch_size,
        norm=norm,
        publish=publish,
        evaluation=built.evaluation,
        held_out=(
            _on_device(built.evaluation.source.batch, device)
            if built.evaluation is not None and built.evaluation.source is not None
            else None
        ),
    )
    startup_peak = memory.training_starts(device)
    try:
        report = Interpreter(workers, context).run()
    except peers.PeerTimeout as silent:
        silent.store = silent.store or store  # where the silent peer's process is published (peers.stop_silent)
        raise
    report.startup = startup
    chunks = list(workers.values())
    return _end(config, report, chunks, link, memory.measure(chunks, device, base, startup_peak))


def _environment(config: RunConfig) -> tuple[int, int, Placement]:
    """This process's rank, the world's size and its device, from the launcher's environment."""
    keep_freed_memory()
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local_rank = int(os.environ.get("LOCAL_RANK", rank))
    placement = choose(config.device, local_rank, int(os.environ.get("LOCAL_WORLD_SIZE", world)))
    if config.threads:
        torch.set_num_threads(config.threads)
    return rank, world, placement


@dataclass(frozen=True, kw_only=True)
class _Built:
    """This worker's place in the plan and what it builds from the launcher's capture: its own
    `stages` by index (one, or a worker of several stages'; only their parameters hold memory;
    `stage_index` and `stage` its first), the `capture` (every stage's description and message
    specs), the `schedule`, the model's `loss_fn`, the run's `first` minibatch, `batch` (minibatch
    counted from `first` -> (inputs, target)) and every stage's boundary `specs`."""

    stage_index: int
    replica: int
    stage: object
    stages: dict
    capture: object
    schedule: Schedule
    loss_fn: Callable
    first: int
    batch: Callable[[int], tuple]
    specs: list[list[BoundaryTensor]]
    no_decay: frozenset = frozenset()  # whole-model names without weight decay (`runtime.optimizers.no_decay`)
    model_parameters: int = 0          # the whole model's parameter count (the clipping budget's share)
    precision: str = "fp32"            # what the stage computes in and its messages travel in (`pdtool.precision`)
    recompute: dict | None = None      # stage -> whether the plan's stage recomputes its forward in each backward
    evaluation: object | None = None   # where the run evaluates through the pipeline (`worker.evaluation`)


def _build(config: RunConfig, plan: Plan, rank: int, device: torch.device) -> _Built:
    """This worker's stage (`model.capture.own_stage`), the schedule and the data (within start-up)."""
    stage_index, replica = place(plan, rank)
    here = stages_here(plan, rank)
    from ...model.build import build_model
    from ...model.capture import own_copies, own_stage, release_others
    from ...model.data import load_source

    bundle, on_meta = build_model(plan.profile.model, config.model, config.seed, config.init)
    source = load_source(config.data, bundle, plan.profile.batch_size, config.seed)
    capture = config.capture  # the launcher's (`launcher.job.with_capture`)
    weights = None
    if config.init_from:
        from ...model.weights import WeightFiles

        weights = WeightFiles.open(config.init_from)
    stages = {s: own_stage(capture, s, plan=plan, bundle=bundle, seed=config.seed, device=device, on_meta=on_meta,
                           weights=weights, release=len(here) == 1) for s in here}
    if len(here) > 1:
        release_others(bundle.module, list(stages.values()))
        own_copies([stages[s] for s in sorted(stages)])
    stage = stages[stage_index]
    schedule = make_schedule(plan, config)
    check_mode(capture.stages, schedule.mode)
    first = config.first_step * minibatches_per_step(schedule)
    batch = lambda b: source.batch(first + b)  # noqa: E731
    precision = config.precision or plan.profile.precision
    specs = [[BoundaryTensor(name, tuple(shape), message_dtype(getattr(torch, dtype), precision))
              for name, shape, dtype in boundary] for boundary in capture.specs]
    return _Built(stage_index=stage_index, replica=replica, stage=stage, stages=stages, capture=capture,
                  schedule=schedule,
                  loss_fn=bundle.loss_fn, first=first, batch=batch, specs=specs,
                  no_decay=optimizers.no_decay(bundle.module),
                  model_parameters=sum(p.numel() for p in bundle.module.parameters()), precision=precision,
                  recompute={s: plan.stages[s].recompute for s in here},
                  evaluation=_evaluation(config, plan, schedule, bundle, stage_index))


def _evaluation(config: RunConfig, plan: Plan, schedule, bundle, stage_index: int):
    """Where this run evaluates through the pipeline (None: nowhere); stage 0 reads the held-out split."""
    if not (config.eval_every or config.evaluate) or not config.eval_batches:
        return None
    found = evaluation_points(schedule.minibatches, minibatches_per_step(schedule), config.eval_every,
                              config.evaluate)
    source = None
    if stage_index == 0:
        from ...model.data import dataset_source, held_out

        source = dataset_source(held_out(config.data), plan.profile.batch_size, config.seed, name="the held-out split",
                                keywords=bundle.keywords)
    return evaluation.Evaluation(found, config.eval_batches, schedule.minibatches, source)


def _join_group(config: RunConfig, placement: Placement, store, rank: int, world: int) -> None:
    """Wait for every worker to have built its stage, then make the default process group."""
    device = placement.device
    if device.type == "cuda":
        torch.cuda.set_device(device)
    peers.wait_for_peers(store, rank, world, config.timeout_s, config.startup_timeout_s)
    dist.init_process_group(placement.backend, store=store, rank=rank, world_size=world,
                            timeout=timedelta(seconds=config.timeout_s),
                            device_id=device if device.type == "cuda" else None)


def _connect(config: RunConfig, plan: Plan, built: _Built, rank: int, device: torch.device,
             store) -> tuple[tuple, Link, dict, Callable | None, Any]:
    """This worker's lowered ops, its link to its neighbours (process groups, shared-memory
    rings), its collectives, the whole model's gradient norm where the recipe clips it across
    stages (else None) and its stage's replicas' process group (None: no replicas). Every rank
    makes every process group, in one order."""
    lowered = lower(built.schedule, sets(built.capture.stages), plan.schedule_ranks,
                    reduce_each=plan.with_shard(config.shard).reduces_each(built.schedule.mode))
    ops = lowered.workers[lowered.index(rank)]
    if built.evaluation is not None:
        ops = evaluation.with_evaluations(ops, sorted(built.stages), built.replica,
                                          [st.ranks[0] for st in plan.stages], built.evaluation)
    groups = {s: dist.new_group(list(st.ranks)) for s, st in enumerate(plan.stages) if st.replicas > 1}
    norm = _whole_norm(config, built, plan, device)
    links = link_groups(lowered, rank)
    ties = tied.make_ties(built.capture.stages, list(built.stages.values()), [st.ranks for st in plan.stages])
    windows = lowered.windows(rank)
    rings = _rings(config=config, lowered=lowered, ops=ops, rank=rank, specs=built.specs, windows=windows,
                   device=device, store=store)
    collectives = _collectives(ops, groups.get(built.stage_index), ties)
    return (ops, Link(device, windows, links, config.timeout_s, rank, rings), collectives, norm,
            groups.get(built.stage_index))


def _whole_norm(config: RunConfig, built: _Built, plan: Plan, device: torch.device) -> Callable | None:
    """Where stages step together and clip or scale the loss (`worker.optim`): a function that
    all-reduces the stages' squared gradient norms (each replica adds its share) and returns the
    whole model's norm. Every rank makes its process group (or none), in one order."""
    if not optim.norm_across_stages(config.optimizer, built.precision, built.schedule):
        return None
    group = dist.new_group(sorted(plan.used_ranks))
    replicas = plan.stages[built.stage_index].replicas

    def norm(workers: list[StageWorker]) -> float:
        total = torch.tensor([sum(w.stepper.squared_norm() for w in workers) / replicas], dtype=torch.float64,
                             device=device)
        dist.all_reduce(total, group=group)
        return float(total.clamp_min(0).sqrt())

    return norm


def _stage_workers(config: RunConfig, built: _Built, device: torch.device, shard: tuple[str | None, ...],
                   replicas_group, ranks: list[tuple[int, ...]]) -> tuple[dict, dict]:
    """This worker's stages on its device, each with its optimizer (restored on --resume; its
    shard where `shard` says, gathered over `replicas_group`, whose replicas are `ranks[stage]`),
    and the savers of their checkpoint shards (replica 0, with --checkpoint-dir; every replica of
    a sharded optimizer), by stage."""
    workers, savers = {}, {}
    for index, stage in built.stages.items():
        stage.module.to(device)
        last = index == len(built.capture.stages) - 1
        loss_fn = built.loss_fn
        if last and isinstance(loss_fn, torch.nn.Module):
            loss_fn.to(device)  # e.g. class weights
        parameters = None
        if shard[index] == "parameters":  # FSDP2 over the replicas (`parameter_shard`), before the optimizer is made
            from .parameter_shard import ParameterSharding

            parameters = ParameterSharding(stage.module, replicas_group, device, built.schedule.rules.split)
        worker = workers[index] = StageWorker(
            stage=stage, schedule=built.schedule, replica=built.replica, optimizer=config.recipe,
            loss_fn=loss_fn if last else None, seed=config.seed, first=built.first, no_decay=built.no_decay,
            model_parameters=built.model_parameters, precision=built.precision, recompute=built.recompute[index],
            sharded=shard[index], parameters=parameters)
        if shard[index] in ("optimizer", "gradients") and worker.stepper.optimizer is not None:
            worker.stepper.optimizer.gather = functools.partial(_gather, ranks=ranks[index],
                                                                group=replicas_group)
        if worker.stepper.reducer is not None:
            worker.stepper.reducer.allreduce = functools.partial(dist.all_reduce, group=replicas_group)
        if config.resume:
            from .shards import restore

            restore(worker, config.resume)
        if config.checkpoint_dir and (built.replica == 0 or shard[index]):
            from .shards import ShardSaver

            savers[index] = ShardSaver(worker, config.checkpoint_dir, config.first_step, config.steps,
                                       config.checkpoint_every, minibatches_per_step(built.schedule), config.run_id,
                                       write=built.replica == 0)
    return workers, savers


def _gather(buffer: torch.Tensor, size: int, whole: bool = True, *, ranks: tuple[int, ...], group) -> None:
    """Every replica's slice of `buffer` (replica i's: the i-th `size` elements) from that replica,
    in place: one broadcast each (`worker.optimizer_shard`; gloo's all-gather would hold a second
    buffer of the whole size). `whole` False: `buffer` is this replica's slice alone, which it
    gives; the others' pass through one slice of scratch."""
    me, scratch = dist.get_rank(), None
    for i, rank in enumerate(ranks):
        if whole:
            part = buffer[i * size:(i + 1) * size]
        elif rank == me:
            part = buffer
        else:
            scratch = torch.empty_like(buffer) if scratch is None else scratch
            part = scratch
        dist.broadcast(part, src=rank, group=group)


def _end(config: RunConfig, report: WorkerReport, workers: list[StageWorker], link: Link,
         measured: dict) -> WorkerReport:
    """The report completed (its memory, weights on request), once every worker is done."""
    report.peak_versions = max(worker.peak_versions for worker in workers)
    report.rings = len(link.rings)
    report.memory = measured
    if config.return_weights:  # sharded parameters gathered (a collective of the stage's replicas)
        report.weights = {worker.stage.param_names[n]: parameter_shard.full(p.detach()).cpu().clone()
                          for worker in workers for n, p in worker.stage.module.named_parameters()}
    dist.barrier()
    dist.destroy_process_group()
    return report


def _on_device(batch: Callable[[int], tuple], device: torch.device) -> Callable[[int], tuple]:
    """`batch` with its minibatches' tensors on `device`."""
    return lambda b: tuple(_to(x, device) for x in batch(b))


def _rings(*, config: RunConfig, lowered: Lowered, ops, rank: int, specs, windows: dict, device: torch.device,
           store) -> dict:
    """Shared-memory rings (`runtime.worker.shm`) for the directions of this worker's links (its send
    and recv ops) whose peer the same launcher started (`--transport`); the rest go through the
    process group."""
    node, local = os.environ.get(peers.NODE_ENV), int(os.environ.get("LOCAL_WORLD_SIZE", 1))
    if not node or not shm.use_shared_memory(config.transport, device, local):
        return {}
    # the ops of each direction of each link (a worker of several stages: of several boundaries, maybe both ways)
    ends: dict[tuple[int, int, bool], list] = {}
    for op in ops:
        if op.kind in ("send", "recv"):
            ends.setdefault((op.peer, op.direction, op.kind == "recv"), []).append(op)
    pids = {peer: peers.process_of(store, peer) for peer, _, _ in ends}
    spin = shm.cores_for_each(local)
    directions = []
    for (peer, direction, _), these in sorted(ends.items()):
        if pids[peer][2] != node:
            continue
        sizes = {layout([(t.shape, t.dtype) for t in message_specs(specs, lowered, op)], pack_all=True).size
                 for op in {op.stage: op for op in these}.values()}  # one op of each boundary: the largest message
        directions.append(shm.Direction(peer=peer, direction=direction, receiving=these[0].kind == "recv",
                                        nbytes=max(sizes), slots=windows[(peer, direction)]))
    rings, made = shm.open_rings(
        store, node, rank, directions,
        lambda peer: shm.Waiter(spin=spin, timeout_s=config.timeout_s, rank=rank, peer=peer, peer_pid=pids[peer][1]))
    dist.barrier()  # every ring is mapped: its file can go
    shm.remove(made)
    return rings


def _to(value, device: torch.device):
    """A minibatch's inputs (a tuple of tensors) or target, on `device`."""
    if isinstance(value, (tuple, list)):
        return type(value)(_to(v, device) for v in value)
    return value.to(device, non_blocking=True) if isinstance(value, torch.Tensor) else value


def _collectives(ops, replicas_group, ties: dict) -> dict:
    """What each collective op of this worker runs, by `collective_key`: the replicas' gradient
    mean (an all-reduce over `replicas_group`, or local with one replica) and the tied-weight sums
    (a `reduce` op, of sharded gradients, goes to the stage's `GradientReducer` itself)."""
    found = {}
    for op in {collective_key(op): op for op in ops if op.kind in ("allreduce", "tie")}.values():
        if op.kind == "allreduce" and len(op.group) > 1:
            found[collective_key(op)] = lambda w: w.stepper.mean_gradients(
                lambda buffer: dist.all_reduce(buffer, group=replicas_group))
        elif op.kind == "allreduce":
            found[collective_key(op)] = lambda w: w.stepper.mean_gradients(None)
        elif op.kind == "tie":
            found[collective_key(op)] = ties[op.stages]

    return found
