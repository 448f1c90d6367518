"""The capture of a plan's stages: made once (by `pd train`'s launcher) on `meta`, loaded by each worker.

`capture` builds nothing real: the model waits on `meta` (`model.build`), the tracer that made
the profile captures it with every tensor on `meta`, and `model.stages` cuts the graph into the
plan's stages. The result, a `Capture`, is plain data that crosses to the workers: per stage a
`StageInfo` (its boundaries, the whole-model names of its parameters and buffers, its tied
weights, its program as `model.program` text) and the shapes and dtypes of every message
(`specs`, found by running the first minibatch through the stages on fake tensors: `check_data`).

A worker calls `own_stage`: its model built on `meta` again, only its stage's parameters given
values by the rule (or taken from the factory with `--init factory`), its program decoded and
bound to its own model's modules and tensors, everything else left on `meta` or released.
"""
from __future__ import annotations

import contextlib
import dataclasses
import json
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import fx, nn

from ..errors import LaunchError
from .build import materialize
from .program import Refused, Unwritable, attribute_targets, check, decode, encode
from .stages import Stage, _Rebuilt, plan_stages, sample_inputs

Spec = tuple[str, tuple[int, ...], str]
"""A message tensor: (name, shape, dtype name)."""


@dataclass(frozen=True, kw_only=True)
class StageInfo:
    """What every worker knows of stage `index` (see `model.stages.Stage`); `program` is its
    graph as `model.program` text (None: the worker cuts the stage itself); `out_spec` the
    model output's pytree spec (last stage of an exported graph), as `treespec_dumps` text."""

    index: int
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    param_names: dict[str, str]
    buffer_names: dict[str, str]
    layers: tuple[int, ...]
    tied: dict[str, tuple[int, ...]] = field(default_factory=dict)
    shared_buffers: dict[str, tuple[int, ...]] = field(default_factory=dict)
    program: str | None = None
    out_spec: str | None = None


@dataclass(frozen=True)
class Capture:
    """A plan's stages as the launcher captured them, and per boundary (then the target) the
    tensors of its messages."""

    stages: tuple[StageInfo, ...]
    specs: tuple[tuple[Spec, ...], ...] = ()
    parameters: tuple[tuple[str, tuple[int, ...]], ...] = ()  # (whole-model name, shape) of every stage parameter
    dtypes: dict[str, str] = field(default_factory=dict)  # whole-model name -> torch dtype name, parameters and buffers

    def to_json(self) -> str:
        """The capture as JSON text (it crosses machines through the job's store)."""
        return json.dumps(dataclasses.asdict(self), separators=(",", ":"))

    @classmethod
    def from_json(cls, text: str) -> "Capture":
        data = json.loads(text)
        stages = tuple(StageInfo(**dict(info, inputs=tuple(info["inputs"]), outputs=tuple(info["outputs"]),
                                        layers=tuple(info["layers"]),
                                        tied={k: tuple(v) for k, v in info["tied"].items()},
                                        shared_buffers={k: tuple(v) for k, v in info["shared_buffers"].items()}))
                       for info in data["stages"])
        specs = tuple(tuple((name, tuple(shape), dtype) for name, shape, dtype in boundary) for boundary in data["specs"])
        return cls(stages, specs, tuple((name, tuple(shape)) for name, shape in data["parameters"]),
                   _dtype_names(data.get("dtypes", {})))


def _dtype_names(dtypes: Any) -> dict[str, str]:
    """`dtypes` (name -> torch dtype name) as read from JSON; `ValueError` unless every value
    names one of torch's dtypes (an entry is data: a name of anything else in torch is refused)."""
    known = {name for name, value in vars(torch).items() if isinstance(value, torch.dtype)}
    if not isinstance(dtypes, dict):
        raise ValueError("capture: dtypes is not an object of name -> dtype")
    for name, dtype in dtypes.items():
        if not isinstance(dtype, str) or dtype not in known:
            raise ValueError(f"capture: {name}'s dtype {dtype!r} is not a torch dtype")
    return dict(dtypes)


@contextlib.contextmanager
def all_on_meta(model: nn.Module):
    """While it lasts, every parameter and buffer of `model` is a `meta` tensor (a tracer then
    sees one device everywhere); the real ones come back afterwards. Yields {id(stand-in): the
    real tensor it stands for}."""
    swapped: list[tuple[dict, str, Any]] = []
    copies: dict[int, torch.Tensor] = {}
    for module in model.modules():
        for table in (module._parameters, module._buffers):
            for name, tensor in table.items():
                if tensor is None or tensor.device.type == "meta":
                    continue
                if id(tensor) not in copies:
                    meta = torch.empty_like(tensor, device="meta")
                    copies[id(tensor)] = nn.Parameter(meta, tensor.requires_grad) if isinstance(tensor, nn.Parameter) \
                        else meta
                swapped.append((table, name, tensor))
                table[name] = copies[id(tensor)]
    try:
        yield {id(copies[id(tensor)]): tensor for _, _, tensor in swapped}
    finally:
        for table, name, tensor in swapped:
            table[name] = tensor


def cut(plan, bundle) -> list[Stage]:
    """The plan's stages of `bundle`'s model, captured with every tensor on `meta` (the stages'
    tensors are those `meta` stand-ins)."""
    inputs = sample_inputs(bundle, plan)
    with all_on_meta(bundle.module):
        return plan_stages(plan, bundle.module, tuple(t.to("meta") for t in inputs))


def model_modules(bundle) -> tuple[str, ...]:
    """The consented model's modules, among those imported: its factory's (`ModelBundle.origin`)
    and those its submodules' classes come from. A stage program may call the functions defined
    in them (`model.program.Allowed`), and the workers' forkserver imports them (`forked.warm`)."""
    import sys

    named = {type(module).__module__ for module in bundle.module.modules()} | {getattr(bundle, "origin", "")}
    return tuple(sorted(m for m in named if m and m in sys.modules))


def describe(stages: list[Stage], model: nn.Module, specs=(), modules=()) -> Capture:
    """The plain-data `Capture` of `cut`'s stages (each program encoded, when it can be and it
    calls only what a program may: `model.program.Allowed` with the model's `modules`; else
    the stage's worker cuts the model itself)."""
    infos = []
    for stage in stages:
        module, out_spec = stage.module, None
        if isinstance(module, _Rebuilt):
            from torch.utils._pytree import treespec_dumps

            module, out_spec = module.graph, treespec_dumps(module.out_spec.value)
        program = None
        if isinstance(module, fx.GraphModule):
            try:
                program = encode(module.graph)
                check(program, modules, resolve=True)
            except (Unwritable, Refused):
                program = None
        infos.append(
            StageInfo(index=stage.index, inputs=stage.inputs, outputs=stage.outputs,
                      param_names=dict(stage.param_names), buffer_names=dict(stage.buffer_names), layers=stage.layers,
                      tied=dict(stage.tied), shared_buffers=dict(stage.shared_buffers), program=program,
                      out_spec=out_spec)
        )
    shapes = {stage.param_names[n]: tuple(p.shape) for stage in stages for n, p in stage.module.named_parameters()}
    dtypes = {stage.param_names[n]: str(p.dtype).removeprefix("torch.")
              for stage in stages for n, p in stage.module.named_parameters()}
    dtypes.update({stage.buffer_names[n]: str(b.dtype).removeprefix("torch.")
                   for stage in stages for n, b in stage.module.named_buffers() if n in stage.buffer_names})
    return Capture(tuple(infos), tuple(specs), tuple(shapes.items()), dtypes)


def names_of(info: StageInfo) -> list[str]:
    """The whole-model names of a stage's parameters, each once."""
    return list(dict.fromkeys(info.param_names.values()))


def bind(graph: fx.Graph, model: nn.Module, index: int, device: torch.device | None,
         out_spec: str | None = None) -> nn.Module:
    """A stage module running `graph` on `model`'s own modules and tensors (as they are now);
    the graph's `meta` devices become `device`."""
    if device is not None:
        retarget(graph, device)
    root = {}
    for target in attribute_targets(graph):
        root[target] = _attribute(model, target)
    module: nn.Module = fx.GraphModule(root, graph, class_name=f"Stage{index}")
    if out_spec is not None:
        from torch.utils._pytree import treespec_loads

        module = _Rebuilt(module, treespec_loads(out_spec))
    return module


def retarget(graph: fx.Graph, device: torch.device) -> None:
    """The devices a capture wrote into `graph`'s ops (torch.export's `arange(device=...)`, its
    device checks: `meta`, or `cpu` for a model traced on fake CPU tensors,
    `layergraph._on_the_cpu`) become `device`, in place."""
    for node in graph.nodes:
        node.args = _on_device(node.args, device)
        node.kwargs = _on_device(node.kwargs, device)


def _on_device(value, device: torch.device):
    if isinstance(value, torch.device) and value.type in ("meta", "cpu"):  # captured on meta, or on fake CPU tensors
        return device
    if isinstance(value, (tuple, list)):
        return type(value)(_on_device(v, device) for v in value)
    if isinstance(value, dict):
        return {k: _on_device(v, device) for k, v in value.items()}
    return value


def _attribute(model: nn.Module, target: str):
    value = model
    for part in target.split("."):
        if not hasattr(value, part):
            raise LaunchError(f"a stage program reads {target}, which the model lacks (a value the tracer made up, "
                              "not a parameter or buffer); please report it")
        value = getattr(value, part)
    return value


def own_stage(capture: Capture, index: int, *, plan, bundle, seed: int, device: torch.device | None = None,
              on_meta: bool = True, weights=None, release: bool = True) -> Stage:
    """Stage `index` of `capture` on this process's `bundle` (its model built by `model.build`):
    its parameters given values by the rule, or read from `weights` (`model.weights.WeightFiles`:
    this stage's tensors only), its program bound to the model, the rest of the model's tensors
    released (`release`; a worker of several stages builds them all, then releases the rest once:
    `release_others`). `plan` cuts the stage here when its program is missing."""
    info = capture.stages[index]
    model = bundle.module
    names = names_of(info)
    values = weights.read(names + list(dict.fromkeys(info.buffer_names.values()))) if weights is not None else {}
    if on_meta:
        materialize(model, names, seed, values)
    with torch.no_grad():
        for name, tensor in values.items():  # the stage's buffers; its parameters too when built whole
            if on_meta and name in names:
                continue
            target = _attribute(model, name)
            if target.device.type != "meta":
                target.copy_(tensor)
    # without a program (a model split by module selection, a graph the format cannot write) it is cut here
    module = stage_module(info, model, device, None if info.program is not None else cut(plan, bundle),
                          model_modules(bundle))
    stage = Stage(index=index, module=module, inputs=info.inputs, outputs=info.outputs, param_names={},
                  buffer_names={}, layers=info.layers, tied=dict(info.tied), shared_buffers=dict(info.shared_buffers))
    _names(model, stage)
    if release:
        _release(model, stage.module)
    return stage


def release_others(model: nn.Module, stages: list[Stage]) -> None:
    """Every real tensor of `model` that none of `stages` holds goes to `meta` (a worker of several stages)."""
    keep = nn.ModuleList([stage.module for stage in stages])
    _release(model, keep)


def own_copies(stages: list[Stage]) -> None:
    """A worker of several stages: a parameter that two of its stages hold (a tied weight, e.g. the
    embedding of stage 0 and the output head of the last on worker 0 of a V placement) becomes
    one copy per stage, as on workers of one stage each, so that every stage steps its own copy
    (`runtime.worker.tied` adds the copies' gradients before the steps) and saves its own shard."""
    seen: set[int] = set()
    for stage in stages:
        for name, p in list(stage.module.named_parameters(remove_duplicate=False)):
            if id(p) in seen:
                owner_name, _, attribute = name.rpartition(".")
                holder = stage.module.get_submodule(owner_name) if owner_name else stage.module
                setattr(holder, attribute, nn.Parameter(p.detach().clone(), requires_grad=p.requires_grad))
        seen.update(id(p) for p in stage.module.parameters())


def stage_module(info: StageInfo, model: nn.Module, device: torch.device | None, cut_stages=None,
                 modules=()) -> nn.Module:
    """Stage `info.index` bound to `model` as it is now: its program decoded (calling only what
    `model.program.Allowed` lets it, with the model's `modules`), else the graph of
    `cut_stages[info.index]` (`cut`), else that stage module itself (split by module selection)."""
    if info.program is not None:
        return bind(decode(info.program, modules=modules), model, info.index, device, info.out_spec)
    module = cut_stages[info.index].module
    graph_module = module.graph if isinstance(module, _Rebuilt) else module
    if isinstance(graph_module, fx.GraphModule):
        return bind(graph_module.graph, model, info.index, device, info.out_spec)
    return module


def _names(model: nn.Module, stage: Stage) -> None:
    """The stage's whole-model names of its parameters and buffers, by identity."""
    params = {}
    for name, p in model.named_parameters():
        params.setdefault(id(p), name)
    buffers = {}
    for name, b in model.named_buffers():
        buffers.setdefault(id(b), name)
    for name, p in stage.module.named_parameters():
        if id(p) not in params or p.device.type == "meta":
            raise LaunchError(f"stage {stage.index}'s parameter {name} is not one of the model's (or has no value); "
                              "please report it")
        stage.param_names[name] = params[id(p)]
    stage.buffer_names.update({name: buffers[id(b)] for name, b in stage.module.named_buffers() if id(b) in buffers})


def _release(model: nn.Module, keep: nn.Module | None, buffers: bool = True) -> None:
    """Every real parameter (and buffer) of `model` that stage module `keep` does not hold goes
    to `meta`."""
    kept = {id(t) for t in keep.parameters()} | {id(t) for t in keep.buffers()} if keep is not None else set()
    for module in model.modules():
        for table in (module._parameters, module._buffers) if buffers else (module._parameters,):
            for name, tensor in list(table.items()):
                if tensor is not None and tensor.device.type != "meta" and id(tensor) not in kept:
                    meta = torch.empty_like(tensor, device="meta")
                    table[name] = nn.Parameter(meta, tensor.requires_grad) if isinstance(tensor, nn.Parameter) else meta
