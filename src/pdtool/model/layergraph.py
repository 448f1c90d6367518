"""The layer graph of a model, from one traced graph, with trivial ops folded into their neighbours.

PipeDream's profiler works on layers, not on single ops: a ResNet-50 should be about a
hundred layers (convolutions, norms, pools, the classifier), not the thousand-odd ops a
trace gives. Two tracers capture the graph, and the same grouping runs on either:

- **torch.fx** symbolic tracing (`trace_fx`): leaf modules of `torch.nn` stay one
  `call_module` node each;
- **torch.export** (`trace_export`, non-strict, for models torch.fx cannot trace, such as
  every Hugging Face transformer): one graph of aten ops in which every node records the
  stack of modules that ran it (`nn_module_stack`). The ops of one call of a module that
  torch.fx would keep whole (a `torch.nn` leaf, or a module `depth` levels deep) are one unit,
  exactly as that module's `call_module` node is under fx. Parameters keep their qualified
  names (the exported module reads them by attribute from the model's own tensors).

Every node is an *anchor* of a layer (a unit that computes: a non-trivial leaf module call, or
a heavy function such as a matmul or attention) or *trivial* (activations, additions, views,
indexing, parameters fetched by attribute), and every trivial node gets the group of one of
its neighbours:

- a trivial node joins the group of its latest producer, where "latest" means the group
  whose anchor comes last in the trace; groups are therefore ordered so that every edge
  between groups goes from an earlier anchor to a later one, and the grouped graph stays
  acyclic (a cut between layers is a cut in the model);
- a trivial node that reads only model inputs or parameters (a view of the input, a
  position embedding) joins the first group that consumes it.

So every op of the graph is inside some layer, and its time is measured with that layer.
`split_module` (stock torch.fx, `LayerGraph.split`) then makes one submodule per group; the
profiler times each submodule, and the train phase splits the same graph by stage.

`torch.distributed.pipelining.pipeline` captures a model the same way (non-strict
`torch.export`, `ExportedProgram.module(check_guards=False)`, fx `split_module`), and pdtool
reuses those pieces rather than `pipeline` itself: `pipeline` cuts only at split points marked
in the model's code, in graph order, and moves each stage's parameters under `submod_<i>`
names, where a pdtool plan's stages are arbitrary down-set differences of the layer graph
(a residual block's branches apart), skips are relayed stage to stage, and parameters keep
their whole-model names for checkpoints and resume under another plan.
"""
from __future__ import annotations

import contextlib
import io
import logging
import operator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import fx, nn
from torch.fx.passes.split_module import split_module
from torch.nn import functional as F

# Leaf modules that never make a layer of their own under "module" granularity.
TRIVIAL_MODULES = (nn.ReLU, nn.ReLU6, nn.GELU, nn.SiLU, nn.Tanh, nn.Sigmoid, nn.LeakyReLU, nn.ELU, nn.Hardswish,
                   nn.Hardsigmoid, nn.Mish, nn.Softmax, nn.LogSoftmax, nn.Dropout, nn.Dropout1d, nn.Dropout2d,
                   nn.Dropout3d, nn.Identity, nn.Flatten, nn.Unflatten)
# Functions (and tensor methods, by name) that compute enough to be a layer of their own.
HEAVY_FUNCTIONS = {
    F.linear, F.bilinear, F.conv1d, F.conv2d, F.conv3d, F.conv_transpose1d, F.conv_transpose2d,
    F.conv_transpose3d, F.embedding, F.layer_norm, F.group_norm, F.batch_norm, F.instance_norm,
    F.scaled_dot_product_attention, F.max_pool1d, F.max_pool2d, F.max_pool3d, F.avg_pool1d,
    F.avg_pool2d, F.avg_pool3d, F.adaptive_avg_pool1d, F.adaptive_avg_pool2d, F.adaptive_max_pool2d,
    torch.matmul, torch.mm, torch.bmm, torch.addmm, torch.baddbmm, torch.einsum, operator.matmul,
}
HEAVY_METHODS = {"matmul", "mm", "bmm", "addmm", "baddbmm"}
# The same, as aten operators (the nodes of an exported graph), by overload packet name.
HEAVY_ATEN = {
    "linear", "bilinear", "mm", "addmm", "bmm", "baddbmm", "matmul", "einsum", "conv1d", "conv2d", "conv3d",
    "convolution", "conv_transpose1d", "conv_transpose2d", "conv_transpose3d", "embedding", "layer_norm",
    "native_layer_norm", "group_norm", "native_group_norm", "batch_norm", "native_batch_norm",
    "_native_batch_norm_legit", "_native_batch_norm_legit_functional", "_native_batch_norm_legit_no_training",
    "instance_norm", "rms_norm", "scaled_dot_product_attention", "_scaled_dot_product_flash_attention",
    "_scaled_dot_product_efficient_attention", "_scaled_dot_product_flash_attention_for_cpu",
    "max_pool1d", "max_pool2d", "max_pool3d", "max_pool2d_with_indices", "avg_pool1d", "avg_pool2d",
    "avg_pool3d", "adaptive_avg_pool1d", "adaptive_avg_pool2d", "adaptive_max_pool2d", "_adaptive_avg_pool2d",
}
TRACERS = ("fx", "export")


class Untraceable(Exception):
    """A tracer could not capture the model; the message says why."""


@dataclass(frozen=True)
class Group:
    """One layer: the graph nodes it folds together, named after its anchor."""

    name: str
    kind: str
    nodes: tuple[str, ...]
    params: tuple[str, ...]  # qualified names of the parameters it owns (a shared one: first user)


@dataclass(kw_only=True)
class LayerGraph:
    """A model's traced graph (`traced`) grouped into layers; `split()` makes one `submod_<i>`
    per group (what the profiler times); the runtime splits `traced` by stage instead.

    `root` holds the attributes the graph reads (the model for fx, the exported module for
    export); `out_spec` (export only) rebuilds the model's output from the graph's flat one.
    `shared` maps a parameter used by several layers (tied weights) to those layers' ids."""

    groups: list[Group]
    edges: list[tuple[int, int]]
    traced: fx.GraphModule
    module: nn.Module
    group_of: dict[fx.Node, int]
    method: str = "fx"
    root: nn.Module | None = None
    out_spec: Any = None
    shared: dict[str, tuple[int, ...]] = field(default_factory=dict)

    def split(self) -> fx.GraphModule:
        root = self.root if self.root is not None else self.module
        # partitions are called in a topological order of their data flow (not in the order of
        # their first nodes: an op that reads only inputs, e.g. an attention mask, sits early in
        # the graph but belongs to the layer that consumes it)
        return split_module(self.traced, root, lambda node: self.group_of[node])


class _DepthTracer(fx.Tracer):
    """The stock tracer, plus: modules nested `depth` levels deep are leaves (one layer each)."""

    def __init__(self, depth: int | None):
        super().__init__()
        self.depth = depth

    def is_leaf_module(self, m: nn.Module, qualname: str) -> bool:
        if self.depth is not None and qualname and qualname.count(".") + 1 >= self.depth:
            return True
        return super().is_leaf_module(m, qualname)


def _first_line(exc: BaseException, limit: int = 200) -> str:
    text = str(exc).strip()
    line = f"{type(exc).__name__}: {text.splitlines()[0] if text else ''}".strip()
    return line if len(line) <= limit else line[:limit - 3].rstrip() + "..."


def trace_fx(module: nn.Module, depth: int | None = None) -> fx.GraphModule:
    """Trace `module` with torch.fx; raise `Untraceable` with the reason when it cannot."""
    tracer = _DepthTracer(depth)
    try:
        graph = tracer.trace(module)
    except Exception as exc:  # fx raises TraceError, TypeError, RuntimeError, ... on dynamic code
        raise Untraceable(_first_line(exc)) from None
    return fx.GraphModule(tracer.root, graph, type(module).__name__)


@contextlib.contextmanager
def quiet(*loggers: str):
    """While it lasts, torch's `loggers` say only what is critical, and nothing reaches stderr
    (a failing capture prints its partial graph there: the one line pdtool gives is what the user needs)."""
    found = [logging.getLogger(name) for name in loggers]
    levels = [logger.level for logger in found]
    for logger in found:
        logger.setLevel(logging.CRITICAL)
    try:
        with contextlib.redirect_stderr(io.StringIO()):
            yield
    finally:
        for logger, level in zip(found, levels):
            logger.setLevel(level)


def trace_export(module: nn.Module, inputs: tuple[torch.Tensor, ...]) -> tuple[fx.GraphModule, Any]:
    """Capture `module` on `inputs` with torch.export (non-strict, training graph): the graph
    module (reading the model's own parameters and buffers) and the output's pytree spec.
    The graph is specialised to the shapes of `inputs`. Raises `Untraceable` with the reason."""
    try:  # a failing export prints the partial graph on stderr: the reason is what the user needs
        with quiet("torch._export", "torch.export", "torch._dynamo", "torch.fx"), \
                _on_the_cpu(module, inputs) as (cpu_inputs, real_of):
            program = torch.export.export(module, tuple(cpu_inputs), strict=False)
            gm = program.module(check_guards=False)
            _put_back(gm, real_of)
    except Exception as exc:  # data-dependent control flow, unsupported ops, ...
        raise Untraceable(_first_line(exc)) from None
    for node in list(gm.graph.nodes):
        if not node.users and (node.op == "call_module" and str(node.target).startswith("_guards")
                               or node.target in _CAPTURE_ASSERTIONS):
            gm.graph.erase_node(node)
    _inline_scalars(gm)
    gm.recompile()
    return gm, program.call_spec.out_spec


@contextlib.contextmanager
def _on_the_cpu(module: nn.Module, inputs: tuple):
    """While it lasts, a model whose tensors wait on `meta` (`model.capture.all_on_meta`) seems to
    be on the CPU: every `meta` parameter, buffer and input is a fake CPU tensor (torch's
    FakeTensorMode: no memory, no compute), so that model code that branches on the device takes
    the CPU's branch (transformers' MoE counts experts with `histc`, which the CPU computes on
    floats only). Yields the inputs to trace with and {id of a stand-in: the model's own tensor};
    the model's own tensors come back afterwards (`_put_back` rebinds the exported module to them)."""
    tensors = [(table, name, t) for m in module.modules() for table in (m._parameters, m._buffers)
               for name, t in table.items() if t is not None]
    if not any(t.device.type == "meta" for _, _, t in tensors) and not any(
            isinstance(t, torch.Tensor) and t.device.type == "meta" for t in inputs):
        yield inputs, {}
        return
    from torch._subclasses.fake_tensor import FakeTensorMode

    mode = FakeTensorMode(allow_non_fake_inputs=True)
    cpu = torch.device("cpu")
    fakes: dict[int, torch.Tensor] = {}

    def fake(t):
        if id(t) not in fakes:
            made = mode.fake_tensor_converter.from_meta_and_device(mode, t, cpu)
            fakes[id(t)] = nn.Parameter(made, t.requires_grad) if isinstance(t, nn.Parameter) else made
        return fakes[id(t)]

    for table, name, t in tensors:
        if t.device.type == "meta":
            table[name] = fake(t)
    real_of = {id(fake(t)): t for _, _, t in tensors if t.device.type == "meta"}
    try:
        with mode:
            yield tuple(fake(t) if isinstance(t, torch.Tensor) and t.device.type == "meta" else t
                        for t in inputs), real_of
    finally:
        for table, name, t in tensors:
            table[name] = t


def _inline_scalars(gm: fx.GraphModule) -> None:
    """Scalar constants the trace lifted out of the model's code (T5's `torch.tensor(x)` of a
    bucket size: `lifted_tensor_0`, which is no parameter or buffer of the model) become ops that
    make them (`aten.scalar_tensor`), so a stage's program holds them and its worker, which binds
    the program to its own model, needs no such attribute."""
    own = {id(t) for t in gm.parameters()} | {id(t) for t in gm.buffers()}
    for node in list(gm.graph.nodes):
        if node.op != "get_attr":
            continue
        value = getattr(gm, str(node.target), None)
        if isinstance(value, torch.Tensor) and id(value) not in own and value.dim() == 0 \
                and value.device.type != "meta" and not isinstance(value, torch._subclasses.FakeTensor):
            with gm.graph.inserting_before(node):
                made = gm.graph.call_function(torch.ops.aten.scalar_tensor.default, (value.item(),),
                                              {"dtype": value.dtype, "device": value.device})
            node.replace_all_uses_with(made)
            gm.graph.erase_node(node)
            delattr(gm, str(node.target))


def _put_back(gm: nn.Module, real_of: dict[int, torch.Tensor]) -> None:
    """The exported module `gm` holds the model's own tensors where the trace saw their fake
    stand-ins (`_on_the_cpu`: `real_of`)."""
    for owner in gm.modules():
        for table in (owner._parameters, owner._buffers):
            for name, t in list(table.items()):
                if t is not None and id(t) in real_of:
                    table[name] = real_of[id(t)]


_CAPTURE_ASSERTIONS = (torch.ops.aten._assert_tensor_metadata.default,)
"""Checks torch.export records of what a tensor was when captured (in fp32: `.to(float32)` in an
RMSNorm): under autocast (`--precision bf16`), or with a message arriving in the compute dtype,
they no longer hold, and they compute nothing."""


def trace(module: nn.Module, depth: int | None = None) -> fx.GraphModule:
    """`trace_fx` (the name the tests and benches know)."""
    return trace_fx(module, depth)


# ----- units: what makes a layer -----------------------------------------------------------------

def _fx_unit(gm: fx.GraphModule, granularity: str):
    """The anchor test of a torch.fx graph: a node is its own unit when it computes enough."""
    def unit(node: fx.Node):
        if node.op in ("placeholder", "output", "get_attr"):
            return None
        if granularity == "op":
            return node
        if node.op == "call_module":
            return None if isinstance(gm.get_submodule(node.target), TRIVIAL_MODULES) else node
        if node.op == "call_function":
            return node if node.target in HEAVY_FUNCTIONS else None
        if node.op == "call_method":
            return node if node.target in HEAVY_METHODS else None
        return None
    return unit


def _fx_leaf(module: nn.Module) -> bool:
    """What torch.fx keeps as one call_module node by default: a torch.nn module, not a container."""
    return (type(module).__module__.startswith(("torch.nn", "torch.ao.nn"))
            and not isinstance(module, nn.Sequential))


def _aten_name(node: fx.Node) -> str:
    packet = getattr(node.target, "overloadpacket", None)
    return getattr(packet, "__name__", None) or getattr(node.target, "__name__", str(node.target))


def _call_of(node: fx.Node, module: nn.Module, depth: int | None):
    """(stack key, qualified name, module) of the module call that makes `node` part of one
    layer in an exported graph: the outermost module on its stack that torch.fx would keep
    whole (a torch.nn leaf, or one nested `depth` levels deep), or that holds parameters and
    no children (a library's own Conv1D or RMSNorm: one layer, named after the module, where
    fx would see its ops); None when there is none."""
    for key, entry in (node.meta.get("nn_module_stack") or {}).items():
        path = entry[0] if isinstance(entry, tuple) else str(entry)
        if not path:
            continue
        try:
            sub = module.get_submodule(path)
        except AttributeError:
            continue
        if ((depth is not None and path.count(".") + 1 >= depth) or _fx_leaf(sub)
                or (next(sub.children(), None) is None and next(sub.parameters(recurse=False), None) is not None)):
            return key, path, sub
    return None


def _scope(node: fx.Node) -> str:
    stack = node.meta.get("nn_module_stack") or {}
    if not stack:
        return ""
    entry = stack[next(reversed(stack))]
    return entry[0] if isinstance(entry, tuple) else str(next(reversed(stack)))


def _export_unit(module: nn.Module, granularity: str, depth: int | None):
    """The anchor test of an exported graph: all ops of one call of a module torch.fx would keep
    whole form one unit (as its call_module node does under fx), heavy ops outside such calls
    are units of their own."""
    def unit(node: fx.Node):
        if node.op != "call_function":
            return None
        if granularity == "op":
            return node
        call = _call_of(node, module, depth)
        if call is not None:
            key, _, sub = call
            return None if isinstance(sub, TRIVIAL_MODULES) else ("call", key)
        return node if _aten_name(node) in HEAVY_ATEN else None
    return unit


def assign_groups(gm: fx.GraphModule, granularity: str = "module", unit=None) -> tuple[list[fx.Node], dict[fx.Node, int]]:
    """The anchors of `gm` in trace order, and every computing node's group (its anchor's index).

    `unit(node)` names the unit a node belongs to (None: trivial); consecutive nodes of one
    unit form one group whose anchor is its first node. The default is torch.fx's test."""
    unit = unit or _fx_unit(gm, granularity)
    nodes = [n for n in gm.graph.nodes if n.op not in ("placeholder", "output")]
    anchors: list[fx.Node] = []
    group: dict[fx.Node, int] = {}
    current = None
    for node in nodes:
        key = unit(node)
        if key is None:
            continue
        if key != current or not anchors:
            anchors.append(node)
            current = key
        group[node] = len(anchors) - 1
    if not anchors:
        anchors, group = nodes[:1], {nodes[0]: 0} if nodes else {}
    pending = []
    for node in nodes:  # graphs keep nodes in a topological order
        if node in group:
            continue
        producers = [group[p] for p in node.all_input_nodes if p in group]
        if producers:
            group[node] = max(producers)
        else:
            pending.append(node)
    for node in reversed(pending):  # reads only inputs/parameters: join its first consumer
        consumers = [group[u] for u in node.users if u in group]
        if not consumers:  # consumes nothing (torch.export's check of a tensor a .to() reads): beside that read
            consumers = [group[u] for p in node.all_input_nodes for u in p.users if u in group]
        group[node] = min(consumers) if consumers else 0
    return anchors, group


def build_layer_graph(module: nn.Module, granularity: str = "module", depth: int | None = None, *,
                      method: str = "fx", inputs: tuple[torch.Tensor, ...] | None = None) -> LayerGraph:
    """Trace `module` with `method` ("fx", or "export" on the sample `inputs`), group and split
    it; raise `Untraceable` if the tracer cannot capture it."""
    if method == "export":
        if inputs is None:
            raise ValueError("torch.export needs sample inputs")
        gm, out_spec = trace_export(module, inputs)
        unit, root = _export_unit(module, granularity, depth), gm
    else:
        gm, out_spec = trace_fx(module, depth), None
        unit, root = _fx_unit(gm, granularity), module
    anchors, group = assign_groups(gm, granularity, unit)
    _attribute_reads_per_group(gm, group)
    members: list[list[fx.Node]] = [[] for _ in anchors]
    for node in gm.graph.nodes:
        if node in group:
            members[group[node]].append(node)
    owned, shared = _parameters(module, gm, members, group)
    describe = (lambda anchor: _describe(anchor, gm)) if method != "export" else (
        lambda anchor: _describe_export(anchor, module, depth))
    groups = _named_groups(anchors, members, describe, owned)
    edges = sorted({(group[p], group[n]) for n in group for p in n.all_input_nodes
                    if p in group and group[p] != group[n]})
    return LayerGraph(groups=groups, edges=edges, traced=gm, module=module, group_of=group, method=method, root=root,
                      out_spec=out_spec, shared=shared)


def _attribute_reads_per_group(gm: fx.GraphModule, group: dict[fx.Node, int]) -> None:
    """Give every group its own read of each attribute it uses: a parameter (an embedding tied to
    an output head) or buffer read in several layers is read in each, never passed between
    layers as if it were an activation (the stages read their own too, `model.stages`)."""
    for node in [n for n in gm.graph.nodes if n.op == "get_attr"]:
        by_group: dict[int, list[fx.Node]] = {}
        for user in node.users:
            if user in group:
                by_group.setdefault(group[user], []).append(user)
        if not by_group:
            continue
        group[node] = min(by_group)
        for g, users in sorted(by_group.items())[1:]:
            first = min(users, key=lambda u: _position(gm, u))
            with gm.graph.inserting_before(first):
                copy = gm.graph.get_attr(node.target)
            copy.meta = dict(node.meta)
            group[copy] = g
            for user in users:
                user.replace_input_with(node, copy)
    gm.recompile()


def _position(gm: fx.GraphModule, node: fx.Node) -> int:
    for index, candidate in enumerate(gm.graph.nodes):
        if candidate is node:
            return index
    return -1


def _describe(node: fx.Node, gm: fx.GraphModule) -> tuple[str, str]:
    """(name, kind) of the layer anchored at `node`: a module's qualified name, or a
    function's name inside the module that called it (e.g. `blocks.0.attn.scaled_dot_product_attention`)."""
    if node.op == "call_module":
        return str(node.target), type(gm.get_submodule(node.target)).__name__
    kind = getattr(node.target, "__name__", str(node.target)) if node.op == "call_function" else str(node.target)
    stack = node.meta.get("nn_module_stack") or {}
    scope = next(reversed(stack), "") if stack else ""
    return (f"{scope}.{kind}" if scope else kind), kind


def _describe_export(node: fx.Node, module: nn.Module, depth: int | None) -> tuple[str, str]:
    """The same names for an exported graph: the module whose call the layer is, or the op's
    name inside the innermost module that ran it."""
    call = _call_of(node, module, depth)
    if call is not None:
        _, path, sub = call
        return path, type(sub).__name__
    kind = _aten_name(node)
    scope = _scope(node)
    return (f"{scope}.{kind}" if scope else kind), kind


def _parameters(module: nn.Module, gm: fx.GraphModule, members: list[list[fx.Node]],
                group: dict[fx.Node, int]) -> tuple[list[tuple[str, ...]], dict[str, tuple[int, ...]]]:
    """Per group, the parameters its nodes use that no earlier group used (by the model's own
    first name for each tensor); and every parameter used by several groups, with their ids."""
    name_of: dict[int, str] = {}
    for name, p in module.named_parameters():
        name_of.setdefault(id(p), name)
    users: dict[str, set[int]] = {}
    for node in gm.graph.nodes:
        if node.op == "call_module" and node in group:
            found = [(p, {group[node]}) for p in gm.get_submodule(node.target).parameters()]
        elif node.op == "get_attr" and isinstance(_attr(gm, node.target), nn.Parameter):
            where = {group[u] for u in node.users if u in group}
            if not where:  # read but never used (torch.export reads every parameter, used or not)
                continue
            found = [(_attr(gm, node.target), where)]
        else:
            continue
        for p, where in found:
            name = name_of.get(id(p))
            if name is not None:
                users.setdefault(name, set()).update(where)
    order = {name: i for i, name in enumerate(name_of.values())}
    owned: list[list[str]] = [[] for _ in members]
    for name in sorted(users, key=lambda n: (min(users[n]), order[n])):
        owned[min(users[name])].append(name)
    shared = {name: tuple(sorted(g)) for name, g in users.items() if len(g) > 1}
    return [tuple(names) for names in owned], shared


def _attr(gm: fx.GraphModule, target: str):
    value = gm
    for part in target.split("."):
        value = getattr(value, part)
    return value


def _named_groups(anchors: list[fx.Node], members: list[list[fx.Node]], describe,
                  params: list[tuple[str, ...]]) -> list[Group]:
    groups, seen = [], {}
    for anchor, nodes, owned in zip(anchors, members, params):
        name, kind = describe(anchor)
        seen[name] = seen.get(name, 0) + 1
        if seen[name] > 1:  # a module called more than once: one layer per call
            name = f"{name}#{seen[name]}"
        groups.append(Group(name, kind, tuple(n.name for n in nodes), owned))
    return groups


def capture(module: nn.Module, inputs: tuple[torch.Tensor, ...], method: str, granularity: str,
            depth: int | None) -> LayerGraph:
    """The layer graph of `module` by the tracer `method` ("fx" or "export"), the way `pd
    profile` made it; raises `Untraceable` when that tracer cannot capture the model."""
    return build_layer_graph(module, granularity, depth, method=method, inputs=inputs)
