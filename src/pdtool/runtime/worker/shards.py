"""Saving a worker's stage into checkpoints and restoring it, by whole-model names.

A checkpoint "at step K" holds every stage's weights after the optimizer steps that cover
the minibatches of stage 0's first K steps (K * g0 minibatches) and nothing of later ones. The
schedule drains the pipeline there (`worker.checkpoint_drain`: flush, gpipe, zb and zb2 drain
before every step, pipedream, vsync and 2bw at every periodic checkpoint, and every run at its
end), so no minibatch is in flight: the shards are all a resumed run needs, and one resumed from
a periodic checkpoint with the same interval repeats the uninterrupted run bit for bit. In
`flush`, `gpipe`, `zb`, `zb2` and `2bw` every stage steps once per group, so all shards hold
exactly K steps; in `pipedream` and `vsync` a replicated stage steps once per round of its r_s
replicas: a periodic checkpoint falls between two rounds (its interval is a multiple of every
r_s), the one at the end after the last, possibly partial, round. A shard is written right after
the step that completes it, before the worker's next forward. Only replica 0 of a stage writes
(its replicas are equal after their all-reduce; with `--shard optimizer` every replica gives it
its slices of the optimizer state first, `optimizer_shard`). Parameters, buffers (e.g. BatchNorm
statistics) and optimizer state are keyed by their names in the whole model (`layer1.0.conv1.weight`,
`layer1.0.conv1.weight::momentum_buffer`), so a run may resume under another plan.
"""
from __future__ import annotations

import math
from pathlib import Path

import torch

from ...artifacts.checkpoint import checkpoint_folder, load_checkpoint, save_shard
from ...errors import LaunchError
from ...schedule import step_group
from ..ties import owner
from .executor import StageWorker
from .parameter_shard import full, load

SEPARATOR = "::"


def stage_state(worker: StageWorker, keep: bool = True) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """(parameters and buffers, optimizer state) of the worker's stage, by whole-model names; a
    tied parameter (and its optimizer state) or a buffer of several stages only in the shard of
    its lowest stage. A replica of a sharded optimizer that does not write (`keep` False) gives
    its state slices to the one that does and gets no optimizer state."""
    stage = worker.stage
    ties = stage.tied
    mine = {n for n, _ in stage.module.named_parameters() if n not in ties or owner(ties[n]) == stage.index}
    # sharded parameters gathered whole (a collective every replica of the stage calls, in one order)
    tensors = {stage.param_names[n]: full(p.detach()) for n, p in stage.module.named_parameters() if n in mine}
    buffer_names, shared = stage.buffer_names, stage.shared_buffers
    tensors.update({buffer_names[n]: b.detach() for n, b in stage.module.named_buffers()
                    if n in buffer_names and (n not in shared or owner(shared[n]) == stage.index)})
    extra: dict[str, torch.Tensor] = {}
    if worker.stepper.optimizer is None:
        return tensors, extra
    # sharded across replicas: gathered (every replica calls this at once; `keep` False: it gives its slices only)
    state = worker.stepper.param_state(keep)
    for name, p in zip(worker.names, worker.live):
        if name not in mine:
            continue  # a tied copy: the owner's shard holds it (runtime.worker.tied)
        for key, value in state.get(p, {}).items():
            if isinstance(value, torch.Tensor):
                extra[f"{stage.param_names[name]}{SEPARATOR}{key}"] = value.detach()
    return tensors, extra


class ShardSaver:
    """Writes the worker's shard at the checkpoint steps of a run (see the module docstring).

    `first_step` is the step the run starts from (after a resume), `steps` how many it runs,
    `every` the steps between checkpoints (0: only at the end; the schedule drains at each, see
    `worker.checkpoint_drain`), `per_step` the minibatches per step of stage 0, `run` the run's id
    (in the shard's name and payload).
    """

    def __init__(self, worker: StageWorker, root: str, first_step: int, steps: int, every: int, per_step: int,
                 run: str | None = None, write: bool = True):
        self.worker = worker
        self.write = write  # False: a replica of a sharded optimizer, which only gives its state to replica 0's shard
        self.root = Path(root)
        self.run = run
        own = step_group(worker.schedule, worker.index)
        marks = set(range(every, steps + 1, every)) if every else set()
        marks.add(steps)
        self.due = {math.ceil(k * per_step / own): first_step + k for k in sorted(marks)}
        self.count = 0

    def after_step(self) -> bool:
        """Count a step of this worker; write its shard when a checkpoint is due (returns whether)."""
        self.count += 1
        step = self.due.get(self.count)
        if step is not None:
            tensors, extra = stage_state(self.worker, keep=self.write)
            if not self.write:
                return True
            folder = checkpoint_folder(self.root, step)
            bad = next((name for name, t in tensors.items() if t.is_floating_point() and not torch.isfinite(t).all()),
                       None)
            if bad is not None:  # no shard: this checkpoint stays incomplete, --resume takes the one before
                raise LaunchError(f"weight {bad} of stage {self.worker.index} is not finite at step {step}: training "
                                  "diverged; lower --lr, then --resume from the last complete checkpoint")
            try:
                save_shard(folder, self.worker.index, tensors, extra, self.run)
            except OSError as exc:  # a read-only or full file system
                raise LaunchError(f"stage {self.worker.index} cannot write its checkpoint shard into {folder} "
                                  f"({exc.strerror or exc}); give a --checkpoint-dir with room that you can write to, "
                                  "then --resume") from None
        return step is not None


def restore(worker: StageWorker, folder: str) -> None:
    """Load the worker's stage (weights, buffers, optimizer state) from a complete checkpoint."""
    manifest, tensors, extra = load_checkpoint(folder)
    stage = worker.stage
    with torch.no_grad():
        for name, p in stage.module.named_parameters():
            qualified = stage.param_names[name]
            if qualified not in tensors:
                raise LaunchError(f"checkpoint {folder} has no parameter {qualified}; it was saved from another model")
            if tensors[qualified].shape != p.shape:  # a sharded parameter's shape is the whole one
                raise LaunchError(f"checkpoint {folder}: {qualified} has shape {tuple(tensors[qualified].shape)}, "
                                  f"the model {tuple(p.shape)}; it was saved from another model")
            load(p, tensors[qualified])  # sharded: this replica's part
        buffer_names = stage.buffer_names
        for name, b in stage.module.named_buffers():
            if buffer_names.get(name) in tensors:
                b.copy_(tensors[buffer_names[name]])
    if worker.stepper.optimizer is not None:
        found = {}
        for name, p in zip(worker.names, worker.live):
            prefix = f"{stage.param_names[name]}{SEPARATOR}"
            state = {key[len(prefix):]: _state_value(key[len(prefix):], value, p)
                     for key, value in extra.items() if key.startswith(prefix)}
            if state:
                found[p] = state
        worker.stepper.load_param_state(found)


def _state_value(key: str, value, param: torch.Tensor):
    """An optimizer state entry on the parameter's device, floating ones in its dtype (Adam's step
    count stays as saved, on the CPU, as torch's own `Optimizer.load_state_dict` keeps it)."""
    if not isinstance(value, torch.Tensor):
        return value
    if key == "step":
        return value.clone()
    return value.to(param.device, dtype=param.dtype if value.is_floating_point() else value.dtype, copy=True)
