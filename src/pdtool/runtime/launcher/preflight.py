"""What `pd train` checks on the launching machine before any worker starts.

A mistake that the files and options show (a plan its model cannot run, a model that cannot
be built or is not the plan's, a parameter the initialization rule cannot set, a split the
model does not allow, tied weights in a mode that cannot train them, data that does not fit
the model) is one `PdtoolError` line within seconds, not a worker's error after the job has
started. None of it needs the model's weights: the launcher builds the model with its
parameters on `meta` (`model.build`), captures the plan's stages once (`model.capture`: the
workers build theirs from this capture) and runs the first minibatch of the data through every
stage and the loss on fake tensors (`model.dryrun`).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable


from ...errors import LaunchError
from ...artifacts.plan import Plan
from ...model.build import build_model, check_initialisable
from ...model.capture import Capture, cut
from ...model.data import load_source
from ...model.dryrun import described
from ..worker import tied


@dataclass(frozen=True)
class Checked:
    """What the checks learnt that the launcher needs: minibatches in one epoch of the data
    (None for endless synthetic data), the whole-model names and shapes of the parameters
    the stages hold (what a checkpoint to resume from must contain), the `capture` the workers
    build their stages from, and the model's keyword inputs (`ModelBundle.keywords`)."""

    batches_per_epoch: int | None
    parameters: dict[str, tuple[int, ...]] = field(default_factory=dict)
    capture: Capture | None = None
    keywords: tuple[str, ...] = ()


def preflight(plan: Plan, plan_path: str, mode: str, data: str, seed: int, model: str | None = None,
              init: str = "rule", warn: Callable[[str], None] = lambda message: None,
              built: Callable = lambda model: None, init_from: str | None = None) -> Checked:
    """Check that the workers can run `plan` in `mode` (the run's, `schedule.resolve`) on `data`;
    raise one line when not. `model`: the spec the user named instead of the plan's (`pd train
    -m`); `init`: `pd train --init` (`model.build`); `built` hears the model once it is built; `init_from`: `pd train --init-from` (its files'
    names and shapes checked against the stages', `model.weights`)."""
    problem = plan.untrainable(mode)
    if problem is not None:
        raise LaunchError(f"{plan_path}: {problem}")
    if plan.profile.model is None:
        raise LaunchError(f"{plan_path} was planned from an imported profile with no model; "
                          "profile the model with pd profile --model and plan that profile")
    bundle, on_meta = build_model(plan.profile.model, model, seed, init, warn)
    built(bundle)
    if on_meta:
        check_initialisable(bundle.module)
    stages = cut(plan, bundle)
    tied.check_mode(stages, mode)
    source = load_source(data, bundle, plan.profile.batch_size, seed)
    inputs, target = source.batch(0)
    capture = described(stages, bundle, inputs, target, data, seed, on_meta)
    if init_from:
        from ...model.weights import WeightFiles

        WeightFiles.open(init_from).check(dict(capture.parameters),
                                          {b for info in capture.stages for b in info.buffer_names.values()})
    return Checked(source.batches_per_epoch, dict(capture.parameters), capture, bundle.keywords)
