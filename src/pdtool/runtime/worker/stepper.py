"""A stage replica's optimizer step (`executor.StageWorker` computes, this steps).

A step comes in two halves with the tied weights' `tie` ops between them: `mean_gradients`
makes `.grad` of every live weight the mean gradient of the backwards since the last step, over
the stage's replicas (a flat buffer the caller's `allreduce` sums, with the number of backwards it
covers: every step applies the mean gradient of the minibatches of its step group), then
`finish_step` unscales (fp16), clips (`--clip-grad-norm`), sets the learning rate of the step
from the recipe's schedule and the mode's factor (`lr_scale`), lets the optimizer apply `.grad`,
and makes the live weights the next version (`executor.VersionStore`).

In the asynchronous modes (`pipedream`, `vsync`) a replicated stage steps once per round of its
r_s replicas where an unreplicated one steps every minibatch; as in the original PipeDream, its
learning rate is scaled by r_s / r_0 (r_0: replicas of the input stage) so that stages move at the
same pace. In `2bw`, `flush` and `gpipe` every stage steps once per group of m microbatches with
the plain learning rate: `flush` and `gpipe` are then exactly single-process gradient accumulation
over m microbatches (mean of the m losses' gradients).
"""
from __future__ import annotations

import math
from typing import Callable

import torch

from ...schedule import Schedule, step_group
from ..run import OptimizerConfig
from .. import optimizers
from . import optim
from .optimizer_shard import ShardedOptimizer
from .parameter_shard import full, local, shard_like

Allreduce = Callable[[torch.Tensor], None]  # sums a flat gradient buffer over the stage's replicas, in place


def lr_scale(schedule: Schedule, stage: int) -> float:
    """The learning-rate factor of `stage` (see the module docstring; the mode's `lr_scale`)."""
    return schedule.rules.lr_scale(schedule.replicas, stage)


class Stepper:
    """The optimizer step of replica `rank` of `stage` (its `live` parameters under their stage
    names `names`, whose versions `weights` keeps) running `schedule`, with the recipe `optimizer`.
    `first`: the run's first minibatch (the learning-rate clock of a resumed run); `no_decay`: the
    parameters without weight decay; `model_parameters`: the whole model's count (a stage's share
    of the clipping budget where stages step on their own)."""

    def __init__(self, *, stage, schedule: Schedule, names: list[str], live: list[torch.nn.Parameter], weights,
                 optimizer: OptimizerConfig, first: int = 0, no_decay: frozenset[str] = frozenset(),
                 model_parameters: int | None = None, precision: str = "fp32", sharded: bool | str = False,
                 replica: int = 0, parameters=None):
        self.schedule = schedule
        self.live = live
        self.weights = weights
        self.recipe = optimizer
        self.loss_scale = optim.LossScale(optimizer.initial_loss_scale) if precision == "fp16" else None
        self.unscaled = False  # this step's gradients were divided by the loss scale already
        # fp16: the last stage seeds each backward with scale / (minibatches per step), as one process scales
        # loss / m; the mean over the step's backwards then leaves the gradients scale / m times the true mean
        self.per_step_last = step_group(schedule, schedule.stages - 1)
        named = [(stage.param_names.get(n, n), p) for n, p in zip(names, live)]
        # sharded: "optimizer" (or True) shards the optimizer state, "gradients" the summed gradients too;
        # `parameters` (--shard parameters, `parameter_shard`): the live weights are shards, stepped as they are
        self.parameters = parameters
        flat = sharded and parameters is None
        self.optimizer = _optimizer(optimizer, named, lr_scale(schedule, stage.index), no_decay,
                                    schedule.replicas[stage.index] if flat else 1, replica,
                                    {p: i for i, p in enumerate(live)} if sharded == "gradients" else None)
        self.reducer = getattr(self.optimizer, "reducer", None)  # --shard gradients: `gradient_shard`
        self.base_lrs = [g["lr"] for g in self.optimizer.param_groups] if self.optimizer is not None else []
        # the learning-rate clock: steps of stage 0 before this stage's next step (`runtime.recipe`)
        per_step = step_group(schedule, 0)
        self.clock = (first / per_step, step_group(schedule, stage.index) / per_step)
        self.steps_taken = 0
        ties = getattr(stage, "tied", {})
        self.owned = [p for n, p in zip(names, live) if n not in ties or min(ties[n]) == stage.index]
        # where stages step on their own (pipedream, vsync) each clips to its share of the budget (`worker.optim`)
        self.clip_budget = None
        if optimizer.clip_grad_norm is not None:
            alone = schedule.rules.per_round or schedule.stages == 1
            self.clip_budget = (optim.stage_budget(optimizer.clip_grad_norm, sum(p.numel() for p in self.owned),
                                                   model_parameters) if alone else optimizer.clip_grad_norm)
        # the whole model's gradient norm, measured across the stages by the caller: for clipping and for fp16's
        # skipped steps, where every stage steps after the same minibatches (fp16 needs that: `job.prepare`)
        self.whole_norm = optim.norm_across_stages(optimizer, precision, schedule)
        self.step_log: list[tuple] = []  # (lr, norm clipped at or None, whole model's?, skipped?) per step
        self.backwards = 0  # backwards since the last step (the compute counts them)
        self._flat: torch.Tensor | None = None  # the gradient buffer of replica all-reduces (gradient_buffer)

    def loss_seed(self) -> float | None:
        """fp16: the factor the last stage seeds each backward with (the loss scale over the
        minibatches of a step); None without loss scaling."""
        return None if self.loss_scale is None else self.loss_scale.value / self.per_step_last

    def mean_gradients(self, allreduce: Allreduce | None = None) -> None:
        """First half of a step: `.grad` of every live weight becomes the mean gradient of the
        backwards since the last step, over the replicas (`allreduce` sums a flat buffer)."""
        if allreduce is None:  # one replica: scale the gradients in place, no flat buffer
            self.weights.keep_current()
            if self.backwards > 1:
                for p in self.live:
                    if p.grad is not None:
                        p.grad.div_(self.backwards)
        elif self.reducer is not None:  # reduced after each backward: the mean of what the slice holds
            self.weights.keep_current()
            self.reducer.mean()
        elif self.parameters is not None:  # the shards hold the replicas' sum: divided by their backwards
            self.weights.keep_current()
            self.parameters.reduce_for_step()
            count = torch.tensor([float(self.backwards)], dtype=torch.float64,  # on the device: NCCL's groups
                                 device=self.live[0].device if self.live else None)
            self.parameters.allreduce(count)
            grads = self._grads()
            if grads:
                torch._foreach_div_(grads, max(float(count), 1.0))
        else:
            buffer = self.gradient_buffer()
            allreduce(buffer)
            self.weights.keep_current()
            self._set_mean_gradients(buffer)

    def finish_step(self, norm: float | None = None) -> None:
        """Second half of a step (between the halves, the `tie` ops of tied weights): the gradients
        clipped (`--clip-grad-norm`; `norm`: the whole model's gradient norm, which the caller
        measures across stages where they step together, `whole_norm`), the learning rate of this
        step set, the optimizer applies `.grad`; the live weights become the next version."""
        lr = self._set_lr()
        self.unscale()
        whole = norm is not None
        if norm is None and (self.clip_budget is not None or self.loss_scale is not None):
            norm = math.sqrt(self.squared_norm())
        skipped = self.loss_scale is not None and not math.isfinite(norm)  # fp16: an overflow skips the step
        if self.loss_scale is not None:
            self.loss_scale.update(skipped)
        if self.clip_budget is not None and not skipped:
            optim.clip(self._grads(), self.clip_budget, norm)
        self.step_log.append((lr, norm if self.clip_budget is not None else None,
                              whole or self.schedule.stages == 1, skipped))
        self._step_optimizer(skipped)
        self.steps_taken += 1

    def unscale(self) -> None:
        """fp16: divide this step's gradients by the loss scale (once per step)."""
        if self.loss_scale is not None and not self.unscaled:
            grads = self._grads()
            if grads:
                torch._foreach_mul_(grads, self.per_step_last / self.loss_scale.value)
            self.unscaled = True

    def squared_norm(self) -> float:
        """The squared norm of this stage's gradients (a tied parameter's only in its owner stage),
        unscaled; not finite when one overflowed."""
        self.unscale()
        shards = self.reducer or self.parameters
        if shards is not None:  # each replica holds a slice: their squares summed (no tied weights here)
            total = torch.tensor([optim.squared_norm(self._grads())], dtype=torch.float64,
                                 device=self.live[0].device if self.live else None)
            shards.allreduce(total)
            return float(total)
        return optim.squared_norm([p.grad for p in self.owned if p.grad is not None])

    def _grads(self) -> list[torch.Tensor]:
        """The gradients the step applies: the live weights', or with sharded gradients this
        replica's slices of them."""
        if self.reducer is not None:
            return list(self.reducer.accumulators)
        if self.parameters is not None:  # sharded parameters: this replica's part of each gradient
            return [local(p.grad) for p in self.live if p.grad is not None]
        return [p.grad for p in self.live if p.grad is not None]

    def lr_now(self) -> float:
        """The learning rate of this stage's next step (its first group's, with the mode's factor)."""
        return self.base_lrs[0] * self._lr_factor() if self.base_lrs else 0.0

    def _lr_factor(self) -> float:
        start, per = self.clock
        return self.recipe.schedule.factor(self.recipe.lr, start + self.steps_taken * per)

    def _set_lr(self) -> float:
        """Every parameter group's learning rate for the step about to be taken; the first's."""
        factor = self._lr_factor()
        for group, base in zip(self.optimizer.param_groups if self.optimizer else [], self.base_lrs):
            group["lr"] = base * factor
        return self.lr_now()

    def gradient_buffer(self) -> torch.Tensor:
        """This replica's gradients, flattened, followed by how many backwards they sum.

        One buffer per worker, reused by every step: a fresh one of a large stage costs more to
        fill (page faults) than the copy itself (51 MB of gradients: 33 ms against 10 ms)."""
        grads = [(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1) for p in self.live]
        like = self.live[0] if self.live else torch.empty(0)
        grads.append(torch.tensor([float(self.backwards)], dtype=like.dtype, device=like.device))
        size = sum(g.numel() for g in grads)
        if self._flat is None or self._flat.numel() != size:
            self._flat = torch.empty(size, dtype=like.dtype, device=like.device)
        return torch.cat(grads, out=self._flat)

    def _set_mean_gradients(self, summed: torch.Tensor) -> None:
        """`.grad` of every live weight becomes its part of `summed` divided by the backwards it
        counts: views of the buffer, divided in place (the optimizer's zero_grad lets them go
        before the next step refills the buffer)."""
        summed.div_(max(float(summed[-1]), 1.0))
        offset = 0
        for p in self.live:
            p.grad = summed[offset:offset + p.numel()].view_as(p)
            offset += p.numel()

    def param_state(self, keep: bool = True) -> dict[torch.Tensor, dict]:
        """Per live parameter, its optimizer state as an unsharded optimizer holds it (sharded:
        gathered from the replicas, a collective every replica calls at once; `keep` False: this
        replica only gives its slices and gets nothing)."""
        if isinstance(self.optimizer, ShardedOptimizer):
            return self.optimizer.param_state(keep)
        if self.parameters is not None:  # every replica gathers each state value in one order (collectives)
            found = {}
            for p in self.live:
                state = self.optimizer.state.get(p, {}) if self.optimizer is not None else {}
                whole = {key: full(state[key]) for key in sorted(state)}
                if keep and whole:
                    found[p] = whole
            return found
        return {p: self.optimizer.state[p] for p in self.live if self.optimizer is not None and p in self.optimizer.state}

    def load_param_state(self, state: dict[torch.Tensor, dict]) -> None:
        """Restore the optimizer from an unsharded state per live parameter (sharded: its slices)."""
        if isinstance(self.optimizer, ShardedOptimizer):
            self.optimizer.load_param_state(state)
        elif self.optimizer is not None:
            for p, values in state.items():
                self.optimizer.state[p].update({key: shard_like(p, value) if isinstance(value, torch.Tensor) else value
                                                for key, value in values.items()})

    def _step_optimizer(self, skip: bool = False) -> None:
        if self.optimizer is not None:
            if not skip:
                self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)
        self.unscaled = False
        self.backwards = 0
        self.weights.advance()


def _optimizer(recipe: OptimizerConfig, named: list, scale: float, no_decay: frozenset[str], replicas: int,
               replica: int, order: dict | None = None):
    """The recipe's optimizer over `named` (None without parameters); with `replicas` > 1, this
    replica's shard of it (`optimizer_shard`), its gradients' too with `order` (each parameter's
    position in the stage)."""
    if not named:
        return None
    if replicas == 1:
        return optimizers.build_optimizer(recipe, named, scale, no_decay)
    groups = optimizers.param_groups(named, recipe.weight_decay, no_decay)
    return ShardedOptimizer(groups, lambda flat: optimizers.build_over(recipe, flat, scale), replicas, replica, order)
