"""Profiling a model bigger than the profiler's memory: one layer's weights at a time.

`pd profile --memory SIZE` (or `--layerwise`) builds the model with its parameters on `meta`
(`model.build`), captures its layer graph with every tensor on `meta` (`model.capture.all_on_meta`)
and runs the graph split into one submodule per layer (`LayerGraph.split`) layer after layer on
the real sample minibatch: before a layer runs, its parameters get their values by the
initialization rule (`model.build.materialize`); the layer is then timed exactly as whole-model
profiling times it (`fx_measure.time_layer`: forward and backward, `repeats` after `warmup`,
on the inputs the layers before it gave), its optimizer step is timed on its own parameters,
and its parameters go back to `meta` before the next layer runs. What the process holds is one
layer's weights, gradients and momentum, and the activations later layers still read (torch.fx's
interpreter frees a value after its last use).

No whole step runs, so the profile's `step_ms` is the sum of its layers (`measured: layers`)
and its update time the sum of the layers' steps. With `reuse_identical` a layer identical to an
earlier one (the same kind, parameter shapes and input shapes: the blocks of a transformer) is run
once to give the next layers their inputs, but not timed: it takes the earlier one's figures
(`Layer.same_as`).
"""
from __future__ import annotations

import time
from typing import Callable

import torch
from torch import fx, nn
from torch.utils._pytree import tree_map

from ..model.build import materialize, to_meta
from ..model.capture import retarget
from ..model.layergraph import LayerGraph
from .fx_measure import LayerCost, Producers, stashes, time_layer
from .timing import Clock, tensors_in, time_sgd_steps


class _Streaming(fx.Interpreter):
    """Runs the split model with one layer's weights real at a time, timing each layer."""

    def __init__(self, *, split: fx.GraphModule, model: nn.Module, names: dict[int, str], real: dict[int, torch.Tensor],
                 seed: int, timing: dict, reuse: bool, progress: Callable[[str], None], device: torch.device):
        super().__init__(split, garbage_collect_values=True)
        self.device = device
        self.model, self.names, self.real, self.seed = model, names, real, seed
        self.timing, self.reuse, self.progress = timing, reuse, progress
        self.costs: dict[int, LayerCost] = {}
        self.producers = Producers()
        self.same_as: dict[int, int] = {}
        self.update_ms = 0.0
        self.seen: dict[tuple, int] = {}
        self.originals: set[int] = set()
        self.total = sum(1 for node in split.graph.nodes if node.op == "call_module" and str(node.target).startswith("submod_"))
        self.started = time.monotonic()

    def run(self, *args):
        self.originals = {id(t) for t in args if isinstance(t, torch.Tensor)}
        return super().run(*args)

    def get_attr(self, target, args, kwargs):
        """An attribute the split model reads outside its layers (and passes to them): the real
        tensor a capture stand-in stands for."""
        value = super().get_attr(target, args, kwargs)
        return self.real.get(id(value), value) if isinstance(value, torch.Tensor) else value

    def call_module(self, target, args, kwargs):
        if not str(target).startswith("submod_"):
            return super().call_module(target, args, kwargs)
        index = int(str(target).removeprefix("submod_"))
        sub = self.module.get_submodule(target)
        self.progress(_progress(index, self.total, time.monotonic() - self.started))
        owned = [(own, t) for own, t in sub.named_parameters()]
        passed = [t for t in tensors_in((args, kwargs)) if t.device.type == "meta" and id(t) in self.names]
        names = list(dict.fromkeys([self.names[id(t)] for _, t in owned if id(t) in self.names]
                                   + [self.names[id(t)] for t in passed]))
        key = (type(sub).__name__, tuple((tuple(t.shape), t.dtype) for _, t in owned),
               tuple((tuple(t.shape), t.dtype) for t in tensors_in((args, kwargs))), _code(sub))
        waited = {n: self.model.get_parameter(n) for n in names if self.model.get_parameter(n).device.type == "meta"}
        materialize(self.model, list(waited), self.seed)
        tensors = {own: self.model.get_parameter(self.names[id(t)]) if id(t) in self.names else t for own, t in owned}
        tensors = {own: nn.Parameter(t.detach().to(self.device), requires_grad=t.requires_grad)
                   for own, t in tensors.items()}
        tensors.update({own: self.real.get(id(b), b).to(self.device) for own, b in sub.named_buffers()})
        real_of = {id(t): self.model.get_parameter(self.names[id(t)]) for t in passed}  # parameters passed in
        args, kwargs = tree_map(lambda v: real_of.get(id(v), v) if isinstance(v, torch.Tensor) else v, (args, kwargs))
        self.producers.consumed(index, args, kwargs)
        with _swapped(sub, tensors):
            with torch.no_grad():
                out = sub(*args, **kwargs)
            self.producers.made_by(index, out)
            if self.reuse and key in self.seen:
                self.same_as[index] = self.seen[key]
                self.costs[index] = self.costs[self.seen[key]]
            else:
                self.seen.setdefault(key, index)
                self.costs[index] = time_layer(sub, args, kwargs, out, self.originals | {id(b) for b in self.real.values()},
                                               **self.timing)
                params = [p for p in sub.parameters() if p.requires_grad and p.grad is not None]
                if params:
                    self.update_ms += time_sgd_steps(params, **self.timing)
                sub.zero_grad(set_to_none=True)
        torch.clear_autocast_cache()  # autocast keeps each weight's bf16/fp16 copy until its region ends: not here
        to_meta(self.model, list(waited), waited)
        return out


def _progress(index: int, total: int, elapsed_s: float) -> str:
    """'layer 12 of 163, about 40 s left' (the time left from the layers done so far)."""
    if index == 0 or total <= index:
        return f"layer {index + 1} of {total}"
    left = elapsed_s / index * (total - index)
    when = f"{left:.0f} s" if left < 120 else f"{left / 60:.0f} min"
    return f"layer {index + 1} of {total}, about {when} left"


def _code(sub: nn.Module) -> str:
    """What a layer computes, without its parameters' names."""
    if not isinstance(sub, fx.GraphModule):
        return type(sub).__name__
    return "\n".join(f"{n.op} {n.target if n.op in ('call_function', 'call_method') else ''}" for n in sub.graph.nodes)


class _swapped:
    """While it lasts, `sub`'s parameters and buffers named in `tensors` are those tensors."""

    def __init__(self, sub: nn.Module, tensors: dict[str, torch.Tensor]):
        self.sub, self.tensors, self.old = sub, tensors, []

    def __enter__(self):
        for name, tensor in self.tensors.items():
            owner, _, attr = name.rpartition(".")
            module = self.sub.get_submodule(owner)
            table = module._parameters if attr in module._parameters else module._buffers
            self.old.append((table, attr, table[attr]))
            table[attr] = tensor
        return self

    def __exit__(self, *exc):
        for table, attr, tensor in reversed(self.old):
            table[attr] = tensor


def measure_layerwise(graph: LayerGraph, model: nn.Module, standins: dict[int, torch.Tensor], inputs: tuple,
                      seed: int, *, repeats: int, warmup: int, clock: Clock, reuse: bool,
                      progress: Callable[[str], None],
                      device: torch.device = torch.device("cpu")) -> tuple[list[LayerCost], dict[int, int], float]:
    """Per layer of `graph` (captured under `all_on_meta`, whose stand-ins map to the real tensors
    by `standins`), its cost, measured one layer's weights at a time on `inputs`; the layers that
    reused an identical earlier one's figures; the sum of the layers' optimizer steps (ms)."""
    names: dict[int, str] = {}
    for name, p in model.named_parameters():
        names.setdefault(id(p), name)
    for standin, real in standins.items():  # parameters that were real (no re-init): by their stand-ins
        for name, p in model.named_parameters():
            if p is real:
                names.setdefault(standin, name)
    split = graph.split()
    for gm in [split] + [m for m in split.modules() if isinstance(m, fx.GraphModule) and m is not split]:
        retarget(gm.graph, device)  # captured on meta
        gm.recompile()
    stream = _Streaming(split=split, model=model, names=names, real=standins, seed=seed,
                        timing=dict(repeats=repeats, warmup=warmup, clock=clock), reuse=reuse, progress=progress,
                        device=device)
    stream.producers = Producers(inputs)
    stream.run(*inputs)
    return stashes(stream.costs, stream.producers.links), stream.same_as, stream.update_ms
