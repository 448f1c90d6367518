"""A stage's module from the names `pd export-plan` wrote, built the way torchtitan builds one.

torchtitan's pipelining keeps, for each stage, a copy of the model with the modules of other
stages removed: a top-level child that the stage does not list becomes `None`, an entry of a
top-level container (`nn.ModuleDict`, `nn.ModuleList`, `nn.Sequential`) that it does not list is
deleted, and the model's own forward skips what is gone (torchtitan's models are written so;
`pdtool.zoo:llama` is). `stage_module` does that to the module it is given. The only module of
`pdtool.targets` that imports torch.
"""
from __future__ import annotations

from typing import Sequence

from torch import nn

from ..errors import PdtoolError
from .units import CONTAINERS


def stage_module(model: nn.Module, modules: Sequence[str]) -> nn.Module:
    """`model` (changed in place, returned) keeping only `modules`; a name that is not a top-level
    module or an entry of a top-level container of `model` is one line."""
    keep = set(modules)
    known: list[str] = []
    for name, child in list(model.named_children()):
        if type(child).__name__ in CONTAINERS and name not in keep:
            for key in list(child._modules):
                known.append(f"{name}.{key}")
                if f"{name}.{key}" not in keep:
                    del child._modules[key]
            continue
        known.append(name)
        if name not in keep:
            setattr(model, name, None)
    missing = [name for name in modules if name not in known]
    if missing:
        shown = ", ".join(known[:6]) + (f" and {len(known) - 6} more" if len(known) > 6 else "")
        raise PdtoolError(f"module {missing[0]!r} of the export is not in the model {type(model).__name__} (its modules: "
                          f"{shown}): export a plan of a profile of the model class you run (pd profile -m ...)")
    return model
