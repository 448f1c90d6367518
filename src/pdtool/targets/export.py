"""What another runtime will run for a plan: its schedule, stages, batch, replicas, recomputation.

`exported(plan, profile, target)` maps a plan onto what `target` (torchtitan, Megatron-Core or
torch.distributed.pipelining) can express and returns an `Export`: each stage's module names
(`units`), the target's schedule, the microbatch size and count, the data-parallel degree and
sharding, recomputation. What the target cannot express is refused (`PlanError`, one line) or
approximated: `Export.notes` say, one line each, what is lost and what the target runs instead,
and `target_ms` is `pd simulate`'s time per minibatch for what the target runs (`plan_ms` for the
plan as pdtool would run it).

| pdtool mode            | torch / torchtitan schedule         | Megatron-Core                        |
|------------------------|-------------------------------------|--------------------------------------|
| flush                  | 1F1B                                | 1F1B (the default)                   |
| gpipe                  | GPipe                               | ~ 1F1B (the same weights)            |
| zb, zb2                | pdtool's schedule as a CSV          | ~ 1F1B                               |
| interleaved            | Interleaved1F1B                     | interleaved, virtual pipeline size v |
| zbv, dualpipev         | ZBVZeroBubble, DualPipeV            | ~ interleaved, v = 2, looped         |
| pipedream, vsync, 2bw  | ~ 1F1B (no asynchronous schedule)   | ~ 1F1B                               |

Pure: no torch.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from ..artifacts.plan import Plan
from ..artifacts.profile import Profile
from ..errors import PlanError, ScheduleError
from ..schedule.modes import rules
from .units import MegatronStage, megatron_stages, stage_modules

TARGETS = ("torchtitan", "megatron", "pipelining")
NAMES = {"torchtitan": "torchtitan", "megatron": "Megatron-Core", "pipelining": "torch.distributed.pipelining"}

TORCH_SCHEDULES = {"flush": "1F1B", "gpipe": "GPipe", "interleaved": "Interleaved1F1B", "zbv": "ZBVZeroBubble",
                   "dualpipev": "DualPipeV"}
"""pdtool modes with a schedule class of torch.distributed.pipelining (`get_schedule_class` names)."""
CSV_MODES = ("zb", "zb2")
"""Modes torch runs from pdtool's own schedule, as a CSV (`_PipelineScheduleRuntime`)."""
MEGATRON_MODES = ("flush", "interleaved")


@dataclass(frozen=True, kw_only=True)
class Export:
    """A plan as `target` will run it (module docstring)."""

    target: str
    mode: str                        # the pdtool mode the target runs
    schedule: str                    # the target's name of it (torch: a get_schedule_class name)
    csv: bool                        # the schedule is pdtool's own, written as a CSV beside the export
    pipeline: int                    # pipeline ranks (workers of one replica of the pipeline)
    stage_ranks: tuple[int, ...]     # each stage's pipeline rank
    modules: tuple[tuple[str, ...], ...]  # each stage's module names (torchtitan, pipelining)
    megatron: tuple[MegatronStage, ...]   # each stage in Megatron's layout words (megatron)
    decoder: str                     # the container of the transformer layers (megatron)
    microbatch: int                  # samples per microbatch (the profile's batch)
    microbatches: int                # microbatches per optimizer step of each pipeline replica (torch's n_microbatches)
    replicas: int                    # data-parallel degree of every stage
    shard: str                       # "none" or "optimizer"
    recompute: tuple[bool, ...]      # per stage, as the target runs it
    shared: tuple[str, ...]          # parameters tied across stages
    tied: bool                       # the model ties parameters (across stages or inside one)
    notes: tuple[str, ...]           # one line per approximation
    target_ms: float                 # pd simulate's time per minibatch of what the target runs
    plan_ms: float                   # ... of the plan as pdtool runs it

    @property
    def chunks(self) -> int:
        return len(self.stage_ranks) // self.pipeline


def exported(plan: Plan, profile: Profile, target: str) -> Export:
    """`plan` as `target` runs it, or a `PlanError` saying why it cannot."""
    if target not in TARGETS:
        raise PlanError(f"unknown export target {target!r}; use one of {', '.join(TARGETS)}")
    name = NAMES[target]
    replicas = _replicas(plan, name)
    notes: list[str] = []
    mode = _mode(plan, target, notes)
    variant = _placed(plan, mode)
    shard = _shard(plan, target, notes)
    recompute = _recompute(plan, target, notes)
    if recompute != tuple(s.recompute for s in plan.stages):
        variant = dataclasses.replace(variant, stages=tuple(
            dataclasses.replace(s, recompute=r) for s, r in zip(variant.stages, recompute)))
    shared = tuple(name for name, _ in plan.shared)
    tied = bool(shared or profile.shared)
    if shared and target != "megatron":
        raise PlanError(f"parameter {shared[0]!r} is shared by stages {', '.join(map(str, plan.shared[0][1]))}: "
                        f"{name} keeps each stage's parameters its own, so it would train two copies; untie it in the "
                        "model, or export --to megatron (which ties the embedding and the output layer)")
    microbatches = _microbatches(plan, variant, mode, replicas, name, notes)
    target_ms = _simulated(variant, mode, microbatches * replicas)
    modules: list[list[str]] = []
    megatron: list[MegatronStage] = []
    decoder = ""
    if target == "megatron":
        megatron, decoder = megatron_stages(plan, profile)
    else:
        modules = stage_modules(plan, profile, name)
    placement = variant.placement or tuple(range(len(plan.stages)))
    return Export(
        target=target, mode=mode, schedule=_schedule(mode, target),
        csv=target != "megatron" and mode in CSV_MODES, pipeline=len(set(placement)), stage_ranks=placement,
        modules=tuple(tuple(m) for m in modules), megatron=tuple(megatron), decoder=decoder,
        microbatch=plan.profile.batch_size, microbatches=microbatches, replicas=replicas, shard=shard,
        recompute=recompute, shared=shared, tied=tied, notes=tuple(notes), target_ms=target_ms,
        plan_ms=plan.predicted.simulated_ms or _simulated(plan, plan.mode, plan.run().group))


def _microbatches(plan: Plan, variant: Plan, mode: str, replicas: int, name: str, notes: list[str]) -> int:
    """Microbatches per step of each pipeline replica: the plan's group (every replica's together:
    pdtool sends microbatch b to replica b mod r) over the replicas, rounded up where it does not
    divide or where the target's schedule needs a multiple of the pipeline ranks (said in `notes`)."""
    group = plan.run().group
    count = -(-group // replicas)
    pipeline = len(set(variant.placement)) if variant.placement else len(plan.stages)
    if rules(mode).group_multiple and count % pipeline:
        count = -(-count // pipeline) * pipeline
        notes.append(f"{name}'s {mode} schedule needs microbatches in multiples of the {pipeline} pipeline ranks: "
                     f"exported {count} a step per pipeline instead of {group / replicas:g}")
    elif count * replicas != group:
        notes.append(f"the plan's {group} microbatches a step do not divide over its {replicas} replicas: exported "
                     f"{count} per replica ({count * replicas} a step)")
    return count


def _replicas(plan: Plan, name: str) -> int:
    counts = sorted({stage.replicas for stage in plan.stages})
    if len(counts) > 1:
        which = [str(i) for i, s in enumerate(plan.stages) if s.replicas != plan.stages[0].replicas][0]
        raise PlanError(f"stage 0 has {plan.stages[0].replicas} replicas and stage {which} "
                        f"{plan.stages[int(which)].replicas}: {name} replicates every pipeline stage alike (one "
                        "data-parallel degree); plan with --straight, or on a cluster the stages divide evenly")
    return counts[0]


def _mode(plan: Plan, target: str, notes: list[str]) -> str:
    """The pdtool mode the target runs for the plan's mode (the table of the module docstring)."""
    row = rules(plan.mode)
    name = NAMES[target]
    if not row.flushes:
        notes.append(f"{name} has no asynchronous schedule: mode {plan.mode} (weight stashing, a step per "
                     f"{'minibatch' if row.per_round else 'group without a flush'}) exported as 1F1B with a flush "
                     "(pdtool's flush: the same stages, one weight version, another time per minibatch)")
        return "flush"
    if target != "megatron" or plan.mode in MEGATRON_MODES:
        return plan.mode
    if row.placement == "v":
        notes.append(f"Megatron-Core has no V schedule: mode {plan.mode} exported as its interleaved 1F1B on the same "
                     "chunks placed looped (stage s on pipeline rank s mod p: pdtool's interleaved)")
        return "interleaved"
    notes.append(f"Megatron-Core has no {plan.mode} schedule: exported as its 1F1B on the same stages (pdtool's flush"
                 + (": backwards not split)" if row.split else ")"))
    return "flush"


def _placed(plan: Plan, mode: str) -> Plan:
    """The plan's stages run in `mode` (a V placement re-placed looped for interleaved; otherwise
    the same ranks), without its recorded group: the target's is priced explicitly."""
    placement = plan.placement
    if rules(mode).placement == "looped" and placement and rules(plan.mode).placement != "looped":
        workers = len(set(placement))
        first = [plan.stages[placement.index(w)].ranks for w in range(workers)]
        stages = tuple(dataclasses.replace(s, ranks=first[i % workers]) for i, s in enumerate(plan.stages))
        return dataclasses.replace(plan, mode=mode, stages=stages, group=None)
    return dataclasses.replace(plan, mode=mode, group=None)


def _shard(plan: Plan, target: str, notes: list[str]) -> str:
    shard = "optimizer" if any(s.shard != "none" for s in plan.stages) else "none"
    finer = sorted({s.shard for s in plan.stages if s.shard in ("gradients", "parameters")})
    if finer and target != "torchtitan":
        notes.append(f"{NAMES[target]} has no per-backward gradient or parameter sharding beside pipeline stages: "
                     f"--shard {'/'.join(finer)} is exported as the optimizer sharding it builds on (each replica "
                     "keeps the whole weights and gradient while it accumulates)")
    if shard == "optimizer" and target == "torchtitan" and any(s.shard in ("optimizer", "gradients")
                                                               for s in plan.stages):
        notes.append("torchtitan has no optimizer-only sharding: exported as FSDP over the replicas "
                     "(data_parallel_shard_degree), which shards gradients and weights too (less memory, an all-gather "
                     "of each layer's weights in every forward and backward); the time below prices pdtool's "
                     "--shard optimizer")
    return shard


def _recompute(plan: Plan, target: str, notes: list[str]) -> tuple[bool, ...]:
    flags = tuple(s.recompute for s in plan.stages)
    if target == "pipelining" or len(set(flags)) == 1:
        return flags
    notes.append(f"{NAMES[target]} recomputes every stage or none: the plan recomputes stages "
                 f"{', '.join(str(i) for i, f in enumerate(flags) if f)} only; exported recomputing every stage "
                 "(the plan's memory holds; the other stages run their forwards twice)")
    return tuple(True for _ in flags)


def _schedule(mode: str, target: str) -> str:
    if target == "megatron":
        return "interleaved 1F1B" if mode == "interleaved" else "1F1B"
    if mode in CSV_MODES:
        return "PipelineScheduleMulti"  # torchtitan then builds _PipelineScheduleRuntime and loads the CSV
    return TORCH_SCHEDULES[mode]


def _simulated(plan: Plan, mode: str, group: int) -> float:
    from ..sim.simulate import simulate

    return simulate(plan, mode=mode, group=group, events=False).time_per_minibatch_ms
