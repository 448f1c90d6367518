"""The first minibatch through a plan's stages before any worker starts: the shapes of every message.

`described` completes a `model.capture.Capture` with its message specs by running the first
minibatch of the data through every stage and the loss function on fake tensors (torch's
`FakeTensorMode`: shapes and dtypes only, no memory, no compute, whatever the model's size).
Where fake tensors cannot follow the model (values that decide shapes, an op without a fake
kernel), it runs for real, one stage's parameters at a time (`model.build.materialize`, then
back to `meta`), so no process holds the whole model for it either. An error of the model on
the data is one `LaunchError` line.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable

from torch import nn

import torch

from ..errors import LaunchError, PdtoolError
from .build import materialize, to_meta
from .capture import Capture, Spec, describe, model_modules, names_of, stage_module
from .layergraph import quiet
from .stages import OUTPUT

_CPU = torch.device("cpu")


def described(stages, bundle, inputs, target, data: str, seed: int, on_meta: bool) -> Capture:
    """The `Capture` of `stages` (`model.capture.cut` of `bundle`'s model) with its message
    specs, from the first minibatch (`inputs`, `target`) of `--data data`."""
    modules = model_modules(bundle)
    capture = describe(stages, bundle.module, modules=modules)
    model = bundle.module
    try:
        with quiet("torch._subclasses.fake_tensor", "torch.fx.experimental.symbolic_shapes"):
            specs, loss = check_data(capture, lambda: [stage_module(info, model, _CPU, stages, modules)
                                                         for info in capture.stages],
                                     model, inputs, target, bundle.loss_fn)
    except Exception:  # noqa: BLE001 - fake tensors cannot follow this model: the real run says what is wrong
        specs, loss = _run_real(capture=capture, stages=stages, bundle=bundle, inputs=inputs, target=target,
                                data=data, seed=seed, on_meta=on_meta)
    if not (isinstance(loss, torch.Tensor) and loss.dim() == 0):
        raise LaunchError(f"the loss function returned {type(loss).__name__} for --data {data}, not a scalar tensor; "
                          "fix the model factory's loss function")
    return dataclasses.replace(capture, specs=specs)


def _run_real(*, capture: Capture, stages, bundle, inputs, target, data: str, seed: int, on_meta: bool):
    """The same for real, holding one stage's parameters at a time."""
    shapes = ", ".join(f"{tuple(t.shape)} {str(t.dtype).removeprefix('torch.')}" for t in inputs
                       if isinstance(t, torch.Tensor))
    model = bundle.module
    specs = []
    try:
        with torch.no_grad():
            values = dict(zip(capture.stages[0].inputs, inputs))
            for info in capture.stages:
                made = [n for n in names_of(info) if on_meta and model.get_parameter(n).device.type == "meta"]
                materialize(model, made, seed)
                values = stage_module(info, model, _CPU, stages, model_modules(bundle))(values)
                to_meta(model, made)
                if info.index < len(capture.stages) - 1:
                    specs.append(tuple((n, tuple(values[n].shape), str(values[n].dtype).removeprefix("torch."))
                                       for n in info.outputs))
            loss = bundle.loss_fn(values[OUTPUT], target)
    except PdtoolError:
        raise
    except Exception as exc:
        text = str(exc).strip()
        first = text.splitlines()[0] if text else ""
        raise LaunchError(f"the first minibatch of --data {data} (inputs {shapes}) does not fit the model: "
                          f"{type(exc).__name__}: {first}; give data of the shapes the model was profiled with "
                          "(the profile's inputs), or profile the model again") from None
    specs.append((("target", tuple(target.shape), str(target.dtype).removeprefix("torch.")),))
    return tuple(specs), loss


def check_data(capture: Capture, stages_on: Callable[[], list[nn.Module]], model: nn.Module, inputs, target,
               loss_fn) -> tuple[tuple[tuple[Spec, ...], ...], Any]:
    """Run `inputs` through every stage and `loss_fn` on fake tensors (no memory, no compute):
    (the message specs per boundary and the target's, the loss). `stages_on()` gives the stage
    modules bound to `model` on the CPU. Raises what the model raises. The inputs' sizes are
    static (a symbol for each would cost its source location: 0.4 s of the first call in a
    process instead of 0.06 s). A model whose sizes the data decides (`nonzero`, `.item()`: a
    mixture of experts' routing) runs again with a shape environment for those, which imports
    torch._dynamo (2.7 s of a core, which `lazy_dynamo` spares every other launch)."""
    from torch._subclasses.fake_tensor import DataDependentOutputException, DynamicOutputShapeException

    try:
        return _fake_run(capture, stages_on, inputs, target, loss_fn, dynamic=False)
    except (DataDependentOutputException, DynamicOutputShapeException):
        return _fake_run(capture, stages_on, inputs, target, loss_fn, dynamic=True)


def _fake_run(capture: Capture, stages_on, inputs, target, loss_fn, dynamic: bool):
    from torch._subclasses.fake_tensor import FakeTensorMode

    shapes = {}
    if dynamic:
        from torch.fx.experimental.symbolic_shapes import ShapeEnv

        shapes = {"shape_env": ShapeEnv()}
    modules = stages_on()
    mode = FakeTensorMode(allow_non_fake_inputs=True, static_shapes=True, **shapes)
    specs = []
    with mode, torch.no_grad():
        values = dict(zip(capture.stages[0].inputs, (_fake(t) for t in inputs)))
        for info, module in zip(capture.stages, modules):
            tensors = {own: _fake(t) for own, t in
                       list(module.named_parameters()) + list(module.named_buffers())}
            values = torch.func.functional_call(module, tensors, (values,))
            if info.index < len(capture.stages) - 1:
                specs.append(tuple((n, tuple(int(d) for d in values[n].shape), _dtype(values[n].dtype))
                                   for n in info.outputs))
        loss = loss_fn(values[OUTPUT], _fake(target) if isinstance(target, torch.Tensor) else target)
    specs.append(((("target", tuple(target.shape), _dtype(target.dtype)),) if isinstance(target, torch.Tensor)
                  else ()))
    return tuple(specs), loss


def _fake(tensor: torch.Tensor):
    """Inside the mode: a fake CPU tensor of `tensor`'s shape, strides and dtype (`from_tensor` would
    import torch._dynamo for a name of it)."""
    return torch.empty_strided(tensor.shape, tensor.stride(), dtype=tensor.dtype, device="cpu")


def _dtype(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")
