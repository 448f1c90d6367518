"""A model built without its weights, and the one rule that gives any part of it its initial values.

No process of pdtool holds a whole model it does not need (docs/big-models.md, "Models bigger than one
worker"). The model's factory runs once in each process, but its parameters never take memory:

- **Parameters on `meta`.** While the factory runs, every parameter registered by a module that
  can initialise it again (a module with `reset_parameters()`, or any module of a Hugging Face
  model) moves to the `meta` device the moment it is registered (torch's parameter registration
  hook), so the model costs no memory and its graph can be captured on fake tensors. Buffers
  (attention masks, rotary frequencies, norm statistics) stay as the factory computed them: they
  are small, and a model built wholly on `meta` would lose those values. A parameter of a module
  with no way to initialise it again (a custom `nn.Parameter` on a module without
  `reset_parameters`) stays real, with the value the factory gave it.
- **The rule.** Parameter `name` (its first whole-model name) gets its initial value, on the CPU,
  from torch's random generator seeded with `(seed, name)`, by the init methods of the module that
  owns it and then of each module above it, children first as Hugging Face applies them: each
  module's `reset_parameters()`, then the `_init_weights(module)` of the Hugging Face model it
  belongs to. While one parameter is initialised every other parameter of the model is on `meta`,
  where init methods draw nothing. So a parameter's value depends on the seed, its name and its
  modules' init code only: the same under every plan, in every worker, on CPU and GPU, and in
  the one-process reference `initial_model`. What a module's `__init__` does to a parameter after
  creating it is not replayed; a parameter that no init method sets is one `ModelError` line
  (before any worker starts: `unset_parameters` checks on `meta`).
- **Fallback.** A factory that cannot run with parameters on `meta` (it reads a parameter's
  values, or loads weights itself) is built whole, for real, in every process, with the values
  it gives (`pd train --init factory` asks for that).
"""
from __future__ import annotations

import contextlib
import hashlib
import math
import sys
from typing import Callable, Iterable, Mapping

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from ..errors import ModelError
from ..artifacts.profile import ModelRef
from .spec import ModelBundle, file_model

def _reinitialisable(module: nn.Module) -> bool:
    """Whether the rule can give `module`'s own parameters their values again."""
    return callable(getattr(module, "reset_parameters", None)) or type(module).__module__.startswith("transformers.")


def _to_meta(module: nn.Module, name: str, param):
    if param is None or param.device.type == "meta" or not _reinitialisable(module):
        return None
    return nn.Parameter(torch.empty_like(param, device="meta"), requires_grad=param.requires_grad)


def _written(func, args, kwargs) -> torch.Tensor | None:
    """The tensor an in-place torch function writes (`x.normal_()`, `init.zeros_(x)`, `x[i] = v`):
    its first argument; None for any other function."""
    name = getattr(func, "__name__", "")
    if not ((name.endswith("_") and not name.endswith("__")) or name == "__setitem__"):
        return None
    first = args[0] if args else kwargs.get("tensor", kwargs.get("self"))
    return first if isinstance(first, torch.Tensor) else None


class _SkipMetaInit(TorchFunctionMode):
    """In-place ops on `meta` tensors (the init methods a factory runs on parameters waiting
    there) return at once: they compute nothing, and their meta kernels would import
    torch._dynamo (about a second) before `pd train` could start its workers' forkserver."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        written = _written(func, args, kwargs)
        if written is not None and written.device.type == "meta":
            return None if getattr(func, "__name__", "") == "__setitem__" else written
        return func(*args, **kwargs)


@contextlib.contextmanager
def parameters_on_meta():
    """While it lasts, parameters registered by re-initialisable modules move to `meta`."""
    handle = nn.modules.module.register_module_parameter_registration_hook(_to_meta)
    try:
        with _SkipMetaInit():
            yield
    finally:
        handle.remove()


def build_model(model: dict, override: str | None, seed: int, init: str = "rule",
                warn: Callable[[str], None] = lambda message: None) -> tuple[ModelBundle, bool]:
    """The model a plan names (`spec.file_model`), its factory called after `torch.manual_seed(seed)`:
    (bundle, whether its parameters wait on `meta` for the rule). With `init="factory"`, or
    when the factory fails with parameters on `meta` (then `warn` says so), the whole model
    is built for real."""
    if init == "rule":
        torch.manual_seed(seed)
        try:
            with parameters_on_meta():
                return file_model(model, override), True
        except ModelError as exc:
            torch.manual_seed(seed)
            bundle = file_model(model, override)  # fails again (the same line) if it is not about meta
            warn(f"the model's factory cannot run with its parameters on the meta device ({exc}); every process "
                 "builds the whole model with the factory's own values (as --init factory does)")
            return bundle, False
    torch.manual_seed(seed)
    return file_model(model, override), False


def seed_of(seed: int, name: str) -> int:
    """The generator seed of parameter `name` under run seed `seed`."""
    return int.from_bytes(hashlib.sha256(f"{seed}/{name}".encode()).digest()[:8], "little") & (2 ** 63 - 1)


def waiting(model: nn.Module) -> list[str]:
    """The (first) names of the model's parameters still on `meta`, in model order."""
    return [name for name, p in model.named_parameters() if p.device.type == "meta"]


class _Slots:
    """Every place the model holds each parameter (a tied one is in several modules)."""

    def __init__(self, model: nn.Module):
        self.model = model
        self.where: dict[int, list[tuple[nn.Module, str]]] = {}
        for module in model.modules():
            for attr, p in module._parameters.items():
                if p is not None:
                    self.where.setdefault(id(p), []).append((module, attr))
        self.hf = _hf_roots(model)

    def put(self, old: nn.Parameter, new: nn.Parameter) -> None:
        for module, attr in self.where.pop(id(old)):
            module._parameters[attr] = new
            self.where.setdefault(id(new), []).append((module, attr))

    def inits(self, name: str) -> list[Callable[[], None]]:
        """The init methods that set parameter `name`: its module's, then each one above it."""
        parts = name.split(".")[:-1]
        found = []
        for depth in range(len(parts), -1, -1):
            module = self.model.get_submodule(".".join(parts[:depth]))
            reset = getattr(module, "reset_parameters", None)
            if callable(reset):
                found.append(reset)
            hf = self.hf.get(id(module))
            if hf is not None:
                found.append(lambda hf=hf, module=module: hf._init_weights(module))
        return found


def _hf_roots(model: nn.Module) -> dict[int, nn.Module]:
    """For each module inside a Hugging Face model, that model (the innermost one)."""
    transformers = sys.modules.get("transformers")  # a Hugging Face model imported it; else none is here
    if transformers is None:
        return {}
    PreTrainedModel = transformers.PreTrainedModel
    roots: dict[int, nn.Module] = {}

    def walk(module: nn.Module, root):
        root = module if isinstance(module, PreTrainedModel) else root
        if root is not None:
            roots[id(module)] = root
        for child in module.children():
            walk(child, root)

    walk(model, None)
    return roots


def materialize(model: nn.Module, names: Iterable[str], seed: int,
                values: Mapping[str, torch.Tensor] | None = None) -> None:
    """Give the parameters `names` (first whole-model names) that wait on `meta` their initial
    values, on the CPU, in place in `model`: from `values` where it has them (pretrained
    weights), else by the rule; the others stay on `meta`. `ModelError` when no init method sets one."""
    slots = _Slots(model)
    made: list[tuple[nn.Parameter, nn.Parameter]] = []
    params = dict(model.named_parameters())
    for name in names:
        meta = params[name]
        if meta.device.type != "meta":
            continue
        if values is not None and name in values:
            made.append((meta, nn.Parameter(values[name].to(meta.dtype).clone(), requires_grad=meta.requires_grad)))
            continue
        real = nn.Parameter(torch.empty_like(meta, device="cpu"), requires_grad=meta.requires_grad)
        floating = real.dtype.is_floating_point
        with torch.no_grad():
            if floating:
                real.fill_(math.nan)  # what no init method overwrites stays NaN
        slots.put(meta, real)
        try:
            with torch.random.fork_rng(devices=[]), torch.no_grad():
                torch.manual_seed(seed_of(seed, name))
                for init in slots.inits(name):
                    init()
        finally:
            slots.put(real, meta)  # while the next one is initialised, this one draws nothing
        if floating and torch.isnan(real.sum()):  # a NaN left anywhere makes the sum NaN (no mask allocated)
            raise _unset(model, name)
        made.append((meta, real))
    for meta, real in made:
        slots.put(meta, real)


def to_meta(model: nn.Module, names: Iterable[str], waited: Mapping[str, nn.Parameter] | None = None) -> None:
    """Parameters `names` of `model` go back to `meta` (their memory is freed): the very `meta`
    parameters in `waited` (name -> the one that waited before), else new ones."""
    slots = _Slots(model)
    for name in names:
        real = model.get_parameter(name)
        if real.device.type != "meta":
            meta = (waited or {}).get(name)
            slots.put(real, meta if meta is not None else
                      nn.Parameter(torch.empty_like(real, device="meta"), requires_grad=real.requires_grad))


class _Writes(TorchFunctionMode):
    """Records the tensors (or bases of views) that in-place torch functions write while it
    lasts; one that writes a `meta` tensor (an init method on a parameter waiting there) is
    skipped, as `_SkipMetaInit` does. (A torch-function mode, not a dispatch mode: torch wraps
    every dispatch mode's handler so that its first call imports torch._dynamo, about a second
    of `pd train`'s checks.)"""

    def __init__(self):
        super().__init__()
        self.written: set[int] = set()
        self._profile = None

    def __enter__(self):
        # torch.nn.init functions that return at once on a `meta` tensor (trunc_normal_ since torch
        # 2.13) dispatch nothing a mode sees: their call counts as the write (a profile hook sees it)
        self._profile = sys.getprofile()
        sys.setprofile(self._init_called)
        return super().__enter__()

    def __exit__(self, *exc):
        sys.setprofile(self._profile)
        return super().__exit__(*exc)

    def _init_called(self, frame, event, arg) -> None:
        if event == "call" and frame.f_code in _INIT_CODES:
            tensor = frame.f_locals.get("tensor")
            if isinstance(tensor, torch.Tensor):
                self.written.add(id(tensor._base if tensor._base is not None else tensor))

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        written = _written(func, args, kwargs)
        if written is not None:
            self.written.add(id(written._base if written._base is not None else written))
            if written.device.type == "meta":
                return None if getattr(func, "__name__", "") == "__setitem__" else written
        return func(*args, **kwargs)


_INIT_CODES = frozenset(f.__code__ for name, f in vars(torch.nn.init).items()
                        if name.endswith("_") and not name.endswith("__") and hasattr(f, "__code__"))
"""The code of torch.nn.init's in-place initialisers (`_no_grad_trunc_normal_` and the like among them)."""


def unset_parameters(model: nn.Module, names: Iterable[str] | None = None) -> list[str]:
    """The parameters among `names` (default: all that wait on `meta`) that no init method of the
    rule would set, found on `meta` (no memory, no compute)."""
    slots = _Slots(model)
    params = dict(model.named_parameters())
    missing = []
    for name in (waiting(model) if names is None else names):
        if params[name].device.type != "meta":
            continue
        with _Writes() as writes, torch.no_grad():
            for init in slots.inits(name):
                init()
        if id(params[name]) not in writes.written:
            missing.append(name)
    return missing


def _unset(model: nn.Module, name: str) -> ModelError:
    owner = name.rpartition(".")[0]
    cls = type(model.get_submodule(owner)).__name__
    return ModelError(f"parameter {name} (of a {cls}) is set by no init method of pdtool's initialization rule (its "
                      f"module's reset_parameters() or a Hugging Face model's _init_weights); give {cls} a "
                      "reset_parameters() that initialises it, or train with --init factory (docs/big-models.md: 'Models bigger "
                      "than one worker')")


def check_initialisable(model: nn.Module) -> None:
    """`ModelError` for the first parameter that the rule would leave unset."""
    missing = unset_parameters(model)
    if missing:
        raise _unset(model, missing[0])


def initial_model(model, seed: int, override: str | None = None, init: str = "rule") -> ModelBundle:
    """The whole model (a plan's {"spec", "kwargs"} or a `ModelRef`) with the initial values every
    pipeline of this seed starts from, in one process (the reference tests compare pipelines with)."""
    if isinstance(model, ModelRef):
        model = {"spec": model.spec, "kwargs": model.kwargs}
    bundle, on_meta = build_model(model, override, seed, init)
    if on_meta:
        materialize(bundle.module, waiting(bundle.module), seed)
    return bundle
