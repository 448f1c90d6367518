"""Plans of several stages (chunks) per worker: `pd plan --virtual-stages V --mode interleaved|zbv|dualpipev`.

The layers are cut into v * p stages by the dynamic program's best straight pipeline of exactly
that many stages (`partition.Solver` on a one-level cluster of v * p units joined by the
cluster's link), so every chunk gets the cost model's figures as a stage of its own; the stages
are then placed on the p workers as the mode places them (`schedule.placement`: looped, or V),
and the plan's prediction is its schedule simulated on those workers (the steady state of one
batch, `sim.steady`). Its cost-model time is the busiest worker's: the sum of its chunks' times.

On a cluster of several levels the cut is made as if every link were the slowest one (a
chunk's neighbours sit on other workers, often on other servers, in a looped or V placement);
the simulation then charges each message on the link it really takes. The memory limit is
checked on each worker's chunks together after the cut (the cut itself ignores it); with
`--recompute auto` a plan that does not fit is cut again with every chunk recomputing.
"""
from __future__ import annotations

import dataclasses

from ..artifacts.cluster import Cluster
from ..artifacts.plan import Plan
from ..artifacts.profile import Profile
from ..errors import PlanError, ScheduleError
from ..schedule.core import check_parameters
from ..schedule.modes import chunked_modes, listed, rules
from ..schedule.placement import make as placed
from ..sim.steady import steady_state
from ..units import format_bytes


def make_chunked_plan(profile: Profile, cluster: Cluster, *, chunks: int, mode: str, group: int | None = None,
                      quick: bool = False, **options) -> Plan:
    """The plan of `chunks` stages on each worker of `cluster` in `mode` (a mode with a placement),
    recording and simulated with `group` microbatches per step (None: the mode's default, the
    stages); `quick`: the data-parallel baseline ranked as `make_plan(quick=True)` ranks; `options`
    as `make_plan` takes them (cost model, optimizer slots, recompute, provenance). With `--recompute
    auto` (the default), a plan whose workers cannot hold their chunks is cut again with every chunk
    recomputing its activations; refused when that does not fit either."""
    try:
        return _chunked(profile, cluster, chunks, mode, group, quick, options)
    except _OverMemory as error:
        if options.get("recompute", "auto") != "auto":
            raise PlanError(str(error)) from None
        try:
            return _chunked(profile, cluster, chunks, mode, group, quick, {**options, "recompute": "all"})
        except _OverMemory as again:
            raise PlanError(f"{again} (even with every chunk recomputing its activations)") from None


class _OverMemory(PlanError):
    """A worker cannot hold its chunks within the cluster's memory."""


def _chunked(profile: Profile, cluster: Cluster, chunks: int, mode: str, group: int | None, quick: bool,
             options: dict) -> Plan:
    """`make_chunked_plan` at one recomputation setting (`options["recompute"]`)."""
    from .make import make_plan, with_group

    row = rules(mode)
    if row.placement is None:
        raise PlanError(f"--virtual-stages puts several stages on a worker, which mode {mode!r} does not run; use "
                        f"--mode {listed(chunked_modes())} (or leave --virtual-stages out)")
    if row.placement == "v" and chunks != 2:
        raise PlanError(f"mode {mode} places 2 stages on each worker in a V; use --virtual-stages 2")
    if chunks < 2:
        raise PlanError(f"--virtual-stages {chunks}: one stage a worker is what the other modes run; give 2 or more")
    workers = cluster.workers
    total = chunks * workers
    slowest = min(cluster.levels, key=lambda level: (level.bandwidth, -level.latency))
    virtual = dataclasses.replace(cluster, levels=(dataclasses.replace(slowest, count=total),), memory=None)
    uncut = PlanError(f"the model cannot be cut into {total} stages ({chunks} on each of {workers} workers): its "
                      f"{len(profile.layers)} layers split only where the profile says they can; use fewer "
                      "--virtual-stages or fewer workers")
    if total > len(profile.layers):  # a stage holds a layer at least: no need to ask the dynamic program
        raise uncut
    try:
        flat = make_plan(profile, virtual, straight=True, mode="flush", simulate=False, every_worker=True, **options)
    except PlanError:
        raise uncut from None
    if len(flat.stages) != total:
        raise PlanError(f"the model cuts into at most {len(flat.stages)} stages where it can be split, fewer than the "
                        f"{total} that {chunks} stages on each of {workers} workers need; use fewer --virtual-stages "
                        "or fewer workers")
    # data parallelism on the real workers, the baseline: priced without the memory limit, and how far it is over
    dp = make_plan(profile, dataclasses.replace(cluster, memory=None), data_parallel=True, quick=quick, **options)
    need = max(stage.memory_bytes for stage in dp.stages)
    over = int(need - cluster.memory) if cluster.memory and need > cluster.memory else None
    baseline = dataclasses.replace(dp.predicted, data_parallel_over_bytes=over)
    placement = placed(row.placement, total, workers)
    stages = tuple(dataclasses.replace(stage, ranks=(placement[s],)) for s, stage in enumerate(flat.stages))
    busiest = max(sum(stage.time_ms for s, stage in enumerate(stages) if placement[s] == w) for w in range(workers))
    plan = dataclasses.replace(flat, cluster=cluster, mode=mode, stages=stages, predicted=dataclasses.replace(
        flat.predicted, time_ms=busiest, data_parallel_ms=baseline.data_parallel_ms,
        simulated_data_parallel_ms=baseline.simulated_ms, data_parallel_over_bytes=baseline.data_parallel_over_bytes))
    if group is not None:
        try:
            check_parameters(mode, [1] * total, group, group, placement)
        except ScheduleError as error:
            raise PlanError(f"--group {group} for {chunks} stages on each of {workers} workers: {error}") from None
        plan = with_group(plan, group)
    state = steady_state(plan)
    if state is None:
        raise PlanError(f"the steady state of {total} stages in mode {mode} is too large to compute here; "
                        "use fewer --virtual-stages")
    plan = dataclasses.replace(plan, predicted=dataclasses.replace(
        plan.predicted, simulated_ms=state.time_per_minibatch_ms, simulated_bubble=state.bubble_fraction,
        simulated_minibatches=state.period_minibatches, simulated_steady=True, candidates=1,
        why=f"{chunks} stages on each of {workers} workers ({row.placement} placement), the best cut into {total} "
            "stages by the cost model, simulated"))
    _check_memory(plan, cluster, options.get("optimizer_slots", 1))
    return plan


def _check_memory(plan: Plan, cluster: Cluster, optimizer_slots: int) -> None:
    """Refuse a plan whose workers cannot hold their chunks within the cluster's memory."""
    if not cluster.memory:
        return
    from ..memory import memory_model
    from ..sim.simulate import simulate

    result = simulate(plan, events=False)
    needs = memory_model(cluster.memory, optimizer_slots, plan.profile.precision, plan.mode).per_worker(plan, result)
    rank = max(needs, key=needs.get)
    if needs[rank] > cluster.memory:
        raise _OverMemory(f"worker {rank} needs {format_bytes(needs[rank])} for its chunks in mode {plan.mode}, more "
                          f"than the {format_bytes(cluster.memory)} per worker; plan more workers, fewer "
                          "--virtual-stages, or another mode")
