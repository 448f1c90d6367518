"""Benchmark of `pd train`: pdtool's runtime against torch.distributed.pipelining, DDP and one process.

Side by side in one run on this machine: the same model, the same 2-stage split (the one
`make_plan(..., straight=True)` picks for 2 workers from a 1-thread profile), the same
microbatch size and optimizer (SGD, lr 0.01, momentum 0.9); every worker is its own process
with one thread (`torch.set_num_threads(1)`), gloo on CPU:

- pdtool `flush` (m microbatches per step), `zb` (flush with each backward split into its input
  and weight gradients, ZB-H1), `zb2` (zb with twice the warm-up forwards and the weight
  gradients kept back: ZB-H2, 2p - 1 microbatches in flight where zb holds p) and `pipedream` (a
  step after every minibatch), started by
  `pdtool.runtime.launcher.launch.launch`, as `pd train` starts them;
- torch.distributed.pipelining's `Schedule1F1B`, `ScheduleGPipe` and
  `ScheduleInterleavedZeroBubble` (with one stage per rank: its ZB-H1) (n_microbatches = m per
  step) on pdtool's own two stage modules (`model.stages.plan_stages`), wrapped to take and
  return positional tensors, 2 processes (torch.multiprocessing);
- DDP: 2 processes with a full replica each; a step is the same global batch as a flush step,
  m microbatches of the profile's batch size, m/2 on each replica (accumulated under `no_sync`,
  then one bucketed all-reduce), at the same microbatch size so every matmul has the same shape;
- one process: plain training of the whole model, m microbatches per step (accumulation);
- the limit: microbatch size / the slowest stage's forward+backward time measured alone in one
  process (plain autograd, no optimizer, no messages, no data): the best a 2-stage pipeline
  can do. "both stages at once" runs the two stages' loops at the same time in two processes:
  what the second busy core (shared caches and memory bandwidth) leaves of that limit.

A "minibatch" is one microbatch of the profile's batch size; every contender runs the same
`--minibatches` of them after `--warmup` more. Time per minibatch is steady state: (time between
two barriers around the timed steps) / minibatches for the contenders written here; for pdtool,
the time between the ends of the backwards of minibatch warmup - 1 and of the last one on the
last stage (`WorkerReport.finished`), / minibatches, from one launch. Where the reports lack
those times, two launches of warmup and warmup + N minibatches and the slope of the slowest
worker's `WorkerReport.wall_s` between them (this cancels start-up, first-iteration allocations
and one pipeline fill and drain). Synthetic data is made in the loop (`data.synthetic_source`,
as in `pd train`) by the rank that feeds the pipeline; the last stage of a torch pipeline gets
its targets made before timing (pdtool's come with the activations). "predicted" is the
simulator's time per minibatch for the plan and that schedule (`simulate(plan, mode, group=m)`);
the cost model's figure (`Plan.predicted.time_ms`) is printed above the table. "other CPU use"
is what programs other than this benchmark took of the machine while a row ran: anything
above about 0.1 cores makes that row's figures meaningless on a 2-core machine.

Then the overhead rows: a 128-wide MLP (192-128x4-10, microbatch 64: ~0.2 ms of compute per
action) on its own 2-stage plan, where what the runtime adds to the compute shows. For each of
pdtool's modes and torch's Schedule1F1B: measured and simulated time per minibatch and the
overhead per op, (measured - simulated) / the ops per minibatch of the busiest worker, an op
being one of the lowered list's recv, F, send, B, W, allreduce, step (`schedule.lower`; a
2-stage flush worker runs 4 per minibatch and a step's 2 per group). The plan's cluster carries
the link's latency as measured first (a ping-pong of a 32 KB tensor between two processes by the
transport the row's workers use: `pd train`'s default between workers of one machine, a
shared-memory ring (`runtime.worker.shm`), or gloo's send and recv: `--cluster 2x10GB/s+<latency>`), so
the simulator knows the compute (profiled), the bandwidth and each message's latency, and the
overhead is the runtime's own: Python between and around the actions, and waits for the peer's
overhead. The table also shows the simulation without the latency (what the overhead per op
would be if messages were free), and pdtool's flush over gloo (`--transport process-group`)
beside torch's Schedule1F1B, whose messages go over gloo too.

    python bench/train_speed.py                      # MLP 1536-1024x4-10, microbatch 512, m = 4, 64 minibatches
    python bench/train_speed.py --minibatches 128    # less noise, twice as long
    python bench/train_speed.py --only overhead      # the overhead rows alone (~1 minute)
    python bench/train_speed.py --only chunks        # the chunk rows alone

Then the chunk rows (issue 37): pdtool's interleaved, zbv and dualpipev against torch's
ScheduleInterleaved1F1B, ScheduleZBVZeroBubble and ScheduleDualPipeV on the same plan (2 chunks on
each of 2 workers, `make_chunked_plan`), with the prediction and the limit (the busiest worker's
chunks' forward+backward measured alone). Each chunk row runs its two contenders and the stages
alone `--rounds` times (6; 4 steps timed a run), alternated: each contender's time is its median
step, pdtool's speed-up the median of the rounds' paired ratios (~4 minutes in all).
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import gc
import math
import os
import resource
import socket
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from pdtool.artifacts.cluster import parse_cluster
from pdtool.model.data import synthetic_source
from pdtool.model.spec import load_model
from pdtool.artifacts.plan import Plan
from pdtool.planner import make_plan
from pdtool.artifacts.profile import ModelRef
from pdtool.profiler import profile_model
from pdtool.runtime.run import OptimizerConfig
from pdtool.runtime.worker import shm
from pdtool.runtime.worker.comm import BoundaryTensor, layout
from pdtool.runtime.launcher import forked
from pdtool.runtime.launcher.forked import PRELOAD
from pdtool.runtime.launcher.launch import launch
from pdtool.model.stages import PositionalStage, plan_stages
from pdtool.runtime.run import RunConfig
from pdtool.schedule import ACTIVATION, GRADIENT, generate, lower, modes_where, rules
from pdtool.sim.simulate import simulate
from record import recorded  # bench/record.py: the dated result file

OPTIMIZER = OptimizerConfig(name="sgd", lr=0.01, momentum=0.9, weight_decay=0.0)
MODES_RUN = ("flush", "zb", "zb2", "pipedream")  # pdtool's rows
TINY = {"in_features": 192, "hidden": 128, "depth": 4, "classes": 10}  # the overhead rows' MLP, microbatch 64
TINY_BATCH = 64
SEED = 0


@dataclasses.dataclass(frozen=True)
class Setup:
    """What every spawned contender needs (picklable)."""

    plan_path: str
    ref: ModelRef
    batch: int          # samples per microbatch (the profile's batch size)
    group: int          # microbatches per optimizer step (m)
    warmup: int         # minibatches before timing (a multiple of group)
    minibatches: int    # minibatches timed (a multiple of group)


# ----- helpers run in every process --------------------------------------------------------

def _build(setup: Setup):
    torch.manual_seed(SEED)  # every process builds the same initial weights, as pdtool's workers do
    bundle = load_model(setup.ref)
    return bundle, synthetic_source(bundle, setup.batch, SEED).batch


def _sgd(params) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=OPTIMIZER.lr, momentum=OPTIMIZER.momentum, weight_decay=OPTIMIZER.weight_decay)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _spawn(fn, setup: Setup, *extra):
    """Run fn(rank, world, setup, queue, *extra) on 2 processes; returns what rank 0 puts in the queue.
    They are forked from multiprocessing's forkserver, as pd train's CPU workers are: it imports torch,
    its pipelining and DDP, and pdtool's worker modules once (`FORKED`), not each contender's two
    processes again (2 s of CPU each); the forkserver serves pdtool's in-process launches too."""
    context = mp.get_context("forkserver")
    context.set_forkserver_preload(FORKED)  # before the forkserver's first start, which keeps it
    queue = context.SimpleQueue()
    port = _free_port()
    mp.start_processes(_entry, args=(fn, port, setup, queue, extra), nprocs=2, join=True, start_method="forkserver")
    return queue.get()


FORKED = [PRELOAD, "torch.distributed.pipelining", "torch.nn.parallel"]


def _entry(rank: int, fn, port: int, setup: Setup, queue, extra) -> None:
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    try:
        fn(rank, 2, setup, queue, *extra)
        gc.collect()  # DDP and pipeline objects sit in reference cycles: free them while their group lives
        dist.barrier()
    finally:
        dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # the result is sent: skip interpreter teardown, where a late C++ destructor can abort


def _timed(setup: Setup, run_step, rank: int, queue, per_step: bool = False) -> None:
    """Warm-up steps, barrier, timed steps, barrier; rank 0 reports ms per minibatch (`per_step`:
    of each step, from when its step calls returned; a schedule that drains every step ends its
    steps there)."""
    steps = setup.warmup // setup.group
    for step in range(steps):
        run_step(step)
    dist.barrier()
    ends = [time.perf_counter()]
    for step in range(steps, steps + setup.minibatches // setup.group):
        run_step(step)
        ends.append(time.perf_counter())
    dist.barrier()
    if rank == 0:
        queue.put([(b - a) * 1e3 / setup.group for a, b in zip(ends, ends[1:])] if per_step else
                  (time.perf_counter() - ends[0]) * 1e3 / setup.minibatches)


# ----- is the machine free? -----------------------------------------------------------------

def _gemm_ms(repeats: int = 40) -> float:
    a, w = torch.randn(512, 1024), torch.randn(1024, 1024)
    for _ in range(3):
        a @ w
    began = time.perf_counter()
    for _ in range(repeats):
        a @ w
    return (time.perf_counter() - began) * 1e3 / repeats


def _gemm_pair(rank: int, world: int, setup: Setup, queue) -> None:
    dist.barrier()
    slowest = torch.tensor([_gemm_ms()])
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
    if rank == 0:
        queue.put(float(slowest))


def _free_cores(setup: Setup) -> float:
    """Speed of two 1-thread processes computing at once, per process, relative to one alone:
    1.0 when this machine has two free cores; other programs running here lower it."""
    alone = _gemm_ms()
    return alone / _spawn(_gemm_pair, setup)


# ----- torch.distributed.pipelining ---------------------------------------------------------

def _pipelining(rank: int, world: int, setup: Setup, queue, schedule_name: str) -> None:
    from torch.distributed.pipelining import (
        PipelineStage, Schedule1F1B, ScheduleGPipe, ScheduleInterleavedZeroBubble,
    )

    bundle, batch = _build(setup)
    stages = plan_stages(Plan.load(setup.plan_path), bundle.module)
    last = rank == world - 1
    module = PositionalStage(stages[rank], last)
    stage = PipelineStage(module, rank, world, torch.device("cpu"))
    if schedule_name == "ScheduleInterleavedZeroBubble":  # a list of this rank's stages: one here
        schedule = ScheduleInterleavedZeroBubble([stage], n_microbatches=setup.group, loss_fn=bundle.loss_fn)
    else:
        kind = {"Schedule1F1B": Schedule1F1B, "ScheduleGPipe": ScheduleGPipe}[schedule_name]
        schedule = kind(stage, n_microbatches=setup.group, loss_fn=bundle.loss_fn)  # every rank: it also means "train"
    optimizer = _sgd(module.parameters())
    total = (setup.warmup + setup.minibatches) // setup.group
    targets = [torch.cat([batch(s * setup.group + k)[1] for k in range(setup.group)]) for s in range(total)] \
        if last else None

    def run_step(step: int) -> None:
        if rank == 0:
            parts = [batch(step * setup.group + k)[0] for k in range(setup.group)]
            schedule.step(*(torch.cat(t) for t in zip(*parts)))
        else:
            schedule.step(target=targets[step])
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    _timed(setup, run_step, rank, queue)


CHUNKED_TORCH = {"interleaved": "ScheduleInterleaved1F1B", "zbv": "ScheduleZBVZeroBubble",
                 "dualpipev": "ScheduleDualPipeV"}
"""The chunk rows: each of pdtool's modes of several stages per worker and torch's schedule of that name."""


def _pipelining_chunks(rank: int, world: int, setup: Setup, queue, schedule_name: str) -> None:
    """torch's multi-stage schedule on the plan's stages, each rank holding the stages the plan's
    placement gives it (looped or V), in the plan's order."""
    from torch.distributed import pipelining

    bundle, batch = _build(setup)
    plan = Plan.load(setup.plan_path)
    stages = plan_stages(plan, bundle.module)
    count = len(stages)
    mine = [s for s, worker in enumerate(plan.placement) if worker == rank]
    modules = [PositionalStage(stages[s], s == count - 1) for s in mine]
    held = [pipelining.PipelineStage(module, s, count, torch.device("cpu")) for module, s in zip(modules, mine)]
    schedule = getattr(pipelining, schedule_name)(held, n_microbatches=setup.group, loss_fn=bundle.loss_fn)
    optimizer = _sgd([p for module in modules for p in module.parameters()])
    total = (setup.warmup + setup.minibatches) // setup.group
    last = count - 1 in mine
    targets = [torch.cat([batch(s * setup.group + k)[1] for k in range(setup.group)]) for s in range(total)] \
        if last else None

    def run_step(step: int) -> None:
        inputs = ()
        if 0 in mine:
            parts = [batch(step * setup.group + k)[0] for k in range(setup.group)]
            inputs = tuple(torch.cat(t) for t in zip(*parts))
        schedule.step(*inputs, **({"target": targets[step]} if last else {}))
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    _timed(setup, run_step, rank, queue, per_step=True)


# ----- DDP and one process ------------------------------------------------------------------

def _ddp(rank: int, world: int, setup: Setup, queue) -> None:
    from torch.nn.parallel import DistributedDataParallel

    bundle, batch = _build(setup)
    model = DistributedDataParallel(bundle.module)
    optimizer = _sgd(model.parameters())
    share = setup.group // world

    def run_step(step: int) -> None:
        for k in range(share):
            inputs, target = batch(step * setup.group + rank * share + k)
            with model.no_sync() if k + 1 < share else contextlib.nullcontext():
                (bundle.loss_fn(model(*inputs), target) / share).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    _timed(setup, run_step, rank, queue)


def _single(setup: Setup) -> float:
    bundle, batch = _build(setup)
    model, optimizer = bundle.module, _sgd(bundle.module.parameters())
    steps = setup.warmup // setup.group
    for step in range(steps + setup.minibatches // setup.group):
        if step == steps:
            start = time.perf_counter()
        for k in range(setup.group):
            inputs, target = batch(step * setup.group + k)
            (bundle.loss_fn(model(*inputs), target) / setup.group).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return (time.perf_counter() - start) * 1e3 / setup.minibatches


def _stage_times(setup: Setup, only: int | None = None, repeats: int = 15) -> list[float]:
    """Median forward+backward ms of each stage (or of stage `only`) by itself: plain autograd on
    one fixed microbatch, no optimizer, no messages, no data loading."""
    bundle, batch = _build(setup)
    stages = plan_stages(Plan.load(setup.plan_path), bundle.module)
    inputs, target = batch(0)
    values = dict(zip(stages[0].inputs, inputs))
    times = []
    for s, stage in enumerate(stages):
        last = s == len(stages) - 1
        with torch.no_grad():
            outputs = stage.forward(values)
        if only in (None, s):
            seeds = {k: torch.randn_like(v) for k, v in outputs.items() if v.is_floating_point()}
            if only is not None:
                dist.barrier()
            samples = []
            for _ in range(repeats + 3):
                leaves = {k: v.detach().requires_grad_(s > 0 and v.is_floating_point()) for k, v in values.items()}
                began = time.perf_counter()
                out = stage.forward(leaves)
                if last:
                    bundle.loss_fn(out["output"], target).backward()
                else:
                    torch.autograd.backward([out[k] for k in seeds], [seeds[k] for k in seeds])
                samples.append(time.perf_counter() - began)
                stage.module.zero_grad(set_to_none=True)
            times.append(statistics.median(samples[3:]) * 1e3)
        values = {k: v.detach() for k, v in outputs.items()}
    return times


def _stages_at_once(rank: int, world: int, setup: Setup, queue) -> None:
    """Both stages' forward+backward loops at the same time, one per process (no messages): what
    two busy cores of this machine leave of the stage times measured alone."""
    both = torch.zeros(world)
    both[rank] = _stage_times(setup, only=rank)[0]
    dist.all_reduce(both)
    if rank == 0:
        queue.put(both.tolist())


# ----- pdtool -------------------------------------------------------------------------------

def _pdtool(setup: Setup, mode: str, transport: str = "auto") -> tuple[float, float, list[dict[str, float]], str, list[float]]:
    """`pd train --mode mode`, as `launch` runs it: steady-state ms per minibatch, start-up s of one
    launch (its wall time less the workers' own), per rank the ms per minibatch spent inside F, B
    and U actions (zeros where the reports carry no events), how the time was measured, and the
    ms per minibatch of each timed step (empty where the reports do not tell).

    Where the last stage reports when each backward ended (`WorkerReport.finished`), one launch
    of warm-up + N minibatches is timed from the end of minibatch warm-up - 1 to the end of the
    last one, like the barrier-timed contenders; otherwise two launches, of warm-up and of
    warm-up + N minibatches, and the slope of the slowest worker's `wall_s` between them.
    """
    per_round = rules(mode).per_round
    per_step = 1 if per_round else setup.group
    quiet = {"progress": False} if "progress" in {f.name for f in dataclasses.fields(RunConfig)} else {}

    def run(minibatches: int):
        config = RunConfig(plan_path=setup.plan_path, steps=minibatches // per_step, mode=mode,
                           group=None if per_round else setup.group, seed=SEED, optimizer=OPTIMIZER,
                           threads=1, timeout_s=120.0, transport=transport, **quiet)
        began = time.perf_counter()
        reports = [report for _, report in sorted(launch(config, 2).items())]
        return reports, time.perf_counter() - began - max(r.wall_s for r in reports)

    first, end = setup.warmup - 1, setup.warmup + setup.minibatches - 1
    reports, start_up = run(setup.warmup + setup.minibatches)
    finished = {b: t for r in reports for b, t in (getattr(r, "finished", None) or {}).items()}  # the last stage's worker
    steps = []
    if first in finished and end in finished:
        window = (finished[first], finished[end])
        actions = [_action_seconds(r, window) for r in reports]
        ms, how = (window[1] - window[0]) * 1e3 / setup.minibatches, "last stage's backward end times (one launch)"
        bounds = [finished.get(b) for b in range(first, end + 1, per_step)]
        if None not in bounds:
            steps = [(b - a) * 1e3 / per_step for a, b in zip(bounds, bounds[1:])]
    else:
        short, _ = run(setup.warmup)
        ms = (max(r.wall_s for r in reports) - max(r.wall_s for r in short)) * 1e3 / setup.minibatches
        actions = [{k: v - _action_seconds(s)[k] for k, v in _action_seconds(r).items()}
                   for r, s in zip(reports, short)]
        how = "slope of the workers' wall_s between two launches"
    per_minibatch = [{k: v * 1e3 / setup.minibatches for k, v in a.items()} for a in actions]
    return ms, start_up, per_minibatch, how, steps


def _measured_bubble(actions: list[dict[str, float]], ms: float) -> float:
    """The workers' idle share of the time per minibatch, in no action (`actions`: per worker, ms
    per minibatch inside each kind of action), as the simulator's `bubble_fraction`."""
    return 1 - sum(sum(a.values()) for a in actions) / (len(actions) * ms) if ms > 0 else 0.0


def _action_seconds(report, window: tuple[float, float] = (-math.inf, math.inf)) -> dict[str, float]:
    """Seconds a worker spent in its F, B, W and U actions that began inside `window` (epoch seconds),
    from `WorkerReport.events` where the reports have them."""
    seconds = {"F": 0.0, "B": 0.0, "W": 0.0, "U": 0.0}
    for action, began, ended in getattr(report, "events", None) or []:
        kind = action.lstrip("0123456789")[:1]
        if kind in seconds and window[0] <= began < window[1]:
            seconds[kind] += ended - began
    return seconds


def _ops_per_minibatch(plan: Plan, mode: str, group: int, minibatches: int) -> float:
    """The most lowered ops (recv, F, send, B, W, allreduce, step) a worker runs per minibatch."""
    schedule = generate(mode, tuple(s.replicas for s in plan.stages), minibatches,
                        1 if rules(mode).per_round else group)
    return max(len(ops) for ops in lower(schedule).workers) / minibatches


def _ping_pong(rank: int, world: int, setup: Setup, queue, rounds: int = 500) -> None:
    """One-way time of a 32 KB message between the two processes, median of `rounds` round trips
    / 2, by each of pd train's transports: the process group's own send and recv (gloo), and a
    pair of shared-memory rings (`runtime.worker.shm`, what pd train uses between the workers of one
    machine here)."""
    group, peer = dist.group.WORLD, 1 - rank
    x = torch.zeros(TINY["hidden"] * TINY_BATCH)
    specs = [BoundaryTensor("x", tuple(x.shape), x.dtype)]
    packed = layout([(x.shape, x.dtype)], pack_all=True)
    found = {"process-group": _round_trips(rank, rounds, lambda i: group.send([x], peer, i).wait(),
                                           lambda i: group.recv([x], peer, i).wait())}
    if shm.available(x.device):
        # a ping-pong holds one message in each direction: one slot a ring
        mine = [
            shm.Direction(peer=peer, direction=d, receiving=(d == GRADIENT) == (rank == 0), nbytes=packed.size, slots=1)
            for d in (ACTIVATION, GRADIENT)
        ]
        rings, made = shm.open_rings(dist.distributed_c10d._get_default_store(), f"bench{os.environ['MASTER_PORT']}",
                                     rank, mine,
                                     lambda p: shm.Waiter(spin=True, timeout_s=60.0, rank=rank, peer=p, peer_pid=None))
        dist.barrier()
        shm.remove(made)
        out, back = (ACTIVATION, GRADIENT) if rank == 0 else (GRADIENT, ACTIVATION)
        found["shared-memory"] = _round_trips(rank, rounds, lambda i: rings[(peer, out, False)].put(packed, [x], i, "x"),
                                              lambda i: rings[(peer, back, True)].take(packed, specs, i, "x"))
    if rank == 0:
        queue.put(found)


def _round_trips(rank: int, rounds: int, send, recv) -> float:
    times = []
    for i in range(rounds + 20):
        began = time.perf_counter()
        if rank == 0:
            send(i)
            recv(i)
        else:
            recv(i)
            send(i)
        times.append(time.perf_counter() - began)
    return statistics.median(times[20:]) / 2


def overhead_rows(m: int, warmup: int, minibatches: int, repeats: int = 10,
                  modes: tuple[str, ...] = MODES_RUN) -> list[tuple[str, bool, str]]:
    """The overhead rows (module docstring) of pdtool's `modes` printed as a table; returns their targets."""
    ref = ModelRef("pdtool.zoo:mlp", TINY)
    _say("overhead rows: profiling the 128-wide MLP, timing a message")
    profile = profile_model(ref, batch_size=TINY_BATCH, repeats=2 * repeats, warmup=5)
    latency_us = {k: v * 1e6 for k, v in _spawn(_ping_pong, Setup("", ref, TINY_BATCH, m, warmup, minibatches)).items()}
    default = "shared-memory" if shm.use_shared_memory("auto", torch.device("cpu"), 2) else "process-group"
    # a 2-stage pipeline whatever the latency: pdtool's cost model may leave a worker idle when the
    # messages cost more than the stage saves (a busy machine), PipeDream's uses every worker
    plans = {t: make_plan(profile, parse_cluster(f"2x10GB/s+{us:.0f}us"), straight=True, mode="pipedream",
                          cost_model="pipedream", command="bench/train_speed.py (overhead rows)")
             for t, us in latency_us.items()}
    if any(len(plan.stages) != 2 for plan in plans.values()):
        raise SystemExit("train_speed: the overhead rows need a 2-stage plan of the 128-wide MLP")
    free = dataclasses.replace(plans[default], cluster=parse_cluster("2x10GB/s"))  # messages without latency
    contenders = [(f"pdtool {mode}", mode, default) for mode in modes]
    if default != "process-group":
        contenders.append(("pdtool flush, --transport process-group", "flush", "process-group"))
    rows = []
    with tempfile.TemporaryDirectory() as folder:
        for t, plan in plans.items():
            plan.save(Path(folder) / f"{t}.plan.json")
        for name, mode, transport in contenders:
            _say(f"overhead rows: {name}")
            group = None if rules(mode).per_round else m
            plan = plans[transport]
            setup = Setup(str(Path(folder) / f"{transport}.plan.json"), ref, TINY_BATCH, m, warmup, minibatches)
            predicted = [simulate(p, mode, minibatches=max(minibatches, 64), group=group).time_per_minibatch_ms
                         for p in (free, plan)]
            rows.append((name, _pdtool(setup, mode, transport)[0], predicted, _ops_per_minibatch(plan, mode, m, 64)))
        _say("overhead rows: torch Schedule1F1B")
        # torch's 1F1B with m microbatches per step is pdtool's flush: same compute, same ops; its messages go over gloo
        setup = Setup(str(Path(folder) / "process-group.plan.json"), ref, TINY_BATCH, m, warmup, minibatches)
        predicted = [simulate(p, "flush", minibatches=max(minibatches, 64), group=m).time_per_minibatch_ms
                     for p in (free, plans["process-group"])]
        rows.append(("torch Schedule1F1B", _spawn(_pipelining, setup, "Schedule1F1B"), predicted, rows[0][3]))
    plan = plans[default]
    stages = " | ".join(f"layers {_ranges(s.layers)}: F {s.fwd_ms:.2f} B {s.bwd_ms:.2f} ms" for s in plan.stages)
    timed = ", ".join(f"{us:.0f} us over {t}" for t, us in latency_us.items())
    print(f"\noverhead rows: {ref.spec} {ref.kwargs}, microbatch {TINY_BATCH}, m = {m}; {stages}; a 32 KB message "
          f"takes {timed} one way (ping-pong); pd train uses {default} here; each row's simulation charges its "
          f"transport's latency (--cluster 2x10GB/s+<latency>)")
    print("| contender | ms / minibatch | simulated ms, messages free / with latency | ops per minibatch (busiest "
          "worker) | overhead per op (ms), beyond free / latency-charged messages |")
    print("|---|---|---|---|---|")
    for name, ms, (free_ms, with_ms), ops in rows:
        print(f"| {name} | {ms:.2f} | {free_ms:.2f} / {with_ms:.2f} | {ops:.2f} | {(ms - free_ms) / ops:.3f} / "
              f"{(ms - with_ms) / ops:.3f} |")
    return [(f"{name}: overhead per op at most 0.15 ms (beyond the simulation with the measured message latency)",
             (ms - with_ms) / ops <= 0.15, f"{(ms - with_ms) / ops:.3f} ms")
            for name, ms, (_, with_ms), ops in rows if name.startswith("pdtool") and "--transport" not in name]


def chunk_rows(profile, ref: ModelRef, batch: int, m: int, warmup: int, minibatches: int, bandwidth: str,
               modes=tuple(CHUNKED_TORCH), rounds: int = 6) -> list[tuple[str, bool, str]]:
    """The chunk rows: pdtool's interleaved, zbv and dualpipev against torch's schedule of the same
    name on the same plan (`make_chunked_plan`: 2 chunks on each of 2 workers, the same layers,
    placement, microbatches and optimizer), each with its prediction (`simulate`) and the limit
    (the busiest worker's chunks' forward+backward, measured alone). Each contender runs `rounds`
    times, alternated with the other one and with the stages alone; its time is the median of all
    its timed steps (each step drains the pipeline: one group of microbatches), and pdtool's
    speed-up the median of the rounds' ratios, each of a pdtool run and the torch run right after
    it: this VM's speed moves 15-60% within seconds (a 1-thread matmul: 11.1-17.8 ms over 40 s,
    20 ms for a 10-second spell), so two runs far apart can see different machines, while a
    spell has to spoil half of the rounds to move the median. Prints a table; returns its
    targets."""
    from pdtool.planner.chunks import make_chunked_plan

    rows = []
    with tempfile.TemporaryDirectory() as folder:
        for mode in modes:
            torch_name = CHUNKED_TORCH[mode]
            plan = make_chunked_plan(profile, parse_cluster(f"2x{bandwidth}"), chunks=2, mode=mode, group=m,
                                     command="bench/train_speed.py (chunk rows)")
            path = Path(folder) / f"{mode}.plan.json"
            plan.save(path)
            setup = Setup(str(path), ref, batch, m, warmup, minibatches)
            alone_runs, our_runs, their_runs = [], [], []
            for r in range(1, rounds + 1):
                _say(f"chunk rows: {mode}, round {r} of {rounds}: each stage alone")
                alone_runs.append(_stage_times(setup))
                _say(f"chunk rows: {mode}, round {r} of {rounds}: pdtool")
                our_runs.append(_pdtool(setup, mode))
                _say(f"chunk rows: {mode}, round {r} of {rounds}: torch {torch_name}")
                their_runs.append(_spawn(_pipelining_chunks, setup, torch_name))
            busiest = [max(sum(t for s, t in enumerate(times) if plan.placement[s] == w) for w in (0, 1))
                       for times in alone_runs]  # the machine's speed, round by round
            alone = [statistics.median(times) for times in zip(*alone_runs)]
            ours = statistics.median(step for run in our_runs for step in run[4] or [run[0]])
            theirs = statistics.median(step for run in their_runs for step in run)
            actions = min(our_runs, key=lambda run: abs(run[0] - ours))[2]  # the run nearest the median's
            ratios = [statistics.median(t) / statistics.median(o[4] or [o[0]]) for o, t in zip(our_runs, their_runs)]
            speed_up = statistics.median(ratios)  # paired: each round's two runs ran seconds apart
            limit = max(sum(t for s, t in enumerate(alone) if plan.placement[s] == w) for w in (0, 1))
            profiled = max(sum(st.fwd_ms + st.bwd_ms for s, st in enumerate(plan.stages) if plan.placement[s] == w)
                           for w in (0, 1))
            predicted = simulate(plan, minibatches=max(minibatches, 8 * m)).time_per_minibatch_ms
            rows.append((mode, torch_name, plan, ours, theirs, speed_up, predicted, limit, limit / profiled, actions,
                         (ratios, busiest)))
    print(f"\nchunk rows: {ref.spec} {ref.kwargs}, microbatch {batch}, m = {m}, 2 workers x 2 chunks "
          f"(pd plan --virtual-stages 2 --mode M --group {m} on 2x{bandwidth}); both sides run the same stages "
          "(pdtool's `plan_stages`), placed as the plan places them")
    print("| mode | stages on worker 0 / 1 | pdtool ms / minibatch | torch schedule | torch ms / minibatch | pdtool "
          "speed-up | predicted ms | measured / predicted | at the machine's speed | share of the limit |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    checks = []
    for mode, torch_name, plan, ours, theirs, speed_up, predicted, limit, speed, *_ in rows:
        where = " / ".join(",".join(str(s) for s, w in enumerate(plan.placement) if w == worker) for worker in (0, 1))
        at_speed = ours / (predicted * speed)
        print(f"| {mode} | {where} | {ours:.1f} | {torch_name} | {theirs:.1f} | {speed_up:.2f}x | "
              f"{predicted:.1f} | {ours / predicted:.2f} | {at_speed:.2f} | {limit / ours:.2f} |")
        floor = 1.0 if mode == "dualpipev" else 1.1
        checks += [(f"pdtool {mode} at least {floor:.1f}x the throughput of torch's {torch_name}",
                    speed_up >= floor, f"{speed_up:.2f}x"),
                   (f"pdtool {mode} within 10% of its prediction (at the machine's speed of the moment)",
                    abs(at_speed - 1) <= 0.10, f"{at_speed:.2f}"),
                   (f"pdtool {mode} at 0.9 of the limit (the busiest worker's chunks alone)", limit / ours >= 0.9,
                    f"{limit / ours:.2f}")]
    print(f"each contender's time: the median step of its {rounds} runs, alternated with the other's; pdtool's "
          "speed-up: the median of the rounds' ratios (a round: a pdtool run and the torch run right after it, "
          "each by its median step), here in order: " + "; ".join(f"{mode} {' / '.join(f'{r:.2f}x' for r in ratios)}"
                                                        for mode, *_, (ratios, _) in rows)
          + "; the busiest worker's chunks alone, round by round (this machine's drift): "
          + "; ".join(f"{mode} {' / '.join(f'{t:.1f}' for t in busiest)} ms" for mode, *_, (_, busiest) in rows))
    for mode, _, _, ours, *_, actions, _ in rows:
        if any(sum(a.values()) for a in actions):
            parts = "; ".join(f"worker {w} F {a['F']:.1f} B {a['B']:.1f} W {a['W']:.1f} U {a['U']:.1f} rest "
                              f"{ours - sum(a.values()):.1f}" for w, a in enumerate(actions))
            print(f"pdtool {mode}, ms per minibatch inside actions (rest: waits, messages, data, Python): {parts}")
    print("at the machine's speed: measured / (predicted x the busiest worker's chunks measured alone now over "
          "their profiled time); share of the limit: that time alone / pdtool's time per minibatch. On CPU "
          "workers dualpipev's forward of one chunk beside the backward of the other runs one after the other; on "
          "a GPU the two overlap (communication of one under computation of the other), which is what it buys")
    return checks


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=512, help="samples per microbatch (the profile's batch size)")
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--depth", type=int, default=4)
    parser.add_argument("--in-features", type=int, default=1536, help="1.5 x hidden balances the two stages")
    parser.add_argument("--microbatches", type=int, default=4,
                        help="m, microbatches per step (flush, GPipe, 1F1B, DDP)")
    parser.add_argument("--minibatches", type=int, default=64, help="minibatches timed, after the warm-up")
    parser.add_argument("--warmup", type=int, default=16, help="minibatches before timing")
    parser.add_argument("--bandwidth", default="10GB/s", help="the link the plan is made for")
    parser.add_argument("--only", choices=("main", "overhead", "chunks"),
                        help="run one part: the main table, the overhead rows or the chunk rows")
    parser.add_argument("--rounds", type=int, default=6,
                        help="chunk rows: runs of each contender (4 steps timed each), alternated; the speed-up is "
                             "the median of the rounds' ratios")
    parser.add_argument("--smoke", action="store_true", help="tiny sizes, a few minibatches: that it runs, not its figures")
    args = parser.parse_args()
    # the workers' forkserver, forked now as pd train forks it (before any torch work), with the contenders' modules
    forked.start_early("cpu", 2)
    forked.warm("cpu", 2, tuple(FORKED[1:]))
    if args.smoke:
        args.batch, args.hidden, args.in_features, args.microbatches, args.minibatches, args.warmup = 32, 64, 96, 2, 4, 2
    repeats = 2 if args.smoke else 10
    m = args.microbatches
    if m % 2 or args.minibatches % m or args.warmup % m or args.warmup < m:
        parser.error("--microbatches must be even, --minibatches and --warmup multiples of it (warmup >= m)")
    torch.set_num_threads(1)
    if args.only == "overhead":
        _verdicts(overhead_rows(m, args.warmup, args.minibatches, repeats), True)
        return
    ref = ModelRef("pdtool.zoo:mlp", {"in_features": args.in_features, "hidden": args.hidden, "depth": args.depth,
                                      "classes": 10})
    profile = profile_model(ref, batch_size=args.batch, repeats=repeats, warmup=3)
    # the chunk rows run twice the microbatches per step (2 chunks a worker: the same bubble share as
    # the one-chunk rows at m), at least dualpipev's 4 stages, within the same minibatches
    chunk_m = max(2 * m, 4)
    # each chunk row's runs are short (4 steps timed) and many (--rounds), each pdtool run beside a torch run:
    # this VM's speed moves within seconds, and a paired ratio sees the two contenders at about the same speed
    chunk_runs = dict(warmup=max(args.warmup, chunk_m) // chunk_m * chunk_m,
                      minibatches=min(max(args.minibatches, chunk_m) // chunk_m, 4) * chunk_m,
                      modes=("zbv",) if args.smoke else tuple(CHUNKED_TORCH),  # the smoke: one V and split backward
                      rounds=1 if args.smoke else max(args.rounds, 1))
    if args.only == "chunks":
        _verdicts(chunk_rows(profile, ref, args.batch, chunk_m, bandwidth=args.bandwidth, **chunk_runs), True)
        return
    plan = make_plan(profile, parse_cluster(f"2x{args.bandwidth}"), straight=True, mode="pipedream",
                     command="bench/train_speed.py")
    if len(plan.stages) != 2:
        raise SystemExit(f"the planner chose {len(plan.stages)} stage(s), not 2; change --hidden/--depth/--in-features")
    simulated = {mode: simulate(plan, mode, minibatches=max(args.minibatches, 64),
                                group=None if rules(mode).per_round else m) for mode in MODES_RUN}
    predicted = {mode: result.time_per_minibatch_ms for mode, result in simulated.items()}
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "mlp.plan.json"
        plan.save(path)
        setup = Setup(str(path), ref, args.batch, m, args.warmup, args.minibatches)
        _say("machine check")
        free = [_free_cores(setup)]
        rows, other, start_up, actions, speed = {}, {}, {}, {}, {}

        def measure(name: str, run, ms=lambda result: result):
            """Run one contender; rows[name] = its ms per minibatch, other[name] = the machine's other load."""
            _say(name)
            before = _cpu_seconds()
            result = run()
            rows[name] = ms(result)
            other[name] = _other_cores(before, _cpu_seconds())
            return result

        stage_ms = measure("limit (slowest stage alone)", lambda: _stage_times(setup), max)
        pair_ms = measure("both stages at once, no messages", lambda: _spawn(_stages_at_once, setup), max)
        measure("one process", lambda: _single(setup))
        for mode in MODES_RUN:
            gauge = max(_spawn(_stages_at_once, setup))
            _, start_up[mode], actions[mode], how, _ = measure(f"pdtool {mode}", lambda: _pdtool(setup, mode),
                                                            lambda r: r[0])
            speed[f"pdtool {mode}"] = (gauge + max(_spawn(_stages_at_once, setup))) / 2 / max(stage_ms)
        for name in ("Schedule1F1B", "ScheduleGPipe", "ScheduleInterleavedZeroBubble"):
            measure(f"torch {name}", lambda: _spawn(_pipelining, setup, name))
        measure("DDP (2 replicas)", lambda: _spawn(_ddp, setup))
        free.append(_free_cores(setup))

    split = " | ".join(f"layers {_ranges(s.layers)}" for s in plan.stages)
    messages = "shared memory" if shm.use_shared_memory("auto", torch.device("cpu"), 2) else "gloo"
    print(f"torch {torch.__version__}, 1 thread per worker; pdtool's messages over {messages} (pd train's default "
          f"here), torch's and DDP's over gloo; {ref.spec} {ref.kwargs}; microbatch "
          f"{args.batch}; m = {m} microbatches per step; {args.minibatches} minibatches timed after {args.warmup}")
    print(f"split {split}; stage fwd+bwd alone {' / '.join(f'{t:.1f}' for t in stage_ms)} ms, both at once "
          f"{' / '.join(f'{t:.1f}' for t in pair_ms)} ms "
          f"(profile {' / '.join(f'{s.fwd_ms + s.bwd_ms:.1f}' for s in plan.stages)} ms); "
          f"cost model {plan.predicted.time_ms:.1f} ms per minibatch")
    print(f"machine check, before / after: two 1-thread processes at once each compute at "
          f"{free[0]:.0%} / {free[1]:.0%} of one alone" + ("" if min(free) > 0.85 and max(other.values()) < 0.2 else
          " -- WARNING: other programs are using the CPUs, the figures below are not trustworthy"))
    print()
    print("| contender | ms / minibatch | samples/s | vs Schedule1F1B | vs limit | predicted ms | measured / predicted "
          "| machine speed | measured / predicted at that speed | other CPU use |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    base, limit = rows["torch Schedule1F1B"], rows["limit (slowest stage alone)"]
    for name, ms in rows.items():
        mode = name.split()[-1] if name.startswith("pdtool") else None
        pred = (f"{predicted[mode]:.1f} | {ms / predicted[mode]:.2f} | {speed[name]:.2f} | "
                f"{ms / predicted[mode] / speed[name]:.2f}") if mode else " | | | "
        print(f"| {name} | {ms:.1f} | {args.batch * 1e3 / ms:.0f} | {base / ms:.2f}x | {limit / ms:.2f} | {pred} | "
              f"{other[name]:.2f} cores |")
    print()
    print("vs Schedule1F1B: its time / the contender's (> 1 is faster); vs limit: limit time / the contender's; "
          "predicted: the simulator on the plan for that schedule; machine speed: the slower stage's time when "
          "both stages compute at once (no messages) just before and after that row, over its time alone at the "
          "start (above 1 slower: this VM's speed drifts 15-40% within minutes, and two busy cores share caches "
          "and memory, which pdtool's prediction does not model); measured / predicted at that speed: the ratio "
          "with the prediction's compute scaled by it, what the targets judge; other CPU use: cores busy with programs other than this benchmark "
          "while that row ran (0 on a quiet machine)")
    for mode in MODES_RUN:
        if any(sum(a.values()) for a in actions[mode]):
            parts = "; ".join(f"stage {s} F {a['F']:.1f} B {a['B']:.1f} W {a['W']:.1f} U {a['U']:.1f} rest "
                              f"{rows[f'pdtool {mode}'] - sum(a.values()):.1f}" for s, a in enumerate(actions[mode]))
            print(f"pdtool {mode}, ms per minibatch inside actions (rest: waits, messages, data, Python): {parts}")
    print(f"pdtool time per minibatch from the {how}; start-up "
          f"{' / '.join(f'{start_up[mode]:.1f}' for mode in MODES_RUN)} s per launch ({' / '.join(MODES_RUN)})")
    bubble = {mode: (simulated[mode].bubble_fraction, _measured_bubble(actions[mode], rows[f"pdtool {mode}"]))
              for mode in ("flush",) + modes_where(split=True)}
    print("bubble (share of the workers' time idle: in no F, B, W or U), simulated / measured: "
          + "; ".join(f"{mode} {sim:.3f} / {real:.3f}" for mode, (sim, real) in bubble.items()))
    checks = [
        ("pdtool flush at least as fast as Schedule1F1B", rows["pdtool flush"] <= base,
         f"{base / rows['pdtool flush']:.2f}x"),
        ("pdtool pipedream at least 10% faster than Schedule1F1B", rows["pdtool pipedream"] * 1.1 <= base,
         f"{base / rows['pdtool pipedream']:.2f}x"),
        ("pdtool pipedream at least 90% of the limit", limit / rows["pdtool pipedream"] >= 0.9,
         f"{limit / rows['pdtool pipedream']:.2f}"),
    ]
    at_speed = {mode: rows[f"pdtool {mode}"] / predicted[mode] / speed[f"pdtool {mode}"] for mode in MODES_RUN}
    checks += [(f"pdtool {mode} within 10% of its prediction (at the machine's speed of the moment)",
                abs(at_speed[mode] - 1) <= 0.10, f"{at_speed[mode]:.2f}") for mode in MODES_RUN]
    zb_torch = rows["torch ScheduleInterleavedZeroBubble"]
    for mode in modes_where(split=True):
        checks += [
            (f"pdtool {mode}'s bubble at most half of flush's, simulated", bubble[mode][0] <= bubble["flush"][0] / 2,
             f"{bubble[mode][0] / bubble['flush'][0]:.2f}"),
            (f"pdtool {mode}'s bubble at most half of flush's, measured", bubble[mode][1] <= bubble["flush"][1] / 2,
             f"{bubble[mode][1] / max(bubble['flush'][1], 1e-9):.2f}"),
            (f"pdtool {mode} faster than torch's zero bubble (ScheduleInterleavedZeroBubble)",
             rows[f"pdtool {mode}"] < zb_torch, f"{zb_torch / rows[f'pdtool {mode}']:.2f}x"),
        ]
    measured = all(ms > 0 for ms in rows.values())
    if args.only != "main":
        checks += overhead_rows(m, args.warmup, args.minibatches, repeats,
                                modes=("flush",) if args.smoke else MODES_RUN)  # the smoke: each kind of row once
        checks += chunk_rows(profile, ref, args.batch, chunk_m, bandwidth=args.bandwidth, **chunk_runs)
    _verdicts(checks, measured)


def _verdicts(checks: list[tuple[str, bool, str]], measured: bool) -> None:
    print()
    for label, ok, value in checks:
        print(f"- target: {label}: {value}, {'NOT MEASURED (noise)' if not measured else 'met' if ok else 'NOT MET'}")


def _cpu_seconds() -> tuple[float, float, float]:
    """(CPU seconds the whole machine has been busy, CPU seconds of this process, its reaped
    children and its live children with what they reaped (the workers' forkserver and the workers
    it forked: `runtime.launcher.forked`), wall seconds); the machine's figure is NaN where
    /proc/stat is missing."""
    own = sum(getattr(resource.getrusage(who), f) for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN)
              for f in ("ru_utime", "ru_stime"))
    own += sum(_tree_seconds(pid) for pid in _children(os.getpid()))
    try:
        fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
        busy = (sum(fields[:8]) - fields[3] - fields[4]) / os.sysconf("SC_CLK_TCK")  # all but idle and iowait
    except (OSError, ValueError):
        busy = float("nan")
    return busy, own, time.perf_counter()


def _children(pid: int) -> list[int]:
    found = []
    for task in Path(f"/proc/{pid}/task").glob("*/children"):
        try:
            found += [int(child) for child in task.read_text().split()]
        except OSError:
            pass
    return found


def _tree_seconds(pid: int) -> float:
    """CPU seconds of a live process, the children it reaped and its live descendants (/proc)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    ticks = sum(int(x) for x in fields[11:15])  # utime, stime, cutime, cstime
    return ticks / os.sysconf("SC_CLK_TCK") + sum(_tree_seconds(child) for child in _children(pid))


def _other_cores(before, after) -> float:
    """Average number of cores that programs other than this benchmark kept busy in between."""
    return max(((after[0] - before[0]) - (after[1] - before[1])) / (after[2] - before[2]), 0.0)


def _ranges(layers) -> str:
    """Layer ids compactly: "0-1", "2-4,7"."""
    parts: list[list[int]] = []
    for layer in sorted(layers):
        if parts and layer == parts[-1][1] + 1:
            parts[-1][1] = layer
        else:
            parts.append([layer, layer])
    return ",".join(f"{a}-{b}" if b > a else f"{a}" for a, b in parts)


def _say(text: str) -> None:
    print(f"[train_speed] {text}", file=sys.stderr, flush=True)


def _theme(argv: list[str]) -> str:
    """The result file's theme: the chunk rows alone get their own file beside the whole run's."""
    alone = "--only=chunks" in argv or any(a == "--only" and b == "chunks" for a, b in zip(argv, argv[1:]))
    return "train_speed_chunks" if alone else "train_speed"


if __name__ == "__main__":
    with recorded(_theme(sys.argv[1:])):
        main()
