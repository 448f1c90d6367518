"""The module-level fallback: layers are leaf-module calls in execution order.

Used when torch.fx cannot trace a model (data-dependent control flow, calls fx cannot
follow). Every call of a leaf module (or of a module at the chosen depth) is an event;
events of trivial modules (activations, dropout, ...) fold into the layer before them.

Edges are exact: one forward pass runs under a `TorchFunctionMode` that follows every
tensor made between module calls back to the layers it came from, so a skip connection
computed with plain functions (`y + x`) still becomes an edge from the layer that made `x`.
Parameters used outside any leaf module (a position embedding added in `forward`) count
toward the next layer that runs.

Times come from hooks during full training steps: forward time from forward pre/post hooks;
backward time from the moment autograd reaches each layer's output node until it reaches
the next layer's (so functional ops between layers are charged to their neighbour).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from .fx_measure import LayerCost
from ..model.layergraph import TRIVIAL_MODULES
from ..artifacts.profile import noisy
from .timing import EXTRA_ROUNDS, MIN_EXTRA, Clock, nbytes, summarize, tensors_in


@dataclass(kw_only=True)
class _Event:
    name: str
    module: nn.Module
    layer: int = -1
    param_bytes: int = 0
    act_bytes: int = 0
    sources: set[int] = field(default_factory=set)  # events whose outputs this call reads
    params: list[nn.Parameter] = field(default_factory=list)  # every parameter this call uses


@dataclass(kw_only=True)
class ModuleLayers:
    """Layers found by the fallback: names, kinds, folded calls, edges, costs and parameters
    (`params`: per layer, the parameters it is the first to use, by object; `shared`: the
    parameters several layers use, with those layers)."""

    names: list[str]
    kinds: list[str]
    ops: list[tuple[str, ...]]
    edges: list[tuple[int, int]]
    param_bytes: list[int]
    costs: list[LayerCost]
    params: list[list[nn.Parameter]] = field(default_factory=list)
    shared: list[tuple[nn.Parameter, tuple[int, ...]]] = field(default_factory=list)


def leaf_modules(module: nn.Module, depth: int | None) -> list[tuple[str, nn.Module]]:
    """Modules without children, or at nesting `depth`, with their qualified names."""
    leaves = []

    def visit(prefix: str, mod: nn.Module, level: int) -> None:
        children = list(mod.named_children())
        if prefix and (not children or (depth is not None and level >= depth)):
            leaves.append((prefix, mod))
            return
        for name, child in children:
            visit(f"{prefix}.{name}" if prefix else name, child, level + 1)

    visit("", module, 0)
    return leaves or [(type(module).__name__, module)]


class _Provenance(TorchFunctionMode):
    """Outside module calls, gives every new tensor the set of events its inputs came from."""

    def __init__(self, tracker: "_Tracker"):
        super().__init__()
        self.tracker = tracker

    def __torch_function__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        tracker = self.tracker
        if tracker.inside == 0:
            sources: set[int] = set()
            for t in tensors_in((args, kwargs)):
                sources |= tracker.origin(t)
                if isinstance(t, nn.Parameter) and id(t) not in tracker.owned:
                    tracker.loose_params[id(t)] = t
            for t in tensors_in(out):
                tracker.mark(t, sources)
        return out


class _Tracker:
    """Forward hooks that record events, their sources and their output sizes."""

    def __init__(self, leaves: list[tuple[str, nn.Module]]):
        self.leaves = leaves
        self.owned = {id(p) for _, m in leaves for p in m.parameters()}
        self.events: list[_Event] = []
        self.inside = 0
        self.origins: dict[int, tuple[torch.Tensor, set[int]]] = {}  # id -> (keep-alive, events)
        self.loose_params: dict[int, nn.Parameter] = {}
        self.counted: set[int] = set()

    def origin(self, t: torch.Tensor) -> set[int]:
        entry = self.origins.get(id(t))
        return entry[1] if entry is not None and entry[0] is t else set()

    def mark(self, t: torch.Tensor, sources: set[int]) -> None:
        self.origins[id(t)] = (t, set(sources))

    def _bytes_of(self, params) -> int:
        total = 0
        for p in params:
            if id(p) not in self.counted:
                self.counted.add(id(p))
                total += p.numel() * p.element_size()
        return total

    def pre(self, name: str, module: nn.Module, args: tuple) -> None:
        calls = sum(1 for e in self.events if e.module is module)
        event = _Event(name=name if calls == 0 else f"{name}#{calls + 1}", module=module)
        for t in tensors_in(args):
            event.sources |= self.origin(t)
        event.params = list(module.parameters()) + list(self.loose_params.values())
        event.param_bytes = self._bytes_of(event.params)
        self.loose_params.clear()
        self.events.append(event)
        self.inside += 1

    def post(self, output: Any) -> None:
        self.inside -= 1
        index = len(self.events) - 1
        self.events[index].act_bytes = nbytes(output)
        for t in tensors_in(output):
            self.mark(t, {index})


def _hooked(leaves, pre: Callable, post: Callable):
    handles = []
    for name, module in leaves:
        handles.append(module.register_forward_pre_hook(lambda m, a, name=name: pre(name, m, a)))
        handles.append(module.register_forward_hook(lambda m, a, out: post(m, out)))
    return handles


def discover(module: nn.Module, inputs: tuple[torch.Tensor, ...], depth: int | None,
             fold: bool = True) -> tuple[list[_Event], list[tuple[str, nn.Module]]]:
    """Run one forward pass and return the leaf-module call events with their sources."""
    leaves = leaf_modules(module, depth)
    tracker = _Tracker(leaves)
    handles = _hooked(leaves, tracker.pre, lambda m, out: tracker.post(out))
    try:
        with torch.no_grad(), _Provenance(tracker):
            module(*inputs)
    finally:
        for h in handles:
            h.remove()
    _fold(tracker.events, fold)
    return tracker.events, leaves


def _fold(events: list[_Event], fold: bool) -> None:
    """Give each event its layer: with `fold`, trivial modules join the layer before them."""
    layer = -1
    for event in events:
        if layer < 0 or not (fold and isinstance(event.module, TRIVIAL_MODULES)):
            layer += 1
        event.layer = layer


def measure_modules(module: nn.Module, inputs: tuple[torch.Tensor, ...], target: Any,
                    loss_fn: Callable[[Any, Any], torch.Tensor], *, depth: int | None, repeats: int,
                    warmup: int, clock: Clock, progress: Callable[[str], None], fold: bool = True) -> ModuleLayers:
    """Find the layers of `module` by its leaf-module calls and time them during real steps (as many
    steps again, up to `EXTRA_ROUNDS` times, while some layer's repeats disagree: `artifacts.profile.noisy`)."""
    events, leaves = discover(module, inputs, depth, fold)
    count = events[-1].layer + 1 if events else 0
    fwd: list[list[float]] = [[] for _ in range(count)]
    bwd: list[list[float]] = [[] for _ in range(count)]

    def step(timed: bool) -> None:
        f_times, b_times = _timed_step(module, inputs, target, loss_fn, leaves, events, clock)
        for layer in range(count if timed else 0):
            fwd[layer].append(f_times[layer])
            bwd[layer].append(b_times[layer])

    for round_ in range(warmup + repeats):
        progress(f"step {round_ + 1}/{warmup + repeats}")
        step(round_ >= warmup)
    for extra in range(EXTRA_ROUNDS):  # some layer's repeats disagree: as many steps again, the median of all
        if not any(noisy(*summarize(fwd[i])) or noisy(*summarize(bwd[i])) for i in range(count)):
            break
        for round_ in range(max(repeats, MIN_EXTRA)):
            progress(f"noisy layers: step {round_ + 1}/{max(repeats, MIN_EXTRA)} of repeat {extra + 1}")
            step(True)
    names, kinds, ops, params, act = [], [], [], [], []
    for layer in range(count):
        members = [e for e in events if e.layer == layer]
        names.append(members[0].name)
        kinds.append(type(members[0].module).__name__)
        ops.append(tuple(e.name for e in members))
        params.append(sum(e.param_bytes for e in members))
        act.append(members[-1].act_bytes)
    edges = sorted({(events[s].layer, e.layer) for e in events for s in e.sources if events[s].layer != e.layer})
    costs = [LayerCost(**dict(zip(("fwd_ms", "fwd_ms_spread"), summarize(fwd[i]))),
                       **dict(zip(("bwd_ms", "bwd_ms_spread"), summarize(bwd[i]))), act_bytes=act[i])
             for i in range(count)]
    users: dict[int, tuple[nn.Parameter, set[int]]] = {}
    for e in events:
        for p in e.params:
            users.setdefault(id(p), (p, set()))[1].add(e.layer)
    owned: list[list[nn.Parameter]] = [[] for _ in range(count)]
    for p, layers in users.values():
        owned[min(layers)].append(p)
    shared = [(p, tuple(sorted(layers))) for p, layers in users.values() if len(layers) > 1]
    return ModuleLayers(
        names=names, kinds=kinds, ops=ops, edges=edges, param_bytes=params, costs=costs, params=owned, shared=shared
    )


def _timed_step(module, inputs, target, loss_fn, leaves, events, clock: Clock) -> tuple[list[float], list[float]]:
    """One forward + backward step; per-layer forward and backward seconds.

    A layer's forward runs from its first call's start to the next layer's start (the last
    one to the end of `forward`); its backward from the moment autograd reaches its output
    until autograd reaches the next layer's (the last one until `backward` returns).
    """
    count = events[-1].layer + 1
    started: list[float] = []
    reached: list[tuple[float, int]] = []  # (time autograd reached a layer's output, layer)

    def post(m, out):
        layer = events[len(started) - 1].layer
        for t in tensors_in(out):
            if t.grad_fn is not None:
                t.grad_fn.register_prehook(lambda grads, layer=layer: reached.append((clock(), layer)))
                break

    module.zero_grad(set_to_none=True)
    handles = _hooked(leaves, lambda name, m, args: started.append(clock()), post)
    try:
        output = module(*inputs)
        started.append(clock())
    finally:
        for h in handles:
            h.remove()
    loss_fn(output, target).backward()
    reached.append((clock(), -1))
    return _per_layer(started, [e.layer for e in events] + [-1], count), _per_layer_sorted(reached, count)


def _per_layer(stamps: list[float], layers: list[int], count: int) -> list[float]:
    """Sum the intervals between consecutive `stamps` into the layer of each interval's start."""
    totals = [0.0] * count
    for (when, layer), after in zip(zip(stamps, layers), stamps[1:]):
        totals[layer] += after - when
    return totals


def _per_layer_sorted(reached: list[tuple[float, int]], count: int) -> list[float]:
    reached.sort()
    return _per_layer([t for t, _ in reached], [layer for _, layer in reached], count)
