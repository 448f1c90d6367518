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

import os
from dataclasses import InitVar, dataclass, field
from typing import Any


from ..fields import Fields, check_schema
from .schemas import SchemaChecked
from ..jsonio import read_json, round_float_fields, write_json

SCHEMA = "pdtool.profile/1"
METHODS = ("fx", "export", "modules", "pipedream")
SPLITS = ("graph", "children", "none")
"""How `pd train` can split a profiled model: "graph" (any layer sets: the traced graph is split),
"children" (between the children of a top-level nn.Sequential only), "none" (one stage only)."""


@dataclass(frozen=True)
class ModelRef:
    """How to rebuild the model: a `pkg.module:factory` string and the factory's kwargs."""

    spec: str
    kwargs: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class TensorSpec:
    """Shape (batch dimension first) and dtype name (e.g. "float32") of one model input."""

    shape: tuple[int, ...]
    dtype: str


@dataclass(frozen=True)
class Layer:
    """One layer of the profiled graph; times in ms per minibatch, sizes in bytes."""

    id: int
    name: str
    kind: str
    fwd_ms: float
    bwd_ms: float
    act_bytes: int
    param_bytes: int
    fwd_ms_spread: float = 0.0
    bwd_ms_spread: float = 0.0
    ops: tuple[str, ...] = ()
    wgrad_ms: float | None = None  # the part of bwd_ms that computes the weight gradients (None: not measured)

    def __post_init__(self) -> None:
        round_float_fields(self)

    @property
    def total_ms(self) -> float:
        return self.fwd_ms + self.bwd_ms

    @property
    def weight_gradient_ms(self) -> float:
        """`wgrad_ms` as measured; unmeasured (an older or imported profile): `estimate_wgrad_ms`."""
        return self.wgrad_ms if self.wgrad_ms is not None else estimate_wgrad_ms(self.bwd_ms, self.param_bytes)


def estimate_wgrad_ms(bwd_ms: float, param_bytes: int) -> float:
    """The weight-gradient part of a backward that was not timed: half of it where there are
    parameters (a matmul's two gradients cost alike), none where there are not."""
    return bwd_ms / 2 if param_bytes else 0.0


@dataclass(frozen=True)
class Profile(SchemaChecked):
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

    model: ModelRef | None
    batch_size: int
    inputs: tuple[TensorSpec, ...]
    device: str
    torch_version: str
    fingerprint: str
    method: str
    granularity: str
    depth: int | None
    repeats: int
    step_ms: float
    step_ms_spread: float
    layers: tuple[Layer, ...]
    edges: tuple[tuple[int, int], ...]
    update_ms: float = 0.0
    data_ms: float = 0.0
    reduce_ms: float = 0.0
    message_ms_per_mib: float = 0.0
    split: str = "graph"
    shared: tuple[tuple[str, tuple[int, ...]], ...] = ()
    schema: str = SCHEMA
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
        return self.layer_sum_ms / self.step_ms if self.step_ms > 0 else None

    @property
    def param_bytes(self) -> int:
        return sum(layer.param_bytes for layer in self.layers)

    def to_json(self) -> dict[str, Any]:
        """The JSON tree of this profile (`layer_sum_over_step` is derived, written for readers)."""
        return {
            "schema": self.schema,
            "model": None if self.model is None else {"spec": self.model.spec, "kwargs": dict(self.model.kwargs)},
            "batch_size": self.batch_size,
            "inputs": [{"shape": list(t.shape), "dtype": t.dtype} for t in self.inputs],
            "device": self.device,
            "torch_version": self.torch_version,
            "fingerprint": self.fingerprint,
            "method": self.method,
            "split": self.split,
            "shared": [{"param": name, "layers": list(layers)} for name, layers in self.shared],
            "granularity": self.granularity,
            "depth": self.depth,
            "repeats": self.repeats,
            "step_ms": self.step_ms,
            "step_ms_spread": self.step_ms_spread,
            "update_ms": self.update_ms,
            "reduce_ms": self.reduce_ms,
            **({"message_ms_per_mib": self.message_ms_per_mib} if self.message_ms_per_mib else {}),
            "data_ms": self.data_ms,
            "layer_sum_over_step": self.layer_sum_over_step,
            "layers": [
                {
                    "id": l.id, "name": l.name, "kind": l.kind,
                    "fwd_ms": l.fwd_ms, "bwd_ms": l.bwd_ms,
                    "fwd_ms_spread": l.fwd_ms_spread, "bwd_ms_spread": l.bwd_ms_spread, "wgrad_ms": l.wgrad_ms,
                    "act_bytes": l.act_bytes, "param_bytes": l.param_bytes, "ops": list(l.ops),
                }
                for l in self.layers
            ],
            "edges": [list(e) for e in self.edges],
        }

    @classmethod
    def _read(cls, data: Any, source: str) -> "Profile":
        """Parse and validate a profile; every problem is an `ArtifactError` naming `source`."""
        check_schema(data, SCHEMA, source)
        top = Fields(data, source, known=_TOP_FIELDS)
        model = None
        if top.get("model", dict, optional=True) is not None:
            ref = top.child("model", known=("spec", "kwargs"))
            model = ModelRef(ref.get("spec", str), dict(ref.get("kwargs", dict)))
        inputs = []
        for where, item in top.items("inputs"):
            spec = Fields(item, source, where, known=("shape", "dtype"))
            shape = spec.get("shape", list)
            if not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape):
                spec.fail("every dimension must be a non-negative integer", "fix the shape", "shape")
            inputs.append(TensorSpec(tuple(shape), spec.get("dtype", str)))
        layers = []
        for where, item in top.items("layers"):
            f = Fields(item, source, where, known=_LAYER_FIELDS)
            ops = f.get("ops", list, optional=True, default=[])
            if not all(isinstance(o, str) for o in ops):
                f.fail("every op must be a string", "fix the list", "ops")
            layers.append(Layer(
                id=f.count("id"), name=f.get("name", str), kind=f.get("kind", str),
                fwd_ms=f.number("fwd_ms"), bwd_ms=f.number("bwd_ms"),
                fwd_ms_spread=f.number("fwd_ms_spread"), bwd_ms_spread=f.number("bwd_ms_spread"),
                act_bytes=f.count("act_bytes"), param_bytes=f.count("param_bytes"), ops=tuple(ops),
                wgrad_ms=f.number("wgrad_ms", optional=True),
            ))
        edges = []
        for where, item in top.items("edges"):
            if not (isinstance(item, list) and len(item) == 2
                    and all(isinstance(x, int) and not isinstance(x, bool) for x in item)):
                top.fail(f"{where}: expected a pair of layer ids [src, dst], found {item!r:.40}", "fix the edge")
            edges.append((item[0], item[1]))
        shared = top.shared("shared", "layers")
        method = top.get("method", str)
        return cls(
            model=model, batch_size=top.count("batch_size", 1), inputs=tuple(inputs),
            device=top.get("device", str), torch_version=top.get("torch_version", str),
            fingerprint=top.get("fingerprint", str), method=method,
            split=top.get("split", str, optional=True, default="children" if method == "modules" else "graph"),
            shared=shared,
            granularity=top.get("granularity", str), depth=top.get("depth", int, optional=True),
            repeats=top.count("repeats"), step_ms=top.number("step_ms"),
            step_ms_spread=top.number("step_ms_spread"), layers=tuple(layers), edges=tuple(edges),
            update_ms=top.get("update_ms", float, optional=True, default=0.0),
            data_ms=top.get("data_ms", float, optional=True, default=0.0),
            reduce_ms=top.get("reduce_ms", float, optional=True, default=0.0),
            message_ms_per_mib=top.get("message_ms_per_mib", float, optional=True, default=0.0),
            source=source,
        )

    @classmethod
    def load(cls, path: str | os.PathLike) -> "Profile":
        return cls.from_json(read_json(path), str(path))

    def save(self, path: str | os.PathLike) -> None:
        write_json(path, self.to_json())


_TOP_FIELDS = ("schema", "model", "batch_size", "inputs", "device", "torch_version", "fingerprint",
               "method", "split", "shared", "granularity", "depth", "repeats", "step_ms", "step_ms_spread", "update_ms", "data_ms",
               "reduce_ms", "message_ms_per_mib", "layer_sum_over_step", "layers", "edges")
_LAYER_FIELDS = ("id", "name", "kind", "fwd_ms", "bwd_ms", "fwd_ms_spread", "bwd_ms_spread", "wgrad_ms",
                 "act_bytes", "param_bytes", "ops")


def _validate(p: Profile, source: str) -> None:
    """Check the invariants every profile holds; raise `ArtifactError` naming the first broken one."""
    top = Fields({}, source)
    top.one_of(p.method, METHODS, "method", "method")
    top.one_of(p.split, SPLITS, "split", "split")
    top.one_of(p.granularity, ("module", "op"), "granularity", "granularity")
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
    for field_name in ("step_ms", "step_ms_spread", "update_ms", "data_ms", "reduce_ms", "message_ms_per_mib"):
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
