"""What `pd train` compares its measurement with, and why they differ: the prediction for the
mode and group that ran (`expected_ms`) and the reasons pdtool knows for a gap (`gap_reasons`);
each worker's memory by the terms of the planner's memory model (`planned_memory`) and the term
that is most off when the measurement differs by more than `MEMORY_GAP` (`memory_gap`).
Pure: no torch."""
from __future__ import annotations

import re

from ..artifacts.plan import Plan


def expected_ms(plan: Plan, mode: str | None, group: int | None) -> tuple[float | None, float]:
    """(simulated, cost model) time per minibatch for `mode` and `group` (None: the plan's): the
    plan's own figures, or a new simulation when the mode or the group changed the schedule."""
    simulated = plan.predicted.simulated_ms
    if mode not in (None, plan.mode) or group is not None:
        from .simulate import simulate

        simulated = simulate(plan, mode=mode, group=group, events=False).time_per_minibatch_ms
    return simulated, plan.predicted.time_ms


GAP = 1.5
"""Measured over predicted time per minibatch beyond which (either way) pd train says why."""


def gap_reasons(measured_ms: float, predicted_ms: float, plan: Plan, threads: int | None, local_workers: int,
                cores: int, on_cpu: bool) -> list[str]:
    """Why the measured time per minibatch is more than `GAP` times off the prediction, from what
    pdtool knows (none when it is not): cores shared by the workers, a profile measured with
    other threads than the workers have, a profile whose layer times do not add up to a step; each
    only where it points the way the measurement went."""
    if not (measured_ms > 0 and predicted_ms > 0) or 1 / GAP <= measured_ms / predicted_ms <= GAP:
        return []
    reasons, explained = [], 1.0
    slow = measured_ms > predicted_ms

    def cite(factor: float, text: str) -> None:
        """A cause that makes the workers `factor` times slower than predicted, cited only where it
        points the way the measurement went (a cause of a faster run cannot explain a slower one)."""
        nonlocal explained
        if factor != 1.0 and (factor > 1.0) == slow:
            explained *= factor
            reasons.append(text)

    if on_cpu and threads and local_workers * threads > cores:
        cite(local_workers * threads / cores,
             f"{local_workers} workers x {threads} thread(s) share {cores} cores "
             f"({local_workers * threads / cores:.1f}x oversubscribed; the prediction gives each worker its own)")
    profiled = re.match(r"cpu \((\d+) threads?\)", plan.profile.device or "")
    if on_cpu and threads and profiled and int(profiled.group(1)) != threads:
        cite(int(profiled.group(1)) / threads,
             f"the profile was measured with {profiled.group(1)} thread(s), the workers have {threads} "
             "(profile with pd profile --threads to match)")
    ratio = plan.profile.layer_sum_over_step
    if ratio is not None and not 0.8 <= ratio <= 1.25:
        cite(1 / ratio, f"the profile's layer times sum to {ratio:.2f} of a measured step, so its costs are off by "
                        "that much")
    rest = measured_ms / predicted_ms / explained
    if not 1 / GAP <= rest <= GAP:
        reasons.append(("about " + f"{rest:.1f}x " if reasons else "") + "outside what pdtool models: the runtime's "
                       "own overhead per action (about 0.4 ms on small layers), message latency and processes "
                       "competing for memory bandwidth; pd simulate --trace beside pd train --trace shows where")
    return reasons


MEMORY_GAP = 1.25
"""Measured over planned memory of a worker beyond which (either way) pd train names the term most off."""


def planned_memory(plan: Plan, mode: str | None, group: int | None, optimizer: str,
                   precision: str = "fp32", weight_decay: float = 0.0,
                   rings: dict[int, bool] | None = None) -> dict[int, dict[str, int]]:
    """Per plan rank, the bytes the memory model gives each term (`Memory.terms`: weights and
    their versions, gradients, optimizer state, activations in flight, messages, temporaries)
    for the schedule of `mode` and `group` (None: the plan's) with `optimizer`'s state and
    `weight_decay`, computing in `precision`; `rings` says per rank whether its messages went
    through shared-memory rings (`WorkerReport.rings`; absent: they did)."""
    from ..memory import OPTIMIZER_SLOTS, memory_model
    from .simulate import simulate

    result = simulate(plan, mode=mode, group=group, events=False)
    slots = OPTIMIZER_SLOTS.get(optimizer, 2)  # a factory: as Adam
    models = {ring: memory_model(None, slots, precision, mode or plan.mode, weight_decay > 0, optimizer == "adamw",
                                 rings=ring) for ring in (True, False)}
    rings = rings or {}
    by_ring = {ring: model.worker_terms(plan, result) for ring, model in models.items()}
    return {rank: {term: int(value) for term, value in by_ring[rings.get(rank, True)][rank].items()}
            for rank in plan.used_ranks}


def planned_for_run(plan: Plan, config, reports) -> dict[int, dict[str, int]]:
    """`planned_memory` of a run: its `config` (a `RunConfig`: mode, group, optimizer, precision)
    and its workers' `reports` (whose messages went through shared-memory rings)."""
    return planned_memory(plan, config.mode, config.group, config.optimizer.name,
                          config.precision or plan.profile.precision, config.optimizer.weight_decay,
                          {report.rank: report.rings > 0 for report in reports})


def measured_beyond(measured: dict[str, int]) -> int:
    """Training's peak beyond the worker's start (`worker.memory.measure`): what the plan's memory
    model predicts (a report without `training` has the process's peak only)."""
    return measured.get("training", measured["peak"]) - measured["base"]


def memory_gap(measured: dict[str, int], planned: dict[str, int]) -> str | None:
    """Why a worker's measured memory beyond its start (`worker.memory.measure`) is more than
    `MEMORY_GAP` times off the plan's (`planned_memory`), naming the term most off; None within it."""
    from ..units import format_bytes

    beyond, total = measured_beyond(measured), sum(planned.values())
    if total <= 0 or 1 / MEMORY_GAP <= beyond / total <= MEMORY_GAP:
        return None
    planned = dict(planned)
    for rest in ("messages", "temporaries"):  # a worker's measured rest holds them too
        if rest in planned and rest not in measured:
            planned["activations"] = planned["activations"] + planned.pop(rest)
    term = max(planned, key=lambda name: abs(measured.get(name, 0) - planned[name]))
    what = (" (what remains of the peak beyond weights, gradients and optimizer state, planned as what autograd "
            "saves for the minibatches in flight, the runtime's message buffers and the step's temporaries; "
            "measured, also whatever else the process held then: freed memory the allocator keeps for reuse, the "
            "libraries' own buffers)") if term == "activations" else ""
    return (f"{beyond / total:.1f}x the plan; the term most off is {term}{what}: measured "
            f"{format_bytes(measured.get(term, 0))}, planned {format_bytes(planned[term])}")
