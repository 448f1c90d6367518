"""Readable tables of artifacts, for `pd show`, and of simulated runs, for `pd simulate` (pandas renders them)."""
from __future__ import annotations

import pandas as pd

from ..artifacts.plan import Plan, compact_ranges
from ..artifacts.profile import Profile
from ..schedule.modes import rules
from ..sim.simulate import SimResult
from ..units import format_bytes

MB = 1e6


def profile_table(profile: Profile, top: int = 15) -> str:
    """The `top` heaviest layers (forward + backward time) and the profile's totals, as text."""
    total = profile.layer_sum_ms or 1.0
    frame = pd.DataFrame(
        {
            "id": layer.id,
            "layer": layer.name,
            "kind": layer.kind,
            "fwd ms": layer.fwd_ms,
            "bwd ms": layer.bwd_ms,
            "% time": 100.0 * layer.total_ms / total,
            "act MB": layer.act_bytes / MB,
            "param MB": layer.param_bytes / MB,
        }
        for layer in profile.layers
    )
    heaviest = frame.assign(_t=frame["fwd ms"] + frame["bwd ms"]).nlargest(top, "_t", keep="first").drop(columns="_t")
    table = heaviest.to_string(index=False, float_format=lambda x: f"{x:.3f}")
    model = profile.model.spec if profile.model else "(imported)"
    kwargs = " ".join(f"{k}={v}" for k, v in sorted(profile.model.kwargs.items())) if profile.model else ""
    skips = sum(1 for s, d in profile.edges if d > s + 1)
    ratio = profile.layer_sum_over_step
    lines = [
        f"model        {model} {kwargs}".rstrip(),
        f"measured on  {profile.device}, torch {profile.torch_version}, batch {profile.batch_size}, "
        f"{profile.repeats} repeats",
        f"layers       {len(profile.layers)} ({profile.method}, granularity {profile.granularity}"
        f"{f', depth {profile.depth}' if profile.depth else ''}), {len(profile.edges)} edges ({skips} skip layers)",
        f"parameters   {profile.param_bytes / MB:.3f} MB",
        f"layer sum    {profile.layer_sum_ms:.3f} ms (fwd {sum(l.fwd_ms for l in profile.layers):.3f} + "
        f"bwd {sum(l.bwd_ms for l in profile.layers):.3f})",
        (f"whole step   {profile.step_ms:.3f} ms (spread {profile.step_ms_spread:.3f}); layer sum / step = "
         + (f"{ratio:.3f}" if ratio is not None else "n/a")) if profile.measured == "step" else
        (f"whole step   not timed: profiled one layer's weights at a time (pd profile --memory); "
         f"{sum(1 for l in profile.layers if l.same_as is not None)} layer(s) carry an identical earlier one's figures"),
        *([f"note         {profile.sum_gap()}"] if profile.sum_gap() else []),
        "",
        f"heaviest {min(top, len(profile.layers))} of {len(profile.layers)} layers:",
        table,
    ]
    return "\n".join(lines) + "\n"


def _memory_terms(plan: Plan) -> list[str]:
    """Each worker's planned memory by term (`prediction.planned_memory`: weights, gradients,
    optimizer state, activations, ...), in the plan's mode and group with the optimizer it was
    planned with; nothing for a plan that does not record it."""
    if plan.optimizer is None:
        return []
    from ..sim.prediction import planned_memory

    planned = planned_memory(plan, None, None, plan.optimizer, plan.profile.precision)
    stage_of = {rank: ",".join(str(i) for i, s in enumerate(plan.stages) if rank in s.ranks) for rank in planned}
    rows = [{"rank": rank, "stage": stage_of[rank], **{f"{term} MiB": value / 2**20 for term, value in terms.items()},
             "total MiB": sum(terms.values()) / 2**20} for rank, terms in sorted(planned.items())]
    table = pd.DataFrame(rows).fillna(0.0).to_string(index=False, float_format=lambda x: f"{x:.1f}")
    return ["", f"memory per worker by term (--optimizer {plan.optimizer}; the run's schedule holds what the memory "
                "GiB column's 1F1B count gives or less):", table]


def plan_table(plan: Plan) -> str:
    """Per-stage table of a plan (layers, replicas, ranks, times, memory) and its predictions."""
    pred = plan.predicted
    recomputing = any(s.recompute for s in plan.stages)
    sharding = any(s.shard != "none" for s in plan.stages)
    rows = []
    for index, s in enumerate(plan.stages):
        rows.append({
            "stage": index,
            "layers": compact_ranges(s.layers),
            "from .. to": f"{s.first_name} .. {s.last_name}",
            "replicas": s.replicas,
            "ranks": compact_ranges(s.ranks),
            "compute ms": s.compute_ms,
            "allreduce ms": s.allreduce_ms,
            "transfer ms": s.transfer_ms,
            "time ms": s.time_ms,
            "in flight": s.in_flight,
            "memory GiB": s.memory_bytes / 2**30,
            **({"recompute": "yes" if s.recompute else "no"} if recomputing else {}),
            **({"shard": s.shard if s.replicas > 1 else "- (no replicas)"} if sharding else {}),
            "": "<- bottleneck" if pred.bottleneck.startswith(f"stage {index} ") else "",
        })
    table = pd.DataFrame(rows).to_string(index=False, float_format=lambda x: f"{x:.3f}")
    lines = [
        f"plan         {len(plan.stages)} stage{'' if len(plan.stages) == 1 else 's'} on {plan.workers} workers ({plan.cluster.describe()}), "
        f"mode {plan.mode}{_group_note(plan)}, cost model {plan.cost_model}{', straight' if plan.straight else ''}"
        f"{', stages over prefixes of the layer order' if plan.state_space == 'prefixes' else ''}",
        f"profile      {plan.profile.model['spec'] if plan.profile.model else '(imported)'}, "
        f"batch {plan.profile.batch_size}, {plan.profile.layers} layers ({plan.profile.method})",
        *[f"tied         {name} is used by stages {', '.join(map(str, stages))}: each holds a copy, and the copies' "
          "gradients are added before every step" for name, stages in plan.shared],
        *(["recompute    a stage marked so runs its forward again before each backward: a minibatch in flight "
           "keeps only its input (its compute ms counts the forward twice)"] if recomputing else []),
        *(["shard        each replica of a stage marked optimizer keeps the optimizer state of 1/replicas of the "
           "stage (its memory GiB counts that share) and all-gathers the updated weights after each step (its "
           "allreduce ms counts it): ZeRO stage 1; a stage without replicas is not sharded"]
          if any(s.shard == "optimizer" for s in plan.stages) else []),
        *(["shard        each replica of a stage marked gradients also keeps 1/replicas of the summed gradients, "
           "which the replicas all-reduce bucket by bucket during every backward (its memory GiB counts the share "
           "and two buckets; the simulator prices each backward's all-reduce, its allreduce ms a step's): ZeRO "
           "stage 2"] if any(s.shard == "gradients" for s in plan.stages) else []),
        *(["shard        each replica of a stage marked parameters keeps 1/replicas of its weights, gradients and "
           "optimizer state, and gathers each layer's weights for its forward and again for its backward, "
           "reduce-scattering its gradients after it (FSDP2; where the mode splits its backward the weights stay "
           "gathered until the step); its memory GiB counts the shares and two gathered layers, the simulator "
           "prices the gathers and reductions: ZeRO stage 3"] if any(s.shard == "parameters" for s in plan.stages)
          else []),
        *([f"chunks       {rules(plan.mode).placement} placement, {len(plan.stages) // len(plan.used_ranks)} stages "
           "on each worker: " + "; ".join(f"rank {rank} holds stages {', '.join(map(str, stages))}"
                                          for rank, stages, _ in _workers(plan))] if plan.placement else []),
        "",
        table,
    ]
    lines += _memory_terms(plan)
    if plan.groups:
        groups = pd.DataFrame({
            "level": g.level, "layers": compact_ranges(g.layers), "units": g.units, "compute ms": g.compute_ms,
            "allreduce ms": g.allreduce_ms, "transfer ms": g.transfer_ms, "time ms": g.time_ms,
        } for g in plan.groups)
        lines += ["", "outer-level stages (each runs the inner stages of its layers on every unit):",
                  groups.to_string(index=False, float_format=lambda x: f"{x:.3f}")]
    used = len(plan.used_ranks)
    model_single, model_dp = pred.cost_model_speedups
    simulated = pred.simulated_data_parallel_ms is not None
    lines += [
        "",
        f"predicted    {pred.expected_ms:.3f} ms per minibatch ({plan.samples_per_s:.1f} samples/s), "
        + (f"simulated ({plan.mode} schedule, "
           + (f"steady state of its {pred.simulated_minibatches}-minibatch period" if pred.simulated_steady
              else f"{pred.simulated_minibatches} minibatches")
           + f", bubble {pred.simulated_bubble:.1%}); " if pred.simulated_ms is not None else "")
        + f"cost model {pred.time_ms:.3f} ms, bottleneck: {pred.bottleneck}",
        *([f"chosen       {pred.why}"] if pred.why else []),
        *([f"hybrid       the fastest candidate with a replicated stage inside a pipeline: {pred.hybrid}"]
          if pred.hybrid else []),
        *([f"idle         {plan.workers - used} of {plan.workers} workers: more stages or replicas would be slower "
           "(their transfers or all-reduces cost more than the compute they share)"] if used < plan.workers else []),
        f"one worker   {pred.single_worker_ms:.3f} ms -> speedup {pred.speedup_over_single:.2f}x"
        + (f" (cost model {model_single:.2f}x)" if simulated else ""),
        (f"data parallel on {plan.workers} workers does not fit: it needs {format_bytes(pred.data_parallel_over_bytes)} "
         "per worker more than the memory limit" if pred.data_parallel_over_bytes is not None else
         f"data parallel on {plan.workers} workers  {pred.baseline_ms:.3f} ms"
         + (f" simulated ({pred.data_parallel_ms:.3f} ms by the cost model)" if simulated else "")
         + f" -> speedup {pred.speedup_over_data_parallel:.2f}x" + (f" (cost model {model_dp:.2f}x)" if simulated else "")),
    ]
    return "\n".join(lines) + "\n"


def steady_table(state, plan: Plan, mode: str | None, group: int | None) -> str:
    """What `pd simulate` prints for a large plan: the steady state of one period (`sim.steady`)
    beside the cost model's figure, without the per-worker figures of an event simulation."""
    run = plan.run(mode, group)
    model = plan.predicted.time_ms
    ratio = f", simulated / cost model = {state.time_per_minibatch_ms / model:.3f}" if model else ""
    steps = "" if run.mode.per_round else f", {run.group} microbatches per step"
    samples = plan.profile.batch_size / state.time_per_minibatch_ms * 1e3 if state.time_per_minibatch_ms else 0.0
    return "\n".join([
        f"simulated    mode {run.name}{steps}, the steady state of one period ({state.period_minibatches} "
        f"minibatches, {state.nodes} graph nodes), {len(plan.used_ranks)} workers in {len(plan.stages)} stages "
        f"({plan.cluster.describe()})",
        f"predicted    {state.time_per_minibatch_ms:.3f} ms per minibatch ({samples:.1f} samples/s) in steady state",
        f"cost model   {model:.3f} ms per minibatch, bottleneck: {plan.predicted.bottleneck}{ratio}",
        f"bubble       {state.bubble_fraction:.3f} of the workers' time idle",
        "per worker   not simulated at this size: pd simulate --events runs every action of every worker (minutes "
        "on hundreds of workers)",
    ]) + "\n"


def _workers(plan: Plan) -> list[tuple[int, tuple[int, ...], int]]:
    """(rank, its stages, replica) of every worker, in the order of their first stage."""
    found: dict[int, tuple[list[int], int]] = {}
    for s, stage in enumerate(plan.stages):
        for i, rank in enumerate(stage.ranks):
            found.setdefault(rank, ([], i))[0].append(s)
    return [(rank, tuple(stages), i) for rank, (stages, i) in found.items()]


def simulation_table(result: SimResult, plan: Plan) -> str:
    """What `pd simulate` prints: the predicted steady state beside the plan's cost-model figure,
    the bubble fraction, and per worker its busy share, weight versions, in-flight minibatches
    and stashed activations."""
    rows = []
    for rank, stages, i in _workers(plan):
        rows.append({
            "rank": rank,
            "stage": ",".join(map(str, stages)),
            "replica": i,
            "busy %": 100.0 * result.busy_ms[rank] / result.makespan_ms if result.makespan_ms else 0.0,
            "peak versions": result.peak_versions[rank],
            "peak in-flight": result.peak_in_flight[rank],
            "peak act MB": result.peak_activation_bytes[rank] / MB,
        })
    table = pd.DataFrame(rows).to_string(index=False, float_format=lambda x: f"{x:.1f}")
    model = plan.predicted.time_ms
    ratio = f", simulated / cost model = {result.time_per_minibatch_ms / model:.3f}" if model else ""
    group = "" if rules(result.mode).per_round else f", {result.group} microbatches per step"
    copies = plan.profile.message_ms_per_mib
    lines = [
        f"simulated    mode {result.mode}, {result.minibatches} minibatches{group}, {len(rows)} workers in "
        f"{len(plan.stages)} stage{'' if len(plan.stages) == 1 else 's'}"
        + (f", {len(plan.stages) // len(rows)} on each worker ({plan.mode}'s placement)" if plan.placement else "")
        + f" ({plan.cluster.describe()})"
        + (f"; a message costs each end {copies:.3g} ms of CPU per MiB (the profile's)" if copies else ""),
        f"predicted    {result.time_per_minibatch_ms:.3f} ms per minibatch ({result.samples_per_s:.1f} samples/s) "
        "in steady state",
        f"cost model   {model:.3f} ms per minibatch ({plan.profile.batch_size / model * 1e3 if model else 0.0:.1f} "
        "samples/s), bottleneck: "
        f"{plan.predicted.bottleneck}{ratio}",
        f"run          {result.makespan_ms:.3f} ms for the whole run, bubble fraction {result.bubble_fraction:.3f} "
        "(share of the workers' time idle: waiting for a message, a peer or the pipeline to fill)",
        "",
        table,
    ]
    return "\n".join(lines) + "\n"


def _group_note(plan: Plan) -> str:
    """' (8 microbatches a step, ...)' where the plan records its group, else ''."""
    return f" ({plan.group} microbatches a step, pd train's default)" if plan.group else ""
