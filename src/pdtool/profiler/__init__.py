"""`pd profile`: measure a model layer by layer and build its `Profile`.

The layer graph comes from torch.fx where the model traces (see `graph`), and from leaf
module calls in execution order where it does not (see `modules`). Each layer's forward and
backward time is the median of `repeats` measurements after `warmup` rounds; the whole
training step is timed too, so `Profile.layer_sum_over_step` shows how far the sum of the
per-layer times is from a real step.
"""
from __future__ import annotations

from typing import Callable

import torch
from torch import nn
from torch.utils._pytree import tree_map

from ..errors import ProfileError
from ..modelspec import fingerprint, load_model, tensor_specs
from ..profile import Layer, ModelRef, Profile
from .fx_measure import LayerCost, measure_split
from .graph import FxUntraceable, build_layer_graph
from .modules import measure_modules
from .timing import Clock, measure_data, measure_step, measure_update

METHODS = ("auto", "fx", "modules")
GRANULARITIES = ("module", "op")


def _no_progress(message: str) -> None:
    pass


def profile_model(ref: ModelRef, *, batch_size: int | None = None, device: str = "cpu", repeats: int = 10,
                  warmup: int = 2, granularity: str = "module", depth: int | None = None,
                  method: str = "auto", progress: Callable[[str], None] = _no_progress) -> Profile:
    """Profile the model `ref` names; `progress` receives one short line per unit of work."""
    if repeats < 1 or warmup < 0:
        raise ProfileError(f"repeats must be >= 1 and warmup >= 0 (got {repeats}, {warmup}); fix the flags")
    bundle = load_model(ref)
    size, inputs, target = bundle.batch(batch_size, ref.spec)
    dev = _device(device)
    module = bundle.module.to(dev).train()
    inputs = tuple(t.to(dev) for t in inputs)
    target = tree_map(lambda t: t.to(dev) if isinstance(t, torch.Tensor) else t, target)
    _check_runs(ref.spec, module, inputs, target, bundle.loss_fn)
    clock = Clock(dev)

    used = method
    if method in ("auto", "fx"):
        try:
            layers, edges = _profile_fx(module, inputs, granularity, depth, repeats, warmup, clock, progress)
            used = "fx"
        except FxUntraceable as exc:
            if method == "fx":
                raise ProfileError(f"{ref.spec}: torch.fx cannot trace this model ({exc}); use --method modules") from None
            progress(f"torch.fx cannot trace {ref.spec} ({exc}); using leaf modules in execution order")
            used = "modules"
    if used == "modules":
        found = measure_modules(module, inputs, target, bundle.loss_fn, depth=depth, repeats=repeats,
                                warmup=warmup, clock=clock, progress=progress,
                                fold=granularity == "module")
        layers = [_layer(i, name, kind, cost, pb, ops) for i, (name, kind, cost, pb, ops) in
                  enumerate(zip(found.names, found.kinds, found.costs, found.param_bytes, found.ops))]
        edges = found.edges
    progress("timing whole training steps, optimizer steps and data")
    step_ms, step_spread = measure_step(module, inputs, target, bundle.loss_fn, repeats=repeats,
                                        warmup=warmup, clock=clock)
    update_ms = measure_update(module, inputs, target, bundle.loss_fn, repeats=repeats, warmup=warmup, clock=clock)
    data_ms = measure_data(lambda: bundle.batch(size, ref.spec), repeats=repeats, warmup=warmup, clock=clock)
    return Profile(
        model=ref, batch_size=size, inputs=tensor_specs(inputs), device=_device_name(dev),
        torch_version=torch.__version__, fingerprint=fingerprint(module), method=used,
        granularity=granularity, depth=depth, repeats=repeats, step_ms=step_ms, step_ms_spread=step_spread,
        layers=tuple(layers), edges=tuple(edges), update_ms=update_ms, data_ms=data_ms,
    )


def _profile_fx(module, inputs, granularity, depth, repeats, warmup, clock, progress):
    graph = build_layer_graph(module, granularity, depth)
    total = len(graph.groups)
    done = iter(range(1, total + 1))
    costs = measure_split(graph.split(), inputs, repeats=repeats, warmup=warmup, clock=clock,
                          progress=lambda name: progress(f"layer {next(done)}/{total}"))
    if len(costs) != total:
        raise ProfileError(f"the traced model ran {len(costs)} of its {total} layers; use --method modules")
    layers = [_layer(i, g.name, g.kind, cost, _bytes(module, g.params), g.nodes)
              for i, (g, cost) in enumerate(zip(graph.groups, costs))]
    return layers, graph.edges


def _bytes(module: nn.Module, names: tuple[str, ...]) -> int:
    return sum(module.get_parameter(n).numel() * module.get_parameter(n).element_size() for n in names)


def _layer(index: int, name: str, kind: str, cost: LayerCost, param_bytes: int, ops) -> Layer:
    return Layer(id=index, name=name, kind=kind, fwd_ms=cost.fwd_ms, bwd_ms=cost.bwd_ms,
                 fwd_ms_spread=cost.fwd_ms_spread, bwd_ms_spread=cost.bwd_ms_spread,
                 act_bytes=cost.act_bytes, param_bytes=param_bytes, ops=tuple(ops))


def _device(name: str) -> torch.device:
    try:
        dev = torch.device(name)
    except RuntimeError:
        raise ProfileError(f"unknown device {name!r}; use cpu or cuda (cuda:N for a given GPU)") from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ProfileError("--device cuda, but this torch sees no CUDA GPU; use --device cpu")
    if dev.type not in ("cpu", "cuda"):
        raise ProfileError(f"device {name!r} is not supported; use cpu or cuda")
    return dev


def _device_name(dev: torch.device) -> str:
    if dev.type == "cuda":
        return f"cuda ({torch.cuda.get_device_name(dev)})"
    threads = torch.get_num_threads()
    return f"cpu ({threads} thread{'s' if threads != 1 else ''})"


def _check_runs(spec: str, module: nn.Module, inputs, target, loss_fn) -> None:
    """One training step, untimed, so that a model that rejects its input fails with one line."""
    shapes = ", ".join(f"{tuple(t.shape)} {str(t.dtype).removeprefix('torch.')}" for t in inputs)
    try:
        loss = loss_fn(module(*inputs), target)
        if not (isinstance(loss, torch.Tensor) and loss.dim() == 0):
            raise ProfileError(f"{spec}: the loss function must return a scalar tensor; fix the factory")
        loss.backward()
    except ProfileError:
        raise
    except Exception as exc:
        first = (str(exc).strip().splitlines() or [""])[0]
        raise ProfileError(
            f"{spec} rejected its sample input [{shapes}]: {type(exc).__name__}: {first}; "
            "check --batch-size and the --model-arg values (e.g. image_size)"
        ) from None
    module.zero_grad(set_to_none=True)
