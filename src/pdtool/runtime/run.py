"""What crosses from the launcher to the workers and back: the run's configuration
(`RunConfig`, with the recipe's `OptimizerConfig`), the settings and schedule it resolves to (`resolved`,
`make_schedule`, `checked_run`), the checks of a job against its plan (`place`, `check_world`),
and what a worker reports when it ends (`WorkerReport`).

The launcher decides with these before any worker starts; every worker makes the same
decisions from the same values. Pure: no torch (a report's weights are torch tensors, made by
the worker).
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from ..artifacts.plan import Plan
from ..errors import LaunchError
from ..schedule import Run, Schedule, checkpoint_unit, generate, step_group
from .recipe import OptimizerConfig

if TYPE_CHECKING:
    import torch

    from ..model.capture import Capture


DEVICES = ("auto", "cpu", "cuda")  # where a worker computes (`runtime.device.choose`)
INITS = ("rule", "factory")  # initial weights: `model.build`'s initialization rule, or the factory's own
TRANSPORTS = ("auto", "shared-memory", "process-group")  # how neighbours' messages travel (`worker.shm.use_shared_memory`)


@dataclass(frozen=True, kw_only=True)
class RunConfig:
    """Everything a worker needs besides the plan file (picklable: it crosses the launcher)."""

    plan_path: str
    steps: int
    mode: str | None = None
    group: int | None = None
    seed: int = 0
    optimizer: OptimizerConfig = OptimizerConfig()
    timeout_s: float = 60.0          # seconds a worker waits for a silent peer (a message, or a beat at start-up)
    startup_timeout_s: float = 600.0  # seconds start-up (import, model, stage, process groups) may take in all
    threads: int | None = None
    return_weights: bool = False
    data: str = "synthetic"          # "synthetic", "digits" or a pkg.module:factory of a Dataset
    first_step: int = 0              # steps already done (resume): minibatches start at first_step * group
    resume: str | None = None        # checkpoint folder to start from
    checkpoint_dir: str | None = None
    checkpoint_every: int = 0        # steps of stage 0 between checkpoints (0: only at the end)
    progress: bool = True            # the last stage's first replica reports progress on stderr
    device: str = "auto"             # auto, cpu or cuda (runtime.device)
    transport: str = "auto"          # auto, shared-memory or process-group (runtime.worker.shm.use_shared_memory)
    model: str | None = None         # pd train -m: the user's own spec instead of the plan's (pdtool.consent)
    run_id: str | None = None        # the run's id in its checkpoint shards and manifests (session.run sets it)
    init: str = "rule"               # pd train --init: the initialization rule, or the factory's values (model.build)
    capture: Capture | None = None   # every stage's program and message specs (the launcher's preflight)
    modules: tuple[str, ...] = ()    # those the model's classes come from (preflight): the forkserver imports them
    init_from: str | None = None     # pd train --init-from: a safetensors file or Hugging Face folder (model.weights)
    precision: str | None = None     # pd train --precision: fp32, bf16 or fp16 (None: the plan's profile's)
    metrics: str | None = None       # pd train --metrics: the CSV the launcher writes as the run goes (launcher.live)
    tensorboard: str | None = None   # pd train --tensorboard: the folder of its TensorBoard events
    eval_every: int | None = None    # pd train --eval-every: steps between evaluations through the pipeline
    evaluate: bool = False           # pd train --evaluate: an evaluation through the pipeline at the end
    eval_batches: int = 0            # held-out minibatches a round (the launcher counts them: `worker.evaluation`)
    settings: dict | None = None     # pd train's options as given (cli.settings): what `recorded_settings` records
    shard: str | None = None         # pd train --shard: none or optimizer for every replicated stage (None: the plan's)

    @property
    def live(self) -> bool:
        """Workers publish each step's figures for the launcher's live metrics."""
        return bool(self.metrics or self.tensorboard)

    @property
    def recipe(self) -> OptimizerConfig:
        """The optimizer settings with the schedule's horizon: the whole run's steps unless set."""
        return self.optimizer.with_horizon(self.first_step + self.steps)


@dataclass(kw_only=True)
class WorkerReport:
    """What a worker reports when it ends: its losses (last stage), time spent computing and
    waiting, the most weight versions it stashed, its memory, and (on request) its final weights."""

    rank: int
    stage: int
    replica: int
    losses: dict[int, float] = field(default_factory=dict)
    busy_s: float = 0.0
    wall_s: float = 0.0
    peak_versions: int = 0
    weights: dict[str, torch.Tensor] = field(default_factory=dict)  # on the CPU
    events: list[tuple[str, float, float]] = field(default_factory=list)  # (action, start, end) in epoch seconds
    finished: dict[int, float] = field(default_factory=dict)  # last stage: minibatch -> time its backward ended
    rings: int = 0  # directions of its links that went through shared memory (runtime.worker.shm)
    memory: dict[str, int] = field(default_factory=dict)  # bytes, as `worker.memory.measure` reports them
    step_memory: list[tuple[float, int]] = field(default_factory=list)  # (end of each step, bytes in use then)
    step_log: list[tuple] = field(default_factory=list)  # (end, lr, norm clipped at or None, whole model's?, skipped?)
    startup: dict[str, float] = field(default_factory=dict)  # epoch times: began, built (its stage), joined (the group)
    evals: list[tuple] = field(default_factory=list)  # last stage: (step, loss, accuracy or None, samples, began, end)


def make_schedule(plan: Plan, config: RunConfig) -> Schedule:
    """The schedule the plan runs: its mode (or --mode), config.steps steps of stage 0, its
    pipeline drained at every periodic checkpoint and evaluation (`drain_every`)."""
    run = resolved(plan, config)
    replicas = [s.replicas for s in plan.stages]
    return generate(run.name, replicas, config.steps * run.per_step, run.group,
                    drain_every=drain_every(run, replicas, config), placement=plan.placement)


def resolved(plan: Plan, config: RunConfig) -> Run:
    """The run's effective mode, group and minibatches per step (`schedule.resolve`)."""
    return plan.run(config.mode, config.group)


def recorded_settings(config: RunConfig, run: Run) -> dict:
    """What a run records of how it was configured (a checkpoint's manifest, the JSON beside
    --metrics): its options as given (`config.settings`: value and source of each) and what the
    launcher resolved them to (`run`: mode, group; and steps, precision, threads, the recipe)."""
    return {**(config.settings or {}), "resolved": {
        "mode": run.name, "group": run.group, "minibatches_per_step": run.per_step,
        "first_step": config.first_step, "steps": config.steps,
        "precision": config.precision, "threads": config.threads, "device": config.device,
        "transport": config.transport, "data": config.data, "seed": config.seed, "init": config.init,
        "shard": config.shard or "the plan's",
        "recipe": config.recipe.summary()}}


def sharded(plan: Plan, config: RunConfig) -> tuple[str | None, ...]:
    """Per stage, what its replicas shard (`optimizer`: the optimizer state,
    `worker.optimizer_shard`; `gradients`: also the gradients, `worker.gradient_shard`), None for
    nothing: `--shard` for every replicated stage, else the plan's choice per stage."""
    return tuple(stage.shard if stage.shard != "none" else None for stage in plan.with_shard(config.shard).stages)


def check_shard(plan: Plan, config: RunConfig) -> None:
    """A `--shard` that cannot run, in one line before any worker starts: no stage to shard, an
    optimizer that a flat slice would not step as it steps the parameters, or sharded gradients
    or parameters that a tied weight, the mode or the schedule rule out (`Plan.sharding_refusal`)."""
    if config.shard not in (None, "none") and not any(s.replicas > 1 for s in plan.stages):
        raise LaunchError(f"--shard {config.shard} shards a stage's state across its replicas, but no stage of "
                          f"{config.plan_path} has replicas; drop --shard, or plan with replicated stages "
                          "(pd plan without --straight)")
    if any(sharded(plan, config)) and config.optimizer.is_factory:
        kinds = "/".join(sorted({kind for kind in sharded(plan, config) if kind}))
        raise LaunchError(f"--shard {kinds} steps flat slices of a stage's parameters, which only the built-in "
                          f"optimizers (sgd, adam, adamw) step exactly as whole ones; optimizer {config.optimizer.name!r} "
                          "may compute per-tensor quantities: use --shard none or a built-in optimizer")
    if "parameters" in sharded(plan, config) and (config.eval_every or config.evaluate):
        raise LaunchError("--eval-every/--evaluate runs the held-out split through the first replica of each stage "
                          "alone, which cannot gather the weights of a stage whose replicas shard them (--shard "
                          "parameters); use --shard gradients, or evaluate the checkpoints in a run of their own")
    if {"gradients", "parameters"} & set(sharded(plan, config)):
        steps = max(config.checkpoint_every, config.eval_every or 0, plan.reduce_check_steps())
        refusal = plan.with_shard(config.shard).sharding_refusal(
            make_schedule(plan, dataclasses.replace(config, steps=steps)))
        if refusal:
            raise LaunchError(f"{config.plan_path}: {refusal}")



def checked_run(plan: Plan, config: RunConfig) -> Run:
    """The run's settings (`resolved`), after making its schedule for one drain's worth of steps
    (cheap): a mode, group, --checkpoint-every or --eval-every that cannot run is refused here, in one line."""
    make_schedule(plan, dataclasses.replace(config, steps=max(config.checkpoint_every, config.eval_every or 0, 1)))
    return resolved(plan, config)


def eval_steps(config: RunConfig, per_step: int) -> tuple[int, ...]:
    """The steps (counted over the whole training, as the metrics do) after which the run
    evaluates through the pipeline (`evaluation_points`)."""
    if not (config.eval_every or config.evaluate) or not config.eval_batches:
        return ()
    return tuple(config.first_step + p // per_step
                 for p in evaluation_points(config.steps * per_step, per_step, config.eval_every, config.evaluate))


def evaluation_points(minibatches: int, per_step: int, every: int | None, at_end: bool) -> tuple[int, ...]:
    """The minibatches of a run after which it evaluates through the pipeline (`worker.evaluation`):
    every `every` steps of `per_step` minibatches (None: never) and, with `at_end`, after the last."""
    found = list(range(every * per_step, minibatches + 1, every * per_step)) if every else []
    if at_end and minibatches not in found:
        found.append(minibatches)
    return tuple(found)


def drain_every(run: Run, replicas: list[int], config: RunConfig) -> int | None:
    """Minibatches between the points where the run's schedule drains the pipeline: its periodic
    checkpoints (`checkpoint_drain`) and its evaluations through the pipeline (`--eval-every N`:
    every N steps; the same rule on N), both when given (every multiple of their gcd)."""
    drains = [d for d in (checkpoint_drain(run, replicas, config), _eval_drain(run, replicas, config)) if d]
    return math.gcd(*drains) if drains else None


def _eval_drain(run: Run, replicas: list[int], config: RunConfig) -> int | None:
    return _drain(run, replicas, "--eval-every", config.eval_every, "an evaluation must")


def checkpoint_drain(run: Run, replicas: list[int], config: RunConfig) -> int | None:
    """Minibatches between the periodic checkpoints of a run (`--checkpoint-dir` with
    `--checkpoint-every K`: K steps of stage 0, `per_step` minibatches each; None without), where
    its schedule drains the pipeline: a checkpoint then holds every minibatch before it and
    nothing after, and a run resumed from it with the same K is the uninterrupted run, bit for
    bit. In the modes that step a replicated stage once per round of its r_s replicas (pipedream,
    vsync), K * per_step must be a multiple of every r_s (a one-line LaunchError says which K do)."""
    return _drain(run, replicas, "--checkpoint-every", config.checkpoint_every if config.checkpoint_dir else 0,
                  "a checkpoint that resumes exactly must")


def _drain(run: Run, replicas: list[int], option: str, steps: int | None, what: str) -> int | None:
    """Minibatches of `steps` steps of stage 0 (None for none), where a drain falls between two
    steps of every stage (`checkpoint_unit`); else a one-line LaunchError naming the `option`
    values that do."""
    if not steps:
        return None
    unit = checkpoint_unit(run.name, replicas, run.per_step)
    if steps % unit:
        raise LaunchError(
            f"{option} {steps}: in mode {run.name} the stages, replicated {'-'.join(map(str, replicas))}, step once "
            f"per round of their replicas, so {what} fall after a multiple of {math.lcm(*replicas)} minibatches "
            f"({unit} steps); use {option} {unit * -(-steps // unit)}")
    return steps * run.per_step


def stages_here(plan: Plan, rank: int) -> tuple[int, ...]:
    """The stages global `rank` runs: one, or a worker of several stages' (the plan's placement)."""
    place(plan, rank)  # one line for a rank with none
    return tuple(s for s, stage in enumerate(plan.stages) if rank in stage.ranks)


def place(plan: Plan, rank: int) -> tuple[int, int]:
    """(stage, replica) that global `rank` runs in the plan."""
    for s, stage in enumerate(plan.stages):
        if rank in stage.ranks:
            return s, stage.ranks.index(rank)
    raise LaunchError(f"rank {rank} has no stage in the plan (ranks {list(plan.used_ranks)}); "
                      "start one worker per rank of the plan")


def minibatches_per_step(schedule: Schedule) -> int:
    """Minibatches that one optimizer step of stage 0 covers."""
    return step_group(schedule, 0)


def check_world(plan: Plan, world: int, plan_path: str) -> None:
    """Refuse, in one line, a job of `world` workers that cannot run `plan`: another number of
    workers than its ranks, or a plan without a model to build."""
    used = plan.used_ranks
    if world != len(used) or used != tuple(range(world)):
        raise LaunchError(f"the plan runs on ranks {_ranges(used)} but {world} workers were started; "
                          f"start exactly {len(used)} workers (pd train does that on one machine)")
    if plan.profile.model is None:
        raise LaunchError(f"{plan_path} was planned from an imported profile with no model; "
                          "profile the model with pd profile --model and plan that profile")


def _ranges(ranks) -> str:
    return f"0..{max(ranks)}" if ranks == tuple(range(len(ranks))) else ",".join(map(str, ranks))


@dataclass(frozen=True, kw_only=True)
class Nodes:
    """Where the workers run: `nnodes` machines of `nproc_per_node` workers, this one `node_rank`."""

    nnodes: int = 1
    node_rank: int = 0
    nproc_per_node: int | None = None
    master_addr: str = "127.0.0.1"
    master_port: int | None = None
    rdzv_endpoint: str | None = None  # HOST:PORT of a c10d rendezvous (instead of master_addr/port)
    rdzv_id: str = "pdtool"           # the job's name at that rendezvous, the same on every machine
    interface: str | None = None      # the network interface of the job's traffic (default: the route to the rendezvous)


@dataclass(kw_only=True)
class TrainResult:
    plan: Plan
    reports: dict[int, WorkerReport]
    wall_s: float
    first_step: int
    steps: int
    per_step: int
    eval_steps: tuple[int, ...] = ()  # the steps after which the run evaluates through the pipeline

    @property
    def evals(self) -> dict[int, tuple]:
        """Step -> (held-out loss, accuracy or None, samples, began, end) of every evaluation round."""
        return {e[0]: tuple(e[1:]) for r in self.reports.values() for e in r.evals}

    @property
    def losses(self) -> dict[int, float]:
        return {b: loss for r in self.reports.values() for b, loss in r.losses.items()}

    @property
    def finished(self) -> dict[int, float]:
        return {b: t for r in self.reports.values() for b, t in r.finished.items()}

    def weights(self) -> dict:
        """The final weights of this machine's stages (replica 0 of each), by qualified name: the
        workers report them with `RunConfig.return_weights`."""
        return {name: t for r in self.reports.values() if r.replica == 0 for name, t in r.weights.items()}

    def time_per_minibatch_ms(self) -> float | None:
        """Steady state, from what the workers did: the time the last stage took to complete its
        last k minibatches, divided by k, where k is about half of them and a whole number of
        rounds of its replicas (which complete their minibatches side by side, in any order):
        completions are counted in time order, never by minibatch id. Across machines, this
        machine's replicas of the last stage complete their share (round robin) of the job's
        minibatches, so the job's time per minibatch is their time per minibatch x that share."""
        times = sorted(self.finished.values())
        here = sum(1 for rank in self.plan.stages[-1].ranks if rank in self.reports)
        rounds = len(times) // max(here, 1)
        if rounds < 2 or len(times) < 4:
            return None
        k = max(rounds // 2, 1) * here
        span = times[-1] - times[-1 - k]
        # an evaluation round between those completions is not training time (its drain is)
        span -= sum(end - began for _, _, _, began, end in self.evals.values() if times[-1 - k] <= began <= times[-1])
        return span / k * here / self.plan.stages[-1].replicas * 1000 if span > 0 else None
