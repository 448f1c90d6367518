"""One worker's share of training: forward and backward of one stage replica, and its weight versions.

`StageWorker` is the numerical core that both interpreters of a schedule use that run
tensors: the distributed runtime (one `StageWorker` per process, messages over
torch.distributed) and the reference executor (all of them in one process, messages in
dictionaries). It knows nothing about communication.

**Weight versions** (docs/schedules.md). "Version v" of a stage is its weights after v
optimizer steps; the schedule says which version every forward and backward uses
(`Schedule.versions`). A forward runs the stage with `torch.func.functional_call` on the
tensors of its version (or, when that is the live weights, calls the module itself: swapping
parameters in costs ~0.1 ms a forward on small layers), so autograd records exactly those
tensors and the backward computes gradients for that version, however many steps the live weights have taken since
(weight stashing). A version a later action needs after the step that replaces it is kept
without copying at the forward: a forward on it runs on views of the live weights (`.data`),
and before the step the live weights move to a copy of their storage (`p.data = p.data.clone()`,
or a copy of the sharded optimizer's flat buffer), leaving the old storage to the version: one
copy per kept version (`schedule.stash_copies`, which the simulator prices), made after the
backwards that free older versions, so a worker holds the live weights and the versions in
flight, as the memory model plans. A version is freed after its last use.

**Gradients.** Each backward adds its parameter gradients to the live weights' `.grad` and is
counted; the step (`stepper.Stepper`: the mean over the replicas, clipping, the learning rate,
the optimizer) applies the mean gradient of the backwards since the last one.
"""
from __future__ import annotations

from typing import Any, Callable

import torch
from torch.func import functional_call

from ...model.data import derive_seed
from ...precision import autocast, message_dtype
from ...errors import LaunchError
from ...schedule import Action, Schedule, stash_copies
from ..run import OptimizerConfig
from .gradient_shard import reached
from .split_backward import ParameterNodes, add_weight_gradients, input_gradients, weight_gradients
from .optimizer_shard import ShardedOptimizer
from .stepper import Stepper


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
                 precision: str = "fp32", recompute: bool = False, sharded: bool | str = False, parameters=None):
        self.stage = stage
        self.seed, self.first = seed, first
        self.index = stage.index
        self.schedule = schedule
        self.replica = replica
        self.rank = schedule.rank(stage.index, replica)
        # its own actions (a worker of several stages runs one StageWorker a stage)
        self.actions: tuple[Action, ...] = tuple(a for a in schedule.workers[self.rank] if a.stage == self.index)
        self.last = stage.index == schedule.stages - 1
        self.loss_fn = loss_fn
        self.names = [name for name, _ in stage.module.named_parameters()]
        self.live = [p for _, p in stage.module.named_parameters()]
        self.precision = precision
        self.recompute = recompute
        self.weights = VersionStore(names=self.names, live=self.live, actions=self.actions,
                                    versions=schedule.versions())
        self.stepper = Stepper(stage=stage, schedule=schedule, names=self.names, live=self.live, weights=self.weights,
                               optimizer=optimizer, first=first, no_decay=no_decay, model_parameters=model_parameters,
                               precision=precision, sharded=sharded, replica=replica, parameters=parameters)
        if isinstance(self.stepper.optimizer, ShardedOptimizer):  # the live weights view its flat buffers
            self.weights.fresh_storage = self.stepper.optimizer.fresh_storage
        # --shard parameters (`parameter_shard`): `live` are this replica's shards; FSDP gathers what the graph uses
        self.parameters = parameters
        # minibatch -> (input leaves, outputs, version, weights); recomputing, (inputs, target, version, weights)
        self.stash: dict[int, tuple[dict, Any, int, dict]] = {}
        self._unchanged: dict[int, dict[str, int]] = {}  # recomputing: each stashed input's version counter
        self.split: dict[int, tuple[Any, int]] = {}  # minibatch -> (what its W needs, version) between B and W
        self.parameter_nodes = ParameterNodes()  # zb, zb2: the live weights' gradient accumulators, found once
        self.reducer = self.stepper.reducer  # --shard gradients: each parameter's gradient handed over when made
        for i, p in enumerate(self.live if self.reducer is not None else ()):
            self._hand_over(i, p)
        self.losses: dict[int, float] = {}

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
            seed = self.stepper.loss_seed()
            scaled = outputs if seed is None else outputs * seed
            roots, seeds = [scaled], [None]
        else:
            pairs = [(outputs[k], grads[k]) for k in outputs if outputs[k].requires_grad and grads.get(k) is not None]
            roots, seeds = [p[0] for p in pairs], [p[1] for p in pairs]
        wanted_inputs = [k for k, t in leaves.items() if t.requires_grad]
        inputs = [leaves[k] for k in wanted_inputs]
        self.weights.used(v)
        if self.parameters is not None:  # the parameters as gathered: what the graph used
            params = dict(zip(self.names, self.parameters.gathered()))
        if not weights:
            found, pending = (input_gradients(roots, seeds, inputs, list(params.values()), self.parameter_nodes)
                              if roots else ([], None))
            self.split[b] = (pending, v)
            return {k: g for k, g in zip(wanted_inputs, found) if g is not None}
        targets = list(params.values()) + inputs
        if self.reducer is not None:  # each weight's gradient handed over as autograd makes it (its hook)
            for i, p in enumerate(params.values()):
                self._hand_over(i, p)
            found_leaves = reached(roots)  # the weights it does not reach add zeros now (their buckets go on)
            for i, p in enumerate(params.values()):
                if id(p) not in found_leaves:
                    self.reducer.absent(i)
        if not (roots and targets):
            found = [None] * len(inputs)
        elif self.parameters is not None and not self.parameters.split:
            # FSDP's hooks gather each unit again, and reduce-scatter its gradients into the shards as they are made
            torch.autograd.backward(roots, seeds)
            found = [leaf.grad for leaf in inputs]
        elif self.parameters is not None:  # kept gathered until the step: the gradients accumulate whole
            torch.autograd.backward(roots, seeds, inputs=targets)
            found = [leaf.grad for leaf in inputs]
        elif self.reducer is not None or (self.live and targets[0] is self.live[0]):
            # the live weights (or, sharding gradients, a stashed version's copies): autograd adds to their .grad
            torch.autograd.backward(roots, seeds, inputs=targets)
            found = [leaf.grad for leaf in inputs]
        else:
            found = torch.autograd.grad(roots, targets, seeds, allow_unused=True)
            self._add_gradients(found[:len(params)])
            found = found[len(params):]
        self.stepper.backwards += 1
        return {k: g for k, g in zip(wanted_inputs, found) if g is not None}

    def weight_backward(self, b: int) -> None:
        """The weight gradients of minibatch b, whose `backward(b, weights=False)` ran: added to
        the live weights (the W of modes `zb`, `zb2`)."""
        pending, v = self.split.pop(b)
        if self.weights.version_of[("W", b)] != v:
            raise LaunchError(f"worker {self.rank}: minibatch {b} ran its backward on version {v} but the schedule "
                              f"puts its weight gradients on version {self.weights.version_of[('W', b)]}")
        if pending is not None and self.reducer is not None:
            for i, grad in enumerate(weight_gradients(pending)):
                if grad is not None:
                    self.reducer.take(i, grad)
        elif pending is not None:
            # the live weights' (a stashed version's gradient too); sharded parameters: the gathered ones'
            add_weight_gradients(pending, pending.params if self.parameters is not None else self.live)
        self.weights.used(v)
        self.stepper.backwards += 1

    def _hand_over(self, i: int, p: torch.Tensor) -> None:
        """With sharded gradients: parameter i's tensor `p` (live, or a stashed version's copy)
        hands each gradient autograd gives it to the reducer, keeping none (once per tensor)."""
        if getattr(p, "_pdtool_hands_over", False) or not p.requires_grad:
            return

        def hook(tensor: torch.Tensor) -> None:
            grad, tensor.grad = tensor.grad, None
            self.reducer.take(i, grad)

        p.register_post_accumulate_grad_hook(hook)
        p._pdtool_hands_over = True

    def _add_gradients(self, grads, params=None) -> None:
        """Add `grads` to the `.grad` of `params` (default: the live weights)."""
        for live, grad in zip(self.live if params is None else params, grads):
            if grad is not None:
                live.grad = grad.detach() if live.grad is None else live.grad.add_(grad)


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
        # the versions some action uses after the step that replaces them: copied (the simulator prices each copy)
        self.copied = stash_copies(versions, actions, actions[0].stage) if actions else {}
        self.current = 0  # version of the live weights
        self.stashed: dict[int, dict[str, torch.Tensor]] = {}
        self.sharing: int | None = None  # the version whose stash still shares the live weights' storage
        self.peak = 0     # most stashed versions held at once (live weights not counted)
        # gives the live weights new storage (a copy of theirs), leaving the old to the views that hold it
        self.fresh_storage: Callable[[], None] = self._fresh_storage

    def _fresh_storage(self) -> None:
        with torch.no_grad():
            for p in self.live:
                p.data = p.data.clone()

    def _view(self) -> dict[str, torch.Tensor]:
        """The live weights as a version of their own: views of their storage (no copy), which
        `keep_current` leaves that storage to when the live weights step. `.data`, not `detach()`:
        a view with a version counter of its own, which the live weights' in-place steps on their
        new storage do not touch (autograd would take them for changes of what it saved)."""
        return {n: p.data.requires_grad_(p.requires_grad) for n, p in zip(self.names, self.live)}

    def get(self, v: int) -> dict[str, torch.Tensor]:
        """The weights of version v by name: the live ones, or the version kept of it. The current
        version that a later action needs after the step is views of the live weights until the
        step (`keep_current`), so that a forward on it copies nothing and the copy the step makes
        comes after the backwards that free older versions."""
        if v == self.current and v not in self.copied:
            return dict(zip(self.names, self.live))
        if v not in self.stashed:
            if v != self.current:
                raise LaunchError(f"weight version {v} was needed but not kept (live version {self.current}); the "
                                  "schedule is inconsistent")
            self.stashed[v], self.sharing = self._view(), v
        return self.stashed[v]

    def used(self, v: int) -> None:
        """One use of version v is done; its copy goes with its last."""
        self.uses[v] -= 1
        if self.uses[v] == 0:
            self.stashed.pop(v, None)
            if self.sharing == v:
                self.sharing = None

    def keep_current(self) -> None:
        """Before the live weights change: keep their version if a later action needs it. The
        version keeps the live weights' storage (views of it; what a forward on it recorded) and
        the live weights step on a copy: one copy per kept version, made here."""
        if self.uses.get(self.current, 0) > 0:
            if self.current not in self.stashed:
                self.stashed[self.current], self.sharing = self._view(), self.current
            if self.sharing == self.current:
                self.fresh_storage()
                self.sharing = None
            self.peak = max(self.peak, len(self.stashed))  # every kept version now holds storage of its own

    def advance(self) -> None:
        """The live weights took a step: a new version, the old one's copy gone if nothing needs it."""
        self.current += 1
        if self.uses.get(self.current - 1, 0) == 0:
            self.stashed.pop(self.current - 1, None)
