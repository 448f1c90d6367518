"""The recipe's optimizer, built over a stage's parameters (`runtime.recipe` holds its settings):
the launcher builds it once on a probe parameter before any worker starts (`check_optimizer`), every
worker over its stage (`worker.stepper`).

**Weight decay** applies to every parameter except (`no_decay`): those with fewer than two
dimensions (biases, the scales and shifts of norms), the weights of embedding modules (any
module whose class name ends in `Embedding`: torch's `nn.Embedding`, Hugging Face's scaled
embeddings), and bare parameters whose own name contains `emb` (a learned position embedding
such as `pos_emb`). Each optimizer gets two parameter groups (decay, no decay). The rule reads
only names, shapes and module classes, so it gives the same groups on `meta`, under any plan
and in one process. `sgd` and `adam` add the decay to the gradient (L2, torch's
`weight_decay`); `adamw` decouples it (`torch.optim.AdamW`).

**A factory** (`--optimizer pkg.module:factory`, named on the command line, so consented to) is
called as `factory(param_groups, lr=LR)` with the two groups above (each a dict of `params` and
`weight_decay`) and must return a `torch.optim.Optimizer`; the launcher calls it once on a
probe parameter before any worker starts.
"""
from __future__ import annotations

import torch

from ..errors import LaunchError
from .recipe import OptimizerConfig


def no_decay(model: torch.nn.Module) -> frozenset[str]:
    """Names (as `model.named_parameters()` gives them) of the parameters without weight decay."""
    names = set()
    for module_name, module in model.named_modules():
        embedding = type(module).__name__.endswith("Embedding")
        for own, p in module.named_parameters(recurse=False):
            if p.dim() < 2 or embedding or "emb" in own.lower():
                names.add(f"{module_name}.{own}" if module_name else own)
    # a tied parameter is named by its first name: make sure that name is there whichever module matched
    first = {id(p): name for name, p in model.named_parameters()}
    every = {name: p for name, p in model.named_parameters(remove_duplicate=False)}
    return frozenset(first[id(every[name])] for name in names if name in every)


def param_groups(named: list[tuple[str, torch.nn.Parameter]], weight_decay: float,
                 skip: frozenset[str]) -> list[dict]:
    """The decay and no-decay groups of `named` (whole-model name, parameter); empty ones dropped."""
    decay = [p for name, p in named if name not in skip]
    plain = [p for name, p in named if name in skip]
    groups = [{"params": decay, "weight_decay": weight_decay}, {"params": plain, "weight_decay": 0.0}]
    return [g for g in groups if g["params"]]


def build_optimizer(config: OptimizerConfig, named: list[tuple[str, torch.nn.Parameter]], lr_scale: float = 1.0,
                    skip: frozenset[str] = frozenset()) -> torch.optim.Optimizer:
    """The optimizer of `config` over `named` parameters, its learning rate times `lr_scale`."""
    return build_over(config, param_groups(named, config.weight_decay, skip), lr_scale)


def build_over(config: OptimizerConfig, groups: list[dict], lr_scale: float = 1.0) -> torch.optim.Optimizer:
    """The optimizer of `config` over parameter `groups` (`param_groups`' form), its learning rate
    times `lr_scale`."""
    lr = config.lr * lr_scale
    if config.name == "sgd":
        momentum = 0.9 if config.momentum is None else config.momentum
        return torch.optim.SGD(groups, lr=lr, momentum=momentum)
    if config.name in ("adam", "adamw"):
        extra = {k: v for k, v in (("betas", config.betas), ("eps", config.eps)) if v is not None}
        kind = torch.optim.Adam if config.name == "adam" else torch.optim.AdamW
        return kind(groups, lr=lr, **extra)
    return _from_factory(config, groups, lr)


def _from_factory(config: OptimizerConfig, groups: list[dict], lr: float) -> torch.optim.Optimizer:
    from ..model.spec import resolve_factory

    factory = resolve_factory(config.name, LaunchError, "optimizer", "torch.optim:RMSprop", given=True,
                              flag="--optimizer")
    try:
        optimizer = factory(groups, lr=lr)
    except Exception as exc:  # the user's factory
        first = (str(exc).strip().splitlines() or [""])[0]
        raise LaunchError(f"optimizer {config.name!r} failed when called as factory(param_groups, lr={lr:g}): "
                          f"{type(exc).__name__}: {first}") from None
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise LaunchError(f"optimizer {config.name!r} returned {type(optimizer).__name__}, not a torch.optim.Optimizer; "
                          "return the optimizer built over the param_groups it is given")
    given = {id(p) for group in groups for p in group["params"]}
    held = {id(p) for group in optimizer.param_groups for p in group["params"]}
    if given - held:
        raise LaunchError(f"optimizer {config.name!r} returned an optimizer that does not hold {len(given - held)} of the "
                          f"{len(given)} parameters it was given, so it would train nothing of them; build it over the "
                          "param_groups the factory receives (e.g. torch.optim.RMSprop(param_groups, lr=lr))")
    return optimizer


def check_optimizer(config: OptimizerConfig) -> None:
    """Build the recipe's optimizer once over a probe parameter (the launcher, before any worker)."""
    probe = torch.nn.Parameter(torch.zeros(2, 2))
    build_optimizer(config, [("probe", probe)])
