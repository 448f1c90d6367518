"""One process of `pd train`: builds its stage from the plan and runs its actions.

Rank and world size come from the environment that torch.distributed's launcher sets
(`RANK`, `WORLD_SIZE`, `LOCAL_RANK`, `MASTER_ADDR`, `MASTER_PORT`). Before any process group
is made the worker checks the plan against the world size and the model's fingerprint, so a
mismatch is one clear error instead of a hang; start-up (joining the job's store, building the
stage, waiting for the others) is bounded as `runtime.peers` says.
"""
from __future__ import annotations

import math
import os
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist

from ...allocator import keep_freed_memory
from ...errors import LaunchError
from ...model.spec import file_model
from ...artifacts.plan import Plan
from ...schedule import ACTIVATION, GRADIENT, Schedule, lower, stash_depth
from ...schedule.lower import Lowered, Op, collective_key
from .comm import Link, Prefetch, BoundaryTensor, layout, link_groups
from .. import peers
from . import shm, tied
from ..device import choose, synchronizer
from .executor import StageWorker
from ..run import RunConfig, WorkerReport, check_world, make_schedule, minibatches_per_step, place


def worker_main(config: RunConfig, store=None) -> WorkerReport:
    """Entry point of every worker process. `store`: the job's store when this process joined it
    already (`peers.join`; a worker started by torchrun or srun, `runtime.launcher.external`)."""
    keep_freed_memory()
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local_rank = int(os.environ.get("LOCAL_RANK", rank))
    placement = choose(config.device, local_rank, int(os.environ.get("LOCAL_WORLD_SIZE", world)))
    if config.threads:
        torch.set_num_threads(config.threads)
    plan = Plan.load(config.plan_path)
    check_world(plan, world, config.plan_path)
    if store is None:
        store = peers.join(rank, world, config.startup_timeout_s)  # start-up: see runtime.peers
    with peers.Beacon(store, rank):
        stage_index, replica = place(plan, rank)
        torch.manual_seed(config.seed)  # every worker builds the same initial weights
        bundle = file_model(plan.profile.model, config.model)
        from ...model.stages import plan_stages, sample_inputs

        stages = plan_stages(plan, bundle.module, sample_inputs(bundle, plan))
        schedule = make_schedule(plan, config)
        tied.check_mode(stages, schedule.mode)
        from ...model.data import load_source

        source = load_source(config.data, bundle, plan.profile.batch_size, config.seed)
        first = config.first_step * minibatches_per_step(schedule)
        batch = lambda b: source.batch(first + b)  # noqa: E731
        specs = boundary_specs(stages, batch(0))
        device = placement.device
        if device.type == "cuda":
            torch.cuda.set_device(device)
        peers.wait_for_peers(store, rank, world, config.timeout_s, config.startup_timeout_s)
        dist.init_process_group(placement.backend, store=store, rank=rank, world_size=world,
                                timeout=timedelta(seconds=config.timeout_s),
                                device_id=device if device.type == "cuda" else None)
    # On an error, no orderly teardown: the launcher records this worker's error before its
    # connections close, so the job reports it rather than a peer's "connection closed".
    ranks = [r for st in plan.stages for r in st.ranks]  # stage-major, as the schedule numbers its workers
    lowered = lower(schedule, tied.sets(stages), ranks)
    ops = lowered.workers[lowered.index(rank)]
    groups = {s: dist.new_group(list(st.ranks)) for s, st in enumerate(plan.stages) if st.replicas > 1}
    links = link_groups(lowered, rank)
    ties = tied.make_ties(stages, [st.ranks for st in plan.stages], stage_index)
    window = max(stash_depth(schedule, s) for s in range(schedule.stages))
    rings = _rings(config, lowered, ops, rank, specs, window, device, store)
    stage = stages[stage_index]
    stage.module.to(device)
    last = stage_index == len(stages) - 1
    loss_fn = bundle.loss_fn
    if last and isinstance(loss_fn, torch.nn.Module):
        loss_fn.to(device)  # e.g. class weights
    worker = StageWorker(stage, schedule, replica, config.optimizer, loss_fn if last else None, config.seed, first)
    if config.resume:
        from .shards import restore

        restore(worker, config.resume)
    saver = None
    if config.checkpoint_dir and replica == 0:
        from .shards import ShardSaver

        saver = ShardSaver(worker, config.checkpoint_dir, config.first_step, config.steps,
                           config.checkpoint_every, minibatches_per_step(schedule), config.run_id)
    on_device = lambda b: tuple(_to(x, device) for x in batch(b))  # noqa: E731
    try:
        report = _run(schedule, ops, worker, specs, on_device, _collectives(ops, groups.get(stage_index), ties),
                      Link(device, window, links, config.timeout_s, rank, rings), saver, first, config.progress,
                      plan.profile.batch_size)
    except peers.PeerTimeout as silent:
        silent.store = silent.store or store  # where the silent peer's process is published (peers.stop_silent)
        raise
    report.peak_versions = worker.peak_versions
    report.rings = len(rings)
    if config.return_weights:
        report.weights = {stage.param_names[n]: p.detach().cpu().clone() for n, p in stage.module.named_parameters()}
    dist.barrier()
    dist.destroy_process_group()
    return report


def _rings(config: RunConfig, lowered: Lowered, ops, rank: int, specs, window: int, device: torch.device,
           store) -> dict:
    """Shared-memory rings (`runtime.worker.shm`) for the directions of this worker's links (its send
    and recv ops) whose peer the same launcher started (`--transport`); the rest go through the
    process group."""
    node, local = os.environ.get(shm.NODE_ENV), int(os.environ.get("LOCAL_WORLD_SIZE", 1))
    if not node or not shm.use_shared_memory(config.transport, device, local):
        return {}
    ends = {(op.peer, op.direction): op for op in ops if op.kind in ("send", "recv")}  # one op of each direction
    pids = {peer: peers.process_of(store, peer) for peer, _ in ends}
    spin = shm.cores_for_each(local)
    directions = []
    for (peer, direction), op in sorted(ends.items()):
        if pids[peer][2] != node:
            continue
        message = message_specs(specs, lowered, op)
        directions.append(shm.Direction(peer, direction, op.kind == "recv",
                                        layout([(t.shape, t.dtype) for t in message], pack_all=True).size))
    rings, made = shm.open_rings(
        store, node, rank, directions, window,
        lambda peer: shm.Waiter(spin, config.timeout_s, rank, peer, pids[peer][1]))
    dist.barrier()  # every ring is mapped: its file can go
    shm.remove(made)
    return rings


def message_specs(specs, lowered: Lowered, op: Op) -> list[BoundaryTensor]:
    """What the message of a `send`/`recv` op carries: what its receiving stage takes in
    (`incoming_specs`)."""
    return incoming_specs(specs, lowered.receiver_stage(op), op.direction)


def incoming_specs(specs, s: int, direction: int) -> list[BoundaryTensor]:
    """What stage s receives in one direction: the previous stage's outputs and the target
    (activations), or the gradients of its own floating-point outputs (none on the last stage)."""
    if direction == ACTIVATION:
        return (specs[s - 1] if s > 0 else []) + specs[-1]
    return [t for t in specs[s] if t.dtype.is_floating_point] if s < len(specs) - 1 else []


def boundary_specs(stages, sample) -> list[list[BoundaryTensor]]:
    """Per stage, the names, shapes and dtypes of what it sends on, and last the target's."""
    inputs, target = sample
    values = dict(zip(stages[0].inputs, inputs))
    specs = []
    with torch.no_grad():
        for stage in stages[:-1]:
            values = stage.forward(values)
            specs.append([BoundaryTensor(n, tuple(values[n].shape), values[n].dtype) for n in stage.outputs])
    specs.append([BoundaryTensor("target", tuple(target.shape), target.dtype)])
    return specs


def _to(value, device: torch.device):
    """A minibatch's inputs (a tuple of tensors) or target, on `device`."""
    if isinstance(value, (tuple, list)):
        return type(value)(_to(v, device) for v in value)
    return value.to(device, non_blocking=True) if isinstance(value, torch.Tensor) else value


def _run(schedule: Schedule, ops, worker: StageWorker, specs, batch, collectives, link: Link, saver, first: int,
         show_progress: bool, batch_size: int) -> WorkerReport:
    """Execute this worker's lowered ops (`schedule.lower`) in order."""
    s, replica = worker.index, worker.replica
    last = s == schedule.stages - 1
    incoming = {d: incoming_specs(specs, s, d) for d in (ACTIVATION, GRADIENT)}
    report = WorkerReport(rank=worker.rank, stage=s, replica=replica)
    start = time.perf_counter()
    sync = synchronizer(link.device)

    def clock() -> float:  # wall time after the device's queued work: events cover the work they name
        sync()
        return time.time()
    progress = (_TrainProgress(first + schedule.minibatches, batch_size)
                if show_progress and last and replica == 0 else None)
    # The input stage makes the minibatch of its next forward before it waits for a gradient: the
    # making overlaps the wait and leaves the path gradient -> backward -> forward -> next stage
    # (bench/train_speed.py model, 3 paired runs of 160 minibatches: 1.1-1.4 ms per minibatch less).
    made: dict[int, tuple] = {}
    upcoming = _next_forwards(ops) if s == 0 and not last else None
    inbox: dict[tuple[int, int], list] = {}   # (direction, minibatch) -> tensors received
    outbox: dict[tuple[int, int], list] = {}  # (direction, minibatch) -> tensors to send
    prefetch = Prefetch(ops, link.window)
    step_began = 0.0
    for i, op in enumerate(ops):
        for ahead in prefetch.fresh[i]:
            link.post_recv((ahead.direction, ahead.minibatch), ahead.peer, incoming[ahead.direction], ahead.direction)
        b = op.minibatch
        if op.kind == "recv":
            if upcoming is not None and upcoming[i] is not None and upcoming[i] not in made:
                made[upcoming[i]] = batch(upcoming[i])
            inbox[(op.direction, b)] = link.wait_recv((op.direction, b))
        elif op.kind == "send":
            link.send(outbox.pop((op.direction, b)), op.peer, b, op.direction)
        elif op.kind == "F":
            if s == 0:
                inputs, target = made.pop(b) if b in made else batch(b)
                values = dict(zip(worker.stage.inputs, inputs))
            else:
                received = inbox.pop((ACTIVATION, b))
                values = {t.name: x for t, x in zip(specs[s - 1], received)}
                target = received[-1]
            began = clock()
            out = worker.forward(b, values, target)
            report.events.append((f"{s}F{b}", began, clock()))
            if last and not math.isfinite(out):
                step = (first + b) // minibatches_per_step(schedule) + 1
                raise LaunchError(f"the loss became {out} at step {step} (minibatch {first + b}, last stage {s}): "
                                  "training diverged; lower --lr, then --resume from the last checkpoint (written "
                                  "before this step, it is kept)")
            if not last:
                outbox[(ACTIVATION, b)] = [out[t.name] for t in specs[s]] + [target]
        elif op.kind == "B":
            grads = None if last else {t.name: g for t, g in zip(incoming[GRADIENT], inbox.pop((GRADIENT, b)))}
            began = clock()
            input_grads = worker.backward(b, grads, op.weights)
            report.events.append((f"{s}B{b}", began, clock()))
            if last:
                report.finished[first + b] = report.events[-1][2]
                if progress is not None:
                    progress.update(first + b, worker.losses.get(b))
            if s > 0:
                outbox[(GRADIENT, b)] = [input_grads.get(t.name, torch.zeros(t.shape, dtype=t.dtype, device=link.device))
                                         for t in specs[s - 1] if t.dtype.is_floating_point]
        elif op.kind == "W":
            began = clock()
            worker.weight_backward(b)
            report.events.append((f"{s}W{b}", began, clock()))
        elif op.kind in ("allreduce", "tie"):
            if op.kind == "allreduce":
                step_began = clock()
            collectives[collective_key(op)](worker)
        else:  # step
            worker.finish_step()
            report.events.append((f"{s}U", step_began, clock()))
            began = clock()
            if saver is not None and saver.after_step():
                report.events.append(("checkpoint", began, clock()))  # shows in the trace, counts as busy
    link.flush()
    if progress is not None:
        progress.close()
    report.losses = {first + b: loss for b, loss in worker.losses.items()}
    report.busy_s = sum(end - began for _, began, end in report.events)
    report.wall_s = time.perf_counter() - start
    return report


def _collectives(ops, replicas_group, ties: dict) -> dict:
    """What each collective op of this worker runs, by `collective_key`: the replicas' gradient
    mean (an all-reduce over `replicas_group`, or local with one replica) and the tied-weight sums."""
    found = {}
    for op in {collective_key(op): op for op in ops if op.kind in ("allreduce", "tie")}.values():
        if op.kind == "allreduce" and len(op.group) > 1:
            found[collective_key(op)] = lambda w: w.mean_gradients(
                lambda buffer: dist.all_reduce(buffer, group=replicas_group))
        elif op.kind == "allreduce":
            found[collective_key(op)] = lambda w: w.mean_gradients(None)
        elif op.kind == "tie":
            found[collective_key(op)] = ties[op.stages]
    return found


def _next_forwards(ops) -> list[int | None]:
    """For each op index, the minibatch of the first forward after it (None: no more)."""
    following: list[int | None] = [None] * len(ops)
    nxt = None
    for i in range(len(ops) - 1, -1, -1):
        following[i] = nxt
        if ops[i].kind == "F":
            nxt = ops[i].minibatch
    return following


class _TrainProgress:
    """One line on stderr, at most once a second: minibatches done, loss, samples/s."""

    def __init__(self, total: int, batch_size: int):
        self.total, self.batch_size = total, batch_size
        self.began = self.last = time.monotonic()
        self.done = 0
        self.tty = sys.stderr.isatty()

    def update(self, minibatch: int, loss: float | None) -> None:
        self.done += 1
        now = time.monotonic()
        if now - self.last >= 1.0 or minibatch + 1 == self.total:
            rate = self.done * self.batch_size / max(now - self.began, 1e-9)
            text = f"minibatch {minibatch + 1}/{self.total}  loss {loss:.4f}  {rate:.1f} samples/s"
            sys.stderr.write(f"\r\033[K{text}" if self.tty else text + "\n")
            sys.stderr.flush()
            self.last = now

    def close(self) -> None:
        if self.tty:
            sys.stderr.write("\n")
            sys.stderr.flush()
