"""The planner: PipeDream's optimizer run on a profile for a cluster, described as a `Plan`.

`make_plan` builds the layer costs and the state space (down-sets of the layer graph),
solves the dynamic program (`partition.Solver`), flattens the nested pipeline into plan
stages and outer-level groups with the cost model's per-stage terms, and records the
simulator's figures for the plan's schedule.
"""
from __future__ import annotations

import dataclasses
import math

import numpy as np

from .. import __version__
from ..sim import simulate as simulator
from ..artifacts.cluster import Cluster
from ..artifacts.plan import (
    MS_PER_S, SHARDS, SYNC_SCALE, Plan, PlanGroup, PlanStage, Prediction, ProfileRef, compact_ranges, profile_sha256,
    with_boundaries,
)
from ..artifacts.profile import Profile
from ..errors import PlanError, ScheduleError
from ..schedule.core import check_parameters
from ..sim.steady import applies as steady_applies, steady_state
from ..schedule.modes import DEFAULT, DEFAULT_TIED, GROUP, MODES, listed, modes_where, rules
from ..units import format_bytes
from .background import background
from .costmodel import MODELS, ChainCosts, CostModel, Memory, memory_model
from .partition import Pipeline, PipelineStage, Solver
from .states import States, build_states


SIMULATED_MINIBATCHES = 2048  # at most, so that planning a large cluster stays quick


CANDIDATES = 4
"""Plans compared in simulation: the cost model's best for each number of workers it may use
(fastest first, at most this many), as many straight pipelines, and data parallelism on every
worker."""
RANKED_WORKERS = 64
"""Up to this many workers, candidates are ranked by event simulation (their steady state where
`steady.steady_state` computes it, else a short run) and the finalists simulated in full. Beyond,
a simulation short enough to plan quickly is mostly pipeline fill and drain: where the plan's mode
has a computed steady state, that figure ranks every candidate and is the prediction; otherwise
the cost model's optimum is kept (and simulated alone), and the plan says so."""
RANKING_MINIBATCHES_PER_WORKER = 8
"""Candidates are compared on runs this long (per worker); the best `FINALISTS` in full."""
FINALISTS = 3
BACKGROUND_SIZE = 100_000
"""States x workers from which the straight pipelines are solved in a second process while the
cost model's candidates are solved here (`background`; 1000 layers x 4096 workers: 15 s of 65)."""


def make_plan(profile: Profile, cluster: Cluster, *, cost_model: str = "pdtool", straight: bool = False,
              mode: str | None = None, optimizer_slots: int = 1, command: str = "", simulate: bool = True,
              data_parallel: bool = False, profile_file: str | None = None, recompute: str = "auto",
              say=lambda message: None, every_worker: bool = False, group: int | None = None,
              quick: bool = False, shard: str = "none", auto_shards: tuple[str, ...] = SHARDS) -> Plan:
    """Run PipeDream's optimizer on `profile` for `cluster` and describe the result as a Plan.

    Trainability is decided here, not by the workers: the stages only cut where the model can
    be split (`Profile.split`), and a plan whose stages share a parameter (tied weights) gets a
    mode that trains them. `mode` None means `pipedream`, or `2bw` when stages share a parameter
    (`say` is told why); a mode given explicitly that cannot train the plan is a `PlanError`.
    `data_parallel` allows no cut: one stage replicated on every worker (the baseline, as a plan).
    `every_worker`: the pipeline uses every worker (with `straight`: exactly as many stages as
    workers; `planner.chunks` cuts chunks so).
    `group`: the microbatches per step the plan records and is simulated with (a mode that steps
    per group; `with_group`); None: the mode's default, not recorded. `quick`: rank and predict
    by the steady state alone (no event simulation of the finalists; the joint search's families).
    `command` and `profile_file` (the profile's file name) are the plan's provenance. `recompute`
    (`artifacts.plan.RECOMPUTE`) says which stages recompute their forward in the backward: with `auto`
    those that fit the cluster's memory only so. `shard` (`artifacts.plan.SHARDS`): what replicated
    stages shard among their replicas (`optimizer`: their optimizer state, which the memory model
    divides by the replicas; the cost model and simulator add the all-gather of the weights; `auto`:
    each replicated stage shards where it fits the memory limit only so, `Solver`, choosing among
    `auto_shards`; where its pick shards gradients or parameters that the mode, the schedule or a
    tied weight rules out, `Plan.sharding_refusal`, it is planned again without that choice).

    With `simulate` (what `pd plan` does), the dynamic program's candidates (its best plan for
    each number of workers it may use, and data parallelism) are run through the simulator,
    which models what the cost model's max(compute, all-reduce, transfer) leaves out (a
    transfer's latency within the stash depth, all-reduces after the backward); the plan that
    simulates fastest wins, its simulated time is the prediction (`Prediction.expected_ms`) and
    the simulated data parallelism the baseline, whichever cost model. Without it, the cost
    model's optimum and figures, as PipeDream's optimizer gives them.
    """
    if (mode or DEFAULT) not in MODES:
        raise PlanError(f"unknown mode {mode!r}; use one of {', '.join(MODES)}")
    if cost_model not in MODELS:
        raise PlanError(f"unknown cost model {cost_model!r}; use one of {', '.join(MODELS)}")
    if data_parallel and straight:
        raise PlanError("--data-parallel replicates one stage on every worker and --straight forbids replicas: "
                        "give one of them")
    model = MODELS[cost_model](sync_scale=SYNC_SCALE[shard if shard != "auto" else "none"])
    costs = ChainCosts.from_profile(profile)
    # what the plan's mode keeps (the default mode's when none is given: PipeDream's weight versions, the most)
    memory = (memory_model(cluster.memory, optimizer_slots, profile.precision, mode, shard=shard,
                           method=profile.method) if cluster.memory else None)
    # zero-time layers follow their producers only where that is safe (states.py, `_followers`)
    states = _splittable(build_states(costs, followers=not model.exact_workers and memory is None), profile, say)
    if data_parallel:
        states = states.restricted(lambda mask: False)
    search = _Search(profile=profile, cluster=cluster, cost_model=cost_model, model=model, costs=costs, states=states,
                     memory=memory, optimizer_slots=optimizer_slots, straight=straight, data_parallel=data_parallel,
                     mode=mode, recompute=recompute, command=command, profile_file=profile_file,
                     every_worker=every_worker, group=group, shard=shard, auto_shards=auto_shards)
    plans, ranking = _candidates(search, ranked=simulate)
    if not simulate:  # the cost model's optimum, as PipeDream's optimizer gives it
        return _trainable(plans[0], mode, say)
    dp_solver = None if data_parallel else search.solver(states=states.restricted(lambda mask: False),
                                                         every_worker=True)
    dp = dp_solver.solve() if dp_solver is not None else None
    baseline = search.describe(dp, dp_solver) if dp is not None else None
    if ranking and baseline is not None and not straight:
        plans.append(baseline)
    in_full = cluster.workers <= RANKED_WORKERS and not quick
    unranked = 0
    if ranking and quick:  # steady states only: a candidate too large to compute one for is not ranked
        computed = [_with_simulation(p, steady=True, events=False) for p in plans]
        kept = [p for p in computed if p.predicted.simulated_ms is not None]
        unranked = len(computed) - len(kept)
        plans = kept or plans[:1]
    ranked = _ranked(plans, cluster.workers, in_full) if ranking else [_with_simulation(plans[0])]
    best = _explained(search, ranked, baseline, ranking=ranking, in_full=in_full, unranked=unranked)
    _warn_noisy(profile, best, say)
    if cluster.workers <= RANKED_WORKERS:
        best = _mode_memory(best, optimizer_slots, memory, short=quick)
    if group is not None and best.group != group:
        _refuse_group(best, group)
    even = math.lcm(1, *(s.replicas for s in best.stages if s.shard == "parameters"))
    if shard == "parameters" and group is None and not rules(best.mode).per_round and best.run().group % even:
        rounded = -(-best.run().group // even) * even  # each replica of a stage as many forwards and backwards
        say(f"--shard parameters: planning again with {rounded} microbatches a step (--group), a multiple of the "
            f"sharded stages' replicas ({even}), so that each replica runs as many")
        return make_plan(profile, cluster, straight=straight, cost_model=cost_model, mode=mode,
                         optimizer_slots=optimizer_slots, command=command, simulate=simulate,
                         data_parallel=data_parallel, profile_file=profile_file, recompute=recompute, say=say,
                         every_worker=every_worker, group=rounded, quick=quick, shard=shard, auto_shards=auto_shards)
    for kind in ("parameters", "gradients") if shard == "auto" else ():
        refusal = best.sharding_refusal(kinds=(kind,)) if kind in auto_shards else None
        if refusal is not None:
            say(f"--shard auto: {refusal}; planning again without sharded {kind}")
            return make_plan(profile, cluster, straight=straight, cost_model=cost_model, mode=mode,
                             optimizer_slots=optimizer_slots, command=command, simulate=simulate,
                             data_parallel=data_parallel, profile_file=profile_file, recompute=recompute, say=say,
                             every_worker=every_worker, group=group, quick=quick, shard=shard,
                             auto_shards=tuple(s for s in auto_shards if s != kind))
    return _trainable(best, mode, say)


def _refuse_group(plan: Plan, group: int) -> None:
    """A PlanError saying why the plan's mode cannot run `group` microbatches per step on its stages."""
    if rules(plan.mode).per_round:
        raise PlanError(f"--group {group}: mode {plan.mode} steps after every round of its replicas, not per group of "
                        f"microbatches; leave --group and --batch out, or plan a mode that steps per group "
                        f"({listed(modes_where(steps=GROUP))})")
    try:
        check_parameters(plan.mode, [s.replicas for s in plan.stages], group, group, plan.placement)
    except ScheduleError as error:
        raise PlanError(f"the best plan ({_shape(plan)}) cannot run --group {group}: {error}") from None


@dataclasses.dataclass(frozen=True, kw_only=True)
class _Search:
    """One `make_plan`: its profile, cluster and options, and what it derives from them once (the
    cost model, the per-layer costs, the states the model can be cut at, the memory model)."""

    profile: Profile
    cluster: Cluster
    cost_model: str
    model: CostModel
    costs: ChainCosts
    states: States
    memory: Memory | None
    optimizer_slots: int
    straight: bool
    data_parallel: bool
    mode: str | None
    recompute: str
    command: str
    profile_file: str | None
    every_worker: bool = False
    group: int | None = None
    shard: str = "none"
    auto_shards: tuple[str, ...] = SHARDS

    def unlimited(self) -> Memory:
        """The memory model without a limit (a plan's figures where the cluster states none)."""
        return memory_model(None, self.optimizer_slots, self.profile.precision, self.mode, shard=self.shard,
                            method=self.profile.method)

    def solver(self, **options) -> Solver:
        """The dynamic program over this search's states and cluster (`options`: Solver's)."""
        options = {"states": self.states, "memory": self.memory, "recompute": self.recompute, "shard": self.shard,
                   "auto_shards": self.auto_shards, **options}
        return Solver(options.pop("states"), [level.count for level in self.cluster.levels],
                      [level.bandwidth for level in self.cluster.levels], self.model, **options)

    def describe(self, pipeline: Pipeline, solver: Solver) -> Plan:
        return _as_plan(self, pipeline, solver)


def _candidates(search: _Search, *, ranked: bool) -> tuple[list[Plan], bool]:
    """The plans to compare, and whether they are ranked by simulation: the dynamic program's best
    plan for each number of workers it may use (only its optimum unless `ranked`), and the best
    straight pipelines (the cost model undervalues them most; solved in a second process beside
    the others on a large search). A search with no plan is a `PlanError` saying why."""
    straight, data_parallel = search.straight, search.data_parallel

    def straight_plans() -> list[Plan]:
        lined = search.solver(straight=True)
        return [search.describe(p, lined) for p in lined.candidates(CANDIDATES) if p is not None]

    with background(straight_plans, ranked and not straight and not data_parallel
                    and len(search.states) * search.cluster.workers >= BACKGROUND_SIZE) as lined_plans:
        solver = search.solver(straight=straight, every_worker=data_parallel or search.every_worker)
        pipelines = solver.candidates(CANDIDATES) if ranked else [solver.solve()]
        if not pipelines or pipelines[0] is None:
            raise PlanError(_no_plan_reason(search))
        plans = [search.describe(p, solver) for p in pipelines]
        if not ranked:
            return plans, False
        ranking = search.cluster.workers <= RANKED_WORKERS or steady_applies(plans[0])  # the candidates share a mode
        if ranking and not straight and not data_parallel:
            plans += lined_plans()
    return plans, ranking


def _explained(search: _Search, ranked: list[Plan], baseline: Plan | None, *, ranking: bool, in_full: bool,
               unranked: int = 0) -> Plan:
    """The winner of `ranked` (fastest first) with its prediction explained: why it won (and how
    many candidates were `unranked`: too large for a steady state, under `make_plan(quick=True)`), the
    data-parallel baseline's simulated time (or by how much data parallelism does not fit), and the
    best hybrid plan when a straight one won. Beyond the ranked sizes (not `ranking`), never a plan
    that its own simulation puts behind data parallelism."""
    best = ranked[0]
    if search.data_parallel:
        baseline = best
    elif baseline is not None:  # simulated already if it was a finalist
        baseline = next((p for p in ranked[:FINALISTS] if _key(p) == _key(baseline)), None) or \
            _with_simulation(baseline, steady=not in_full)
    if not ranking:
        why = f"the cost model's optimum (clusters over {RANKED_WORKERS} workers are not ranked by simulation)"
        if baseline is not None and not search.data_parallel and \
                baseline.predicted.simulated_ms < best.predicted.simulated_ms:
            why = (f"data parallelism: the cost model's optimum ({_shape(best)}) simulates slower, "
                   f"{best.predicted.simulated_ms:.3f} ms per minibatch against {baseline.predicted.simulated_ms:.3f} "
                   f"(clusters over {RANKED_WORKERS} workers are not ranked by simulation)")
            ranked, best = [baseline, best], baseline
        elif baseline is not None and not search.data_parallel:
            ranked = [best, baseline]  # both simulated: the candidates compared
    else:
        why = f"fastest of {len(ranked)} candidate plans in simulation" + (
            "" if in_full else " (their steady states, computed from one period of their schedules)") + (
            f"; next: {_shape(ranked[1])}" if len(ranked) > 1 else "") + (
            f"; {unranked} more too large to compute a steady state for were not ranked" if unranked else "")
    hybrid = None if _hybrid(best) else next((p for p in ranked if _hybrid(p)), None)
    if hybrid is not None:
        full = hybrid.predicted.simulated_steady or any(_key(p) == _key(hybrid) for p in ranked[:FINALISTS])
        hybrid = (f"{_shape(hybrid)}: {hybrid.predicted.simulated_ms:.3f} ms per minibatch simulated"
                  + ("" if full else f" (on a run of {hybrid.predicted.simulated_minibatches} minibatches)"))
    over = None if baseline is not None else _data_parallel_excess(search)
    return dataclasses.replace(best, predicted=dataclasses.replace(
        best.predicted, candidates=len(ranked), why=why, data_parallel_over_bytes=over, hybrid=hybrid,
        simulated_data_parallel_ms=baseline.predicted.simulated_ms if baseline is not None else None))


def _mode_memory(plan: Plan, optimizer_slots: int, memory: Memory | None, short: bool = False) -> Plan:
    """The plan with each stage's `memory_bytes` as its mode holds it (the simulated schedule's most
    minibatches in flight and weight versions per worker: `Memory.per_worker`, what `pd train`
    compares its workers with), and one line when a stage then passes the limit of `memory`. `short`:
    from a run of two groups (or two passes of the workers), where every worker reaches its peak."""
    run = plan.run()
    most = 2 * max(run.group, plan.workers)
    result = simulator.simulate(plan, minibatches=-(-most // run.group) * run.group if short else None, events=False)
    model = memory_model(None, optimizer_slots, plan.profile.precision, plan.mode)
    need = model.per_worker(plan, result)
    stages = tuple(dataclasses.replace(s, memory_bytes=max(need[r] for r in s.ranks)) for s in plan.stages)
    worst = max(range(len(stages)), key=lambda i: stages[i].memory_bytes)
    if memory is not None and stages[worst].memory_bytes > memory.limit:
        raise PlanError(f"the best plan's stage {worst} needs {format_bytes(stages[worst].memory_bytes)} per worker in "
                        f"mode {plan.mode} (the minibatches its schedule holds in flight and its weight versions), "
                        f"over --memory {format_bytes(memory.limit)}; raise --memory, add workers, or plan another --mode")
    return dataclasses.replace(plan, stages=stages)


def _warn_noisy(profile: Profile, plan: Plan, say) -> None:
    """Say which layers whose profiled repeats disagree (`Layer.noisy`) decide the plan: a layer at
    a stage boundary (the first or last of a stage) or in the bottleneck stage."""
    noisy = {layer.id for layer in profile.layers if layer.noisy}
    if not noisy:
        return
    deciding = {stage.layers[0] for stage in plan.stages[1:]} | {stage.layers[-1] for stage in plan.stages[:-1]}
    bottleneck = next((stage for index, stage in enumerate(plan.stages)
                       if plan.predicted.bottleneck.startswith(f"stage {index} ")), None)
    if bottleneck is not None:
        deciding |= set(bottleneck.layers)
    hit = sorted(noisy & deciding)
    if hit:
        names = ", ".join(profile.layers[i].name for i in hit[:5]) + (f" and {len(hit) - 5} more" if len(hit) > 5 else "")
        say(f"{len(hit)} layer(s) whose profiled repeats disagree (spread over a quarter of the median) decide this "
            f"plan's stage boundaries or lie in its bottleneck stage: {names}; profile again on a quiet machine "
            "(or with more --repeats) before trusting the plan")


def _hybrid(plan: Plan) -> bool:
    """Whether a plan replicates a stage inside a pipeline (the PipeDream paper's hybrid plans)."""
    return len(plan.stages) > 1 and any(stage.replicas > 1 for stage in plan.stages)


def _key(plan: Plan) -> tuple:
    """What makes two candidate plans the same: each stage's layers and ranks."""
    return tuple((s.layers, s.ranks) for s in plan.stages)


def _ranked(plans: list[Plan], workers: int, full: bool) -> list[Plan]:
    """The distinct plans, fastest first in simulation: compared on short runs, then (`full`) the
    best `FINALISTS` simulated in full (those come first, with their full figures; the rest carry
    their short run's)."""
    unique = list({_key(p): p for p in reversed(plans)}.values())
    if len(unique) == 1:
        return [_with_simulation(unique[0], steady=not full)]
    short = RANKING_MINIBATCHES_PER_WORKER * workers
    ranked = sorted((_with_simulation(p, short, steady=True) for p in unique),  # the rest keep these figures
                    key=lambda p: (p.predicted.simulated_ms, p.predicted.time_ms))
    if not full:
        return ranked
    finalists = sorted((_with_simulation(p) for p in ranked[:FINALISTS]), key=lambda p: p.predicted.simulated_ms)
    return finalists + ranked[FINALISTS:]


def _data_parallel_excess(search: _Search) -> int | None:
    """Bytes per worker by which data parallelism on every worker exceeds the memory limit."""
    if search.memory is None:
        return None
    solver = search.solver(states=search.states.restricted(lambda mask: False), memory=None, every_worker=True,
                           recompute="none")
    free = solver.solve()
    if free is None:
        return None
    stages, _ = _describe(free, search.profile, search.costs, search.model, solver, search.unlimited())
    return int(max(s.memory_bytes for s in stages) - search.memory.limit)


def _shape(plan: Plan) -> str:
    """A plan's stages in a few words: "2 stages x1 on 2 of 4 workers"."""
    replicas = "x".join(str(s.replicas) for s in plan.stages)
    used = len(plan.used_ranks)
    return (f"{len(plan.stages)} stage{'s' if len(plan.stages) != 1 else ''} (replicas {replicas}) on {used}"
            + (f" of {plan.workers}" if used < plan.workers else "") + " workers")


def _as_plan(search: _Search, pipeline: Pipeline, solver: Solver) -> Plan:
    """The plan of one of the dynamic program's pipelines, with the cost model's figures."""
    profile, cluster, costs, model, mode = search.profile, search.cluster, search.costs, search.model, search.mode
    stages, groups = _describe(pipeline, profile, costs, model, solver, search.memory or search.unlimited())
    stages = with_boundaries(profile, stages)
    items = [(s.time_ms, f"stage {i} {_dominant(s.compute_ms, s.allreduce_ms, s.transfer_ms)}")
             for i, s in enumerate(stages)]
    items += [(g.time_ms, f"level-{g.level} group of layers {compact_ranges(g.layers)} "
                          f"{_dominant(g.compute_ms, g.allreduce_ms, g.transfer_ms)}") for g in groups]
    slowest = max(time for time, _ in items)
    bottleneck = next(label for time, label in items if time >= slowest * (1 - 1e-9))  # stages win ties
    counts = [level.count for level in cluster.levels]
    bandwidths = [level.bandwidth for level in cluster.levels]
    prediction = Prediction(time_ms=pipeline.time * MS_PER_S, bottleneck=bottleneck,
                            single_worker_ms=float(costs.compute.sum()) * MS_PER_S,
                            data_parallel_ms=model.data_parallel(costs, counts, bandwidths) * MS_PER_S)
    ref = ProfileRef(sha256=profile_sha256(profile), fingerprint=profile.fingerprint,
                     model=None if profile.model is None else {"spec": profile.model.spec, "kwargs": dict(profile.model.kwargs)},
                     batch_size=profile.batch_size, layers=len(profile.layers), method=profile.method,
                     granularity=profile.granularity, depth=profile.depth, split=profile.split, device=profile.device,
                     layer_sum_over_step=profile.layer_sum_over_step, message_ms_per_mib=profile.message_ms_per_mib,
                     copy_ms_per_mib=profile.copy_ms_per_mib, precision=profile.precision)
    plan = Plan(profile=ref, cluster=cluster, cost_model=search.cost_model, straight=search.straight,
                mode=mode or DEFAULT, stages=tuple(stages), groups=tuple(groups), predicted=prediction,
                command=search.command, profile_file=search.profile_file,
                pdtool_version=__version__, state_space=solver.states.space, shared=shared_parameters(profile, stages))
    if mode is None and plan.untrainable() is not None:
        plan = dataclasses.replace(plan, mode=DEFAULT_TIED)  # `_trainable` says why, for the plan chosen
    return with_group(plan, search.group)



def with_group(plan: Plan, group: int | None) -> Plan:
    """The plan recording `group` microbatches per step where its mode steps per group and runs
    that group on its stages (`schedule.check_parameters`); otherwise as it is (its mode's default)."""
    if group is None or rules(plan.mode).per_round:
        return plan
    try:
        check_parameters(plan.mode, [s.replicas for s in plan.stages], group, group, plan.placement)
    except ScheduleError:
        return plan
    return dataclasses.replace(plan, group=group)


def _trainable(plan: Plan, mode: str | None, say) -> Plan:
    """The plan, when its mode trains it: an explicit mode that cannot is a PlanError; the
    default mode was replaced by `DEFAULT_TIED` for tied weights (say why)."""
    if mode is not None and plan.untrainable() is not None:
        raise PlanError(plan.untrainable())
    if mode is None and plan.shared and not rules(DEFAULT).ties:
        others = listed([m for m in modes_where(ties=True) if m != plan.mode])
        say(f"{plan.describe_shared()} (tied weights), whose copies {DEFAULT} cannot keep equal: the plan uses mode "
            f"{plan.mode} (every stage steps at batch boundaries after the sharing stages add their gradients; "
            f"--mode {others} work too)")
    return plan


def _splittable(states: States, profile: Profile, say) -> States:
    """The states at which the model can be cut: all of them for a traced model; for a model
    neither tracer captured, only between the children of its nn.Sequential, or nowhere."""
    if profile.split == "graph":
        return states
    if profile.split == "none":
        say("neither torch.fx nor torch.export captured this model (its profile lists leaf modules), so it is "
            "planned as one stage: data parallel over its replicas")
        return states.restricted(lambda mask: False)
    children: dict[str, int] = {}
    for layer in profile.layers:
        child = layer.name.split(".")[0].split("#")[0]
        children[child] = children.get(child, 0) | 1 << layer.id
    return states.restricted(lambda mask: all(mask & m in (0, m) for m in children.values()))


def shared_parameters(profile: Profile, stages) -> tuple[tuple[str, tuple[int, ...]], ...]:
    """The profile's shared parameters that several of these stages use, with those stages."""
    stage_of = {layer: s for s, stage in enumerate(stages) for layer in stage.layers}
    found = []
    for name, layers in profile.shared:
        users = tuple(sorted({stage_of[layer] for layer in layers}))
        if len(users) > 1:
            found.append((name, users))
    return tuple(found)


def _with_simulation(plan: Plan, most: int = SIMULATED_MINIBATCHES, steady: bool = False, events: bool = True) -> Plan:
    """The plan with the simulator's figures for its own schedule recorded in `predicted`: with
    `steady`, its steady state computed from one period where that applies (`steady.steady_state`);
    otherwise from an event simulation of at most `most` minibatches (without `events`: as it is)."""
    found = steady_state(plan) if steady else None
    if found is None and not events:
        return plan
    if found is not None:
        return dataclasses.replace(plan, predicted=dataclasses.replace(
            plan.predicted, simulated_ms=found.time_per_minibatch_ms, simulated_bubble=found.bubble_fraction,
            simulated_minibatches=found.period_minibatches, simulated_steady=True))
    group = plan.run().group
    most = min(most, SIMULATED_MINIBATCHES)
    minibatches = min(simulator.default_minibatches(plan.workers, group), max(most // group, 1) * group)
    result = simulator.simulate(plan, minibatches=minibatches, group=None if group == 1 else group, events=False)
    return dataclasses.replace(plan, predicted=dataclasses.replace(
        plan.predicted, simulated_ms=result.time_per_minibatch_ms, simulated_bubble=result.bubble_fraction,
        simulated_minibatches=result.minibatches))


def _dominant(compute: float, allreduce: float, transfer: float) -> str:
    """Which term sets a stage's time (ties go to compute, then all-reduce)."""
    parts = {"compute": compute, "allreduce": allreduce, "transfer": transfer}
    return max(parts, key=parts.get)


def _describe(pipeline: Pipeline, profile: Profile, costs: ChainCosts, model: CostModel, solver: Solver,
              memory: Memory) -> tuple[list[PlanStage], list[PlanGroup]]:
    """Flatten the nested pipeline into plan stages (innermost) and groups (outer levels)."""
    stages: list[PlanStage] = []
    groups: list[PlanGroup] = []
    final = solver.final
    cut = solver.states.cut
    total_params = profile.param_bytes
    placed = [0]  # workers of the stages described so far

    def walk(p: Pipeline, bases: list[int], outer: int) -> None:
        size = solver.inner[p.level]
        for index, stage in enumerate(p.stages):
            last_in_pipeline = index == len(p.stages) - 1
            charge = True if not last_in_pipeline else bool(np.asarray(final).reshape(-1)[stage.end]
                                                             if np.ndim(final) else final)
            members = list(stage.layers)
            unit = stage.inner.time if stage.inner is not None else float(
                costs.compute[members].sum() + (costs.forwards[members].sum() if stage.recompute else 0.0))
            # `shard` auto: the stages that shard gather too
            priced = solver.sharded_models[SHARDS.index(stage.shard)] if stage.shard != "none" else model
            terms = priced.terms(unit, float(costs.params[members].sum()),
                                float(cut[stage.start]), float(cut[stage.end]), stage.replicas,
                                solver.bandwidths[p.level], size, index == 0, charge)
            units = range(stage.units_before, stage.units_before + stage.replicas)
            here = [base + u * size for base in bases for u in units]
            if stage.inner is None:
                stages.append(
                    _leaf(stage, terms=terms, outer=outer, ranks=sorted(here), profile=profile, costs=costs,
                          solver=solver, memory=memory, earlier=stages, before=placed[0], total_params=total_params)
                )
                placed[0] += len(here)
            else:
                groups.append(PlanGroup(level=p.level, layers=stage.layers, units=stage.replicas,
                                        **_term_ms(terms, outer)))
                walk(stage.inner, here, outer * stage.replicas)

    walk(pipeline, [0], 1)
    return stages, groups


def _term_ms(terms: dict, outer: int) -> dict[str, float]:
    """A stage's cost-model terms (compute_ms, allreduce_ms, transfer_ms, time_ms), ms per
    minibatch over the `outer` replicas of the levels above it."""
    return {f"{k}_ms": terms[k] / outer * MS_PER_S for k in ("compute", "allreduce", "transfer", "time")}


def _leaf(stage: PipelineStage, *, terms: dict, outer: int, ranks: list[int], profile: Profile, costs: ChainCosts,
          solver: Solver, memory: Memory, earlier: list[PlanStage], before: int, total_params: int) -> PlanStage:
    """One plan stage: `before` workers run the `earlier` stages; `total_params` is the profile's."""
    k = Memory.in_flight(solver.workers, before, len(ranks))
    a, b = stage.start, stage.end
    layers = [profile.layers[i] for i in stage.layers]
    largest = max(l.param_bytes for l in layers)
    kind = stage.shard if stage.shard != "none" else memory.shard  # `shard` auto: the stage's own choice
    sharing = len(ranks) if kind != "none" and len(ranks) > 1 else 1
    need = memory.need(float(solver.params[a, b]), float(solver.stashed[a, b]), k,
                       recompute=float(solver.states.cut[a]) if stage.recompute else None,
                       cut=(float(solver.states.cut[a]), float(solver.states.cut[b])), largest=largest, sharing=sharing,
                       shard=kind, replicas=len(ranks))
    params = sum(l.param_bytes for l in layers)
    share = params / total_params if total_params else 0.0
    scale = profile.compute_scale  # the layers' times scaled to the measured step, as in `costs`
    return PlanStage(layers=stage.layers, first_name=layers[0].name, last_name=layers[-1].name, ranks=tuple(ranks),
                     in_flight=k, fwd_ms=scale * sum(l.fwd_ms for l in layers),
                     bwd_ms=scale * sum(l.bwd_ms for l in layers),
                     param_bytes=params, in_bytes=int(solver.states.cut[a]), out_bytes=int(solver.states.cut[b]),
                     activation_bytes=int(solver.stashed[a, b]), **_term_ms(terms, outer),
                     memory_bytes=int(round(need)), update_ms=profile.update_ms * share, largest_layer_bytes=largest,
                     data_ms=profile.data_ms if not earlier else 0.0,
                     wgrad_ms=scale * sum(l.weight_gradient_ms for l in layers), reduce_ms=profile.reduce_ms * share,
                     recompute=stage.recompute, shard=kind if sharing > 1 else "none")


def _no_plan_reason(search: _Search) -> str:
    """Why no plan exists: name the stage that does not fit and by how much, when memory is why."""
    profile, costs, model, memory, straight = search.profile, search.costs, search.model, search.memory, search.straight
    recompute = search.recompute
    if memory is not None:
        solver = search.solver(straight=straight, memory=None, recompute="none")
        free = solver.solve()
        if free is not None:
            fake = dataclasses.replace(memory, limit=float("inf"))
            stages, _ = _describe(free, profile, costs, model, solver, fake)
            worst_index, worst = max(enumerate(stages), key=lambda item: item[1].memory_bytes)
            over = worst.memory_bytes - memory.limit
            return (f"no plan fits in {format_bytes(memory.limit)} per worker: the fastest plan's stage {worst_index} "
                    f"(layers {compact_ranges(worst.layers)}, {worst.first_name}..{worst.last_name}) needs "
                    f"{worst.memory_bytes / 2**30:.3f} GiB per worker, {over / 2**30:.3f} GiB over, and no other "
                    "partition fits either" + (" (even recomputing activations)" if recompute != "none" else "")
                    + "; raise --memory, add workers" + (", recompute (--recompute auto)" if recompute == "none" else "")
                    + " or profile a smaller batch")
    if model.exact_workers:
        return (f"the pipedream cost model uses exactly every worker and no partition of {len(profile.layers)} layers "
                f"does on {search.cluster.workers} workers{' with --straight' if straight else ''}; "
                "use fewer workers, drop --straight, or use --cost-model pdtool")
    return "no partition exists for this profile and cluster; check the cluster description"
