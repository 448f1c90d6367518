"""The layer graph of a model, from torch.fx, with trivial ops folded into their neighbours.

PipeDream's profiler works on layers, not on single ops: a ResNet-50 should be about a
hundred layers (convolutions, norms, pools, the classifier), not the thousand-odd ops a
trace gives. This module traces the model with torch.fx, marks every node as an *anchor*
(a leaf module that computes, or a heavy function such as a matmul or attention) or as
*trivial* (activations, additions, views, indexing, parameters fetched by attribute), and
gives every trivial node the group of one of its neighbours:

- a trivial node joins the group of its latest producer, where "latest" means the group
  whose anchor comes last in the trace; groups are therefore ordered so that every edge
  between groups goes from an earlier anchor to a later one, and the grouped graph stays
  acyclic (a cut between layers is a cut in the model);
- a trivial node that reads only model inputs or parameters (a view of the input, a
  position embedding) joins the first group that consumes it.

`split_module` (stock torch.fx, `LayerGraph.split`) then makes one submodule per group; the
profiler times each submodule, and the train phase splits the same trace by stage.
"""
from __future__ import annotations

import operator
from dataclasses import dataclass

import torch
from torch import fx, nn
from torch.fx.passes.split_module import split_module
from torch.nn import functional as F

# Leaf modules that never make a layer of their own under "module" granularity.
TRIVIAL_MODULES = (
    nn.ReLU, nn.ReLU6, nn.GELU, nn.SiLU, nn.Tanh, nn.Sigmoid, nn.LeakyReLU, nn.ELU, nn.Hardswish,
    nn.Hardsigmoid, nn.Mish, nn.Softmax, nn.LogSoftmax, nn.Dropout, nn.Dropout1d, nn.Dropout2d,
    nn.Dropout3d, nn.Identity, nn.Flatten, nn.Unflatten,
)
# Functions (and tensor methods, by name) that compute enough to be a layer of their own.
HEAVY_FUNCTIONS = {
    F.linear, F.bilinear, F.conv1d, F.conv2d, F.conv3d, F.conv_transpose1d, F.conv_transpose2d,
    F.conv_transpose3d, F.embedding, F.layer_norm, F.group_norm, F.batch_norm, F.instance_norm,
    F.scaled_dot_product_attention, F.max_pool1d, F.max_pool2d, F.max_pool3d, F.avg_pool1d,
    F.avg_pool2d, F.avg_pool3d, F.adaptive_avg_pool1d, F.adaptive_avg_pool2d, F.adaptive_max_pool2d,
    torch.matmul, torch.mm, torch.bmm, torch.addmm, torch.baddbmm, torch.einsum, operator.matmul,
}
HEAVY_METHODS = {"matmul", "mm", "bmm", "addmm", "baddbmm"}


class FxUntraceable(Exception):
    """torch.fx could not trace the model; the message says why."""


@dataclass(frozen=True)
class Group:
    """One layer: the fx nodes it folds together, named after its anchor."""

    name: str
    kind: str
    nodes: tuple[str, ...]
    params: tuple[str, ...]  # qualified names of the parameters it owns (a shared one: first user)


@dataclass
class LayerGraph:
    """A model traced (`traced`) and grouped into layers; `split()` makes one `submod_<i>`
    per group (what the profiler times); the runtime splits `traced` by stage instead."""

    groups: list[Group]
    edges: list[tuple[int, int]]
    traced: fx.GraphModule
    module: nn.Module
    group_of: dict[fx.Node, int]

    def split(self) -> fx.GraphModule:
        return split_module(self.traced, self.module, lambda node: self.group_of[node], keep_original_order=True)


class _DepthTracer(fx.Tracer):
    """The stock tracer, plus: modules nested `depth` levels deep are leaves (one layer each)."""

    def __init__(self, depth: int | None):
        super().__init__()
        self.depth = depth

    def is_leaf_module(self, m: nn.Module, qualname: str) -> bool:
        if self.depth is not None and qualname and qualname.count(".") + 1 >= self.depth:
            return True
        return super().is_leaf_module(m, qualname)


def trace(module: nn.Module, depth: int | None = None) -> fx.GraphModule:
    """Trace `module` with torch.fx; raise `FxUntraceable` with the reason when it cannot."""
    tracer = _DepthTracer(depth)
    try:
        graph = tracer.trace(module)
    except Exception as exc:  # fx raises TraceError, TypeError, RuntimeError, ... on dynamic code
        raise FxUntraceable(f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}") from None
    return fx.GraphModule(tracer.root, graph, type(module).__name__)


def _is_anchor(node: fx.Node, gm: fx.GraphModule, granularity: str) -> bool:
    if node.op in ("placeholder", "output"):
        return False
    if granularity == "op":
        return node.op != "get_attr"
    if node.op == "call_module":
        return not isinstance(gm.get_submodule(node.target), TRIVIAL_MODULES)
    if node.op == "call_function":
        return node.target in HEAVY_FUNCTIONS
    if node.op == "call_method":
        return node.target in HEAVY_METHODS
    return False


def _describe(node: fx.Node, gm: fx.GraphModule) -> tuple[str, str]:
    """(name, kind) of the layer anchored at `node`: a module's qualified name, or a
    function's name inside the module that called it (e.g. `blocks.0.attn.scaled_dot_product_attention`)."""
    if node.op == "call_module":
        return str(node.target), type(gm.get_submodule(node.target)).__name__
    kind = getattr(node.target, "__name__", str(node.target)) if node.op == "call_function" else str(node.target)
    stack = node.meta.get("nn_module_stack") or {}
    scope = next(reversed(stack), "") if stack else ""
    return (f"{scope}.{kind}" if scope else kind), kind


def assign_groups(gm: fx.GraphModule, granularity: str = "module") -> tuple[list[fx.Node], dict[fx.Node, int]]:
    """The anchors of `gm` in trace order, and every computing node's group (its anchor's index)."""
    nodes = [n for n in gm.graph.nodes if n.op not in ("placeholder", "output")]
    anchors = [n for n in nodes if _is_anchor(n, gm, granularity)] or nodes[:1]
    group: dict[fx.Node, int] = {n: i for i, n in enumerate(anchors)}
    pending = []
    for node in nodes:  # fx keeps nodes in a topological order
        if node in group:
            continue
        producers = [group[p] for p in node.all_input_nodes if p in group]
        if producers:
            group[node] = max(producers)
        else:
            pending.append(node)
    for node in reversed(pending):  # reads only inputs/parameters: join its first consumer
        consumers = [group[u] for u in node.users if u in group]
        group[node] = min(consumers) if consumers else 0
    return anchors, group


def build_layer_graph(module: nn.Module, granularity: str = "module", depth: int | None = None) -> LayerGraph:
    """Trace, group and split `module`; raise `FxUntraceable` if torch.fx cannot trace it."""
    gm = trace(module, depth)
    anchors, group = assign_groups(gm, granularity)
    members: list[list[fx.Node]] = [[] for _ in anchors]
    for node in gm.graph.nodes:
        if node in group:
            members[group[node]].append(node)
    groups = _named_groups(anchors, members, gm, _owned_parameters(members, gm))
    edges = sorted({(group[p], group[n]) for n in group for p in n.all_input_nodes
                    if p in group and group[p] != group[n]})
    return LayerGraph(groups, edges, gm, module, group)


def _owned_parameters(members: list[list[fx.Node]], gm: fx.GraphModule) -> list[tuple[str, ...]]:
    """Per group, the parameters its nodes use that no earlier group used."""
    taken: set[str] = set()
    owned = []
    for nodes in members:
        names = []
        for node in nodes:
            if node.op == "call_module":
                used = [f"{node.target}.{n}" for n, _ in gm.get_submodule(node.target).named_parameters()]
            elif node.op == "get_attr" and isinstance(_attr(gm, node.target), nn.Parameter):
                used = [str(node.target)]
            else:
                used = []
            for name in used:
                if name not in taken:
                    taken.add(name)
                    names.append(name)
        owned.append(tuple(names))
    return owned


def _attr(gm: fx.GraphModule, target: str):
    value = gm
    for part in target.split("."):
        value = getattr(value, part)
    return value


def _named_groups(anchors: list[fx.Node], members: list[list[fx.Node]], gm: fx.GraphModule,
                  params: list[tuple[str, ...]]) -> list[Group]:
    groups, seen = [], {}
    for anchor, nodes, owned in zip(anchors, members, params):
        name, kind = _describe(anchor, gm)
        seen[name] = seen.get(name, 0) + 1
        if seen[name] > 1:  # a module called more than once: one layer per call
            name = f"{name}#{seen[name]}"
        groups.append(Group(name, kind, tuple(n.name for n in nodes), owned))
    return groups
