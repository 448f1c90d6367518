"""A training job as `pd train` runs it on the launching machine.

Around `launch` it holds the checkpoint folder's lock (one writer per folder), settles where
the run starts (`resume`), completes checkpoints while the workers write their shards
(`manifests`), restarts a failed job (`--max-restarts`) and returns the workers' reports as a
`TrainResult` (which `views` write out as metrics and traces).
"""
from __future__ import annotations

import time
from pathlib import Path
from typing import TYPE_CHECKING

from ...artifacts.plan import Plan
from ...errors import Interrupted, LaunchError
from ..run import Nodes, RunConfig, TrainResult, WorkerReport, eval_steps
from .launch import launch

if TYPE_CHECKING:
    from .job import Job
from .manifests import ManifestWriter
from .resume import kept, plan_sha256, restart_point, settle


def run(config: RunConfig, nodes: Nodes = Nodes(), verbose: bool = False, resume: bool = False,
        warn=lambda message: None, needs: set[str] | None = None, say=lambda message: None,
        talk=lambda message: None, restarts: int = 0, job: Job | None = None) -> TrainResult:
    """Run `config` (config.steps = the step the run should reach) and complete its checkpoints.

    With a checkpoint folder, the run holds its lock (`folder_lock`: one writer per folder) and
    gets a run id that its shards and manifests carry. With `resume`, the run continues from the
    newest good checkpoint (`checkpoint.latest_complete`: bad ones are skipped with a `warn` line
    saying why; `needs` are the parameter names it must hold), after completing what an
    interrupted run left with every shard written; with none, it sets aside what is there and
    starts from step 0. `say` is told which; `talk` hears what the run is doing while the
    workers start. With `restarts` (and a checkpoint folder), a failed job starts again from the
    newest complete checkpoint, up to that many times, each restart one `say` line. `job`: the
    plan and run `job.prepare` resolved (pd train's), so that neither is read or resolved again;
    without one (tests, benches), the plan is read from config.plan_path."""
    plan = job.plan if job is not None else Plan.load(config.plan_path)
    start = settle(plan, config, nodes, resume, warn, needs, say, hold=nodes.node_rank == 0,
                   run=job.run if job is not None else None)
    config, per_step, meta, lock = start.config, start.per_step, start.meta, start.lock
    try:
        for restart in range(restarts + 1):
            try:
                return _run_from(config, plan=plan, per_step=per_step, nodes=nodes, verbose=verbose, meta=meta,
                                 talk=talk, warn=warn, job=job)
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


def _run_from(config: RunConfig, *, plan: Plan, per_step: int, nodes: Nodes, verbose: bool, meta: dict,
              talk, warn=lambda message: None, job: Job | None = None) -> TrainResult:
    """Launch the workers of a run whose starting point is settled, completing its checkpoints."""
    writer = None
    if config.checkpoint_dir and nodes.node_rank == 0:
        writer = ManifestWriter(Path(config.checkpoint_dir), len(plan.stages), plan_sha256(config.plan_path), meta,
                                 config.run_id)
        writer.start()
    began = time.perf_counter()
    try:
        reports = launch(config, len(plan.used_ranks), nodes, verbose=verbose, talk=talk, warn=warn, job=job)
    except Interrupted as stop:
        if writer is not None:
            writer.stop()
        raise Interrupted(f"{stop}; {kept(config.checkpoint_dir)}", stop.exit_code - 128) from None
    finally:
        if writer is not None:
            writer.stop()
    if writer is not None and writer.error is not None:  # e.g. a full disk after the workers' last shard
        raise writer.error
    return TrainResult(plan=plan, reports=reports, wall_s=time.perf_counter() - began, first_step=config.first_step,
                       steps=config.steps, per_step=per_step, eval_steps=eval_steps(config, per_step))
