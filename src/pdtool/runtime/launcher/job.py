"""What `pd train` decides before it starts workers, and what it expects of them.

`prepare` turns a plan and the user's options into the `RunConfig` the workers run: it runs
the launcher's checks (`preflight`: the model, the plan's split, the mode, the first minibatch),
turns epochs into steps, picks the device and the threads per CPU worker, and says what would
make the measurement differ from the prediction. `expected_ms` is the prediction a run is
compared with. The CLI only parses options and prints; benches and tests call these directly.
"""
from __future__ import annotations

import dataclasses
import math
import os
from dataclasses import dataclass
from typing import Callable

import torch

from ...artifacts.plan import Plan
from ...errors import LaunchError
from ...signals import deadline
from ..worker import shm
from .preflight import Checked, preflight
from ...schedule import Run
from ...schedule.modes import GROUP, listed, modes_where
from ..run import RunConfig, check_shard, checked_run, resolved


@dataclass(frozen=True, kw_only=True)
class Job:
    """A run ready to start, resolved once: its plan (read once), its config, what the settings
    resolve to (`run`: the mode's row, the group, minibatches per step), the launcher's checks,
    and this machine's share (`local` workers, `cores`, `on_cpu`) for explaining a measurement.
    The session, the views and the settings record read it; nobody resolves the run again."""

    plan: Plan
    config: RunConfig
    run: Run
    checked: Checked
    local: int
    cores: int
    on_cpu: bool


def prepare(plan: Plan, config: RunConfig, *, epochs: int | None = None, nnodes: int = 1,
            nproc_per_node: int | None = None, warn: Callable[[str], None] = lambda message: None,
            imports: Callable[[tuple[str, ...]], None] = lambda modules: None) -> Job:
    """Check everything the files and options show, before any worker starts (one line each),
    and fill in the steps (from `epochs`) and the threads per CPU worker. `imports` is called with
    the modules the model's classes come from as soon as the checks know them (`preflight`)."""
    run = resolved(plan, config)  # mode, group, minibatches per step: the only place the launcher resolves them
    check_shard(plan, config)
    unsharding = config.shard == "none" and any(s.shard != "none" for s in plan.stages)
    plan = plan.with_shard(config.shard)  # what each stage shards (--shard, else the plan's): memory, prediction
    checked = _checked(plan, config, run.name, warn, imports)
    config = dataclasses.replace(config, capture=checked.capture, modules=checked.modules,
                                 precision=config.precision or plan.profile.precision)
    _check_shardable(plan, checked.capture)
    if config.precision == "fp16" and run.mode.per_round and len(plan.stages) > 1:
        raise LaunchError(f"--precision fp16 skips a step whose gradients overflow on every stage at once, and in mode "
                          f"{run.name} the stages step after different minibatches; use --precision bf16 (no loss "
                          f"scaling) or a mode whose stages step together ({listed(modes_where(steps=GROUP))})")
    if config.optimizer.is_factory:  # the user's optimizer factory, called once here rather than in every worker
        from ..optimizers import check_optimizer

        check_optimizer(config.optimizer)
    check_memory(plan, config, run, unsharding)
    config = dataclasses.replace(config, eval_batches=held_out_batches(plan, config, checked.keywords))
    checked_run(plan, config)  # a mode, group or drain that cannot run: one line (the session does not check again)
    if epochs:
        config = dataclasses.replace(config, steps=steps_for_epochs(epochs, checked.batches_per_epoch, run.per_step))
    check_warmup(config)
    local = nproc_per_node or len(plan.used_ranks) // nnodes
    cores = os.cpu_count() or 1
    from ..device import choose, visible_gpus

    on_cpu = choose(config.device, 0, local).device.type == "cpu"  # a device this machine lacks fails here
    gpus = visible_gpus()
    if config.device == "auto" and 0 < gpus < local:
        warn(f"torch sees {gpus} GPU(s) for {local} workers on this machine, so they train on the CPU; NCCL needs a "
             "GPU per worker (plan for fewer workers per machine to use the GPUs)")
    if on_cpu and config.threads is None:  # torch's default (every core in every worker) oversubscribes
        config = dataclasses.replace(config, threads=max(1, cores // local))
    if on_cpu and local * config.threads > cores:
        warn(f"{local} workers x {config.threads} thread(s) share {cores} CPU cores on this machine: the measured time "
             "per minibatch will exceed the plan's prediction, which gives every worker a core of its own")
    if config.transport == "shared-memory" and not (on_cpu and shm.available(torch.device("cpu"))):
        warn("--transport shared-memory needs CPU workers on x86 and a writable /dev/shm, which this machine's "
             "workers lack: their messages go through the process group")
    return Job(plan=plan, config=config, run=run, checked=checked, local=local, cores=cores, on_cpu=on_cpu)


def _checked(plan: Plan, config: RunConfig, mode: str, warn, imports) -> Checked:
    """The launcher's checks (`preflight`), within --startup-timeout."""
    overdue = LaunchError(f"the launcher's checks (importing and building the model, its first minibatch) took more "
                          f"than --startup-timeout {config.startup_timeout_s:g} s; raise it if the model takes that "
                          "long to build, else look at what its factory waits for")
    with deadline(config.startup_timeout_s, overdue):
        return preflight(plan, plan_path=config.plan_path, mode=mode, data=config.data, seed=config.seed,
                         model=config.model, init=config.init, warn=warn, imports=imports, init_from=config.init_from)


def with_capture(config: RunConfig, warn: Callable[[str], None] = lambda message: None) -> RunConfig:
    """`config` with the stages' capture and the model's modules, for a caller of `launch.launch`
    that did not run `prepare` (the Python API's lower level): the launcher's checks (`preflight`,
    from the capture cache where it holds this run) once here, rather than each worker capturing
    the model itself."""
    if config.capture is not None:
        return config
    plan = Plan.load(config.plan_path)
    checked = _checked(plan, config, resolved(plan, config).name, warn, lambda modules: None)
    return dataclasses.replace(config, capture=checked.capture, modules=checked.modules)


def check_warmup(config: RunConfig) -> None:
    """A warm-up longer than the learning rate's horizon (the run's steps, or --lr-decay-steps)
    trains at a fraction of --lr throughout: one line before any worker starts."""
    recipe = config.recipe
    warmup, horizon = recipe.schedule.warmup_steps, recipe.schedule.total_steps
    if warmup and horizon is not None and warmup > horizon:
        top = recipe.schedule.lr(recipe.lr, horizon - 1) / recipe.lr if recipe.lr > 0 else 0.0
        raise LaunchError(f"--warmup-steps {warmup} is longer than the run's {horizon} step(s): the learning rate "
                          f"would rise to only {top:.0%} of --lr; give --warmup-steps at most {horizon} (a few percent "
                          "of the run is usual), or more --steps")


def held_out_batches(plan: Plan, config: RunConfig, keywords: tuple[str, ...] = ()) -> int:
    """Minibatches of the held-out split a run evaluates on through the pipeline (`--eval-every`,
    `--evaluate`; 0 without): whole minibatches of the plan's size, the rest left out. A data set
    without a held-out split, with less than one minibatch of it, or whose items do not fit the
    model (`keywords`: its keyword inputs) is refused here in one line."""
    if not (config.eval_every or config.evaluate):
        return 0
    from ...model.data import collate, held_out, named_dataset_source

    option = "--eval-every" if config.eval_every else "--evaluate"
    dataset = held_out(config.data)
    if dataset is None:
        raise LaunchError(f"{option} needs a data set with a held-out split: --data digits, or a factory that takes "
                          "train=False")
    batches = len(dataset) // plan.profile.batch_size
    if batches == 0:
        raise LaunchError(f"{option}: the held-out split of {config.data} has {len(dataset)} samples, fewer than one "
                          f"minibatch of {plan.profile.batch_size} (the plan's); the pipeline evaluates whole "
                          "minibatches: give a larger split or profile a smaller batch")
    held = collate([dataset[0]], "the held-out split", [0], keywords)  # items the model takes, before any worker
    trained = collate([named_dataset_source(config.data, 1, config.seed, keywords).dataset[0]], "the training split",
                      [0], keywords)
    for what, a, b in _tensors_of(held, trained):
        if a is None or b is None or a.shape != b.shape or a.dtype != b.dtype:
            seen = lambda t: "nothing" if t is None else f"{tuple(t.shape[1:])} {str(t.dtype).removeprefix('torch.')}"
            raise LaunchError(f"{option}: the held-out split of {config.data} has {what} of {seen(a)} per item where "
                              f"the training split has {seen(b)}; give a held-out split of the training split's shapes")
    return batches


def _tensors_of(held, trained):
    """(what, held-out tensor, training tensor) of two collated minibatches, input by input, then the target."""
    (held_inputs, held_target), (inputs, target) = held, trained
    for i in range(max(len(held_inputs), len(inputs))):
        pick = lambda xs: xs[i] if i < len(xs) else None  # noqa: E731
        yield f"input {i}", pick(held_inputs), pick(inputs)
    if held_target is not None or target is not None:
        yield "a target", held_target, target


def _check_shardable(plan: Plan, capture) -> None:
    """`--shard parameters` shards each weight of a stage along its first dimension: a weight
    without one is one line here, before any worker starts (`worker.parameter_shard`)."""
    shapes = dict(capture.parameters)
    for info, stage in zip(capture.stages, plan.stages):
        if stage.shard == "parameters" and stage.replicas > 1:
            scalar = next((name for name in info.param_names.values() if shapes.get(name) == ()), None)
            if scalar is not None:
                raise LaunchError(f"--shard parameters shards each weight along its first dimension, but stage "
                                  f"{info.index}'s {scalar} has none; use --shard gradients")


def check_memory(plan: Plan, config: RunConfig, run: Run, unsharding: bool = False) -> None:
    """Refuse, in one line, a run whose mode and group hold more than the plan's cluster gives a
    worker (`cluster.memory`): the planner counts 1F1B's weight versions and minibatches in
    flight, and `--mode gpipe` or `zb2`, or a larger `--group`, hold more; `unsharding`: `--shard none`
    undid the plan's sharding (the line says so)."""
    limit = plan.cluster.memory
    if not limit:
        return
    from ...memory import memory_model
    from ...sim.simulate import simulate
    from ...units import format_bytes

    result = simulate(plan, mode=run.name, group=config.group, events=False)
    needs = memory_model(limit, config.optimizer.state_slots, config.precision or plan.profile.precision, run.name,
                         config.optimizer.weight_decay > 0, config.optimizer.name == "adamw").per_worker(plan, result)
    rank = max(needs, key=needs.get)
    if needs[rank] <= limit:
        return
    stage = next(s for s, st in enumerate(plan.stages) if rank in st.ranks)
    group = "" if run.mode.per_round else f" with {result.group} microbatches per step"
    raise LaunchError(
        f"{config.plan_path}: mode {run.name}{group} needs {format_bytes(needs[rank])} on each worker of stage {stage} "
        f"({result.peak_versions[rank]} weight version(s), {result.peak_in_flight[rank]} minibatch(es) in flight), "
        f"{format_bytes(needs[rank] - limit)} more than the {format_bytes(limit)} per worker of the plan's cluster; "
        + ("leave out --shard none (the plan shards the optimizer state of its replicated stages, which the limit "
           "needs), or " if unsharding else "")
        + "train with a mode or --group that holds less (pd simulate PLAN --mode M prints each worker's peaks), or "
        "plan over more workers (pd plan counts 1F1B's versions and minibatches in flight)")


def steps_for_epochs(epochs: int, batches_per_epoch: int | None, per_step: int) -> int:
    """The steps of stage 0 that `epochs` passes over the data take."""
    if not batches_per_epoch:
        raise LaunchError("--epochs needs a data set with a size; --data synthetic is endless, use --steps")
    return math.ceil(epochs * batches_per_epoch / per_step)
