"""The plan artifact (`pdtool.plan/2`, reads `/1`); `planner.make_plan` makes it from a profile.

A plan says which layers each stage runs (a set of layer ids: the difference of two down-sets
of the layer graph, on a chain a contiguous range), on how many replicas and on which ranks,
in which schedule mode, and what the cost model predicts: time per minibatch per stage (compute,
all-reduce and transfer), memory per worker, the bottleneck, and the speedup over one worker
and over data parallelism on every worker. It is canonical JSON, byte-identical for identical
inputs, so it can be checked in and diffed. `pd train` executes it.
"""
from __future__ import annotations

import dataclasses
import hashlib
import math
import os
from dataclasses import InitVar, dataclass
from pathlib import Path
from typing import Any

from .cluster import Cluster
from ..errors import ArtifactError, PdtoolError, ScheduleError
from ..fields import At, check_schema
from ..jsonio import canonical_json, round_float_fields
from ..schedule.core import check_parameters
from ..schedule.modes import TABLE, Run, resolve, rules, ties_refusal
from ..schedule.placement import shape_of
from .profile import METHODS, PRECISIONS, SPLITS, ModelRef, Profile, default_split, estimate_wgrad_ms
from .record import Artifact, Bool, Const, Int, ListOf, Num, Record, Records, Shared, Str, derived, field

SCHEMA = "pdtool.plan/2"
OLDER = ("pdtool.plan/1",)
"""The formats read as they were: /1 gave every rank one stage; /2 lets a worker hold several
stages (chunks) where the mode places them (`schedule.placement`)."""
MS_PER_S = 1e3  # the planner works in seconds, plans and the simulator in ms


COST_MODELS = ("pdtool", "pipedream")  # the planner's cost models (`planner.costmodel`), by name
SHARDS = ("none", "optimizer", "gradients", "parameters")  # what a replicated stage's replicas shard (PlanStage.shard)
SYNC_SCALE = {"none": 1.0, "optimizer": 1.5, "gradients": 1.5, "parameters": 2.0}
"""The replicas' synchronisation per step, in all-reduces of the stage's gradients, by what they
shard (`artifacts.plan.SHARDS`): `optimizer` adds the all-gather of the updated weights, half an
all-reduce's bytes ((r - 1) / r of them; the all-reduce of gradients stays, which gloo runs as
a reduce-scatter would cost anyway: see docs/sharding.md). `gradients` reduces after every
backward instead of once a step (`REDUCES_EACH_BACKWARD`): 1.5 where a replica runs one backward
a step (PipeDream's rounds, which the planner's cost model prices); the simulator prices each.
`parameters` gathers the weights for every forward and again for every backward, and reduces
after every backward: 2 all-reduces' bytes a backward (where the mode splits its backward, the
weights stay gathered from the step's first forward to the step, which reduces once: 1.5)."""
REDUCES_EACH_BACKWARD = ("gradients", "parameters")
"""The shards whose replicas reduce their gradients after every backward (and keep only their
slice of the sum), not once a step (`schedule.lower`'s `reduce` ops); `parameters` only where
the mode does not split its backward (`Plan.reduce_each`)."""
RECOMPUTE = ("auto", "none", "all")  # pd plan --recompute: which stages recompute their forward in the backward
DOWN_SETS, PREFIXES = "down-sets", "prefixes"  # the planner's state spaces (`planner.states`)


LAYER_IDS = ListOf(
    item=Int(), problem="expected a list of layer ids, found {value!r:.40}", fix="list the stage's layer ids", sort=True
)
"""Layer ids, read sorted (a repeated id stays, for `_validate` to name)."""


class LayerSet:
    """Mixin for things that hold `layers`, a sorted tuple of layer ids."""

    @property
    def first(self) -> int:
        return self.layers[0]

    @property
    def last(self) -> int:
        return self.layers[-1]


@dataclass(frozen=True, kw_only=True)
class PlanStage(LayerSet):
    """One pipeline stage: the layer ids `layers` (ascending; `first`/`last` are the lowest and
    highest, named `first_name`/`last_name`), replicated on `ranks`.

    `fwd_ms`/`bwd_ms` are one minibatch's forward/backward time on one worker (the sum over
    its layers), `param_bytes` its parameters, `in_bytes`/`out_bytes` what crosses its
    input/output boundary per minibatch (each way), `activation_bytes` what one minibatch in
    flight keeps stashed for its backward (its input plus what its layers save: the profile's saved_bytes). `compute_ms`, `allreduce_ms`,
    `transfer_ms` and `time_ms` are ms per minibatch as the cost model charges them (already
    divided by all replicas), `memory_bytes` what one of its workers needs, `in_flight` the
    minibatches each of its workers holds at once under 1F1B. `update_ms` is one optimizer step
    of its parameters on one worker and `data_ms` the making of one minibatch (stage 0 only),
    both from the profile; the simulator charges them, the cost model does not. `reduce_ms` is
    the worker's own work in one all-reduce of its gradients (the profile's share, charged by the
    simulator on replicated stages beside the link's time). `wgrad_ms` is the part of `bwd_ms`
    that computes the weight gradients (the W of mode `zb`). `recompute`: the stage runs its forward
    again before each backward instead of keeping its activations (`fwd_ms`/`bwd_ms` stay the
    profile's; `compute_ms` and the simulator count the forward twice).

    `receives` are the ids of the layers of earlier stages whose outputs its layers read, `sends`
    the ids of its own layers whose outputs later stages read (both ascending; from the profile's
    edges when the plan was made): the plan's own record of its data flow, so that its stages'
    order is checked without the profile (`_validate`).
    """

    DERIVED = (derived("id", Int(), lambda stage, plan, index: index, required=True),
               derived("replicas", Int(1), lambda stage, *_: stage.replicas, required=True))

    layers: tuple[int, ...] = field(LAYER_IDS, doc="layer ids, ascending")
    first_name: str = field(Str(), key="first_layer")
    last_name: str = field(Str(), key="last_layer")
    ranks: tuple[int, ...] = field(
        ListOf(item=Int(), problem="every rank must be a non-negative integer", fix="fix the list", min_items=1)
    )
    in_flight: int = field(Int(1))
    fwd_ms: float = field(Num())
    bwd_ms: float = field(Num())
    param_bytes: int = field(Int())
    in_bytes: int = field(Int())
    out_bytes: int = field(Int())
    activation_bytes: int = field(Int())
    compute_ms: float = field(Num())
    allreduce_ms: float = field(Num())
    transfer_ms: float = field(Num())
    time_ms: float = field(Num())
    memory_bytes: int = field(Int())
    update_ms: float = field(Num(), 0.0)
    largest_layer_bytes: int = field(Int(), 0, doc="The parameter bytes of its largest layer: the size of the "
                                     "temporaries its optimizer step and gradient accumulation make (0 in plans "
                                     "made before: not counted)")
    data_ms: float = field(Num(), 0.0)
    wgrad_ms: float = field(Num(), 0.0, missing=lambda v: estimate_wgrad_ms(v["bwd_ms"], v["param_bytes"]),
                           doc="The part of bwd_ms that computes the weight gradients (the W of mode zb).")
    reduce_ms: float = field(Num(), 0.0)
    receives: tuple[int, ...] = field(LAYER_IDS, (), required=True, doc="Ids of the layers of earlier stages whose "
                                      "outputs this stage's layers read, ascending.")
    sends: tuple[int, ...] = field(LAYER_IDS, (), required=True, doc="Ids of this stage's layers whose outputs "
                                   "later stages read, ascending.")
    recompute: bool = field(Bool(), False, omit=False, doc="The stage recomputes its forward during each backward "
                            "(on the same weight version) instead of keeping its activations: a minibatch in flight "
                            "stashes only its input (pd plan --recompute).")
    shard: str = field(Str(SHARDS), "none", omit="none", doc="What the stage's replicas shard among themselves (pd plan --shard): "
                       "none, optimizer (each replica keeps the optimizer state of 1/replicas of the stage's "
                       "parameters: ZeRO stage 1), gradients (also 1/replicas of the summed gradients, reduced "
                       "after every backward: ZeRO stage 2) or parameters (also 1/replicas of the weights, "
                       "gathered for each forward and backward: ZeRO stage 3, FSDP). Only a stage with replicas is "
                       "sharded.")

    @classmethod
    def _read_check(cls, at: At, values: dict[str, Any], figures: dict[str, Any], index: int) -> None:
        if figures["replicas"] != len(values["ranks"]):
            at.fail(f"replicas is {figures['replicas']} but {len(values['ranks'])} ranks are listed",
                    "make replicas equal the number of ranks", "ranks")
        if values["shard"] != "none" and len(values["ranks"]) == 1:
            at.fail(f"shard is {values['shard']} but the stage has one replica, which has nobody to share its state "
                    "with", 'set shard to "none" (or remove it), or replicate the stage', "shard")
        if figures["id"] != index:
            at.fail(f"id is {figures['id']}, expected {index}", "number stages 0, 1, 2, ...", "id")
        for key in ("receives", "sends"):
            ids = values[key]
            if len(set(ids)) < len(ids):
                at.fail(f"layer {next(i for i in ids if ids.count(i) > 1)} is listed twice", "list each layer once",
                        key)

    def __post_init__(self) -> None:
        round_float_fields(self)

    @property
    def replicas(self) -> int:
        return len(self.ranks)

    @property
    def step_ms(self) -> float:
        """One optimizer step on one of its workers: `update_ms`, or its 1/replicas share where the
        replicas shard the optimizer (each steps its slice of the parameters)."""
        return self.update_ms / self.replicas if self.shard != "none" else self.update_ms



@dataclass(frozen=True, kw_only=True)
class PlanGroup(LayerSet):
    """A stage of an outer cluster level (e.g. across servers): the layer ids `layers` on
    `units` units of `level`, each running the inner stages it contains; ms per minibatch.
    `compute_ms` is the inner pipeline's time divided by the units."""

    level: int = field(Int())
    layers: tuple[int, ...] = field(LAYER_IDS, doc="layer ids, ascending")
    units: int = field(Int(1))
    compute_ms: float = field(Num())
    allreduce_ms: float = field(Num())
    transfer_ms: float = field(Num())
    time_ms: float = field(Num())

    def __post_init__(self) -> None:
        round_float_fields(self)


def compact_ranges(layers: tuple[int, ...] | list[int]) -> str:
    """Integer ids (layers, ranks) compactly, ascending: "0-16" when contiguous, else e.g. "0-5,8,10-12"."""
    parts, ids = [], sorted(layers)
    start = None
    for i, layer in enumerate(ids):
        if start is None:
            start = layer
        if i + 1 == len(ids) or ids[i + 1] != layer + 1:
            parts.append(f"{start}-{layer}" if layer != start else f"{layer}")
            start = None
    return ",".join(parts)


@dataclass(frozen=True, kw_only=True)
class Prediction:
    """What the cost model predicts for the whole plan (ms per minibatch of the profile's size),
    and what the simulator predicts for the plan's schedule (`simulated_*`; None when the plan
    was made without simulating)."""

    DERIVED = (derived("samples_per_s", Num(), lambda prediction, plan, _: plan.samples_per_s),
               derived("speedup_over_single", Num(), lambda prediction, *_: prediction.speedup_over_single),
               derived("speedup_over_data_parallel", Num(), lambda prediction, *_: prediction.speedup_over_data_parallel))

    time_ms: float = field(Num(), key="time_per_minibatch_ms")
    bottleneck: str = field(Str())
    single_worker_ms: float = field(Num())
    data_parallel_ms: float = field(Num(), doc="Data parallelism on every worker by the cost model.")
    simulated_ms: float | None = field(Num(), None, key="simulated.time_per_minibatch_ms", required=True)
    simulated_bubble: float | None = field(Num(), None, key="simulated.bubble_fraction", required=True)
    simulated_minibatches: int | None = field(Int(1), None, key="simulated.minibatches", required=True)
    simulated_steady: bool = field(Bool(), False, key="simulated.steady", omit=False,
                                   doc="The simulated figures are the schedule's steady state, computed from one "
                                   "period of `simulated.minibatches` minibatches (pdtool.sim.steady), not a run of "
                                   "that many (absent: a run).")
    candidates: int | None = field(Int(1), None, key="simulated.candidates", null=True,
                                   doc="Plans pd plan compared in simulation (null: not compared).")
    why: str | None = field(Str(), None, key="simulated.why", null=True, doc="Why this plan won among them.")
    simulated_data_parallel_ms: float | None = field(Num(), None, key="simulated.data_parallel_ms", null=True,
                                                     doc="Data parallelism on every worker, simulated: the baseline "
                                                     "whichever cost model (null when it does not fit).")
    data_parallel_over_bytes: int | None = field(Int(), None, null=True, doc="How much more memory per worker data "
                                                 "parallelism on every worker needs than the cluster's limit; null "
                                                 "when it fits or no limit was given.")
    hybrid: str | None = field(Str(), None, key="simulated.hybrid", null=True, omit=None,
                               doc="When the plan has no replicated stage inside a pipeline: the fastest candidate "
                               "that has one and its simulated time (absent when none was compared).")

    def __post_init__(self) -> None:
        round_float_fields(self)

    @property
    def expected_ms(self) -> float:
        """The prediction: the simulated time per minibatch where the plan was simulated (it
        includes what the cost model leaves out), else the cost model's."""
        return self.simulated_ms if self.simulated_ms is not None else self.time_ms

    @property
    def baseline_ms(self) -> float:
        """Data parallelism on every worker, as `expected_ms` is: simulated where the plan was."""
        return self.simulated_data_parallel_ms if self.simulated_data_parallel_ms is not None else self.data_parallel_ms

    @property
    def speedup_over_single(self) -> float:
        return self.single_worker_ms / self.expected_ms if self.expected_ms else 0.0

    @property
    def speedup_over_data_parallel(self) -> float:
        return self.baseline_ms / self.expected_ms if self.expected_ms else 0.0

    @property
    def cost_model_speedups(self) -> tuple[float, float]:
        """Over one worker and over data parallelism, by the cost model alone (PipeDream's figures)."""
        return ((self.single_worker_ms / self.time_ms, self.data_parallel_ms / self.time_ms) if self.time_ms
                else (0.0, 0.0))


@dataclass(frozen=True, kw_only=True)
class ProfileRef:
    """What the plan needs of its profile: identity, how to rebuild the model's layers, and the
    host's cost of a message and of a weight version's copy (`message_ms_per_mib`, `copy_ms_per_mib`, the
    profile's: charged by the simulator)."""

    sha256: str = field(Str())
    fingerprint: str = field(Str())
    model: dict[str, Any] | None = field(Record(ModelRef, as_dict=True), null=True, required=False, missing=None)
    batch_size: int = field(Int(1))
    layers: int = field(Int(1))
    method: str = field(Str(METHODS))
    granularity: str = field(Str())
    depth: int | None = field(Int(1), null=True, required=False, missing=None)
    split: str = field(Str(SPLITS), "graph", missing=default_split,
                       doc="how pd train can split the model (the profile's split)")
    device: str = field(Str(), "", doc="where the profile was measured, e.g. 'cpu (2 threads)'")
    layer_sum_over_step: float | None = field(Num(), None, null=True,
                                              doc="the profile's summed layer times over a measured step")
    message_ms_per_mib: float = field(Num(), 0.0, omit=0.0, doc="CPU ms that one MiB of a message costs its "
                                      "sender and, again, its receiver (the profile's)")
    copy_ms_per_mib: float = field(Num(), 0.0, omit=0.0, doc="ms that copying one MiB of parameters costs a "
                                   "worker: each weight version weight stashing keeps (the profile's; 0: not priced)")
    precision: str = field(Str(PRECISIONS), "fp32", omit="fp32", doc="what the profile computed in: pd train's "
                           "default --precision")

    def __post_init__(self) -> None:
        round_float_fields(self)


@dataclass(frozen=True, kw_only=True)
class Plan(Artifact):
    """A plan (module doc). `state_space` says which stages the planner considered: "down-sets"
    (differences of down-sets of the layer graph) or "prefixes" (contiguous ranges of the
    profile's layer order, when the graph had too many down-sets: states.MAX_STATES)."""

    SCHEMA_NAME = "plan"  # schemas/plan.schema.json

    profile: ProfileRef = field(Record(ProfileRef), doc="The profile planned: its sha256 and model fingerprint, "
                                "so pd train can refuse a mismatch.")
    cluster: Cluster = field(Record(Cluster))
    cost_model: str = field(Str(COST_MODELS))
    straight: bool = field(Bool())
    mode: str = field(Str(tuple(TABLE)))
    group: int | None = field(Int(1), None, omit=None, doc="Microbatches per optimizer step that pd plan chose "
                              "(--group, --batch or a joint search) and predicted: pd train's default --group in a "
                              "mode that steps per group. Absent: the mode's default (the stages).")
    optimizer: str | None = field(Str(("sgd", "adam", "adamw")), None, omit=None, doc="The optimizer whose state "
                                  "the memory model counted (pd plan --optimizer); pd show prints each worker's memory "
                                  "terms with it. Absent in plans written before it was recorded.")
    stages: tuple[PlanStage, ...] = field(Records(PlanStage, min_items=1), doc="One stage each: its layers, "
                                          "replicated on `ranks`; times are ms per minibatch as the cost model "
                                          "charges them.")
    groups: tuple[PlanGroup, ...] = field(Records(PlanGroup), doc="The stages of the outer levels of the hierarchy.")
    predicted: Prediction = field(Record(Prediction))
    command: str = field(Str(), key="provenance.command")
    pdtool_version: str = field(Str(), key="provenance.pdtool_version")
    state_space: str = field(Str((DOWN_SETS, PREFIXES)), DOWN_SETS, required=True)
    shared: tuple[tuple[str, tuple[int, ...]], ...] = field(Shared("stages"), (), doc="parameters used by several "
                                                            "stages (tied weights): each worker of those stages holds "
                                                            "a copy, and the copies' gradients are added before every "
                                                            "step (modes 2bw, flush, gpipe, zb, zb2)")
    profile_file: str | None = field(Str(), None, key="provenance.profile", omit=None, doc="The profile's file as "
                                     "pd plan was given it, without its folder (where pd show looks for it).")
    schema: str = field(Const(SCHEMA, "", OLDER), SCHEMA, required=True)
    source: InitVar[str] = "plan"

    def __post_init__(self, source: str) -> None:
        _validate(self, source)

    def untrainable(self, mode: str | None = None) -> str | None:
        """Why `pd train` cannot run this plan in `mode` (default: the plan's), or None: a split
        of a model that cannot be split so, or tied weights in a mode that refuses them."""
        mode = mode or self.mode
        p = self.profile
        if p.split == "none" and len(self.stages) > 1:
            return (f"the plan splits the model into {len(self.stages)} stages, but its profile was made from leaf "
                    f"modules (neither torch.fx nor torch.export captured the model), so it trains as one stage "
                    "only; plan it again with the current pd plan (which keeps it in one stage)")
        refusal = ties_refusal(mode)
        if self.shared and refusal:
            return f"{self.describe_shared()} (tied weights), and {refusal}"
        return None

    @property
    def reduce_each(self) -> tuple[int, ...]:
        """`reduces_each` in the plan's own mode."""
        return self.reduces_each()

    def reduces_each(self, mode: str | None = None) -> tuple[int, ...]:
        """The stages whose replicas reduce their gradients after every backward (`--shard
        gradients`, `parameters`: `REDUCES_EACH_BACKWARD`) in `mode` (default: the plan's; `pd train
        --mode` runs another), for `schedule.lower`."""
        split = rules(mode or self.mode).split
        return tuple(i for i, s in enumerate(self.stages) if s.shard in REDUCES_EACH_BACKWARD and s.replicas > 1
                     and s.param_bytes > 0 and not (s.shard == "parameters" and split))

    def reduce_check_steps(self) -> int:
        """Steps of stage 0 whose schedule shows whether the replicas that reduce after every
        backward deadlock (`sharding_refusal`): two, and past the warm-up of every
        replica's round (a pipeline without flushes reaches its steady order only after about
        stages x lcm(replicas) minibatches; a deadlock there shows from 6 minibatches on a (1, 3, 1)
        pipedream pipeline)."""
        run = self.run()
        horizon = 4 * len(self.stages) * math.lcm(*(s.replicas for s in self.stages))
        return max(2, -(-horizon // run.per_step))

    def sharding_refusal(self, schedule=None, kinds: tuple[str, ...] = ("gradients", "parameters")) -> str | None:
        """Why the replicas of the stages that shard `kinds` cannot in `schedule` (default:
        `reduce_check_steps` steps of the plan's mode and group), in one line, or None. Sharded
        gradients and parameters: a weight shared with another stage (its copies add their whole
        gradients at the step), or a deadlock once the replicas reduce after every backward
        (`schedule.check.check_reduce_each`). Sharded parameters also: a mode that keeps more than
        one version of the weights (`Mode.versions_kept`), or replicas that run their forwards and
        backwards in different orders (`schedule.check.check_same_order`)."""
        from ..schedule import generate
        from ..schedule.check import check_reduce_each, check_same_order

        stages = {kind: [i for i, s in enumerate(self.stages) if s.shard == kind and s.replicas > 1 and s.param_bytes]
                  for kind in kinds}
        if not any(stages.values()):
            return None
        mode = self.mode if schedule is None else schedule.mode
        kept = rules(mode).versions_kept
        if stages.get("parameters") and kept != 1:
            keeping = [m.name for m in TABLE.values() if m.versions_kept == 1 and not m.placement]
            return (f"--shard parameters gathers one version of a stage's weights, but mode {mode} keeps "
                    f"{kept or 'one per minibatch in flight'}; use --shard gradients, or a mode that keeps one "
                    f"({', '.join(keeping)})")
        for kind, these in stages.items():
            tied = [(name, users) for name, users in self.shared if set(users) & set(these)]
            if tied:
                name, users = tied[0]
                return (f"--shard {kind} keeps a slice of each gradient, but parameter {name} is shared by stages "
                        f"{', '.join(map(str, users))}, which add its whole gradient at every step; use --shard "
                        "optimizer")
        if schedule is None:
            run = self.run()
            schedule = generate(run.name, [s.replicas for s in self.stages], self.reduce_check_steps() * run.per_step,
                                run.group, placement=self.placement)
        try:
            check_same_order(schedule, stages.get("parameters", ()))
        except ScheduleError as error:
            return f"--shard parameters: {error}"
        reducing = [i for i in self.reduces_each(schedule.mode) if any(i in these for these in stages.values())]
        try:
            check_reduce_each(schedule, reducing)
        except ScheduleError as error:
            found = str(error).split("; reorder the actions")[0]
            kind = "/".join(sorted({self.stages[i].shard for i in reducing}))
            return (f"--shard {kind} would deadlock this schedule once the replicas of stage(s) "
                    f"{', '.join(map(str, reducing))} reduce after every backward ({found}); use --shard optimizer, or "
                    "another mode (flush)")
        return None

    def with_shard(self, shard: str | None) -> "Plan":
        """The plan with `shard` on every replicated stage (`pd train --shard`); None: as it is."""
        if shard is None:
            return self
        return dataclasses.replace(self, stages=tuple(dataclasses.replace(s, shard=shard if s.replicas > 1 else "none")
                                                      for s in self.stages))

    def describe_shared(self) -> str:
        """'parameter X is used by stages 0 and 3' (and how many more such parameters there are)."""
        name, stages = self.shared[0]
        listed = ", ".join(map(str, stages[:-1])) + f" and {stages[-1]}"
        more = len(self.shared) - 1
        return f"parameter {name}{f' (and {more} more)' if more else ''} is used by stages {listed}"

    @property
    def workers(self) -> int:
        return self.cluster.workers

    @property
    def used_ranks(self) -> tuple[int, ...]:
        """The ranks that hold a stage, each once, ascending."""
        return tuple(sorted({r for s in self.stages for r in s.ranks}))

    @property
    def schedule_ranks(self) -> tuple[int, ...]:
        """The plan rank of each of the schedule's workers (`schedule.lower`'s `ranks`): stage-major,
        every replica of stage 0, then of stage 1, ...; where a worker holds several stages, each
        worker once, numbered as the placement numbers them."""
        if not self.placement:
            return tuple(r for s in self.stages for r in s.ranks)
        order: dict[int, int] = {}
        for stage in self.stages:
            order.setdefault(stage.ranks[0], len(order))
        return tuple(order)

    @property
    def placement(self) -> tuple[int, ...]:
        """Where the mode puts several stages on a worker (`schedule.placement`): each stage's worker,
        the workers numbered in the order their ranks first appear; () in a mode of one stage per worker."""
        if rules(self.mode).placement is None:
            return ()
        order: dict[int, int] = {}
        for stage in self.stages:
            order.setdefault(stage.ranks[0], len(order))
        return tuple(order[stage.ranks[0]] for stage in self.stages)

    def run(self, mode: str | None = None, group: int | None = None) -> Run:
        """The run of this plan in `mode` (None: the plan's) with `group` microbatches per step
        (None: the plan's recorded group where the mode steps per group, else the mode's default)."""
        if group is None and not rules(mode or self.mode).per_round:
            group = self.group
        return resolve(mode, self.mode, [s.replicas for s in self.stages], group)

    @property
    def samples_per_s(self) -> float:
        return self.profile.batch_size / (self.predicted.expected_ms / MS_PER_S) if self.predicted.expected_ms else 0.0

    @classmethod
    def _check_raw(cls, data: Any, source: str) -> None:
        """The kind of file; a plan from before stages recorded what they receive and send is
        refused in one line that says to make it again (with the command that made it)."""
        check_schema(data, SCHEMA, source, OLDER)
        stages = data.get("stages")
        for index, stage in enumerate(stages if isinstance(stages, list) else []):
            if isinstance(stage, dict) and "receives" not in stage and "sends" not in stage:
                provenance = data.get("provenance")
                command = provenance.get("command") if isinstance(provenance, dict) else None
                words = command.split() if isinstance(command, str) else []
                again = " ".join(words + ["-o", source]) if words[:2] == ["pd", "plan"] else "pd plan"
                At(source, f"stages[{index}]").fail(
                    "no receives/sends: the plan was made by an older pdtool, before plans recorded what each stage "
                    "receives and sends", f"make it again with {again}")


def _validate(plan: Plan, source: str) -> None:
    """The invariants a plan holds; a hand edit that breaks one gets one clear line."""
    top = At(source)
    top.one_of(plan.mode, tuple(TABLE), "mode", "mode")
    top.one_of(plan.cost_model, COST_MODELS, "cost model", "cost_model")
    top.one_of(plan.state_space, (DOWN_SETS, PREFIXES), "state space", "state_space")
    if not plan.stages:
        top.fail("a plan needs at least one stage", "regenerate the plan with pd plan", "stages")
    if plan.profile.method not in METHODS:
        top.fail(f"unknown method {plan.profile.method!r}", f"use one of {', '.join(METHODS)}", "profile.method")
    if plan.profile.split not in SPLITS:
        top.fail(f"unknown split {plan.profile.split!r}", f"use one of {', '.join(SPLITS)}", "profile.split")
    layers = plan.profile.layers
    owner: dict[int, int] = {}
    seen: dict[int, int] = {}
    for index, stage in enumerate(plan.stages):
        where = f"stages[{index}]"
        if not stage.layers:
            top.fail("layers [] is an empty stage", "give every stage at least one layer", where)
        for layer in stage.layers:
            if not 0 <= layer < layers:
                top.fail(f"layer {layer} does not exist in a profile of {layers} layers",
                         f"use layer ids 0..{layers - 1}", where)
            if layer in owner:
                problem = (f"layer {layer} is listed twice" if owner[layer] == index
                           else f"layer {layer} is already in stages[{owner[layer]}]")
                top.fail(problem, "put every layer in exactly one stage", where)
            owner[layer] = index
        if not stage.ranks:
            top.fail("no ranks", "give every stage at least one rank", where)
        for rank in stage.ranks:
            if not 0 <= rank < plan.cluster.workers:
                top.fail(f"rank {rank} does not exist in a cluster of {plan.cluster.workers} workers",
                         f"use ranks 0..{plan.cluster.workers - 1}", where)
            if rank in seen and rules(plan.mode).placement is None:
                top.fail(f"rank {rank} is also in stages[{seen[rank]}]", "give every rank to one stage only (a worker "
                         "holds several stages only in a mode of several chunks: interleaved, zbv, dualpipev)", where)
            seen.setdefault(rank, index)
    for index, (name, stages) in enumerate(plan.shared):
        if len(set(stages)) < 2 or not all(0 <= s < len(plan.stages) for s in stages):
            top.fail(f"parameter {name!r} must list two or more distinct stage ids in 0..{len(plan.stages) - 1}, "
                     f"found {list(stages)}", "regenerate the plan with pd plan", f"shared[{index}]")
    if len(owner) != layers:
        missing = [layer for layer in range(layers) if layer not in owner]
        top.fail(f"layer{'s' if len(missing) > 1 else ''} {compact_ranges(missing)} "
                 f"{'are' if len(missing) > 1 else 'is'} in no stage", "put every layer in exactly one stage", "stages")
    _check_data_flow(plan, owner, top)
    _check_chunks(plan, top)
    _check_group(plan, top)


def _check_group(plan: Plan, top: At) -> None:
    """A recorded group is one the plan's mode runs on its stages (`schedule.check_parameters`)."""
    if plan.group is None:
        return
    if rules(plan.mode).per_round:
        top.fail(f"group {plan.group}: mode {plan.mode!r} steps per round of its replicas, not per group",
                 "remove the group, or plan a mode that steps per group", "group")
    try:
        check_parameters(plan.mode, [s.replicas for s in plan.stages], plan.group, plan.group, plan.placement)
    except ScheduleError as error:
        top.fail(str(error), "plan it again with pd plan --group", "group")


def _check_chunks(plan: Plan, top: At) -> None:
    """A mode of several stages per worker: one rank a stage, placed as the mode places them."""
    shape = rules(plan.mode).placement
    if shape is None:
        return
    for index, stage in enumerate(plan.stages):
        if len(stage.ranks) != 1:
            top.fail(f"{len(stage.ranks)} ranks: mode {plan.mode!r} puts several stages (chunks) on each worker and "
                     "does not replicate them", "give every stage one rank", f"stages[{index}]")
    placement = plan.placement
    if shape_of(placement) != shape:
        found = shape_of(placement)
        top.fail(f"mode {plan.mode!r} places the stages {shape} over the workers, but the stages' ranks place them "
                 f"{', '.join(str(s.ranks[0]) for s in plan.stages)}" + (f" ({found})" if found else ""),
                 "plan the stages for this mode, or use a mode of one stage per worker", "stages")


def _check_data_flow(plan: Plan, owner: dict[int, int], top: At) -> None:
    """The stages in data-flow order by the plan's own record: every layer a stage receives is
    computed by an earlier stage, and every stage sends exactly those of its layers that later
    stages receive (a hand edit that moves layers between stages breaks one or the other)."""
    for index, stage in enumerate(plan.stages):
        for layer in stage.receives:
            if layer not in owner:
                top.fail(f"receives layer {layer}, which does not exist in a profile of {plan.profile.layers} layers",
                         "regenerate the plan with pd plan", f"stages[{index}]")
            if owner[layer] >= index:
                computer = "it computes it itself" if owner[layer] == index else f"stages[{owner[layer]}] computes it later"
                top.fail(f"receives layer {layer} from an earlier stage, but {computer}: {OUT_OF_ORDER}",
                         "regenerate the plan with pd plan", f"stages[{index}]")
    received: dict[int, set[int]] = {}  # stage -> its layers that later stages receive
    for later, stage in enumerate(plan.stages):
        for layer in stage.receives:
            if layer in owner and owner[layer] < later:
                received.setdefault(owner[layer], set()).add(layer)
    for index, stage in enumerate(plan.stages):
        read = sorted(received.get(index, ()))
        if list(stage.sends) != read:
            top.fail(f"sends layers [{compact_ranges(stage.sends)}], but the later stages receive "
                     f"[{compact_ranges(read)}] of its layers: the stages' records disagree (edited by hand?)",
                     "regenerate the plan with pd plan", f"stages[{index}]")


OUT_OF_ORDER = "the stages are not in data-flow order (edited by hand?)"
"""What a plan whose stage reads what a later stage computes is told; no schedule can run it."""


def with_boundaries(profile: Profile, stages) -> tuple[PlanStage, ...]:
    """`stages` (of a plan of `profile`) with `receives` and `sends` from the profile's edges."""
    owner = {layer: index for index, stage in enumerate(stages) for layer in stage.layers}
    receives = [set() for _ in stages]
    sends = [set() for _ in stages]
    for src, dst in profile.edges:
        if owner[src] != owner[dst]:
            receives[owner[dst]].add(src)
            sends[owner[src]].add(src)
    return tuple(dataclasses.replace(stage, receives=tuple(sorted(r)), sends=tuple(sorted(s)))
                 for stage, r, s in zip(stages, receives, sends))


def profile_sha256(profile: Profile) -> str:
    """sha256 of the profile's canonical JSON text (what `pd profile` writes)."""
    return hashlib.sha256(canonical_json(profile.to_json()).encode()).hexdigest()


def find_profile(plan_path: str, plan: Plan) -> str | None:
    """The profile `plan` was made from, or None: X.profile.json beside X.plan.json (the Make
    convention), the file its provenance names, or any *.profile.json beside it or in the current
    folder, as long as its sha256 is the one the plan records."""
    here = os.path.dirname(plan_path) or "."
    words = plan.command.split()  # a plan from before provenance named the profile: its command does
    named = plan.profile_file or (words[2] if plan.command.startswith("pd plan ") and len(words) > 2 else None)
    candidates = ([plan_path[: -len(".plan.json")] + ".profile.json"] if plan_path.endswith(".plan.json") else []) + (
        [os.path.join(here, named), named] if named else []) + sorted(
        str(p) for folder in {here, "."} for p in Path(folder).glob("*.profile.json"))
    for candidate in dict.fromkeys(candidates):
        if not os.path.isfile(candidate):
            continue
        try:
            if profile_sha256(Profile.load(candidate)) == plan.profile.sha256:
                return candidate
        except PdtoolError:
            continue
    return None


def check_against_profile(plan: Plan, profile: Profile, plan_path: str = "the plan",
                          profile_path: str = "the profile given") -> None:
    """Refuse a profile that is not the plan's (one line naming both), and a plan whose stages
    are not in data-flow order (a stage reading what a later stage computes: a hand edit that
    no schedule can run)."""
    sha = profile_sha256(profile)
    if sha != plan.profile.sha256:
        raise ArtifactError(
            f"{profile_path} is not the profile {plan_path} was made from: the plan records sha256 "
            f"{plan.profile.sha256[:12]} ({plan.profile.layers} layers, "
            f"{plan.profile.model['spec'] if plan.profile.model else 'imported'}), the profile is {sha[:12]} "
            f"({len(profile.layers)} layers, {profile.model.spec if profile.model else 'imported'}); pass the profile "
            f"the plan was made from (made by: {plan.command or 'an unknown command'})")
    owner = {layer: index for index, stage in enumerate(plan.stages) for layer in stage.layers}
    for src, dst in profile.edges:
        if owner[src] > owner[dst]:
            raise ArtifactError(f"{plan_path}: stages[{owner[dst]}] reads layer {src} ({profile.layers[src].name}), "
                                f"which stages[{owner[src]}] computes later: {OUT_OF_ORDER}; regenerate the plan "
                                "with pd plan")
    for index, (stage, actual) in enumerate(zip(plan.stages, with_boundaries(profile, plan.stages))):
        if (stage.receives, stage.sends) != (actual.receives, actual.sends):
            raise ArtifactError(f"{plan_path}: stages[{index}] records receiving [{compact_ranges(stage.receives)}] "
                                f"and sending [{compact_ranges(stage.sends)}], but by {profile_path}'s edges it "
                                f"receives [{compact_ranges(actual.receives)}] and sends "
                                f"[{compact_ranges(actual.sends)}] (edited by hand?); regenerate the plan with pd plan")
