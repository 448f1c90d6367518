"""A training job as `pd train` runs it on the launching machine.

Around `launch` it holds the checkpoint folder's lock (one writer per folder), settles where
the run starts (`resume`), completes checkpoints while the workers write their shards
(`manifests`), restarts a failed job (`--max-restarts`) and returns the workers' reports as a
`TrainResult` (which `views` write out as metrics and traces).
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

from ...artifacts.plan import Plan
from ...errors import Interrupted, LaunchError
from ..run import RunConfig, WorkerReport, eval_steps
from .launch import Nodes, launch
from .manifests import ManifestWriter
from .resume import kept, plan_sha256, restart_point, settle


@dataclass
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


def run(config: RunConfig, nodes: Nodes = Nodes(), verbose: bool = False, resume: bool = False,
        warn=lambda message: None, needs: set[str] | None = None, say=lambda message: None,
        talk=lambda message: None, restarts: int = 0) -> TrainResult:
    """Run `config` (config.steps = the step the run should reach) and complete its checkpoints.

    With a checkpoint folder, the run holds its lock (`folder_lock`: one writer per folder) and
    gets a run id that its shards and manifests carry. With `resume`, the run continues from the
    newest good checkpoint (`checkpoint.latest_complete`: bad ones are skipped with a `warn` line
    saying why; `needs` are the parameter names it must hold), after completing what an
    interrupted run left with every shard written; with none, it sets aside what is there and
    starts from step 0. `say` is told which; `talk` hears what the run is doing while the
    workers start. With `restarts` (and a checkpoint folder), a failed job starts again from the
    newest complete checkpoint, up to that many times, each restart one `say` line."""
    plan = Plan.load(config.plan_path)
    start = settle(plan, config, nodes, resume, warn, needs, say, hold=nodes.node_rank == 0)
    config, per_step, meta, lock = start.config, start.per_step, start.meta, start.lock
    try:
        for restart in range(restarts + 1):
            try:
                return _run_from(config, plan, per_step, nodes, verbose, meta, talk, warn)
            except LaunchError as failure:
                if restart == restarts or not config.checkpoint_dir:
                    if lock is None:
                        raise
                    raise LaunchError(f"{failure}; {kept(config.checkpoint_dir)}") from None
                config = restart_point(config, plan, start.record, needs)
                say(f"{failure}; restart {restart + 1} of {restarts} from " +
                    (f"{config.resume} (step {config.first_step})" if config.resume else "step 0"))
        raise AssertionError("unreachable")
    finally:
        if lock is not None:
            lock.release()


def _run_from(config: RunConfig, plan: Plan, per_step: int, nodes: Nodes, verbose: bool, meta: dict,
              talk, warn=lambda message: None) -> TrainResult:
    """Launch the workers of a run whose starting point is settled, completing its checkpoints."""
    writer = None
    if config.checkpoint_dir and nodes.node_rank == 0:
        writer = ManifestWriter(Path(config.checkpoint_dir), len(plan.stages), plan_sha256(config.plan_path), meta,
                                 config.run_id)
        writer.start()
    began = time.perf_counter()
    try:
        reports = launch(config, len(plan.used_ranks), nodes, verbose=verbose, talk=talk, warn=warn)
    except Interrupted as stop:
        if writer is not None:
            writer.stop()
        raise Interrupted(f"{stop}; {kept(config.checkpoint_dir)}", stop.exit_code - 128) from None
    finally:
        if writer is not None:
            writer.stop()
    if writer is not None and writer.error is not None:  # e.g. a full disk after the workers' last shard
        raise writer.error
    return TrainResult(plan, reports, time.perf_counter() - began, config.first_step, config.steps, per_step,
                       eval_steps(config, per_step))


