"""What `pd train` prints when its workers are done: steps, loss, and the measured time per
minibatch beside the plan's predictions, with the reasons for a gap. Pure: no torch."""
from __future__ import annotations

from ..artifacts.plan import Plan
from ..sim.prediction import expected_ms, gap_reasons, measured_beyond, memory_gap, planned_for_run
from ..units import format_bytes
from ..runtime.run import RunConfig


def train_summary(result, job) -> list[str]:
    """The lines pd train prints when the workers are done (`result`: a `session.TrainResult`,
    `job`: the `launcher.job.Job` that ran): steps, loss, and the measured time per minibatch
    beside the plan's predictions for the mode and group that ran, and why they differ when they
    differ by more than 1.5x (the job's threads, local workers, cores, whether on the CPU)."""
    plan, config = job.plan, job.config
    losses = result.losses
    if not losses:
        return []
    lines = []
    first, last = losses[min(losses)], losses[max(losses)]
    here, everywhere = len(result.reports), len(plan.used_ranks)
    workers = f"{here} worker{'s' if here != 1 else ''}" + (f" of this machine ({everywhere} in the job)"
                                                          if here < everywhere else "")
    rings = sum(report.rings for report in result.reports.values()) // 2  # each counted by both ends
    lines.append(f"trained steps {result.first_step + 1}-{result.first_step + result.steps} ({len(losses)} minibatches) "
                 f"on {workers} in {result.wall_s:.1f} s; loss {first:.4f} -> {last:.4f}"
                 + (f"; {rings} link direction(s) over shared memory" if rings else ""))
    lines.append(f"recipe: {recipe_line(config, plan, result)}")
    measured = result.time_per_minibatch_ms()
    rate = lambda ms: f"{ms:.3f} ms" + (f" ({plan.profile.batch_size / ms * 1e3:.0f} samples/s)" if ms > 0 else "")  # noqa: E731
    simulated, cost_model = expected_ms(plan, config.mode, config.group)
    expected = simulated if simulated is not None else cost_model
    predicted = (f"predicted {rate(simulated)} (simulated, {job.run.name}), {rate(plan.predicted.time_ms)} "
                 "by the cost model" if simulated is not None else f"predicted {rate(expected)} by the cost model")
    lines.append(f"time per minibatch: measured {rate(measured)}, {predicted}" if measured else
                 f"time per minibatch: too few minibatches to measure; {predicted}")
    if measured:
        reasons = gap_reasons(measured, expected, plan, config.threads, job.local, job.cores, job.on_cpu)
        if reasons:
            lines.append(f"measured {measured / expected:.1f}x the prediction, because:")
            lines += [f"  - {reason}" for reason in reasons]
    return lines + memory_lines(result, plan, config)


def recipe_line(config: RunConfig, plan: Plan, result) -> str:
    """The run's optimizer, schedule, clipping and precision in a few words."""
    recipe = config.recipe
    parts = [f"{recipe.name} lr {recipe.lr:g}"]
    if recipe.weight_decay:
        parts.append(f"weight decay {recipe.weight_decay:g}")
    if recipe.schedule.name != "constant" or recipe.schedule.warmup_steps:
        parts.append(recipe.schedule.describe())
    if recipe.clip_grad_norm is not None:
        parts.append(f"gradients clipped to norm {recipe.clip_grad_norm:g}")
    precision = config.precision or plan.profile.precision
    parts.append(precision)
    if precision == "fp16":
        head = next((r for r in result.reports.values() if r.stage == 0 and r.replica == 0), None)
        skipped = sum(1 for entry in head.step_log if entry[4]) if head else 0
        parts.append(f"{skipped} step(s) skipped on overflow (loss scaling)")
    return ", ".join(parts)


def memory_lines(result, plan: Plan, config: RunConfig) -> list[str]:
    """Per stage of this machine (its busiest replica): the peak memory beyond the worker's start
    beside the plan's, and the term most off where they differ by more than 25%."""
    reports = [r for r in result.reports.values() if r.memory]
    if not reports:
        return []
    planned = planned_for_run(plan, config, reports)
    busiest = {}
    for report in reports:
        if report.stage not in busiest or _beyond(report) > _beyond(busiest[report.stage]):
            busiest[report.stage] = report
    parts, gaps, states = [], [], []
    for first, report in sorted(busiest.items()):
        # a worker of several stages (the plan's placement) holds them all
        stage = ",".join(str(s) for s, st in enumerate(plan.stages) if report.rank in st.ranks) if plan.placement \
            else first
        plan_bytes = sum(planned[report.rank].values())
        parts.append(f"stage {stage} {format_bytes(_beyond(report))} measured (rank {report.rank}, beyond "
                     f"{format_bytes(report.memory['base'])} at its start), {format_bytes(plan_bytes)} planned")
        states.append(f"stage {stage} " + ", ".join(
            f"{term} {format_bytes(report.memory.get(term, 0))} / {format_bytes(planned[report.rank].get(term, 0))}"
            for term in ("weights", "gradients", "optimizer"))
            + {"none": "", "optimizer": f" (optimizer sharded over {plan.stages[first].replicas} replicas)",
               "gradients": f" (optimizer and gradients sharded over {plan.stages[first].replicas} replicas: its "
                            "gradients are its slice and bucket buffer)",
               "parameters": f" (parameters, gradients and optimizer sharded over {plan.stages[first].replicas} "
                             "replicas: each term its shards; the gathered layers count as activations)"}[
                plan.stages[first].shard])
        gap = memory_gap(report.memory, planned[report.rank])
        if gap:
            gaps.append(f"  - stage {stage}: {gap}")
        limit = plan.cluster.memory
        if limit and _beyond(report) > limit:
            gaps.append(f"  - stage {stage}: its peak ({format_bytes(_beyond(report))} beyond its start) passes the "
                        f"{format_bytes(limit)} per worker the plan was made for (pd plan --memory): on those workers "
                        "it would not fit; plan again with more memory, more workers or --recompute")
    files = max(report.memory.get("files", 0) for report in reports)
    if files:
        parts.append(f"file pages left out (torch's code, mapped files: up to {format_bytes(files)} a worker)")
    return ([f"peak memory per worker: {'; '.join(parts)}", f"  state measured / planned: {'; '.join(states)}"]
            + gaps)


def _beyond(report) -> int:
    return measured_beyond(report.memory)
