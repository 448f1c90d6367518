"""`pd profile`: measure a model layer by layer and build its `Profile`.

The layer graph comes from one traced graph (`pdtool.model.layergraph`): torch.fx symbolic tracing where
the model traces, else torch.export (Hugging Face transformers and other models with Python
fx cannot follow); the same graph is what `pd train` splits into stages. Where neither tracer
captures the model, the layers are leaf module calls in execution order (see `modules`), and
only a one-stage plan (or a split between the children of an nn.Sequential) can train it. Each layer's forward and
backward time is the median of `repeats` measurements after `warmup` rounds; the whole
training step is timed too, so `Profile.layer_sum_over_step` shows how far the sum of the
per-layer times is from a real step.
"""
from __future__ import annotations

import dataclasses
from typing import Callable

import torch
from torch import nn
from torch.utils._pytree import tree_map

from ..allocator import keep_freed_memory
from ..units import format_bytes
from ..errors import ProfileError
from ..model.spec import fingerprint, load_model, tensor_specs
from ..artifacts.profile import Layer, ModelRef, Profile
from .fx_measure import LayerCost, measure_split
from ..model.layergraph import TRACERS, LayerGraph, Untraceable, capture
from .modules import measure_modules
from .timing import (Clock, computing_in, measure_copy, measure_data, measure_message, measure_reduce, measure_update,
                     step_samples, summarize)

METHODS = ("auto",) + TRACERS + ("modules",)


def _no_progress(message: str) -> None:
    pass


WHOLE_MODEL_FACTOR = 4
"""Profiling the whole model at once needs about this many times its parameter bytes: the
weights, their gradients, the momentum of the timed optimizer step and a copy of the weights
(measured: 4.2x on bench/big_model.py's 1.75 GiB MLP); more than `--memory` allows, and the
model is profiled one layer at a time."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class ProfileRequest:
    """What `pd profile` was asked (`profile_model`'s options), handed to each of its steps."""

    ref: ModelRef
    batch_size: int | None = None
    device: torch.device
    repeats: int = 10
    warmup: int = 2
    granularity: str = "module"
    depth: int | None = None
    method: str = "auto"
    progress: Callable[[str], None] = _no_progress
    warn: Callable[[str], None] = _no_progress
    reuse_identical: bool = False
    precision: str = "fp32"


@dataclasses.dataclass(frozen=True, kw_only=True)
class _Timed:
    """The layers a whole-model profile timed: how they were found (`method`), the layers and their
    edges, the parameters several layers use, and the parameter names the layers cover."""

    method: str
    layers: list[Layer]
    edges: tuple
    shared: tuple
    planned: set[str]


def profile_model(ref: ModelRef, *, batch_size: int | None = None, device: str = "cpu", repeats: int = 10,
                  warmup: int = 2, granularity: str = "module", depth: int | None = None,
                  method: str = "auto", progress: Callable[[str], None] = _no_progress,
                  warn: Callable[[str], None] = _no_progress, memory: int | None = None, layerwise: bool = False,
                  reuse_identical: bool = False, precision: str = "fp32") -> Profile:
    """Profile the model `ref` names; `progress` receives one short line per unit of work,
    `warn` what the user should know about the result (a fallback, modules never called).
    `memory`: the profiler's budget in bytes (default: what the device has free): a model whose
    whole-model profiling would need more (`WHOLE_MODEL_FACTOR`), or any with `layerwise`, is
    profiled one layer's weights at a time (`profiler.layerwise`); `reuse_identical` times a layer
    identical to an earlier one only once. `precision`: what the layers compute in (autocast, weights
    fp32), and the floating dtype of the messages their outputs become (`pdtool.precision`)."""
    keep_freed_memory()  # as the workers do, so that the profile measures what they run
    if repeats < 1 or warmup < 0:
        raise ProfileError(f"repeats must be >= 1 and warmup >= 0 (got {repeats}, {warmup}); fix the flags")
    request = ProfileRequest(ref=ref, batch_size=batch_size, device=_device(device), repeats=repeats, warmup=warmup,
                             granularity=granularity, depth=depth, method=method, progress=progress, warn=warn,
                             reuse_identical=reuse_identical, precision=precision)
    from ..model.build import build_model

    waiting, on_meta = build_model({"spec": ref.spec, "kwargs": ref.kwargs}, ref.spec, 0, warn=warn)
    need = WHOLE_MODEL_FACTOR * sum(p.numel() * p.element_size() for p in waiting.module.parameters())
    budget = memory if memory is not None else _free_bytes(request.device)
    if layerwise or reuse_identical or need > budget:
        if not on_meta:
            raise ProfileError(f"{ref.spec}: its factory cannot build it with parameters on the meta device, so it "
                               "cannot be profiled one layer at a time; profile it whole (without --layerwise, with "
                               "a --memory it fits)")
        if method not in ("auto",) + TRACERS:
            raise ProfileError(f"--method {method} times leaf modules of a whole model; profiling one layer at a time "
                               "needs a traced graph: use --method auto, fx or export")
        if not (layerwise or reuse_identical):
            warn(f"profiling the whole of {ref.spec} would need about {format_bytes(need)}, more than the "
                 f"{format_bytes(budget)} budget (--memory): profiling it one layer's weights at a time")
        return dataclasses.replace(_profile_layerwise(request, waiting), precision=precision)
    del waiting
    return _profile_whole(request)


def _profile_whole(request: ProfileRequest) -> Profile:
    """The model built whole and timed: whole training steps before and after its layers (a machine
    whose speed drifts while the layers are timed moves both sides of `layer_sum_over_step`
    alike), its layers (`_timed_layers`), then the optimizer step, all-reduce work, messages, data."""
    ref, dev, repeats, warmup, precision = request.ref, request.device, request.repeats, request.warmup, request.precision
    bundle = load_model(ref, given=True)  # the caller names the model (pd profile -m): consented
    size, inputs, target = bundle.batch(request.batch_size, ref.spec)
    module = bundle.module.to(dev).train()
    inputs = tuple(t.to(dev) for t in inputs)
    target = tree_map(lambda t: t.to(dev) if isinstance(t, torch.Tensor) else t, target)
    _check_runs(ref.spec, module, inputs, target, bundle.loss_fn)
    clock = Clock(dev)
    with computing_in(dev, precision):
        early = step_samples(module, inputs, target, bundle.loss_fn, repeats=(repeats + 1) // 2, warmup=warmup,
                             clock=clock)
    timed = _timed_layers(request, module, inputs, target, bundle.loss_fn, clock)
    _warn_unused(module, timed.planned, request.warn)
    request.progress("timing whole training steps, optimizer steps, all-reduce work, messages and data")
    with computing_in(dev, precision):
        late = step_samples(module, inputs, target, bundle.loss_fn, repeats=repeats, warmup=warmup, clock=clock)
    step_ms, step_spread = summarize(early + late)
    update_ms = measure_update(module, inputs, target, bundle.loss_fn, repeats=repeats, warmup=warmup, clock=clock)
    return Profile(
        model=ref, batch_size=size, inputs=tensor_specs(inputs), device=_device_name(dev),
        torch_version=torch.__version__, fingerprint=fingerprint(module), method=timed.method, shared=timed.shared,
        split="graph" if timed.method in TRACERS else "children" if isinstance(module, nn.Sequential) else "none",
        granularity=request.granularity, depth=request.depth, repeats=repeats, step_ms=step_ms,
        step_ms_spread=step_spread, layers=tuple(timed.layers), edges=tuple(timed.edges), update_ms=update_ms,
        precision=precision, **_memory_costs(module, lambda: bundle.batch(size, ref.spec), dev, repeats, warmup, clock),
        classes=module_classes(module, [layer.name for layer in timed.layers]),
    )


def _timed_layers(request: ProfileRequest, module: nn.Module, inputs, target, loss_fn, clock: Clock) -> _Timed:
    """The layers of one traced graph (torch.fx, then torch.export, or the one `--method` names),
    each timed; where no tracer captures the model (`--method auto`), its leaf modules in execution
    order (`modules`), with a warning saying what that allows."""
    ref, dev, method = request.ref, request.device, request.method
    reasons = {}
    for tracer in (TRACERS if method == "auto" else (method,) if method in TRACERS else ()):
        try:
            graph = capture(module, inputs, tracer, request.granularity, request.depth)
        except Untraceable as exc:
            reasons[tracer] = str(exc)
            continue
        try:
            with computing_in(dev, request.precision):
                layers, edges = _profile_graph(graph, module, inputs, request.repeats, request.warmup, clock,
                                               request.progress)
        except ProfileError:
            raise
        except Exception as exc:  # a graph that captured but does not run layer by layer
            text = str(exc).strip()
            raise ProfileError(f"{ref.spec}: timing the layers of its torch.{tracer} graph failed with "
                               f"{type(exc).__name__}: {text.splitlines()[0] if text else ''}; profile it with "
                               "--method modules (and please report it)") from None
        return _Timed(method=tracer, layers=layers, edges=edges, shared=tuple(sorted(graph.shared.items())),
                      planned={name for group in graph.groups for name in group.params})
    if method in TRACERS:
        verb = "trace" if method == "fx" else "export"
        raise ProfileError(f"{ref.spec}: torch.{method} cannot {verb} this model ({reasons[method]}); use "
                           "--method auto (which also tries the other tracer, then leaf modules)")
    if method == "auto":
        request.warn(f"neither torch.fx ({reasons['fx']}) nor torch.export ({reasons['export']}) captures {ref.spec}; "
                     "profiling its leaf modules in execution order: plans of it train as one stage (data parallel)"
                     + (", or split between the children of its nn.Sequential" if isinstance(module, nn.Sequential)
                        else ""))
    with computing_in(dev, request.precision):
        found = measure_modules(module, inputs, target, loss_fn, depth=request.depth, repeats=request.repeats,
                                warmup=request.warmup, clock=clock, progress=request.progress,
                                fold=request.granularity == "module")
    layers = [_layer(i, name, kind, cost, pb, ops) for i, (name, kind, cost, pb, ops) in
              enumerate(zip(found.names, found.kinds, found.costs, found.param_bytes, found.ops))]
    names = _parameter_names(module)
    return _Timed(method="modules", layers=layers, edges=found.edges,
                  shared=tuple(sorted((names[id(p)], layers_) for p, layers_ in found.shared if id(p) in names)),
                  planned={names[id(p)] for owned in found.params for p in owned if id(p) in names})


def _profile_layerwise(request: ProfileRequest, bundle) -> Profile:
    """`profile_model` one layer's weights at a time (`profiler.layerwise`)."""
    ref, dev, repeats, warmup, precision = request.ref, request.device, request.repeats, request.warmup, request.precision
    batch_size, granularity, depth, method = request.batch_size, request.granularity, request.depth, request.method
    progress, warn, reuse = request.progress, request.warn, request.reuse_identical
    from ..model.capture import all_on_meta
    from .layerwise import measure_layerwise

    size, inputs, target = bundle.batch(batch_size, ref.spec)
    module = bundle.module.train()
    clock = Clock(dev)
    reasons = {}
    for tracer in (TRACERS if method == "auto" else (method,)):
        try:
            with all_on_meta(module) as standins:
                graph = capture(module, tuple(t.to("meta") for t in inputs), tracer, granularity, depth)
        except Untraceable as exc:
            reasons[tracer] = str(exc)
            continue
        break
    else:
        raise ProfileError(f"{ref.spec}: no tracer captures it ({'; '.join(f'{k}: {v}' for k, v in reasons.items())}), "
                           "so it cannot be profiled one layer at a time; profile it whole (--method modules)")
    try:
        with computing_in(dev, precision):
            costs, same_as, update_ms = measure_layerwise(
                graph, module, standins, tuple(t.to(dev) for t in inputs), 0, repeats=repeats, warmup=warmup,
                clock=clock, reuse=reuse, progress=progress, device=dev)
    except Exception as exc:  # noqa: BLE001 - as _profile_graph: one line
        text = str(exc).strip()
        raise ProfileError(f"{ref.spec}: timing its torch.{tracer} graph one layer at a time failed with "
                           f"{type(exc).__name__}: {text.splitlines()[0] if text else ''}; profile it whole "
                           "(without --layerwise, with a --memory it fits; and please report it)") from None
    if len(costs) != len(graph.groups):
        raise ProfileError(f"the traced model ran {len(costs)} of its {len(graph.groups)} layers; profile it whole")
    layers = [dataclasses.replace(_layer(i, g.name, g.kind, cost, _bytes(module, g.params), g.nodes),
                                  same_as=same_as.get(i))
              for i, (g, cost) in enumerate(zip(graph.groups, costs))]
    planned = {name for group in graph.groups for name in group.params}
    _warn_unused(module, planned, warn)
    progress("timing all-reduce work, messages and data")
    return Profile(
        model=ref, batch_size=size, inputs=tensor_specs(inputs), device=_device_name(dev),
        torch_version=torch.__version__, fingerprint=fingerprint(module), method=tracer,
        shared=tuple(sorted(graph.shared.items())), split="graph", granularity=granularity, depth=depth,
        repeats=repeats, step_ms=sum(layer.fwd_ms + layer.bwd_ms for layer in layers), step_ms_spread=0.0,
        layers=tuple(layers), edges=tuple(graph.edges), update_ms=update_ms, measured="layers",
        **_memory_costs(module, lambda: bundle.batch(size, ref.spec), dev, repeats, warmup, clock),
        classes=module_classes(module, [layer.name for layer in layers]),
    )


def _free_bytes(dev: torch.device) -> int:
    """What the device has free: CUDA's free memory, or the host's MemAvailable."""
    if dev.type == "cuda":
        return torch.cuda.mem_get_info(dev)[0]
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 2 ** 62  # unknown: whole-model profiling, as before


def _profile_graph(graph: LayerGraph, module, inputs, repeats, warmup, clock, progress):
    total = len(graph.groups)
    costs = measure_split(graph.split(), inputs, repeats=repeats, warmup=warmup, clock=clock, progress=progress)
    if len(costs) != total:
        raise ProfileError(f"the traced model ran {len(costs)} of its {total} layers; use --method modules")
    layers = [_layer(i, g.name, g.kind, cost, _bytes(module, g.params), g.nodes)
              for i, (g, cost) in enumerate(zip(graph.groups, costs))]
    return layers, graph.edges


def module_classes(module: nn.Module, names: list[str]) -> dict[str, str]:
    """The class name of every module of `module` that holds one of the layers `names` (each
    qualified name's proper prefixes that name a submodule): `model.layers.4` -> LlamaDecoderLayer."""
    modules = dict(module.named_modules())
    found = {}
    for name in names:
        parts = name.split(".")
        for end in range(1, len(parts)):
            prefix = ".".join(parts[:end])
            if prefix in modules and prefix not in found:
                found[prefix] = type(modules[prefix]).__name__
    return found


def _parameter_names(module: nn.Module) -> dict[int, str]:
    names: dict[int, str] = {}
    for name, p in module.named_parameters():
        names.setdefault(id(p), name)
    return names


def _warn_unused(module: nn.Module, planned: set[str], warn) -> None:
    """Name the modules whose parameters no layer used with the sample (a branch the sample did
    not take, a module never called): the planner does not see them, and no stage holds them."""
    missing = [name for name, _ in module.named_parameters() if name not in planned]
    owners = sorted({name.rpartition(".")[0] or name for name in missing})
    if owners:
        shown = ", ".join(owners[:8]) + (f" and {len(owners) - 8} more" if len(owners) > 8 else "")
        warn(f"{len(owners)} module(s) never ran with the sample input, so their parameters are in no layer and no "
             f"stage trains them: {shown}; give the factory a sample that runs every branch, if they should train")


def _bytes(module: nn.Module, names: tuple[str, ...]) -> int:
    return sum(module.get_parameter(n).numel() * module.get_parameter(n).element_size() for n in names)


def _layer(index: int, name: str, kind: str, cost: LayerCost, param_bytes: int, ops) -> Layer:
    return Layer(id=index, name=name, kind=kind, fwd_ms=cost.fwd_ms, bwd_ms=cost.bwd_ms,
                 fwd_ms_spread=cost.fwd_ms_spread, bwd_ms_spread=cost.bwd_ms_spread,
                 act_bytes=cost.act_bytes, param_bytes=param_bytes, ops=tuple(ops), wgrad_ms=cost.wgrad_ms,
                 saved_bytes=cost.saved_bytes)


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


def _memory_costs(module: nn.Module, make_batch, dev: torch.device, repeats: int, warmup: int, clock: Clock) -> dict:
    """The profile's costs beside the layers' compute: a worker's own work in an all-reduce, a
    weight version's copy, a message's host copies (none on GPUs: NCCL moves them device to
    device), making a minibatch."""
    return dict(reduce_ms=measure_reduce(module, repeats=repeats, warmup=warmup, clock=clock),
                copy_ms_per_mib=measure_copy(module, repeats=repeats, warmup=warmup, clock=clock),
                message_ms_per_mib=0.0 if dev.type == "cuda" else measure_message(repeats=repeats, warmup=warmup),
                data_ms=measure_data(make_batch, repeats=repeats, warmup=warmup, clock=clock))


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
