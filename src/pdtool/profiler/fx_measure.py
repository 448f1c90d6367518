"""Per-layer forward and backward times of a model split into one submodule per layer.

PipeDream's profiler (Narayanan et al., SOSP 2019, section 3.1) times each layer's forward
and backward pass separately. Here every layer is a submodule made by `split_module`; one
forward pass of the whole split model records each submodule's inputs, then each
submodule is run on its own: forward (timed), then backward from a gradient of ones on its
differentiable outputs (timed), `repeats` times after `warmup` untimed rounds, the layers taking
turns, less what timing a layer by itself adds (`timing.Clock.fixed`: the clock's reads, a
backward's own start). Each round of a layer with parameters whose inputs need gradients also
times a backward of the input gradients alone; what the whole backward takes beyond it is the
layer's `wgrad_ms` (the W of mode `zb`).

The first round also records what the layer's forward leaves for its backward (`Saved`: every
tensor autograd saves, by its storage, less parameters, buffers and autocast's copies of
parameters): a layer's `saved_bytes` are the storages it made and saved, and those of its outputs
that a consumer saves (`stashes`), so that a stage's stash is the sum over its layers plus its
input, each storage counted once. A layer's outputs are often not what its backward needs (a
ReLU's input, a Linear's output when a ReLU follows) and its intermediates often are (attention
probabilities, dropout masks, normalisation statistics): GPT-2's layers save 2.4x their outputs,
an MLP's half.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Callable

import torch
from torch import fx, nn
from torch.utils._pytree import tree_map
from torch.autograd.graph import saved_tensors_hooks

from ..artifacts.profile import noisy
from .timing import (EXTRA_ROUNDS, MIN_EXTRA, Clock, backward_from, nbytes, roots_and_seeds, seeds_for, summarize,
                     tensors_in)


@dataclass(frozen=True, kw_only=True)
class LayerCost:
    """Measured cost of one layer: ms (median and spread) and output bytes."""

    fwd_ms: float
    fwd_ms_spread: float
    bwd_ms: float
    bwd_ms_spread: float
    act_bytes: int
    wgrad_ms: float | None = None  # the part of bwd_ms that computes the weight gradients
    saved: "Saved | None" = None   # what its forward saved for its backward (None: not recorded)
    saved_bytes: int | None = None  # its share of a stage's stash (`stashes`; None: not recorded)


@dataclass(frozen=True, kw_only=True)
class Saved:
    """What one layer's forward saved for its backward: `own` bytes of storages it made, which of
    its inputs (positions among `tensors_in((args, kwargs))`) and of its outputs (among
    `tensors_in(out)`) it saved, and its outputs' bytes."""

    own: int
    inputs: tuple[int, ...]
    outputs: tuple[int, ...]
    out_bytes: tuple[int, ...]
    in_bytes: tuple[int, ...] = ()


def _storage(t: torch.Tensor) -> tuple[int, int]:
    storage = t.untyped_storage()
    return storage.data_ptr(), storage.nbytes()


def _copy_of_parameter(t: torch.Tensor) -> bool:
    """Whether `t` is autocast's (or a .to()'s) copy of a parameter: a weight, not an activation."""
    fn = t.grad_fn
    if fn is None or fn.name() != "ToCopyBackward0":
        return False
    return any(type(nxt).__name__ == "AccumulateGrad" for nxt, _ in fn.next_functions if nxt is not None)


def record_saved(sub: nn.Module, args, kwargs) -> Saved:
    """What a forward of `sub` on `args`/`kwargs` saves for its backward (the backward is not run)."""
    saved: dict[int, int] = {}

    def pack(t: torch.Tensor) -> None:
        # keeps nothing: an output saved as itself would hold its own graph in a reference cycle
        # (the layer's weights with it); this forward's backward never runs
        if not _copy_of_parameter(t):
            ptr, size = _storage(t)
            saved[ptr] = size

    def unpack(_) -> None:
        raise RuntimeError("a forward run to record what it saves has no backward")

    with saved_tensors_hooks(pack, unpack):
        result = sub(*args, **kwargs)
    weights = {_storage(t)[0] for t in list(sub.parameters()) + list(sub.buffers())}
    taken = [_storage(t)[0] for t in tensors_in((args, kwargs))]
    outs = list(tensors_in(result))
    own = sum(size for ptr, size in saved.items() if ptr not in weights and ptr not in taken)
    return Saved(own=own, inputs=tuple(p for p, ptr in enumerate(taken) if ptr in saved and ptr not in weights),
                 outputs=tuple(q for q, t in enumerate(outs) if _storage(t)[0] in saved),
                 out_bytes=tuple(_storage(t)[1] for t in outs),
                 in_bytes=tuple(_storage(t)[1] for t in tensors_in((args, kwargs))))


MODEL_INPUT = -1
"""The maker `Producers` gives the model's inputs: a layer that saves one keeps it itself."""


class Producers:
    """Which layer made each tensor of a forward pass (by storage), so that a layer's saved inputs
    can be charged to the layer whose output they are (`stashes`). Record the model's inputs, then
    each layer's output as it is made; a storage freed and reused later is charged to its latest
    maker, which is the right one while the tensor is alive. Tensors of neither kind (buffers an
    exported graph passes to a layer) are held once, not per minibatch: charged to no one."""

    def __init__(self, inputs=()):
        self.made: dict[int, tuple[int, int]] = {}
        self.links: dict[int, tuple] = {}
        self.made_by(MODEL_INPUT, inputs)

    def consumed(self, index: int, args, kwargs) -> None:
        """Layer `index` is called on `args`/`kwargs`: where each of its input tensors came from."""
        self.links[index] = tuple(self.made.get(t.untyped_storage().data_ptr() or None)
                                  for t in tensors_in((args, kwargs)))

    def made_by(self, index: int, out) -> None:
        for q, t in enumerate(tensors_in(out)):
            if t.untyped_storage().data_ptr():  # not a meta tensor
                self.made[t.untyped_storage().data_ptr()] = (index, q)


def stashes(costs: dict[int, LayerCost] | list[LayerCost], links: dict[int, tuple]) -> list[LayerCost]:
    """`costs` (by layer index) with `saved_bytes` set: what each layer made and saved, its
    outputs that it did not save itself but a consumer did (a Linear saving a Linear's output),
    and the model's inputs it saves; None where a layer's `saved` was not recorded."""
    costs = dict(enumerate(costs)) if isinstance(costs, list) else dict(costs)
    wanted: dict[int, set[int]] = {}
    data: dict[int, int] = {}  # bytes of the model's inputs each layer saves
    for index, cost in costs.items():
        for p in (cost.saved.inputs if cost.saved else ()):
            source = links.get(index, ())[p] if p < len(links.get(index, ())) else None
            if source is not None and source[0] == MODEL_INPUT:
                data[index] = data.get(index, 0) + cost.saved.in_bytes[p]
            elif source is not None:
                wanted.setdefault(source[0], set()).add(source[1])
    done = []
    for index in sorted(costs):
        cost = costs[index]
        if cost.saved is None:
            done.append(cost)
            continue
        extra = sum(cost.saved.out_bytes[q] for q in wanted.get(index, ())
                    if q < len(cost.saved.out_bytes) and q not in cost.saved.outputs)
        done.append(replace(cost, saved_bytes=cost.saved.own + extra + data.get(index, 0)))
    return done


class _RecordCalls(fx.Interpreter):
    """Runs the split model and keeps, for every `submod_<i>` call, its inputs and outputs."""

    def __init__(self, gm: fx.GraphModule):
        super().__init__(gm)
        self.calls: list[tuple[str, tuple, dict, Any]] = []

    def call_module(self, target, args, kwargs):
        out = super().call_module(target, args, kwargs)
        if str(target).startswith("submod_"):
            self.calls.append((str(target), args, kwargs, out))
        return out


def measure_split(split: fx.GraphModule, inputs: tuple[torch.Tensor, ...], *, repeats: int, warmup: int,
                  clock: Clock, progress: Callable[[str], None]) -> list[LayerCost]:
    """Time every `submod_<i>` of `split` on the activations a real forward pass gives it;
    costs in the order of i. The layers take turns (`time_layers`)."""
    recorder = _RecordCalls(split)
    with torch.no_grad():
        recorder.run(*inputs)
    producers = Producers(inputs)
    for name, args, kwargs, out in recorder.calls:  # in the order they ran
        index = int(name.removeprefix("submod_"))
        producers.consumed(index, args, kwargs)
        producers.made_by(index, out)
    # model inputs and the model's own buffers (an exported graph passes them to the layer that
    # reads them) are data: no gradient flows to them
    originals = {id(t) for t in inputs} | {id(b) for b in split.buffers()}
    calls = sorted(recorder.calls, key=lambda call: int(call[0].removeprefix("submod_")))  # by layer id
    timers = [_LayerTimer(split.get_submodule(name), args, kwargs, out, originals, clock)
              for name, args, kwargs, out in calls]
    costs = time_layers(timers, repeats=repeats, warmup=warmup, progress=progress)
    return stashes({int(name.removeprefix("submod_")): cost for (name, *_), cost in zip(calls, costs)},
                   producers.links)


def time_layer(sub: nn.Module, args, kwargs, out, originals: set[int], *, repeats: int, warmup: int,
               clock: Clock) -> LayerCost:
    """One layer's cost: `sub` run on the `args`/`kwargs` a real forward gave it (`out`: what it
    returned), timed as `time_layers` times a model's layers. `originals`: ids of tensors that are
    data (model inputs, buffers), to which no gradient flows."""
    return time_layers([_LayerTimer(sub, args, kwargs, out, originals, clock)], repeats=repeats, warmup=warmup)[0]


def time_layers(timers: list["_LayerTimer"], *, repeats: int, warmup: int,
                progress: Callable[[str], None] = lambda message: None) -> list[LayerCost]:
    """Every layer's forward and backward, `repeats` times after `warmup` rounds, the layers taking
    turns (each round times every layer once), then as many again (at least `MIN_EXTRA`), up to
    `EXTRA_ROUNDS` times, for the layers whose repeats disagree (`noisy`). Taking turns spreads a
    slow spell of the machine over one repeat of many layers, which the medians drop, instead of
    over every repeat of a few layers (seen here: a layer timed at 1.3x its turn-taking time)."""
    rounds = warmup + repeats
    for index in range(rounds):
        progress(f"layers: round {index + 1} of {rounds} over {len(timers)} layers")
        for timer in timers:
            timer.round(timed=index >= warmup)
    for _ in range(EXTRA_ROUNDS):  # repeats that disagree: measure as many again, the median of all
        unsettled = [timer for timer in timers if timer.noisy()]
        if not unsettled:
            break
        progress(f"layers: {len(unsettled)} whose repeats disagree, measured again")
        for _ in range(max(repeats, MIN_EXTRA)):
            for timer in unsettled:
                timer.round(timed=True)
    return [timer.cost() for timer in timers]


class _LayerTimer:
    """One layer (`sub`) on the inputs a real forward gave it: `round` runs and times its forward
    and backward once, `cost` summarises the rounds, less what timing a layer alone adds
    (`Clock.fixed`, where the clock knows it)."""

    def __init__(self, sub: nn.Module, args, kwargs, out, originals: set[int], clock: Clock):
        def as_leaf(value: Any) -> Any:
            if not isinstance(value, torch.Tensor) or isinstance(value, nn.Parameter):
                return value
            leaf = value.detach()
            if leaf.is_floating_point() and id(value) not in originals:
                leaf.requires_grad_(True)  # an activation from another layer: its gradient is sent back
            return leaf

        self.sub, self.clock, self.out = sub, clock, out
        self.args, self.kwargs = tree_map(as_leaf, args), tree_map(as_leaf, kwargs)
        self.leaves = [t for t in tensors_in((self.args, self.kwargs)) if t.requires_grad]
        self.splits = any(p.requires_grad for p in sub.parameters()) and bool(self.leaves)
        self.fwd: list[float] = []
        self.bwd: list[float] = []
        self.inputs_only: list[float] = []
        self.saved: Saved | None = None
        self.seeds = seeds_for(out)  # the output's gradient, made outside the timed backward

    def _fresh(self) -> tuple:
        # a differentiable copy, so that a layer that works in place on its input cannot
        # touch the leaf (or the next round's input)
        def fresh(value: Any) -> Any:
            if not isinstance(value, torch.Tensor) or isinstance(value, nn.Parameter):
                return value
            return value.clone()
        return tree_map(fresh, self.args), tree_map(fresh, self.kwargs)

    def round(self, timed: bool) -> None:
        """One timed forward and backward (the last round's gradients stay, for an optimizer step)."""
        sub, clock = self.sub, self.clock
        sub.zero_grad(set_to_none=True)
        for leaf in self.leaves:
            leaf.grad = None
        if self.saved is None:  # once, untimed: what its forward saves
            self.saved = record_saved(sub, *self._fresh())

        call_args, call_kwargs = self._fresh()
        start = clock()
        result = sub(*call_args, **call_kwargs)
        middle = clock()
        backward_from(result, self.seeds)
        end = clock()
        if self.splits:  # the same layer's backward of the input gradients only (zb's B), right after
            again_args, again_kwargs = self._fresh()
            seconds = _input_gradients_s(sub(*again_args, **again_kwargs), self.leaves, clock, self.seeds)
            if timed:
                self.inputs_only.append(seconds)
        if timed:
            self.fwd.append(middle - start)
            self.bwd.append(end - middle)

    def noisy(self) -> bool:
        return noisy(*summarize(self.fwd)) or noisy(*summarize(self.bwd))

    def cost(self) -> LayerCost:
        # what timing it alone adds (the whole step pays it once), where the clock knows it
        fixed_fwd, fixed_bwd = self.clock.fixed() if hasattr(self.clock, "fixed") else (0.0, 0.0)
        fwd_ms, fwd_spread = summarize([_less(seconds, fixed_fwd) for seconds in self.fwd])
        bwd_ms, bwd_spread = summarize([_less(seconds, fixed_bwd) for seconds in self.bwd])
        owns = any(p.requires_grad for p in self.sub.parameters())
        if self.splits:
            inputs_ms = summarize([_less(seconds, fixed_bwd) for seconds in self.inputs_only])[0]
            wgrad = min(max(0.0, bwd_ms - inputs_ms), bwd_ms)
        else:  # no parameters: no weight gradients; inputs that need none: all of the backward is
            wgrad = bwd_ms if owns else 0.0
        return LayerCost(fwd_ms=fwd_ms, fwd_ms_spread=fwd_spread, bwd_ms=bwd_ms, bwd_ms_spread=bwd_spread,
                         act_bytes=nbytes(self.out), wgrad_ms=wgrad, saved=self.saved)


def _less(seconds: float, fixed: float) -> float:
    """A sample less the fixed cost of timing it alone, but never below half of it: the fixed cost
    is an estimate (an empty layer's), and a layer that ran is never credited with no time."""
    return max(seconds - fixed, seconds / 2)


def _input_gradients_s(result, leaves: list[torch.Tensor], clock: Clock, seeds: dict | None = None) -> float:
    """Seconds of a backward from `result` that computes the gradients of `leaves` only."""
    pairs = roots_and_seeds(result, seeds)
    if not pairs:
        return 0.0
    start = clock()
    torch.autograd.grad([root for root, _ in pairs], leaves, [seed for _, seed in pairs], allow_unused=True)
    return clock() - start
