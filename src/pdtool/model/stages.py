"""A plan's pipeline stages, cut from the model itself (no generated source).

`pd train`'s launcher cuts them once, on a model waiting on `meta` (`model.capture`), and each
worker rebinds its own stage's graph to its own model (`model.capture.own_stage`).

The model is captured by the tracer that made its profile (torch.fx, or torch.export on a
sample minibatch of the profile's size) and grouped into layers exactly as `pd profile` grouped
it (`profiler.capture`, so layer i is group i); every graph node goes to the stage whose layer
set holds its group, and each stage becomes an `fx.GraphModule` made of its own nodes only
(docs/train.md). A model neither tracer captures is split by module
selection instead: one stage runs it whole, or stages are runs of the children of its
top-level nn.Sequential.

- **Dict in, dict out.** Stage s takes the values of boundary s-1 by name and returns the
  values of boundary s; stage 0 takes the model inputs by placeholder name, the last stage
  returns `{"output": <the model's output>}` (for an exported graph rebuilt from its flat
  outputs with the output's pytree spec: a Hugging Face `ModelOutput` stays one). Value names
  are graph node names (deterministic).
- **Relaying.** Boundary k holds every value produced at a stage <= k (model inputs count as
  produced before stage 0) and consumed at a stage > k, each once, in graph order. A skip
  connection over a whole stage, or a model input read late, therefore passes *through* the
  stages in between, which return it as the very tensor object they received: stage s only
  ever receives from s-1 and sends to s+1, and autograd hands a relayed value's gradient
  straight back.
- **Parameter ownership.** A stage module holds references to (not copies of) the leaf
  modules it calls and the tensors it reads by attribute, at their qualified names in the
  whole model; `Stage.param_names` maps them to the model's own names (for a parameter with
  two names, the first one `named_parameters` gives), so checkpoints key parameters by
  whole-model names and a run can resume under another plan. A parameter read by `get_attr`
  (a position embedding added in `forward`) is a real parameter of the stage that reads it,
  never an input. A parameter used in several stages (tied weights, e.g. an embedding and an
  output head) is a parameter of each of them, recorded in `Stage.tied`: every worker holds
  its own copy, and the synchronous modes add the copies' gradients before each step (see
  `runtime.worker.main`), so the copies stay equal. Buffers and constants read by `get_attr` in
  several stages are shared by those stages.

Every stage works under `torch.func.functional_call(stage.module, params, (values,))` with
`params` keyed by the stage module's own parameter names (weight stashing, section 4).
"""
from __future__ import annotations

import operator
from dataclasses import dataclass, field
from typing import Sequence

import torch
from torch import fx, nn

from ..errors import LaunchError
from .spec import fingerprint
from ..artifacts.plan import Plan
from .layergraph import TRACERS, Group, Untraceable, capture

OUTPUT = "output"
_REPROFILE = "re-run pd profile and pd plan for this model"


@dataclass(kw_only=True)
class Stage:
    """One pipeline stage: `module(values)` maps the dict of boundary `index - 1` (named
    `inputs`) to the dict of boundary `index` (named `outputs`).

    `module`'s parameters and buffers are exactly this stage's; `param_names` and
    `buffer_names` map the module's own names to qualified names in the whole model.
    `layers` are the ids of the layers the stage runs (a contiguous range on a chain; on a
    branchy graph possibly, e.g., a residual block's main branch without its downsample branch).
    """

    index: int
    module: nn.Module
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    param_names: dict[str, str]
    buffer_names: dict[str, str] = field(default_factory=dict)
    layers: tuple[int, ...] = ()
    tied: dict[str, tuple[int, ...]] = field(default_factory=dict)  # own param name -> every stage using it
    shared_buffers: dict[str, tuple[int, ...]] = field(default_factory=dict)  # likewise, buffers in several stages

    def forward(self, values: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Run the stage on the values of its input boundary; returns its output boundary."""
        return self.module(values)


class PositionalStage(nn.Module):
    """A `Stage` (a dict in, a dict out) as a module of positional tensors, what
    torch.distributed.pipelining's `PipelineStage` runs: its inputs in the stage's input order,
    its outputs as a tensor or a tuple (`last`: the model's output alone)."""

    def __init__(self, stage: Stage, last: bool):
        super().__init__()
        self.stage, self.names_in, self.names_out, self.last = stage.module, stage.inputs, stage.outputs, last

    def forward(self, *tensors):
        out = self.stage(dict(zip(self.names_in, tensors)))
        if self.last:
            return out["output"]
        values = tuple(out[n] for n in self.names_out)
        return values[0] if len(values) == 1 else values


def build_stages(module: nn.Module, layer_sets: Sequence[Sequence[int]], *, method: str, granularity: str,
                 depth: int | None, layer_names: dict[int, str] | None = None,
                 inputs: tuple[torch.Tensor, ...] | None = None) -> list[Stage]:
    """Split `module` into one `Stage` per set of layer ids in `layer_sets` (stage order).

    `method`, `granularity` and `depth` are the profile's (how its layers were found);
    `layer_names` (layer id -> name, e.g. each plan stage's first and last layer) are checked
    against the traced model's layers; `inputs` is a sample minibatch of the profile's size
    (torch.export captures the graph on it; a whole-model stage takes as many inputs). Raises
    `LaunchError` when the model does not match.
    """
    layer_sets = [tuple(sorted(layers)) for layers in layer_sets]
    if method == "modules":
        if len(layer_sets) == 1:
            _check_layer_sets(layer_sets)
            return [_whole_stage(module, layer_sets[0], len(inputs) if inputs is not None else 1)]
        return _sequential_stages(module, layer_sets, layer_names or {})
    if method not in TRACERS:
        raise LaunchError(f"the plan's layers come from a {method!r} profile, not from a model traced by pdtool, so "
                          "its stages cannot be built; re-run pd profile and pd plan for this model")
    count = _check_layer_sets(layer_sets)
    layers = _layer_graph(module, method, granularity, depth, inputs)
    _check_layers(layers.groups, count, layer_names, granularity, depth)
    gm = layers.traced  # the trace the layers were grouped on, node for node
    stage_of_group = {g: s for s, ids in enumerate(layer_sets) for g in ids}
    node_stage = {node: stage_of_group[g] for node, g in layers.group_of.items()}
    boundaries = _boundaries(gm, node_stage, len(layer_sets))
    stages = []
    for s, ids in enumerate(layer_sets):
        if s == 0:
            inputs = tuple(n.name for n in gm.graph.nodes if n.op == "placeholder")
        else:
            inputs = tuple(n.name for n in boundaries[s - 1])
        outputs = (OUTPUT,) if s == len(layer_sets) - 1 else tuple(n.name for n in boundaries[s])
        graph = _stage_graph(gm, node_stage, s, len(layer_sets), inputs, outputs)
        stage_module: nn.Module = fx.GraphModule(gm, graph, class_name=f"Stage{s}")
        if s == len(layer_sets) - 1 and layers.out_spec is not None:
            stage_module = _Rebuilt(stage_module, layers.out_spec)
        stages.append(
            Stage(index=s, module=stage_module, inputs=inputs, outputs=outputs, param_names={}, buffer_names={},
                  layers=ids)
        )
    _name_state(module, stages)
    return stages


class _Rebuilt(nn.Module):
    """The last stage of an exported graph: its flat outputs rebuilt into the model's output
    structure (`out_spec`, e.g. a Hugging Face ModelOutput), so the loss function sees what
    the model returns."""

    def __init__(self, graph: nn.Module, out_spec):
        super().__init__()
        self.graph = graph
        self.out_spec = _Shared(out_spec)

    def forward(self, values: dict[str, torch.Tensor]) -> dict[str, object]:
        from torch.utils._pytree import tree_unflatten

        flat = self.graph(values)[OUTPUT]
        return {OUTPUT: tree_unflatten(list(flat) if isinstance(flat, (tuple, list)) else [flat], self.out_spec.value)}


class _Shared:
    """An immutable value that copies of a stage share (a pytree spec: copying one is deprecated)."""

    def __init__(self, value):
        self.value = value

    def __deepcopy__(self, memo):
        return self


class _Whole(nn.Module):
    """A whole model as one stage: takes `{input0: x0, input1: x1, ...}`, returns `{output: y}`.
    Any module trains this way (data parallel over the stage's replicas), traced or not."""

    def __init__(self, model: nn.Module, names: tuple[str, ...]):
        super().__init__()
        self.model = model
        self.names = names

    def forward(self, values: dict[str, torch.Tensor]) -> dict[str, object]:
        return {OUTPUT: self.model(*(values[n] for n in self.names))}


def _whole_stage(module: nn.Module, layers: tuple[int, ...], count: int) -> Stage:
    names = tuple(f"input{i}" for i in range(count))
    stage = Stage(index=0, module=_Whole(module, names), inputs=names, outputs=(OUTPUT,), param_names={},
                  buffer_names={}, layers=layers)
    _name_state(module, [stage])
    return stage


class _SequentialSlice(nn.Module):
    """Some consecutive children of an nn.Sequential, as a stage: takes the boundary dict
    `{source: x}` and returns `{target: y}`. The children keep their names, so their
    parameters keep their whole-model names."""

    def __init__(self, children: list[tuple[str, nn.Module]], source: str, target: str):
        super().__init__()
        for name, child in children:
            self.add_module(name, child)
        self.source, self.target = source, target

    def forward(self, values: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        x = values[self.source]
        for child in self.children():
            x = child(x)
        return {self.target: x}


def _sequential_stages(module: nn.Module, layer_sets: list[tuple[int, ...]], layer_names: dict[int, str]) -> list[Stage]:
    """Stages of a model torch.fx cannot trace, by module selection: each stage is a run of
    consecutive children of a top-level nn.Sequential, starting at the child that holds its
    first layer (layers of a --method modules profile are leaf-module calls in execution
    order, named by the modules' qualified names)."""
    if not isinstance(module, nn.Sequential):
        raise LaunchError(f"neither torch.fx nor torch.export captures this {type(module).__name__}, and only an "
                          "nn.Sequential can be split without them (by its children); plan it again with pd plan (which "
                          "keeps such a model in one stage), or make it traceable and re-run pd profile and pd plan")
    _check_layer_sets(layer_sets)
    children = list(module.named_children())
    index = {name: i for i, (name, _) in enumerate(children)}
    starts = []
    for s, layers in enumerate(layer_sets):
        name = layer_names.get(layers[0])
        child = (name or "").split(".")[0].split("#")[0]
        if s == 0:
            starts.append(0)
        elif child not in index:
            raise LaunchError(f"stage {s} starts at layer {layers[0]} ({name!r}), which is not inside a child of the "
                              "model's nn.Sequential; re-run pd profile and pd plan for this model")
        else:
            starts.append(index[child])
    if any(b <= a for a, b in zip(starts, starts[1:])):
        raise LaunchError("the plan cuts inside one child of the model's nn.Sequential, which cannot be split "
                          "without torch.fx; profile with --depth 1 (one layer per child) and re-plan")
    bounds = starts + [len(children)]
    stages = []
    for s in range(len(layer_sets)):
        source = "input" if s == 0 else f"stage{s - 1}"
        target = OUTPUT if s == len(layer_sets) - 1 else f"stage{s}"
        slice_ = _SequentialSlice(children[bounds[s]:bounds[s + 1]], source, target)
        stages.append(
            Stage(index=s, module=slice_, inputs=(source,), outputs=(target,), param_names={}, buffer_names={},
                  layers=layer_sets[s])
        )
    _name_state(module, stages)
    return stages


def plan_stages(plan: Plan, module: nn.Module, inputs: tuple[torch.Tensor, ...] | None = None) -> list[Stage]:
    """`check_model`, then the plan's stages of `module` (the plan's layer sets and names);
    `inputs` is a sample minibatch of the profile's size (needed for an exported model)."""
    check_fingerprint(plan, module)
    p = plan.profile
    return build_stages(module, [s.layers for s in plan.stages], method=p.method,
                        granularity=p.granularity, depth=p.depth, layer_names=_plan_layer_names(plan), inputs=inputs)


def sample_inputs(bundle, plan: Plan) -> tuple[torch.Tensor, ...]:
    """A minibatch of the profile's size from the model's factory, made without touching the
    global random state (every worker must still draw the same initial weights and dropout)."""
    with torch.random.fork_rng(devices=[]):
        return bundle.batch(plan.profile.batch_size, plan.profile.model["spec"] if plan.profile.model else "model")[1]


# ----- checks ---------------------------------------------------------------------------------

def check_fingerprint(plan: Plan, module: nn.Module) -> None:
    found = fingerprint(module)
    if found != plan.profile.fingerprint:
        model = plan.profile.model
        args = "".join(f" {k}={v}" for k, v in sorted((model or {}).get("kwargs", {}).items()))
        spec = f" {model['spec']}{args}," if model else ""
        count = sum(1 for _ in module.named_parameters())
        raise LaunchError(f"the model's parameter names and shapes (fingerprint {found[:12]}, {count} tensors) differ "
                          f"from those of{spec} the model the plan was made for (fingerprint "
                          f"{plan.profile.fingerprint[:12]}); use that model, or {_REPROFILE}")


def _check_layer_sets(layer_sets: list[tuple[int, ...]]) -> int:
    """The layer count the stages cover; `LaunchError` unless every layer 0..count-1 is in
    exactly one non-empty stage."""
    if not layer_sets:
        raise LaunchError("a plan needs at least one stage; regenerate the plan with pd plan")
    owner: dict[int, int] = {}
    for s, ids in enumerate(layer_sets):
        if not ids:
            raise LaunchError(f"stage {s} runs no layer; regenerate the plan with pd plan")
        for layer in ids:
            if layer in owner:
                raise LaunchError(f"layer {layer} is in stages {owner[layer]} and {s}; every layer belongs to one "
                                  "stage; regenerate the plan with pd plan")
            owner[layer] = s
    count = max(owner) + 1
    missing = sorted(set(range(count)) - set(owner))
    if missing or min(owner) < 0:
        raise LaunchError(f"layer {missing[0] if missing else min(owner)} is in no stage; the stages must cover "
                          "every layer; regenerate the plan with pd plan")
    return count


def _layer_graph(module: nn.Module, method: str, granularity: str, depth: int | None, inputs):
    if method == "export" and inputs is None:
        raise LaunchError("the plan was made from a torch.export profile, and capturing the model needs a sample "
                          "minibatch; please report it")
    try:
        return capture(module, inputs, method, granularity, depth)
    except Untraceable as exc:
        raise LaunchError(f"the plan was made from a torch.{method} profile, but torch.{method} cannot capture this "
                          f"model ({exc}); {_REPROFILE}") from None


def _check_layers(groups: list[Group], count: int, names: dict[int, str] | None, granularity: str,
                  depth: int | None) -> None:
    how = f"granularity {granularity}" + (f", depth {depth}" if depth is not None else "")
    if len(groups) != count:
        raise LaunchError(f"the plan has {count} layers but this model has {len(groups)} at {how}: the plan was "
                          f"made for a different model or granularity; {_REPROFILE}")
    for layer, name in sorted((names or {}).items()):
        found = groups[layer].name if 0 <= layer < len(groups) else None
        if found != name:
            raise LaunchError(f"the plan's layer {layer} is {name!r} but this model's is {found!r} at {how}: the plan "
                              f"was made for a different model or granularity; {_REPROFILE}")


def _plan_layer_names(plan: Plan) -> dict[int, str]:
    names = {}
    for stage in plan.stages:
        names[stage.first] = stage.first_name
        names[stage.last] = stage.last_name
    return names


# ----- splitting --------------------------------------------------------------------------------

def _boundaries(gm: fx.GraphModule, node_stage: dict[fx.Node, int], stages: int) -> list[list[fx.Node]]:
    """Boundary k (k = 0..stages-2): the values produced at a stage <= k and consumed at a stage
    > k, in graph order. Attribute reads (`get_attr`) are never sent: each stage reads its own."""
    last = stages - 1
    boundaries: list[list[fx.Node]] = [[] for _ in range(last)]
    for node in gm.graph.nodes:
        if node.op in ("get_attr", "output"):
            continue
        made = node_stage.get(node, -1)  # placeholders: before stage 0
        used = [last if u.op == "output" else node_stage[u] for u in node.users]
        if any(s < made for s in used):  # the stages' layer sets are not in data-flow order
            raise LaunchError(f"stage {min(used)} reads {node.name}, which stage {made} computes later: the plan's "
                              "stages are not in data-flow order (edited by hand?); regenerate the plan with pd plan")
        for k in range(max(made, 0), max(used, default=made)):
            boundaries[k].append(node)
    return boundaries


def _stage_graph(gm: fx.GraphModule, node_stage: dict[fx.Node, int], s: int, stages: int,
                 inputs: tuple[str, ...], outputs: tuple[str, ...]) -> fx.Graph:
    """The graph of stage `s`: `forward(values)` reads its inputs from the dict `values`, runs
    its own nodes in the original order and returns the dict of its outputs."""
    graph = fx.Graph()
    values = graph.placeholder("values")
    by_name = {n.name: n for n in gm.graph.nodes}
    received = set(inputs)
    env: dict[fx.Node, fx.Node] = {}

    def local(node: fx.Node) -> fx.Node:
        """This stage's node for `node`: made on first use for attributes and received values."""
        if node not in env:
            if node.op == "get_attr":
                env[node] = graph.get_attr(node.target)
            elif node.name in received:
                env[node] = graph.create_node("call_function", operator.getitem, (values, node.name), name=node.name)
            else:
                raise LaunchError(f"stage {s} needs value {node.name} that its input boundary lacks; please report it")
        return env[node]

    for node in gm.graph.nodes:
        if node.op != "get_attr" and node_stage.get(node) == s:
            env[node] = graph.node_copy(node, local)
    if s == stages - 1:
        result = next(n for n in gm.graph.nodes if n.op == "output").args[0]
        graph.output({OUTPUT: fx.map_arg(result, local)})
    else:
        graph.output({name: local(by_name[name]) for name in outputs})
    return graph


def _name_state(module: nn.Module, stages: list[Stage]) -> None:
    """Fill each stage's `param_names`/`buffer_names`, `tied` for parameters in several stages and
    `shared_buffers` for buffers in several stages."""
    param_name = {}
    for name, p in module.named_parameters():
        param_name.setdefault(id(p), name)
    buffer_name = {}
    for name, b in module.named_buffers():
        buffer_name.setdefault(id(b), name)
    users: dict[int, list[int]] = {}
    for stage in stages:
        for name, p in stage.module.named_parameters():
            users.setdefault(id(p), []).append(stage.index)
            stage.param_names[name] = param_name.get(id(p), name)
    for stage in stages:
        for _, b in stage.module.named_buffers():
            users.setdefault(id(b), []).append(stage.index)
    for stage in stages:
        stage.tied = {name: tuple(users[id(p)]) for name, p in stage.module.named_parameters() if len(users[id(p)]) > 1}
        stage.shared_buffers = {name: tuple(users[id(b)]) for name, b in stage.module.named_buffers()
                                if len(users[id(b)]) > 1}
        stage.buffer_names.update({name: buffer_name[id(b)] for name, b in stage.module.named_buffers()
                                   if id(b) in buffer_name})
