"""The plan artifact (`pdtool.plan/1`); `planner.make_plan` makes it from a profile.

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
import os
from dataclasses import InitVar, dataclass
from pathlib import Path
from typing import Any

from .cluster import Cluster
from ..errors import ArtifactError, PdtoolError
from ..fields import Fields, check_schema
from .schemas import SchemaChecked
from ..jsonio import canonical_json, read_json, round_float_fields, write_json
from ..schedule.modes import MODES, ties_refusal
from .profile import METHODS, SPLITS, Profile, estimate_wgrad_ms

SCHEMA = "pdtool.plan/1"
"""Modes that train tied weights (a parameter used by several stages): every stage steps at
batch boundaries, so the sharing stages add their copies' gradients before each step and the
copies stay equal. `pipedream` and `vsync` step each stage after different minibatches."""
MS_PER_S = 1e3  # the planner works in seconds, plans and the simulator in ms


COST_MODELS = ("pdtool", "pipedream")  # the planner's cost models (`planner.costmodel`), by name
DOWN_SETS, PREFIXES = "down-sets", "prefixes"  # the planner's state spaces (`planner.states`)


class LayerSet:
    """Mixin for things that hold `layers`, a sorted tuple of layer ids."""

    @property
    def first(self) -> int:
        return self.layers[0]

    @property
    def last(self) -> int:
        return self.layers[-1]


@dataclass(frozen=True)
class PlanStage(LayerSet):
    """One pipeline stage: the layer ids `layers` (ascending; `first`/`last` are the lowest and
    highest, named `first_name`/`last_name`), replicated on `ranks`.

    `fwd_ms`/`bwd_ms` are one minibatch's forward/backward time on one worker (the sum over
    its layers), `param_bytes` its parameters, `in_bytes`/`out_bytes` what crosses its
    input/output boundary per minibatch (each way), `activation_bytes` what one minibatch in
    flight keeps stashed for its backward (its input plus its layers' outputs). `compute_ms`, `allreduce_ms`,
    `transfer_ms` and `time_ms` are ms per minibatch as the cost model charges them (already
    divided by all replicas), `memory_bytes` what one of its workers needs, `in_flight` the
    minibatches each of its workers holds at once under 1F1B. `update_ms` is one optimizer step
    of its parameters on one worker and `data_ms` the making of one minibatch (stage 0 only),
    both from the profile; the simulator charges them, the cost model does not. `reduce_ms` is
    the worker's own work in one all-reduce of its gradients (the profile's share, charged by the
    simulator on replicated stages beside the link's time). `wgrad_ms` is the part of `bwd_ms`
    that computes the weight gradients (the W of mode `zb`).

    `receives` are the ids of the layers of earlier stages whose outputs its layers read, `sends`
    the ids of its own layers whose outputs later stages read (both ascending; from the profile's
    edges when the plan was made): the plan's own record of its data flow, so that its stages'
    order is checked without the profile (`_validate`).
    """

    layers: tuple[int, ...]
    first_name: str
    last_name: str
    ranks: tuple[int, ...]
    in_flight: int
    fwd_ms: float
    bwd_ms: float
    param_bytes: int
    in_bytes: int
    out_bytes: int
    activation_bytes: int
    compute_ms: float
    allreduce_ms: float
    transfer_ms: float
    time_ms: float
    memory_bytes: int
    update_ms: float = 0.0
    data_ms: float = 0.0
    wgrad_ms: float = 0.0
    reduce_ms: float = 0.0
    receives: tuple[int, ...] = ()
    sends: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        round_float_fields(self)

    @property
    def replicas(self) -> int:
        return len(self.ranks)



@dataclass(frozen=True)
class PlanGroup(LayerSet):
    """A stage of an outer cluster level (e.g. across servers): the layer ids `layers` on
    `units` units of `level`, each running the inner stages it contains; ms per minibatch.
    `compute_ms` is the inner pipeline's time divided by the units."""

    level: int
    layers: tuple[int, ...]
    units: int
    compute_ms: float
    allreduce_ms: float
    transfer_ms: float
    time_ms: float

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


@dataclass(frozen=True)
class Prediction:
    """What the cost model predicts for the whole plan (ms per minibatch of the profile's size),
    and what the simulator predicts for the plan's schedule (`simulated_*`; None when the plan
    was made without simulating)."""

    time_ms: float
    bottleneck: str
    single_worker_ms: float
    data_parallel_ms: float
    simulated_ms: float | None = None
    simulated_bubble: float | None = None
    simulated_minibatches: int | None = None
    candidates: int | None = None  # plans compared in simulation (pd plan); None: the cost model's optimum alone
    why: str | None = None         # why this plan won among them
    simulated_data_parallel_ms: float | None = None  # data parallelism on every worker, simulated
    data_parallel_over_bytes: int | None = None  # data parallelism needs this much more memory per worker than there is

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


@dataclass(frozen=True)
class ProfileRef:
    """What the plan needs of its profile: identity, how to rebuild the model's layers, and the
    host's cost of a message (`message_ms_per_mib`, the profile's: charged by the simulator)."""

    sha256: str
    fingerprint: str
    model: dict[str, Any] | None
    batch_size: int
    layers: int
    method: str
    granularity: str
    depth: int | None
    split: str = "graph"
    device: str = ""
    layer_sum_over_step: float | None = None
    message_ms_per_mib: float = 0.0

    def __post_init__(self) -> None:
        round_float_fields(self)


@dataclass(frozen=True)
class Plan(SchemaChecked):
    """A plan (module doc). `state_space` says which stages the planner considered: "down-sets"
    (differences of down-sets of the layer graph) or "prefixes" (contiguous ranges of the
    profile's layer order, when the graph had too many down-sets: states.MAX_STATES)."""

    SCHEMA_NAME = "plan"  # schemas/plan.schema.json

    profile: ProfileRef
    cluster: Cluster
    cost_model: str
    straight: bool
    mode: str
    stages: tuple[PlanStage, ...]
    groups: tuple[PlanGroup, ...]
    predicted: Prediction
    command: str
    pdtool_version: str
    state_space: str = DOWN_SETS
    shared: tuple[tuple[str, tuple[int, ...]], ...] = ()
    schema: str = SCHEMA
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
        return tuple(sorted(r for s in self.stages for r in s.ranks))

    @property
    def samples_per_s(self) -> float:
        return self.profile.batch_size / (self.predicted.expected_ms / MS_PER_S) if self.predicted.expected_ms else 0.0

    def to_json(self) -> dict[str, Any]:
        p, pred = self.profile, self.predicted
        return {
            "schema": self.schema,
            "profile": {"sha256": p.sha256, "fingerprint": p.fingerprint, "model": p.model,
                        "batch_size": p.batch_size, "layers": p.layers, "method": p.method, "split": p.split,
                        "granularity": p.granularity, "depth": p.depth, "device": p.device,
                        "layer_sum_over_step": p.layer_sum_over_step,
                        **({"message_ms_per_mib": p.message_ms_per_mib} if p.message_ms_per_mib else {})},
            "cluster": self.cluster.to_json(),
            "cost_model": self.cost_model,
            "straight": self.straight,
            "mode": self.mode,
            "state_space": self.state_space,
            "shared": [{"param": name, "stages": list(stages)} for name, stages in self.shared],
            "stages": [
                {"id": i, "layers": list(s.layers), "first_layer": s.first_name, "last_layer": s.last_name,
                 "replicas": s.replicas, "ranks": list(s.ranks), "in_flight": s.in_flight,
                 "fwd_ms": s.fwd_ms, "bwd_ms": s.bwd_ms, "param_bytes": s.param_bytes,
                 "in_bytes": s.in_bytes, "out_bytes": s.out_bytes, "activation_bytes": s.activation_bytes,
                 "update_ms": s.update_ms, "data_ms": s.data_ms, "wgrad_ms": s.wgrad_ms, "reduce_ms": s.reduce_ms,
                 "compute_ms": s.compute_ms, "allreduce_ms": s.allreduce_ms, "transfer_ms": s.transfer_ms,
                 "time_ms": s.time_ms, "memory_bytes": s.memory_bytes,
                 "receives": list(s.receives), "sends": list(s.sends)}
                for i, s in enumerate(self.stages)
            ],
            "groups": [
                {"level": g.level, "layers": list(g.layers), "units": g.units, "compute_ms": g.compute_ms,
                 "allreduce_ms": g.allreduce_ms,
                 "transfer_ms": g.transfer_ms, "time_ms": g.time_ms}
                for g in self.groups
            ],
            "predicted": {
                "time_per_minibatch_ms": pred.time_ms, "bottleneck": pred.bottleneck,
                "samples_per_s": self.samples_per_s,
                "single_worker_ms": pred.single_worker_ms, "data_parallel_ms": pred.data_parallel_ms,
                "speedup_over_single": pred.speedup_over_single,
                "speedup_over_data_parallel": pred.speedup_over_data_parallel,
                "simulated": None if pred.simulated_ms is None else {
                    "time_per_minibatch_ms": pred.simulated_ms, "bubble_fraction": pred.simulated_bubble,
                    "minibatches": pred.simulated_minibatches, "candidates": pred.candidates, "why": pred.why,
                    "data_parallel_ms": pred.simulated_data_parallel_ms},
                "data_parallel_over_bytes": pred.data_parallel_over_bytes,
            },
            "provenance": {"command": self.command, "pdtool_version": self.pdtool_version},
        }

    @classmethod
    def _read(cls, data: Any, source: str) -> "Plan":
        check_schema(data, SCHEMA, source)
        top = Fields(data, source, known=("schema", "profile", "cluster", "cost_model", "straight", "mode",
                                          "state_space", "shared", "stages", "groups", "predicted", "provenance"))
        pf = top.child("profile", known=("sha256", "fingerprint", "model", "batch_size", "layers", "method", "split",
                                          "granularity", "depth", "device", "layer_sum_over_step",
                                          "message_ms_per_mib"))
        method = pf.get("method", str)
        profile = ProfileRef(pf.get("sha256", str), pf.get("fingerprint", str), pf.get("model", dict, optional=True),
                             pf.count("batch_size", 1), pf.count("layers", 1), method,
                             pf.get("granularity", str), pf.get("depth", int, optional=True),
                             pf.get("split", str, optional=True, default="children" if method == "modules" else "graph"),
                             pf.get("device", str, optional=True, default=""),
                             pf.get("layer_sum_over_step", float, optional=True),
                             pf.get("message_ms_per_mib", float, optional=True, default=0.0))
        shared = top.shared("shared", "stages")
        stages = []
        for where, item in top.items("stages"):
            f = Fields(item, source, where, known=("id", "layers", "first_layer", "last_layer", "replicas", "ranks",
                                                   "in_flight", "fwd_ms", "bwd_ms", "param_bytes", "in_bytes",
                                                   "out_bytes", "activation_bytes", "compute_ms", "allreduce_ms", "transfer_ms",
                                                   "time_ms", "memory_bytes", "update_ms", "data_ms", "wgrad_ms",
                                                   "reduce_ms", "receives", "sends"))
            layers = _layer_ids(f, "layers")
            receives, sends = _boundary(f, data)
            ranks = f.get("ranks", list)
            if not all(isinstance(r, int) and not isinstance(r, bool) for r in ranks):
                f.fail("every rank must be an integer", "fix the list", "ranks")
            if f.count("replicas", 1) != len(ranks):
                f.fail(f"replicas is {f.get('replicas', int)} but {len(ranks)} ranks are listed",
                       "make replicas equal the number of ranks", "ranks")
            if f.count("id") != len(stages):
                f.fail(f"id is {f.get('id', int)}, expected {len(stages)}", "number stages 0, 1, 2, ...", "id")
            stages.append(PlanStage(layers, f.get("first_layer", str), f.get("last_layer", str), tuple(ranks),
                                    f.count("in_flight", 1), f.number("fwd_ms"), f.number("bwd_ms"),
                                    f.count("param_bytes"), f.count("in_bytes"), f.count("out_bytes"),
                                    f.count("activation_bytes"),
                                    f.number("compute_ms"), f.number("allreduce_ms"),
                                    f.number("transfer_ms"), f.number("time_ms"), f.count("memory_bytes"),
                                    f.get("update_ms", float, optional=True, default=0.0),
                                    f.get("data_ms", float, optional=True, default=0.0),
                                    # a plan from before weight gradients were timed
                                    f.get("wgrad_ms", float, optional=True,
                                          default=estimate_wgrad_ms(f.number("bwd_ms"), f.count("param_bytes"))),
                                    f.get("reduce_ms", float, optional=True, default=0.0), receives, sends))
        groups = []
        for where, item in top.items("groups"):
            f = Fields(item, source, where, known=("level", "layers", "units", "compute_ms", "allreduce_ms",
                                                   "transfer_ms", "time_ms"))
            groups.append(PlanGroup(f.count("level"), _layer_ids(f, "layers"), f.count("units", 1),
                                    f.number("compute_ms"), f.number("allreduce_ms"),
                                    f.number("transfer_ms"), f.number("time_ms")))
        pr = top.child("predicted", known=("time_per_minibatch_ms", "bottleneck", "samples_per_s", "single_worker_ms",
                                           "data_parallel_ms", "speedup_over_single", "speedup_over_data_parallel",
                                           "simulated", "data_parallel_over_bytes"))
        simulated = (None, None, None, None, None, None)
        if pr.get("simulated", dict, optional=True) is not None:
            sim = pr.child("simulated", known=("time_per_minibatch_ms", "bubble_fraction", "minibatches", "candidates",
                                               "why", "data_parallel_ms"))
            simulated = (sim.number("time_per_minibatch_ms"), sim.number("bubble_fraction"), sim.count("minibatches", 1),
                         sim.count("candidates", 1, optional=True), sim.get("why", str, optional=True),
                         sim.number("data_parallel_ms", optional=True))
        over = pr.count("data_parallel_over_bytes", optional=True)
        prov = top.child("provenance", known=("command", "pdtool_version"))
        return cls(profile=profile, cluster=Cluster.from_json(top.get("cluster", dict), f"{source}: cluster"),
                   cost_model=top.get("cost_model", str), straight=top.get("straight", bool), mode=top.get("mode", str),
                   state_space=top.get("state_space", str), shared=shared, stages=tuple(stages),
                   groups=tuple(groups),
                   predicted=Prediction(pr.number("time_per_minibatch_ms"), pr.get("bottleneck", str),
                                        pr.number("single_worker_ms"), pr.number("data_parallel_ms"), *simulated,
                                        data_parallel_over_bytes=over),
                   command=prov.get("command", str), pdtool_version=prov.get("pdtool_version", str), source=source)

    @classmethod
    def load(cls, path: str | os.PathLike) -> "Plan":
        return cls.from_json(read_json(path), str(path))

    def save(self, path: str | os.PathLike) -> None:
        write_json(path, self.to_json())


def _layer_ids(f: Fields, key: str) -> tuple[int, ...]:
    """A list of layer ids, sorted (a repeated id stays, for `_validate` to name)."""
    value = f.get(key, list)
    if not all(isinstance(x, int) and not isinstance(x, bool) for x in value):
        f.fail(f"expected a list of layer ids, found {value!r:.40}", "list the stage's layer ids", key)
    return tuple(sorted(value))


def _boundary(f: Fields, data: dict) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """A stage's `receives` and `sends`; a plan from before they were recorded is refused in one
    line that says to make it again (with the command that made it)."""
    if "receives" not in f.data and "sends" not in f.data:
        provenance = data.get("provenance")
        command = provenance.get("command") if isinstance(provenance, dict) else None
        words = command.split() if isinstance(command, str) else []
        again = " ".join(words + ["-o", f.source]) if words[:2] == ["pd", "plan"] else "pd plan"
        f.fail("no receives/sends: the plan was made by an older pdtool, before plans recorded what each stage "
               "receives and sends", f"make it again with {again}")
    found = []
    for key in ("receives", "sends"):
        ids = _layer_ids(f, key)
        if len(set(ids)) < len(ids):
            f.fail(f"layer {next(i for i in ids if ids.count(i) > 1)} is listed twice", "list each layer once", key)
        found.append(ids)
    return found[0], found[1]


def _validate(plan: Plan, source: str) -> None:
    """The invariants a plan holds; a hand edit that breaks one gets one clear line."""
    top = Fields({}, source)
    top.one_of(plan.mode, MODES, "mode", "mode")
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
            if rank in seen:
                top.fail(f"rank {rank} is also in stages[{seen[rank]}]", "give every rank to one stage only", where)
            seen[rank] = index
    for index, (name, stages) in enumerate(plan.shared):
        if len(set(stages)) < 2 or not all(0 <= s < len(plan.stages) for s in stages):
            top.fail(f"parameter {name!r} must list two or more distinct stage ids in 0..{len(plan.stages) - 1}, "
                     f"found {list(stages)}", "regenerate the plan with pd plan", f"shared[{index}]")
    if len(owner) != layers:
        missing = [layer for layer in range(layers) if layer not in owner]
        top.fail(f"layer{'s' if len(missing) > 1 else ''} {compact_ranges(missing)} "
                 f"{'are' if len(missing) > 1 else 'is'} in no stage", "put every layer in exactly one stage", "stages")
    _check_data_flow(plan, owner, top)


def _check_data_flow(plan: Plan, owner: dict[int, int], top: Fields) -> None:
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
    for index, stage in enumerate(plan.stages):
        read = sorted({layer for later in plan.stages[index + 1:] for layer in later.receives if owner[layer] == index})
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
    convention), the file its command names, or any *.profile.json beside it or in the current
    folder, as long as its sha256 is the one the plan records."""
    here = os.path.dirname(plan_path) or "."
    words = plan.command.split()
    named = words[2] if plan.command.startswith("pd plan ") and len(words) > 2 else None
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
