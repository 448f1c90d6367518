"""The recipe's torch side in a worker (`runtime.recipe`; the optimizer itself is built by
`runtime.optimizers`): the gradient norm it clips and the loss scale of fp16.

**Clipping by the global norm** (`--clip-grad-norm MAX`), after the replicas' mean gradient and
the tied weights' sum, before the step. In the modes whose stages all step once per group
(`flush`, `gpipe`, `zb`, `zb2`, `2bw`) the norm is the whole model's: every worker all-reduces
its stage's squared norm (a tied parameter counted once, by its owner stage; a replicated
stage's divided by its replicas) and scales its gradients by min(1, MAX / (norm + 1e-6)), as
one process's `torch.nn.utils.clip_grad_norm_` does. In `pipedream` and `vsync` stages step
after different minibatches, so there is no common gradient to measure: each stage clips its
own gradient to its share of the budget, MAX * sqrt(P_s / P) (P_s its parameters, P the
model's), so the whole model's update never has a larger norm than MAX, and no stage waits
for another.
"""
from __future__ import annotations

import math

import torch

from ..recipe import OptimizerConfig

NORM_EPS = 1e-6  # as torch.nn.utils.clip_grad_norm_


def squared_norm(grads: list[torch.Tensor]) -> float:
    """The sum of the squares of `grads`' elements (in float64)."""
    if not grads:
        return 0.0
    return float(sum(torch.linalg.vector_norm(g, dtype=torch.float64) ** 2 for g in grads))


def clip(grads: list[torch.Tensor], max_norm: float, norm: float) -> None:
    """Scale `grads` in place by min(1, max_norm / (norm + 1e-6))."""
    coef = min(1.0, max_norm / (norm + NORM_EPS))
    if coef < 1.0 and grads:
        torch._foreach_mul_(grads, coef)


def norm_across_stages(recipe: OptimizerConfig, precision: str, schedule) -> bool:
    """Whether the stages measure the whole model's gradient norm together before each step: to
    clip it, or (fp16) to skip an overflowing step on every stage; only where they all step after
    the same minibatches and there are several."""
    return ((recipe.clip_grad_norm is not None or precision == "fp16") and not schedule.rules.per_round
            and schedule.stages > 1)


class LossScale:
    """fp16's dynamic loss scale, by `torch.amp.GradScaler`'s rule: the last stage's backward starts
    from loss * `value`; a step whose gradients overflowed (not finite, anywhere in the model
    where stages step together) is skipped and halves the scale; 2000 steps in a row without one
    double it. Every stage keeps its own copy and updates it from the same outcome, so all agree."""

    def __init__(self, initial: float = 2.0 ** 16, growth: float = 2.0, backoff: float = 0.5, interval: int = 2000):
        self.value, self.growth, self.backoff, self.interval = float(initial), growth, backoff, interval
        self.good = 0  # steps since the last overflow or growth

    def update(self, overflowed: bool) -> None:
        if overflowed:
            self.value *= self.backoff
            self.good = 0
            return
        self.good += 1
        if self.good == self.interval:
            self.value *= self.growth
            self.good = 0


def stage_budget(max_norm: float, stage_parameters: int, model_parameters: int | None) -> float:
    """A stage's share of the clipping budget where stages clip on their own: MAX * sqrt(P_s / P)."""
    if not model_parameters:
        return max_norm
    return max_norm * math.sqrt(min(stage_parameters / model_parameters, 1.0))
