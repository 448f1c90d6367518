"""A backward in two parts, for zero-bubble schedules: the input gradients now, the weight
gradients later.

The stage before waits for the input gradients, nobody for the weight gradients, so `zb` runs
the first part (B) as soon as it can and the second (W) where the worker would otherwise idle.
Splitting without computing anything twice needs the autograd graph: `input_gradients` walks it
from the outputs, finds where the paths to the parameters leave the paths to the inputs (for a
Linear layer, its AddmmBackward node: it passes gradients both to the layer's input and to its
weight and bias), computes the input gradients with the graph kept, and saves the gradients
that reached those nodes (a hook before each). `weight_gradients` later runs only those nodes'
parameter parts, from the saved gradients (torch.distributed.pipelining splits its backward the
same way). A parameter that some path from the outputs reaches without passing the inputs'
paths (every parameter of stage 0, whose inputs are data) is computed from the outputs in W.

A Linear layer's node (AddmmBackward0 of bias + x @ W.t(), MmBackward0 without a bias) whose
group is just its weight and bias gets its W computed directly from what the node saved:
gradient.t() @ x and gradient.sum(0), the same products the node would compute. An autograd
call costs about 50 us of fixed work, a 128-wide layer's matmul a few; a stage of such layers
would otherwise pay one call per layer in every W. Where the weight already holds a gradient
(every microbatch of a group after the first), `add_weight_gradients` adds the product into it
(`addmm_`) instead of making it apart and adding it: one pass over the weight's memory fewer.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch.autograd.graph import GradientEdge, get_gradient_edge


@dataclass(kw_only=True)
class Pending:
    """What `weight_gradients` needs: per group of parameters, the nodes where their paths
    leave the inputs' paths and the gradients saved there; the parameters reached otherwise."""

    params: list[torch.Tensor]
    groups: list[tuple[list[int], list, dict]] = field(default_factory=list)  # (param indices, nodes, saved grads)
    direct: list[int] = field(default_factory=list)
    roots: list[torch.Tensor] = field(default_factory=list)
    seeds: list | None = None
    accumulators: dict[int, object] = field(default_factory=dict)  # param index -> its AccumulateGrad node


def _node(tensor: torch.Tensor):
    return get_gradient_edge(tensor).node


class ParameterNodes:
    """The autograd nodes that accumulate the gradients of a worker's parameters, found once.

    A leaf's node (its AccumulateGrad) lives as long as something holds it, and every graph
    built on the leaf then reaches that same node; finding it anew builds a view of the leaf each
    time (`get_gradient_edge`). Holding it is what DDP does to hook its gradients."""

    def __init__(self):
        self.held: dict[int, tuple[torch.Tensor, object]] = {}

    def __call__(self, p: torch.Tensor):
        found = self.held.get(id(p))
        if found is None or found[0] is not p:
            found = self.held[id(p)] = (p, _node(p))
        return found[1]


def input_gradients(roots: list[torch.Tensor], seeds, inputs: list[torch.Tensor], params: list[torch.Tensor],
                    nodes=_node):
    """(the gradients of `inputs`, a `Pending` for `weight_gradients`): back-propagate `seeds`
    from `roots` to the inputs only, keeping the graph and what the parameters' part needs.
    `nodes` finds a parameter's node (a `ParameterNodes` reuses them across calls)."""
    parents: dict = {}  # node -> the nodes that pass it gradients (toward the roots)
    stack, seen = [r.grad_fn for r in roots if r.grad_fn is not None], set()
    while stack:
        node = stack.pop()
        if node in seen:
            continue
        seen.add(node)
        for child, _ in node.next_functions:
            if child is not None:
                parents.setdefault(child, []).append(node)
                stack.append(child)
    feeds_inputs = _closure([_node(x) for x in inputs], parents)
    pending = Pending(params=params, roots=roots, seeds=seeds)
    by_nodes: dict[frozenset, int] = {}
    for index, p in enumerate(params):
        start = nodes(p)
        if start not in seen:
            continue  # the outputs do not depend on it: no gradient
        pending.accumulators[index] = start
        boundary, direct = _boundary(start, parents, feeds_inputs)
        if direct or not boundary:
            pending.direct.append(index)
            continue
        key = frozenset(boundary)
        if key not in by_nodes:
            by_nodes[key] = len(pending.groups)
            pending.groups.append(([], sorted(boundary, key=id), {}))
        pending.groups[by_nodes[key]][0].append(index)
    hooks = []
    for _, nodes, saved in pending.groups:
        for node in nodes:
            hooks.append(node.register_prehook(lambda grads, node=node, saved=saved: saved.__setitem__(node, grads)))
    try:
        found = torch.autograd.grad(roots, inputs, seeds, retain_graph=True, allow_unused=True) if inputs else []
    finally:
        for hook in hooks:
            hook.remove()
    return list(found), pending


def weight_gradients(pending: Pending, into: list[torch.Tensor] | None = None) -> list[torch.Tensor | None]:
    """The gradients of `pending.params` (None where a parameter gets none), from the saved
    gradients, without running the input part of any node again. With `into` (tensors in the
    order of `pending.params`), a Linear layer's weight gradient goes straight into
    `into[i].grad` where one is there (`addmm_`: no product made apart, no temporary the size of
    the weight) and comes back as None; `add_weight_gradients` adds the rest."""
    grads: list[torch.Tensor | None] = [None] * len(pending.params)
    for indices, nodes, saved in pending.groups:
        found = _linear_weight_gradients(nodes, saved, indices, pending.accumulators, into)
        if found is not None:
            for i, grad in found.items():
                grads[i] = grad
            continue
        edges, outputs = [], []
        for node in nodes:
            for i, grad in enumerate(saved.get(node, ())):
                if grad is not None:
                    edges.append(GradientEdge(node, i))
                    outputs.append(grad)
        if not edges:
            continue
        # a node of the group that another one feeds gets its saved gradient, not a second copy
        clamps = [node.register_prehook(lambda grads, node=node, saved=saved: saved.get(node, grads)) for node in nodes]
        try:
            found = torch.autograd.grad(edges, [pending.params[i] for i in indices], outputs, retain_graph=True,
                                        allow_unused=True)
        finally:
            for clamp in clamps:
                clamp.remove()
        for i, grad in zip(indices, found):
            grads[i] = grad
    if pending.direct:
        found = torch.autograd.grad(pending.roots, [pending.params[i] for i in pending.direct], pending.seeds,
                                    retain_graph=True, allow_unused=True)
        for i, grad in zip(pending.direct, found):
            grads[i] = grad
    return grads


# node type -> (the saved input x, the edge to W.t(), the edge to the bias or None)
_LINEAR_NODES = {"AddmmBackward0": ("_saved_mat1", 2, 0), "MmBackward0": ("_saved_self", 1, None)}


def add_weight_gradients(pending: Pending, into: list[torch.Tensor]) -> None:
    """Add the gradients of `pending.params` to the `.grad` of `into` (the same order): the W
    of a split backward on the weights it trains."""
    for target, grad in zip(into, weight_gradients(pending, into)):
        if grad is not None:
            target.grad = grad.detach() if target.grad is None else target.grad.add_(grad)


def _linear_weight_gradients(nodes: list, saved: dict, indices: list[int], accumulators: dict,
                             into: list[torch.Tensor] | None = None) -> dict | None:
    """{param index: gradient} of a group that is one Linear layer's weight (and bias), computed
    from the node's saved input and the gradient saved before it (with `into`: a weight's added
    to `into[i].grad` where there is one, and None); None where the group is anything else (the
    autograd call then computes it)."""
    if len(nodes) != 1:
        return None
    node = nodes[0]
    shape = _LINEAR_NODES.get(type(node).__name__)
    grad = (saved.get(node) or (None,))[0]
    if shape is None or grad is None or grad.dim() != 2:
        return None
    saved_input, weight_edge, bias_edge = shape
    if bias_edge is not None and (node._saved_alpha != 1 or node._saved_beta != 1):
        return None
    edges = node.next_functions
    transpose = edges[weight_edge][0]
    if type(transpose).__name__ != "TBackward0":
        return None
    parts = {transpose.next_functions[0][0]: "weight"}
    if bias_edge is not None and edges[bias_edge][0] is not None:
        parts[edges[bias_edge][0]] = "bias"
    kinds = [parts.get(accumulators.get(i)) for i in indices]
    if None in kinds:
        return None
    x = getattr(node, saved_input)
    found = {}
    with torch.no_grad():  # the saved input may require grad (a stage's received activation): no graph here
        for i, kind in zip(indices, kinds):
            held = None if into is None else into[i].grad
            if held is not None and kind == "weight" and held.dtype == grad.dtype == x.dtype:
                held.addmm_(grad.t(), x)
                found[i] = None
            else:
                found[i] = grad.t().mm(x) if kind == "weight" else grad.sum(0)
    return found


def _closure(starts, parents) -> set:
    """The nodes from which some node of `starts` is reached (`starts` included)."""
    found, stack = set(), list(starts)
    while stack:
        node = stack.pop()
        if node in found:
            continue
        found.add(node)
        stack.extend(parents.get(node, ()))
    return found


def _boundary(start, parents, feeds_inputs: set) -> tuple[set, bool]:
    """Walking from a parameter's node toward the roots: the first nodes on the inputs' paths,
    and whether some path reaches a root without meeting one."""
    boundary, seen, stack, direct = set(), set(), [start], False
    while stack:
        node = stack.pop()
        if node in seen:
            continue
        seen.add(node)
        if node in feeds_inputs:
            boundary.add(node)
            continue
        above = parents.get(node, ())
        if not above:
            direct = True
        stack.extend(above)
    return boundary, direct
