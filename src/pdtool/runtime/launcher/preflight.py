"""What `pd train` checks on the launching machine before any worker starts.

A mistake that the files and options show (a plan its model cannot run, a model that cannot
be built or is not the plan's, a split the model does not allow, tied weights in a mode that
cannot train them, data that does not fit the model) is one `PdtoolError` line within seconds,
not a worker's error after the job has started. The launcher builds the model and its stages
exactly as a worker will (same factory, same tracer, same split) and runs the first minibatch
of the data through every stage and the loss, without gradients.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ...model.data import load_source
from ...errors import LaunchError, PdtoolError
from ...model.spec import file_model
from ...artifacts.plan import Plan
from ..worker import tied
from ...model.stages import plan_stages, sample_inputs


@dataclass(frozen=True)
class Checked:
    """What the checks learnt that the launcher needs: minibatches in one epoch of the data
    (None for endless synthetic data), and the whole-model names and shapes of the parameters
    the stages hold (what a checkpoint to resume from must contain)."""

    batches_per_epoch: int | None
    parameters: dict[str, tuple[int, ...]] = field(default_factory=dict)


def preflight(plan: Plan, plan_path: str, mode: str, data: str, seed: int, model: str | None = None) -> Checked:
    """Check that the workers can run `plan` in `mode` (the run's, `schedule.resolve`) on `data`;
    raise one line when not.
    `model`: the spec the user named instead of the plan's (`pd train -m`)."""
    problem = plan.untrainable(mode)
    if problem is not None:
        raise LaunchError(f"{plan_path}: {problem}")
    if plan.profile.model is None:
        raise LaunchError(f"{plan_path} was planned from an imported profile with no model; "
                          "profile the model with pd profile --model and plan that profile")
    torch.manual_seed(seed)
    bundle = file_model(plan.profile.model, model)
    stages = plan_stages(plan, bundle.module, sample_inputs(bundle, plan))
    tied.check_mode(stages, mode)
    source = load_source(data, bundle, plan.profile.batch_size, seed)
    inputs, target = source.batch(0)
    _run_once(stages, bundle.loss_fn, inputs, target, data)
    return Checked(source.batches_per_epoch, {stage.param_names[n]: tuple(p.shape) for stage in stages
                                              for n, p in stage.module.named_parameters()})


def _run_once(stages, loss_fn, inputs, target, data: str) -> None:
    """The first minibatch through every stage and the loss function, without gradients."""
    shapes = ", ".join(f"{tuple(t.shape)} {str(t.dtype).removeprefix('torch.')}" for t in inputs
                       if isinstance(t, torch.Tensor))
    try:
        with torch.no_grad():
            values = dict(zip(stages[0].inputs, inputs))
            for stage in stages:
                values = stage.forward(values)
            loss = loss_fn(values["output"], target)
    except PdtoolError:
        raise
    except Exception as exc:
        text = str(exc).strip()
        first = text.splitlines()[0] if text else ""
        raise LaunchError(f"the first minibatch of --data {data} (inputs {shapes}) does not fit the model: "
                          f"{type(exc).__name__}: {first}; give data of the shapes the model was profiled with "
                          "(the profile's inputs), or profile the model again") from None
    if not (isinstance(loss, torch.Tensor) and loss.dim() == 0):
        raise LaunchError(f"the loss function returned {type(loss).__name__} for --data {data}, not a scalar tensor; "
                          "fix the model factory's loss function")
