"""The profile artifact (`pdtool.profile/1`): a model's layer graph with measured costs.

A profile lists layers in a topological order of the model's data flow. Every layer has its
forward and backward time for one minibatch in milliseconds (median over repeats, with the
interquartile range as `*_spread`), the bytes of the outputs it hands to other layers
(`act_bytes`, whole minibatch) and the bytes of its parameters (`param_bytes`). Edges
`(src, dst)` say that dst reads an output of src; since layers are topologically ordered,
`src < dst` always, and an edge with `dst > src + 1` skips layers (a residual connection).

Pure: no torch.
"""
from __future__ import annotations

from dataclasses import InitVar, dataclass
from typing import Any

from ..fields import At, check_schema
from ..jsonio import round_float_fields
from .record import (Artifact, Const, Int, ListOf, MapOf, Num, Obj, Pair, Record, Records, Shared, Str, derived,
                     field)

PRECISIONS = ("fp32", "bf16", "fp16")
"""What layers compute in (autocast, `pd profile --precision`) and messages between stages travel
in; the weights (master weights) and the optimizer state stay fp32."""

SCHEMA = "pdtool.profile/1"
MEASURED = ("fx", "export", "modules")  # how pd profile finds layers (`profiler`)
METHODS = MEASURED + ("pipedream",)       # ... or a profile converted from PipeDream's graph.txt
SPLITS = ("graph", "children", "none")
"""How `pd train` can split a profiled model: "graph" (any layer sets: the traced graph is split),
"children" (between the children of a top-level nn.Sequential only), "none" (one stage only)."""
GRANULARITIES = ("module", "op")


NOISY = 0.25
"""Interquartile range over median above which a layer's repeats disagree. In the shipped profiles
(made on a 2-core VM whose speed drifts) 90% of the layers of 0.05 ms or more have a spread of at
most 0.22 of their median (0.09-0.22 by profile); beyond a quarter, something else ran meanwhile
for a good part of the repeats, and a median of a few repeats can be off by more than the
difference between two stage boundaries."""
NOISY_FLOOR_MS = 0.05  # below this a layer's time moves no boundary, however it jitters


SUM_BAND = (0.85, 1.15)
"""Where the sum of the layers' times over a measured step should lie (`Profile.sum_gap`): the
per-layer model is then within 15% of a real step."""


def noisy(median_ms: float, spread_ms: float) -> bool:
    """Whether repeats with this median and interquartile range disagree (`NOISY`)."""
    return median_ms >= NOISY_FLOOR_MS and spread_ms > NOISY * median_ms


@dataclass(frozen=True)
class ModelRef:
    """How to rebuild the model: a `pkg.module:factory` string and the factory's kwargs."""

    spec: str = field(Str(), doc="pkg.module:factory that builds the model")
    kwargs: dict[str, Any] = field(Obj(), factory=dict, required=True, doc="keyword arguments of the factory")


@dataclass(frozen=True)
class TensorSpec:
    """Shape (batch dimension first) and dtype name (e.g. "float32") of one model input."""

    shape: tuple[int, ...] = field(
        ListOf(item=Int(), problem="every dimension must be a non-negative integer", fix="fix the shape")
    )
    dtype: str = field(Str())


@dataclass(frozen=True, kw_only=True)
class Layer:
    """One layer of the profiled graph; times in ms per minibatch, sizes in bytes."""

    id: int = field(Int())
    name: str = field(Str())
    kind: str = field(Str())
    fwd_ms: float = field(Num())
    bwd_ms: float = field(Num())
    act_bytes: int = field(Int())
    param_bytes: int = field(Int())
    fwd_ms_spread: float = field(Num(), 0.0, required=True)
    bwd_ms_spread: float = field(Num(), 0.0, required=True)
    ops: tuple[str, ...] = field(ListOf(item=Str(), problem="every op must be a string", fix="fix the list"), ())
    wgrad_ms: float | None = field(Num(), None, null=True, doc="The part of bwd_ms that computes the weight "
                                   "gradients (null: not measured).")
    saved_bytes: int | None = field(Int(), None, null=True, omit=None, doc="What its forward saves for its "
                                    "backward, per minibatch: the storages it made and autograd saved, and its "
                                    "outputs a consumer saves (absent: not measured; the planner takes act_bytes).")
    same_as: int | None = field(Int(0), None, null=True, omit=None, doc="Not timed: identical to layer same_as "
                                "(the same kind, parameter and input shapes), whose figures it carries "
                                "(pd profile --reuse-identical).")

    def __post_init__(self) -> None:
        round_float_fields(self)

    @property
    def total_ms(self) -> float:
        return self.fwd_ms + self.bwd_ms

    @property
    def noisy(self) -> bool:
        """Whether its forward's or backward's repeats disagree (`NOISY`), after `pd profile` measured
        it again (`profiler.timing.EXTRA_ROUNDS`)."""
        return noisy(self.fwd_ms, self.fwd_ms_spread) or noisy(self.bwd_ms, self.bwd_ms_spread)

    @property
    def weight_gradient_ms(self) -> float:
        """`wgrad_ms` as measured; unmeasured (an older or imported profile): `estimate_wgrad_ms`."""
        return self.wgrad_ms if self.wgrad_ms is not None else estimate_wgrad_ms(self.bwd_ms, self.param_bytes)


def default_split(values: dict[str, Any]) -> str:
    """The split of a profile (or a plan's record of one) from before profiles recorded it."""
    return "children" if values["method"] == "modules" else "graph"


def estimate_wgrad_ms(bwd_ms: float, param_bytes: int) -> float:
    """The weight-gradient part of a backward that was not timed: half of it where there are
    parameters (a matmul's two gradients cost alike), none where there are not."""
    return bwd_ms / 2 if param_bytes else 0.0


@dataclass(frozen=True, kw_only=True)
class Profile(Artifact):
    """A measured layer graph of one model at one minibatch size on one device.

    `method` says how the layers were found: "fx" (torch.fx graph, `ops` are its node
    names), "export" (torch.export graph, likewise), "modules" (leaf modules in execution
    order, `ops` are module call names: neither tracer captured the model), or "pipedream"
    (imported from the original's graph.txt). `split` says how `pd train` can split the model
    (`SPLITS`), `shared` lists the parameters used by several layers (tied weights) with the
    ids of those layers. `granularity` is "module" (trivial
    ops folded into their neighbours) or "op" (every traced op is a layer); `depth`, when
    set, makes every submodule at that nesting depth one layer. `step_ms` is the measured
    time of a whole forward + loss + backward step, `update_ms` of one optimizer step (SGD with
    momentum) over all parameters, `data_ms` of making one minibatch (0 when not measured),
    `reduce_ms` the worker's own work in one all-reduce of all the gradients (flattening them
    into one buffer, adding a peer's buffer, dividing by the count: on a CPU these passes over
    memory cost as much as a fast link; 0 when not measured), `message_ms_per_mib` the CPU time
    that one MiB of a message between two workers costs each end, the sender's write into a
    TCP socket and the receiver's read (measured over loopback; 0 when not measured, and on GPUs).
    """

    SCHEMA_NAME = "profile"  # schemas/profile.schema.json
    DERIVED = (derived("layer_sum_over_step", Num(), lambda profile, *_: profile.layer_sum_over_step, null=True),)

    model: ModelRef | None = field(Record(ModelRef), null=True)
    batch_size: int = field(Int(1))
    inputs: tuple[TensorSpec, ...] = field(Records(TensorSpec))
    device: str = field(Str())
    torch_version: str = field(Str())
    fingerprint: str = field(Str())
    method: str = field(Str(METHODS), doc="how the layers were found: torch.fx, torch.export, leaf modules in "
                        "execution order (neither tracer captured the model), or imported from the original PipeDream")
    granularity: str = field(Str(GRANULARITIES))
    depth: int | None = field(Int(1), null=True)
    repeats: int = field(Int())
    step_ms: float = field(Num())
    step_ms_spread: float = field(Num())
    layers: tuple[Layer, ...] = field(Records(Layer, min_items=1), doc="One layer each: forward/backward ms per "
                                      "minibatch (median, and the interquartile range as spread), output activation "
                                      "bytes, parameter bytes, the traced ops it covers.")
    edges: tuple[tuple[int, int], ...] = field(
        ListOf(item=Pair(), problem="expected a pair of layer ids [src, dst], found " "{value!r:.40}",
               fix="fix the edge", each=True),
        doc="[source layer id, destination layer id] each",
    )
    update_ms: float = field(Num(), 0.0)
    data_ms: float = field(Num(), 0.0)
    reduce_ms: float = field(Num(), 0.0)
    message_ms_per_mib: float = field(Num(), 0.0, omit=0.0)
    copy_ms_per_mib: float = field(Num(), 0.0, omit=0.0, doc="ms that copying one MiB of parameters costs a worker "
                                   "(a weight version kept by weight stashing; 0 when not measured: profiles made "
                                   "before it was, which then price no copy)")
    precision: str = field(Str(PRECISIONS), "fp32", omit="fp32", doc="what the layers computed in (autocast; "
                           "weights fp32) and the messages' floating dtype: act_bytes count that")
    measured: str = field(Str(("step", "layers")), "step", omit="step", doc="step: step_ms is a timed whole "
                          "training step; layers: the model was profiled one layer's weights at a time (pd profile "
                          "--memory, --layerwise), step_ms and update_ms are the sums of its layers'")
    split: str = field(Str(SPLITS), "graph", missing=default_split, doc="how pd train can split the model: graph "
                       "(any layer sets, from the traced graph), children (only between the children of a top-level "
                       "nn.Sequential), none (only one stage; untraceable model)")
    shared: tuple[tuple[str, tuple[int, ...]], ...] = field(Shared("layers"), (), doc="parameters used by several "
                                                            "layers (tied weights), with the ids of those layers")
    classes: dict[str, str] = field(MapOf(Str(), r"\S+", "a module's qualified name"), factory=dict, omit={},
                                    doc="the class of each module that holds layers (qualified name -> class name, "
                                    "e.g. model.layers.4 -> LlamaDecoderLayer): pictures group a stage's layers by "
                                    "them")
    schema: str = field(Const(SCHEMA, ""), SCHEMA, required=True)
    source: InitVar[str] = "profile"

    def __post_init__(self, source: str) -> None:
        round_float_fields(self)
        _validate(self, source)

    # ----- derived figures -----------------------------------------------------------------
    @property
    def layer_sum_ms(self) -> float:
        """Sum of every layer's forward and backward time (ms per minibatch)."""
        return sum(layer.total_ms for layer in self.layers)

    @property
    def layer_sum_over_step(self) -> float | None:
        """How the per-layer model compares with a measured whole step (1.0 = exact)."""
        return self.layer_sum_ms / self.step_ms if self.step_ms > 0 and self.measured == "step" else None

    @property
    def compute_scale(self) -> float:
        """What the planner multiplies the layers' times by: the measured step over their sum where
        they add up to more than it (timed one at a time, each layer pays the fixed costs of a call
        that a whole step pays once: on the small convolutions of bench/real_links.py the sum ran
        1.07-1.12x the step, and the trained pipelines 0.85-0.90x their prediction), else 1 (what
        is in no layer, the loss and the operations between layers, is left out, as before)."""
        ratio = self.layer_sum_over_step
        return 1.0 / ratio if ratio is not None and ratio > 1.0 else 1.0

    def sum_gap(self) -> str | None:
        """Where the layers' times do not add up to the measured step (outside `SUM_BAND`), what
        that means for the plan, as one sentence; None when they do (or no step was timed)."""
        ratio = self.layer_sum_over_step
        if ratio is None or SUM_BAND[0] <= ratio <= SUM_BAND[1]:
            return None
        gap = abs(self.step_ms - self.layer_sum_ms)
        if ratio < SUM_BAND[0]:
            return (f"the layers' times add up to {ratio:.2f} of the measured step: {gap:.1f} ms of each step "
                    "({:.0%}) is in no layer (the loss, operations between the layers, autograd's own work), so "
                    "stage times and predictions leave it out".format(1 - ratio))
        heaviest = sorted(self.layers, key=lambda layer: -layer.total_ms)[:3]
        return (f"the layers' times add up to {ratio:.2f}x the measured step: timed one at a time they took "
                f"{gap:.1f} ms more than inside it (pd plan scales them down to the step, but which layers took the "
                f"extra is not known); the heaviest, which weigh most in the plan: " + ", ".join(f"{layer.name} ({layer.total_ms:.1f} ms)" for layer in heaviest)
                + "; profile again on a quiet machine or with more --repeats")

    @property
    def param_bytes(self) -> int:
        return sum(layer.param_bytes for layer in self.layers)

    @classmethod
    def _check_raw(cls, data: Any, source: str) -> None:
        check_schema(data, SCHEMA, source)


def _validate(p: Profile, source: str) -> None:
    """Check the invariants every profile holds; raise `ArtifactError` naming the first broken one."""
    top = At(source)
    top.one_of(p.method, METHODS, "method", "method")
    top.one_of(p.split, SPLITS, "split", "split")
    top.one_of(p.granularity, GRANULARITIES, "granularity", "granularity")
    if p.depth is not None and p.depth < 1:
        top.fail(f"must be >= 1 or null, found {p.depth}", "fix the value", "depth")
    if p.batch_size < 1:
        top.fail(f"must be >= 1, found {p.batch_size}", "fix the value", "batch_size")
    if not p.layers:
        top.fail("a profile needs at least one layer", "profile a model with at least one layer", "layers")
    names: dict[str, int] = {}
    for index, layer in enumerate(p.layers):
        where = f"layers[{index}]"
        if layer.id != index:
            top.fail(f"id is {layer.id}, expected {index}", "number layers 0, 1, 2, ... in list order", where)
        if layer.name in names:
            top.fail(f"name {layer.name!r} repeats layers[{names[layer.name]}]", "give every layer its own name", where)
        names[layer.name] = index
        for key in ("fwd_ms", "bwd_ms", "fwd_ms_spread", "bwd_ms_spread", "act_bytes", "param_bytes"):
            if getattr(layer, key) < 0:
                top.fail(f"{key} is negative ({getattr(layer, key)})", "costs are never negative; fix it", where)
        if layer.wgrad_ms is not None and not 0 <= layer.wgrad_ms <= layer.bwd_ms:
            top.fail(f"wgrad_ms {layer.wgrad_ms} is outside 0..bwd_ms ({layer.bwd_ms})",
                     "the weight gradients are a part of the backward; fix it or remove it", where)
    for field_name in ("step_ms", "step_ms_spread", "update_ms", "data_ms", "reduce_ms", "message_ms_per_mib",
                       "copy_ms_per_mib"):
        if getattr(p, field_name) < 0:
            top.fail(f"is negative ({getattr(p, field_name)})", "fix the value", field_name)
    count = len(p.layers)
    for index, (name, layers) in enumerate(p.shared):
        if len(set(layers)) < 2 or not all(0 <= layer < count for layer in layers):
            top.fail(f"parameter {name!r} must list two or more distinct layer ids in 0..{count - 1}, found "
                     f"{list(layers)}", "fix the list or remove the entry", f"shared[{index}]")
    seen = set()
    for index, (src, dst) in enumerate(p.edges):
        where = f"edges[{index}]"
        if not (0 <= src < count and 0 <= dst < count):
            top.fail(f"edge {src}->{dst} names a layer that does not exist (ids are 0..{count - 1})",
                     "remove the dangling edge or add the layer", where)
        if src >= dst:
            top.fail(f"edge {src}->{dst} does not go forward",
                     "list layers in a topological order (every edge from a lower id to a higher one)", where)
        if (src, dst) in seen:
            top.fail(f"edge {src}->{dst} is listed twice", "remove the duplicate", where)
        seen.add((src, dst))
