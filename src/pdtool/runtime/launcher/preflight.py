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
from ...model.capture import Capture, cut, model_modules
from ...model.program import check
from ...model.data import load_source, named_dataset_source
from ...consent import consent
from ...model.dryrun import described
from .. import ties
from . import capture_cache


@dataclass(frozen=True, kw_only=True)
class Checked:
    """What the checks learnt that the launcher needs: minibatches in one epoch of the data
    (None for endless synthetic data), the whole-model names and shapes of the parameters
    the stages hold (what a checkpoint to resume from must contain), the `capture` the workers
    build their stages from, and the model's keyword inputs (`ModelBundle.keywords`)."""

    batches_per_epoch: int | None
    parameters: dict[str, tuple[int, ...]] = field(default_factory=dict)
    capture: Capture | None = None
    keywords: tuple[str, ...] = ()
    cached: str | None = None  # the capture cache's entry the capture came from (`capture_cache`), if it did
    modules: tuple[str, ...] = ()  # those the model's classes come from (`model.capture.model_modules`)


def preflight(plan: Plan, *, plan_path: str, mode: str, data: str, seed: int, model: str | None = None,
              init: str = "rule", warn: Callable[[str], None] = lambda message: None,
              imports: Callable[[tuple[str, ...]], None] = lambda modules: None,
              init_from: str | None = None) -> Checked:
    """Check that the workers can run `plan` in `mode` (the run's, `schedule.resolve`) on `data`;
    raise one line when not. `model`: the spec the user named instead of the plan's (`pd train
    -m`); `init`: `pd train --init` (`model.build`); `imports` hears the modules the model's
    classes come from as soon as they are known (from `capture_cache` before the model is built,
    else once it is); `init_from`: `pd train --init-from` (its files' names and shapes checked
    against the stages', `model.weights`)."""
    problem = plan.untrainable(mode)
    if problem is not None:
        raise LaunchError(f"{plan_path}: {problem}")
    if plan.profile.model is None:
        raise LaunchError(f"{plan_path} was planned from an imported profile with no model; "
                          "profile the model with pd profile --model and plan that profile")
    name = capture_cache.key(plan.to_json(), data, model, init)
    entry = capture_cache.lookup(name, warn)
    if entry is not None:
        checked = _from_cache(
            entry=entry, plan=plan, mode=mode, data=data, seed=seed, model=model, warn=warn, imports=imports
        )
        if checked is not None:
            _check_init_from(init_from, checked.capture)
            return checked
    said: list[str] = []
    with capture_cache.Reads() as read:  # a config file the factory builds the model from is part of the capture
        bundle, on_meta = build_model(plan.profile.model, model, seed, init, lambda message: (said.append(message),
                                                                                             warn(message)))
    modules = model_modules(bundle)
    imports(modules)  # (a forkserver told an entry's modules already keeps those: the first telling counts)
    if on_meta:
        check_initialisable(bundle.module)
    stages = cut(plan, bundle)
    ties.check_mode(stages, mode)
    source = load_source(data, bundle, plan.profile.batch_size, seed)
    inputs, target = source.batch(0)
    capture = described(stages, bundle, inputs, target, data, seed, on_meta)
    batch = capture_cache.signature(inputs, target, bundle.keywords)
    if batch is not None:
        files = capture_cache.loaded_files(read)
        capture_cache.store(
            name,
            capture_cache.Entry(capture=capture.to_json(), batch=batch, modules=list(modules),
                                keywords=list(bundle.keywords), warnings=said, files=files,
                                hashes=capture_cache.content_hashes(files)),
        )
    _check_init_from(init_from, capture)
    return Checked(batches_per_epoch=source.batches_per_epoch, parameters=dict(capture.parameters), capture=capture,
                   keywords=bundle.keywords, modules=tuple(modules))


def _from_cache(*, entry: capture_cache.Entry, plan: Plan, mode: str, data: str, seed: int, model: str | None,
                warn: Callable[[str], None], imports: Callable[[tuple[str, ...]], None]) -> Checked | None:
    """The checks of a run whose capture is in the cache (`capture_cache`), without building the
    model: what they found is what they found for the same plan, model files and options, except
    the data, whose first minibatch must have the cached shapes (else None: check it all again).
    The entry is data: its programs may call only what `model.program.Allowed` lets them, and its
    modules are told to the workers' forkserver only once the plan's model passed consent."""
    consent(model or plan.profile.model["spec"], given=model is not None)  # as the build would, importing nothing
    try:
        capture = Capture.from_json(entry.capture)
        for info in capture.stages:
            if info.program is not None:
                check(info.program, entry.modules)
    except LaunchError as exc:
        warn(f"capture cache entry {entry.path} is not used: {str(exc).partition(' (')[0]}; capturing again")
        return None
    except (KeyError, TypeError, ValueError, AttributeError, RecursionError):
        return None
    imports(tuple(entry.modules))  # the workers' forkserver imports the model's modules now
    keywords = tuple(entry.keywords)
    source = None
    if data != "synthetic":  # synthetic minibatches are the model factory's own, as before
        source = named_dataset_source(data, plan.profile.batch_size, seed, keywords)
        if not entry.fits(capture_cache.signature(*source.batch(0), keywords)):
            return None
    for message in entry.warnings:
        warn(message)
    ties.check_mode(capture.stages, mode)
    return Checked(batches_per_epoch=source.batches_per_epoch if source is not None else None,
                   parameters=dict(capture.parameters), capture=capture, keywords=keywords, cached=entry.path,
                   modules=tuple(entry.modules))


def _check_init_from(init_from: str | None, capture: Capture) -> None:
    """`pd train --init-from`: its files hold every stage's parameters, of their shapes and dtypes."""
    if init_from:
        from ...model.weights import WeightFiles

        WeightFiles.open(init_from).check(dict(capture.parameters),
                                          {b for info in capture.stages for b in info.buffer_names.values()},
                                          dtypes=capture.dtypes)
