"""A stage's module from the names `pd export-plan` wrote, built the way torchtitan builds one.

torchtitan's pipelining keeps, for each stage, a copy of the model with the modules of other
stages removed: a top-level child that the stage does not list becomes `None`, an entry of a
top-level container (`nn.ModuleDict`, `nn.ModuleList`, `nn.Sequential`) that it does not list is
deleted, and the model's own forward skips what is gone (torchtitan's models are written so;
`pdtool.zoo:llama` is). `stage_module` does that to the module it is given; `check_covered`
says in one line when a module of the model is in no stage (every stage would remove it). The
only module of `pdtool.targets` that imports torch.
"""
from __future__ import annotations

from typing import Sequence

from torch import nn

from ..errors import PdtoolError


def stage_module(model: nn.Module, modules: Sequence[str]) -> nn.Module:
    """`model` (changed in place, returned) keeping only `modules`; a name that is not a top-level
    module or an entry of a top-level container of `model` is one line."""
    keep = set(modules)
    known = _names(model)
    missing = [name for name in modules if name not in known]
    if missing:
        shown = ", ".join(known[:6]) + (f" and {len(known) - 6} more" if len(known) > 6 else "")
        raise PdtoolError(f"module {missing[0]!r} of the export is not in the model {type(model).__name__} (its modules: "
                          f"{shown}): export a plan of a profile of the model class you run (pd profile -m ...)")
    for name, child in list(model.named_children()):
        if isinstance(child, (nn.ModuleDict, nn.ModuleList)) and name not in keep:
            for key in list(child._modules):
                if f"{name}.{key}" not in keep:
                    del child._modules[key]
        elif name not in keep:
            setattr(model, name, None)
    return model


def check_covered(model: nn.Module, stages: Sequence[Sequence[str]]) -> None:
    """Every top-level module of `model` (every entry of a top-level container) is in one of the
    export's `stages`; one that is in none (a parameterless module the profile folded into a
    neighbouring layer's figures) would be removed from every stage: one line."""
    listed = {name for names in stages for name in names}
    left = [name for name in _names(model) if name not in listed]
    if left:
        raise PdtoolError(f"module {left[0]!r} of the model {type(model).__name__} is in no stage of the export (the "
                          "profile measured it inside a neighbouring layer), so every stage would remove it: profile "
                          "with --granularity op (or a --depth that makes it a layer of its own) and plan again")


def _names(model: nn.Module) -> list[str]:
    """The names a stage can list: top-level modules, and the entries of top-level containers."""
    found: list[str] = []
    for name, child in model.named_children():
        if isinstance(child, (nn.ModuleDict, nn.ModuleList)):
            found += [f"{name}.{key}" for key in child._modules]
        else:
            found.append(name)
    return found
