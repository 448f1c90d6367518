"""The training recipe every stage shares: optimizer, weight decay, learning-rate schedule and
gradient clipping (`OptimizerConfig`), as plain values the launcher checks and the workers apply
(`runtime.optimizers` builds the optimizer, `runtime.worker.optim` clips). Pure: no torch.

**Learning rate.** `LrSchedule.lr(base, t)` is the learning rate of the optimizer step taken
after `t` steps of stage 0 (t = 0: the first step); a stage's own step count drives it
(`stepper.Stepper`: in the modes whose stages step at other rates, a stage's k-th step is at
t = k * its minibatches per step / stage 0's), counted from the start of training (a resumed
run goes on from its checkpoint's step):

- warm-up (`warmup_steps` W > 0): lr = base * (t + 1) / W for t < W (the first step is not 0);
- then `constant`: base; `linear`: from base down to `min_lr` at step `total_steps`;
  `cosine`: base -> `min_lr` along half a cosine over the same span:
  min_lr + (base - min_lr) * (1 + cos(pi * p)) / 2, p = (t - W) / (total_steps - W).

`total_steps` is the run's `--steps` (the whole run's, also when it is resumed) unless
`--lr-decay-steps` says otherwise. A stage's learning-rate factor of the mode (`Mode.lr_scale`)
multiplies the result, `min_lr` included.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

LR_SCHEDULES = ("constant", "linear", "cosine")
OPTIMIZERS = ("sgd", "adam", "adamw")  # built in (`runtime.optimizers.build_optimizer`); else a pkg.module:factory
MOMENTUM = {"sgd": 0.9}  # the default momentum of the built-in optimizers that have one
ADAM_LIKE = ("adam", "adamw")  # they take --betas and --eps


@dataclass(frozen=True)
class LrSchedule:
    """The learning rate over the steps (see the module docstring)."""

    name: str = "constant"
    warmup_steps: int = 0
    min_lr: float = 0.0
    total_steps: int | None = None  # None: the launcher sets the run's --steps (`with_horizon`)

    def factor(self, base: float, t: float) -> float:
        """lr(base, t) / base: what multiplies every parameter group's own learning rate."""
        return self.lr(base, t) / base if base > 0 else 1.0

    def lr(self, base: float, t: float) -> float:
        warmup = self.warmup_steps
        if t < warmup:
            return base * (t + 1) / warmup
        if self.name == "constant":
            return base
        total = self.total_steps if self.total_steps is not None else warmup + 1
        progress = min(max((t - warmup) / max(total - warmup, 1), 0.0), 1.0)
        floor = min(self.min_lr, base)
        if self.name == "linear":
            return floor + (base - floor) * (1.0 - progress)
        return floor + (base - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))

    def describe(self) -> str:
        """In words, for the launcher's line and the manifest's comparison."""
        parts = [self.name]
        if self.warmup_steps:
            parts.append(f"{self.warmup_steps} warm-up steps")
        if self.name != "constant":
            parts.append(f"to {self.min_lr:g} at step {self.total_steps}")
        return ", ".join(parts)


@dataclass(frozen=True, kw_only=True)
class OptimizerConfig:
    """The recipe shared by every stage: `name` (sgd, adam, adamw, or a pkg.module:factory named
    on the command line), base `lr`, `momentum` (sgd; None: its default 0.9), `weight_decay`
    (not on biases, norms and embeddings: `runtime.optimizers.no_decay`), `betas`/`eps` (adam,
    adamw; None: torch's defaults), the learning-rate `schedule`, and `clip_grad_norm` (None:
    no clipping; see `worker.optim` for what the norm is in each mode)."""

    name: str = "sgd"
    lr: float = 0.01
    momentum: float | None = None
    weight_decay: float = 0.0
    betas: tuple[float, float] | None = None
    eps: float | None = None
    schedule: LrSchedule = field(default_factory=LrSchedule)
    clip_grad_norm: float | None = None
    initial_loss_scale: float = 2.0 ** 16  # fp16's first loss scale (torch.amp.GradScaler's default)

    @property
    def is_factory(self) -> bool:
        return self.name not in OPTIMIZERS

    @property
    def state_slots(self) -> int:
        """Optimizer state buffers per parameter for the memory model (a factory's: assumed 2, as Adam)."""
        from ..memory import OPTIMIZER_SLOTS

        return OPTIMIZER_SLOTS.get(self.name, 2)

    def with_horizon(self, steps: int) -> OptimizerConfig:
        """This recipe with its schedule's `total_steps` set to `steps` when unset."""
        if self.schedule.total_steps is not None:
            return self
        from dataclasses import replace

        return replace(self, schedule=replace(self.schedule, total_steps=steps))

    def problem(self) -> str | None:
        """What is wrong with this recipe, as the end of a one-line usage error (None: nothing)."""
        name = self.name
        if self.is_factory and ":" not in name:
            return f"--optimizer {name!r}: use {', '.join(OPTIMIZERS)} or a pkg.module:factory"
        if self.momentum is not None and name not in MOMENTUM:
            what = "the factory sets its own" if self.is_factory else f"{name} has none"
            hint = "; use --betas" if name in ADAM_LIKE else ""
            return f"--momentum: {what}{hint}"
        if (self.betas is not None or self.eps is not None) and name not in ADAM_LIKE:
            flag = "--betas" if self.betas is not None else "--eps"
            return f"{flag} is for adam and adamw, not {name}" + ("" if self.is_factory else "; use --momentum")
        if self.betas is not None and not all(0 <= b < 1 for b in self.betas):
            return f"--betas {self.betas[0]:g} {self.betas[1]:g}: each must be in [0, 1)"
        schedule = self.schedule
        if schedule.name not in LR_SCHEDULES:
            return f"--lr-schedule {schedule.name!r}: use one of {', '.join(LR_SCHEDULES)}"
        if schedule.min_lr > self.lr:
            return f"--min-lr {schedule.min_lr:g} is above --lr {self.lr:g}; give a smaller --min-lr"
        if schedule.min_lr and schedule.name == "constant":
            return "--min-lr needs --lr-schedule linear or cosine (a constant schedule never decays)"
        return None

    def summary(self) -> dict:
        """The recipe as JSON values (checkpoint manifests record it; `--resume` compares)."""
        return {"optimizer": self.name, "lr": self.lr, "momentum": self.momentum, "weight_decay": self.weight_decay,
                "betas": list(self.betas) if self.betas else None, "eps": self.eps, "lr_schedule": self.schedule.name,
                "warmup_steps": self.schedule.warmup_steps, "min_lr": self.schedule.min_lr,
                "total_steps": self.schedule.total_steps, "clip_grad_norm": self.clip_grad_norm}
