"""One worker's share of training: forward, backward and optimizer step of one stage replica.

`StageWorker` is the numerical core that both interpreters of a schedule use that run
tensors: the distributed runtime (one `StageWorker` per process, messages over
torch.distributed) and the reference executor (all of them in one process, messages in
dictionaries). It knows nothing about communication.

**Weight versions** (docs/schedules.md). "Version v" of a stage is its weights after v
optimizer steps; the schedule says which version every forward and backward uses
(`Schedule.versions`). A forward runs the stage with `torch.func.functional_call` on the
tensors of its version (or, when that is the live weights, calls the module itself: swapping
parameters in costs ~0.1 ms a forward on small layers), so autograd records exactly those
tensors and the backward computes gradients for that version, however many steps the live weights have taken since (weight
stashing without swapping `.data`). Versions are copies of the live weights, made lazily: the
live weights are copied when a forward needs the current version, and before a step when a
later action still needs the current version. A version is freed after its last use.

**Gradients and learning rate.** Each backward adds its parameter gradients to the live
weights' `.grad`. A step first sums the gradients over the stage's replicas (the caller's
`allreduce`, with the number of backwards they cover) and divides by that number: every step
applies the mean gradient of the minibatches of its step group. In the asynchronous modes
(`pipedream`, `vsync`) a replicated stage steps once per round of its r_s replicas where an
unreplicated one steps every minibatch; as in the original PipeDream, its learning rate is
scaled by r_s / r_0 (r_0: replicas of the input stage) so that stages move at the same pace.
In `2bw`, `flush` and `gpipe` every stage steps once per group of m microbatches with the
plain learning rate: `flush` and `gpipe` are then exactly single-process gradient
accumulation over m microbatches (mean of the m losses' gradients).
"""
from __future__ import annotations

import math
from typing import Any, Callable

import torch
from torch.func import functional_call

from ...model.data import derive_seed
from ...precision import autocast, message_dtype
from ...errors import LaunchError
from ...schedule import Action, Schedule, step_group
from ..run import OptimizerConfig
from .. import optimizers
from . import optim
from .split_backward import ParameterNodes, input_gradients, weight_gradients



def lr_scale(schedule: Schedule, stage: int) -> float:
    """The learning-rate factor of `stage` (see the module docstring; the mode's `lr_scale`)."""
    return schedule.rules.lr_scale(schedule.replicas, stage)


Allreduce = Callable[[torch.Tensor], None]  # sums a flat gradient buffer over the stage's replicas, in place


class StageWorker:
    """Replica `replica` of stage `stage` (a `model.stages.Stage`) running `schedule`.

    `loss_fn(output, target)` is given to the last stage only. `forward` and `backward`
    take and return dictionaries of tensors keyed by the stage's boundary names. `seed` is the
    run's, `first` the run's first minibatch (a resumed run's minibatch b is `first + b` of the
    whole training): the forward of b draws its random numbers (dropout) from torch's generators
    seeded by (seed, first + b, stage), so they are the same in every run, resumed or not, and
    in the reference executor.
    """

    def __init__(self, *, stage, schedule: Schedule, replica: int, optimizer: OptimizerConfig,
                 loss_fn: Callable[[Any, Any], torch.Tensor] | None = None, seed: int = 0, first: int = 0,
                 no_decay: frozenset[str] = frozenset(), model_parameters: int | None = None,
                 precision: str = "fp32", recompute: bool = False):
        self.stage = stage
        self.seed, self.first = seed, first
        self.index = stage.index
        self.schedule = schedule
        self.replica = replica
        self.rank = schedule.rank(stage.index, replica)
        self.actions: tuple[Action, ...] = schedule.workers[self.rank]
        self.last = stage.index == schedule.stages - 1
        self.loss_fn = loss_fn
        self.names = [name for name, _ in stage.module.named_parameters()]
        self.live = [p for _, p in stage.module.named_parameters()]
        self.recipe = optimizer
        self.precision = precision
        self.recompute = recompute
        self.loss_scale = optim.LossScale(optimizer.initial_loss_scale) if precision == "fp16" else None
        self.unscaled = False  # this step's gradients were divided by the loss scale already
        # fp16: the last stage seeds each backward with scale / (minibatches per step), as one process scales
        # loss / m; the mean over the step's backwards then leaves the gradients scale / m times the true mean
        self.per_step_last = step_group(schedule, schedule.stages - 1)
        named = [(stage.param_names.get(n, n), p) for n, p in zip(self.names, self.live)]
        self.optimizer = (optimizers.build_optimizer(optimizer, named, lr_scale(schedule, stage.index), no_decay)
                          if self.live else None)
        self.base_lrs = [g["lr"] for g in self.optimizer.param_groups] if self.optimizer is not None else []
        # the learning-rate clock: steps of stage 0 before this stage's next step (`runtime.recipe`)
        per_step = step_group(schedule, 0)
        self.clock = (first / per_step, step_group(schedule, stage.index) / per_step)
        self.steps_taken = 0
        ties = getattr(stage, "tied", {})
        self.owned = [p for n, p in zip(self.names, self.live) if n not in ties or min(ties[n]) == stage.index]
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
        self.weights = VersionStore(names=self.names, live=self.live, actions=self.actions,
                                    versions=schedule.versions())
        # minibatch -> (input leaves, outputs, version, weights); recomputing, (inputs, target, version, weights)
        self.stash: dict[int, tuple[dict, Any, int, dict]] = {}
        self._unchanged: dict[int, dict[str, int]] = {}  # recomputing: each stashed input's version counter
        self.split: dict[int, tuple[Any, int]] = {}  # minibatch -> (what its W needs, version) between B and W
        self.parameter_nodes = ParameterNodes()  # zb, zb2: the live weights' gradient accumulators, found once
        self.backwards = 0        # backwards since the last step
        self.losses: dict[int, float] = {}
        self._flat: torch.Tensor | None = None  # the gradient buffer of replica all-reduces (gradient_buffer)

    @property
    def peak_versions(self) -> int:
        """The most stashed weight versions this worker held at once (live weights not counted)."""
        return self.weights.peak

    # ----- actions -------------------------------------------------------------------------
    def forward(self, b: int, inputs: dict[str, torch.Tensor], target: Any = None):
        """Forward of minibatch b on its version; returns the outputs to send (detached),
        or on the last stage the loss (a float). A stage that recomputes runs it without
        recording anything for the backward and stashes only its inputs (and target)."""
        v = self.weights.version_of[("F", b)]
        params = self.weights.get(v)
        if self.recompute:
            with torch.no_grad():
                outputs = self._run(b, inputs, target, v, params)
            self.stash[b] = (inputs, target, v, params)
            self._unchanged[b] = {k: t._version for k, t in inputs.items() if isinstance(t, torch.Tensor)}
        else:
            # stage 0's inputs are data: no gradient is sent anywhere, so none is computed
            wants_grad = self.index > 0
            leaves = {k: (t.detach().requires_grad_(True) if wants_grad and t.is_floating_point() else t)
                      for k, t in inputs.items()}
            with torch.enable_grad():
                outputs = self._run(b, leaves, target, v, params)
            self.stash[b] = (leaves, outputs, v, params)
        self.weights.used(v)
        if self.last:
            loss = float(outputs.detach())
            self.losses[b] = loss
            return loss
        return {k: o.detach() for k, o in outputs.items()}

    def evaluate(self, inputs: dict[str, torch.Tensor], target: Any = None):
        """A held-out minibatch through this stage on the live weights, in eval mode and without
        gradients (`worker.evaluation`): the outputs to send on, or on the last stage (loss,
        correct predictions or None, predictions, samples)."""
        module = self.stage.module
        training = module.training
        device = next(iter(inputs.values())).device if inputs else torch.device("cpu")
        module.eval()
        try:
            with torch.no_grad(), autocast(device, self.precision):
                outputs = module(inputs)
                if not self.last:
                    return {k: o.to(message_dtype(o.dtype, self.precision)) if isinstance(o, torch.Tensor) else o
                            for k, o in outputs.items()}
                output = outputs["output"]
                loss = float(self.loss_fn(output, target))
        finally:
            module.train(training)
        batched = [target] + list(inputs.values())  # no target (a model's own loss): the inputs' batch
        samples = next((t.shape[0] for t in batched if isinstance(t, torch.Tensor) and t.dim()), 1)
        logits = getattr(output, "logits", output)  # a Hugging Face ModelOutput carries its logits
        if (isinstance(target, torch.Tensor) and isinstance(logits, torch.Tensor) and not target.is_floating_point()
                and logits.shape[:-1] == target.shape):
            return loss, int((logits.argmax(dim=-1) == target).sum()), target.numel(), samples
        return loss, None, 0, samples

    def _run(self, b: int, leaves: dict, target: Any, v: int, params: dict):
        """The stage's computation of minibatch b on version v (`params`) under the run's precision,
        with b's random numbers: its outputs in the message dtype, or on the last stage the loss."""
        self._seed_random(b)
        device = next(iter(leaves.values())).device if leaves else torch.device("cpu")
        with autocast(device, self.precision):
            if not params or next(iter(params.values())) is self.live[0]:
                outputs = self.stage.module(leaves)  # the live weights: the module as it is (no parameter swap)
            else:
                outputs = functional_call(self.stage.module, params, (leaves,))
            if self.last:
                return self.loss_fn(outputs["output"], target)
            # messages travel in the compute dtype (the cast is part of the graph: its gradient comes back so)
            return {k: o.to(message_dtype(o.dtype, self.precision)) if isinstance(o, torch.Tensor) else o
                    for k, o in outputs.items()}

    def _recomputed(self, b: int) -> tuple[dict, Any, int, dict]:
        """A recomputing stage's stash entry of minibatch b made whole again: its forward run once
        more, recording the graph, on the same inputs, weight version and random numbers."""
        inputs, target, v, params = self.stash.pop(b)
        if any(inputs[k]._version != version for k, version in self._unchanged.pop(b).items()):
            raise LaunchError(f"worker {self.rank}: stage {self.index} changed its input in place during the forward "
                              f"of minibatch {b}, so its forward cannot be recomputed; plan it with --recompute none "
                              "or make the first operation on the input out of place")
        wants_grad = self.index > 0
        leaves = {k: (t.detach().requires_grad_(True) if wants_grad and t.is_floating_point() else t)
                  for k, t in inputs.items()}
        with torch.enable_grad():
            return leaves, self._run(b, leaves, target, v, params), v, params

    def _seed_random(self, b: int) -> None:
        """Seed torch's CPU generator, and the current GPU's once CUDA is in use, for the forward of
        minibatch b (see the class docstring); ~2 us, where torch.manual_seed takes ~90."""
        seed = derive_seed(f"forward/stage-{self.index}", self.seed, self.first + b)
        torch.default_generator.manual_seed(seed)
        if torch.cuda.is_initialized():
            torch.cuda.default_generators[torch.cuda.current_device()].manual_seed(seed)

    def backward(self, b: int, grads: dict[str, torch.Tensor] | None = None,
                 weights: bool | None = None) -> dict[str, torch.Tensor]:
        """Backward of minibatch b on the version its forward used; returns the gradients of the
        inputs (floating ones only). With `weights` (by default: unless the schedule has a W for b,
        modes `zb`, `zb2`) it also adds the parameter gradients to the live weights; without,
        `weight_backward(b)` does that later."""
        if weights is None:
            weights = ("W", b) not in self.weights.version_of
        leaves, outputs, v, params = self._recomputed(b) if self.recompute else self.stash.pop(b)
        if self.weights.version_of[("B", b)] != v:
            raise LaunchError(f"worker {self.rank}: minibatch {b} ran forward on version {v} but the schedule "
                              f"puts its backward on version {self.weights.version_of[('B', b)]}")
        if self.last:
            scaled = outputs if self.loss_scale is None else outputs * (self.loss_scale.value / self.per_step_last)
            roots, seeds = [scaled], [None]
        else:
            pairs = [(outputs[k], grads[k]) for k in outputs if outputs[k].requires_grad and grads.get(k) is not None]
            roots, seeds = [p[0] for p in pairs], [p[1] for p in pairs]
        wanted_inputs = [k for k, t in leaves.items() if t.requires_grad]
        inputs = [leaves[k] for k in wanted_inputs]
        self.weights.used(v)
        if not weights:
            found, pending = (input_gradients(roots, seeds, inputs, list(params.values()), self.parameter_nodes)
                              if roots else ([], None))
            self.split[b] = (pending, v)
            return {k: g for k, g in zip(wanted_inputs, found) if g is not None}
        targets = list(params.values()) + inputs
        if not (roots and targets):
            found = [None] * len(inputs)
        elif self.live and targets[0] is self.live[0]:  # the live weights: autograd adds to their .grad itself
            torch.autograd.backward(roots, seeds, inputs=targets)
            found = [leaf.grad for leaf in inputs]
        else:
            found = torch.autograd.grad(roots, targets, seeds, allow_unused=True)
            self._add_gradients(found[:len(params)])
            found = found[len(params):]
        self.backwards += 1
        return {k: g for k, g in zip(wanted_inputs, found) if g is not None}

    def weight_backward(self, b: int) -> None:
        """The weight gradients of minibatch b, whose `backward(b, weights=False)` ran: added to
        the live weights (the W of modes `zb`, `zb2`)."""
        pending, v = self.split.pop(b)
        if self.weights.version_of[("W", b)] != v:
            raise LaunchError(f"worker {self.rank}: minibatch {b} ran its backward on version {v} but the schedule "
                              f"puts its weight gradients on version {self.weights.version_of[('W', b)]}")
        if pending is not None:
            self._add_gradients(weight_gradients(pending))
        self.weights.used(v)
        self.backwards += 1

    def _add_gradients(self, grads) -> None:
        for live, grad in zip(self.live, grads):
            if grad is not None:
                live.grad = grad.detach() if live.grad is None else live.grad.add_(grad)

    def mean_gradients(self, allreduce: Allreduce | None = None) -> None:
        """First half of a step: `.grad` of every live weight becomes the mean gradient of the
        backwards since the last step, over the replicas (`allreduce` sums a flat buffer)."""
        if allreduce is None:  # one replica: scale the gradients in place, no flat buffer
            self.weights.keep_current()
            if self.backwards > 1:
                for p in self.live:
                    if p.grad is not None:
                        p.grad.div_(self.backwards)
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
            optim.clip([p.grad for p in self.live if p.grad is not None], self.clip_budget, norm)
        self.step_log.append((lr, norm if self.clip_budget is not None else None,
                              whole or self.schedule.stages == 1, skipped))
        self._step_optimizer(skipped)
        self.steps_taken += 1

    def unscale(self) -> None:
        """fp16: divide this step's gradients by the loss scale (once per step)."""
        if self.loss_scale is not None and not self.unscaled:
            grads = [p.grad for p in self.live if p.grad is not None]
            if grads:
                torch._foreach_mul_(grads, self.per_step_last / self.loss_scale.value)
            self.unscaled = True

    def squared_norm(self) -> float:
        """The squared norm of this stage's gradients (a tied parameter's only in its owner stage),
        unscaled; not finite when one overflowed."""
        self.unscale()
        return optim.squared_norm([p.grad for p in self.owned if p.grad is not None])

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

    def _step_optimizer(self, skip: bool = False) -> None:
        if self.optimizer is not None:
            if not skip:
                self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)
        self.unscaled = False
        self.backwards = 0
        self.weights.advance()


class VersionStore:
    """The weight versions one worker keeps (PipeDream's weight stashing): which version each of its
    forwards, backwards and weight-gradient passes uses (`Schedule.versions`), the live weights'
    version, and a copy of every older version some action still needs, dropped after its last
    use. A version whose every use comes before the step that replaces it runs on the live weights
    themselves, with no copy (always in flush and gpipe, and on the last stage in pipedream)."""

    def __init__(self, *, names: list[str], live: list[torch.nn.Parameter], actions: tuple[Action, ...],
                 versions: dict):
        self.names, self.live = names, live
        self.version_of = {(a.kind, a.minibatch): versions[(a.kind, a.stage, a.minibatch)]
                           for a in actions if a.kind != "U"}
        self.uses: dict[int, int] = {}
        for v in self.version_of.values():
            self.uses[v] = self.uses.get(v, 0) + 1
        self.live_ok = self._done_before_their_step(actions)
        self.current = 0  # version of the live weights
        self.stashed: dict[int, dict[str, torch.Tensor]] = {}
        self.peak = 0     # most stashed versions held at once (live weights not counted)

    def _done_before_their_step(self, actions: tuple[Action, ...]) -> set[int]:
        """Versions whose every use comes before the step that replaces them."""
        last_use: dict[int, int] = {}
        steps: list[int] = []
        for index, action in enumerate(actions):
            if action.kind == "U":
                steps.append(index)
            else:
                last_use[self.version_of[(action.kind, action.minibatch)]] = index
        return {v for v, index in last_use.items() if v >= len(steps) or index < steps[v]}

    def _snapshot(self) -> dict[str, torch.Tensor]:
        return {n: p.detach().clone().requires_grad_(p.requires_grad) for n, p in zip(self.names, self.live)}

    def _stash(self, v: int) -> None:
        self.stashed[v] = self._snapshot()
        self.peak = max(self.peak, len(self.stashed))

    def get(self, v: int) -> dict[str, torch.Tensor]:
        """The weights of version v by name: the live ones, or the copy kept of it."""
        if v == self.current and v in self.live_ok:
            return dict(zip(self.names, self.live))
        if v not in self.stashed:
            if v != self.current:
                raise LaunchError(f"weight version {v} was needed but not kept (live version {self.current}); the "
                                  "schedule is inconsistent")
            self._stash(v)
        return self.stashed[v]

    def used(self, v: int) -> None:
        """One use of version v is done; its copy goes with its last."""
        self.uses[v] -= 1
        if self.uses[v] == 0:
            self.stashed.pop(v, None)

    def keep_current(self) -> None:
        """Before the live weights change: keep a copy of their version if a later action needs it."""
        if self.uses.get(self.current, 0) > 0 and self.current not in self.stashed:
            self._stash(self.current)

    def advance(self) -> None:
        """The live weights took a step: a new version, the old one's copy gone if nothing needs it."""
        self.current += 1
        if self.uses.get(self.current - 1, 0) == 0:
            self.stashed.pop(self.current - 1, None)
