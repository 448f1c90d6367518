"""Where a run of `pd train` starts and what it leaves: step 0, or with `--resume` the newest
good checkpoint (completing what an interrupted run left with every shard written, setting
aside what cannot be resumed), the run's id, the checkpoint folder's lock, and what a stopped
run leaves to resume from. `session` (pd train's own launcher) and `external` (rank 0 under
torchrun or srun) both start with `settle`."""
from __future__ import annotations

import dataclasses
import hashlib
import uuid
from pathlib import Path

from ...artifacts.checkpoint import (
    MANIFEST, complete_run, existing_steps, latest_complete, read_manifest, set_aside_after,
)
from ...artifacts.plan import Plan
from ...schedule import Run
from ...errors import LaunchError
from ..run import Nodes, RunConfig, checked_run, recorded_settings
from .folder_lock import FolderLock


@dataclasses.dataclass(kw_only=True)
class Start:
    """A run whose starting point is settled: its `config` (run id, first step, checkpoint to
    resume from), minibatches per step, the `meta` its manifests carry, the `record` claimed in
    the folder's lock (the last writer, for the next `--resume`), and the lock (None: no folder,
    or another machine holds it)."""

    config: RunConfig
    per_step: int
    meta: dict
    record: dict
    lock: FolderLock | None


def settle(plan: Plan, config: RunConfig, nodes: "Nodes", resume: bool, warn, needs, say, hold: bool = True,
           run: Run | None = None) -> Start:
    """Check the run's schedule (`checked_run`; `run`: what `job.prepare` resolved and checked
    already), give it a run id, take the checkpoint folder's lock when `hold` (the machine that
    owns the folder) and settle where it starts (`starting_point`), claiming the folder for this
    run. On any error the lock is released."""
    run = run if run is not None else checked_run(plan, config)  # a schedule it cannot run: refused here
    config = dataclasses.replace(config, run_id=config.run_id or run_id(config, nodes))
    lock = FolderLock.acquire(config.checkpoint_dir) if config.checkpoint_dir and hold else None
    try:
        config = starting_point(config, plan, resume, lock.previous if lock else None, warn, needs, say)
        meta = {"mode": run.name, "data": config.data, "seed": config.seed, "recipe": config.recipe.summary(),
                "settings": recorded_settings(config, run)}
        record = {"run": config.run_id, "stages": len(plan.stages), "plan_sha256": plan_sha256(config.plan_path),
                  "meta": meta}
        if lock is not None:
            lock.claim(record)
    except BaseException:
        if lock is not None:
            lock.release()
        raise
    return Start(config=config, per_step=run.per_step, meta=meta, record=record, lock=lock)


def plan_sha256(path: str) -> str:
    """The sha256 of the plan file at `path`, as checkpoints record it."""
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def run_id(config: RunConfig, nodes: Nodes) -> str:
    """A new run's id: random on one machine; across machines the same on every one (each
    launcher derives it from the job's command line: rendezvous, plan, steps, seed)."""
    if nodes.nnodes == 1:
        return uuid.uuid4().hex[:12]
    job = f"{nodes.rdzv_id}|{nodes.rdzv_endpoint or nodes.master_addr}|{nodes.master_port}|{config.steps}|{config.seed}"
    return hashlib.sha256(f"{job}|{plan_sha256(config.plan_path)}".encode()).hexdigest()[:12]


def restart_point(config: RunConfig, plan: Plan, writer: dict, needs) -> RunConfig:
    """`config` for a restart of this very run after a failure (`--max-restarts`): from the newest
    complete checkpoint (completing what its workers left with every shard written), aiming at
    the same last step; its own unfinished folders are set aside without a word."""
    whole = dataclasses.replace(config, steps=config.first_step + config.steps, first_step=0, resume=None)
    return starting_point(whole, plan, True, writer, lambda message: None, needs, lambda message: None)


def starting_point(config: RunConfig, plan: Plan, resume: bool, previous: dict | None, warn, needs,
                    say) -> RunConfig:
    """`config` from where the run starts: step 0, or with `resume` the newest good checkpoint;
    `previous` is the last run that wrote into the folder (`FolderLock.previous`). With `--init-from`
    too (a requeued fine-tune, the same command every time: torchtitan's initial load), a checkpoint
    wins, and without one the run starts from the pretrained weights; `say` hears which."""
    root = config.checkpoint_dir
    if not resume:
        if root and existing_steps(root):
            raise LaunchError(f"--checkpoint-dir {root} already holds checkpoints (newest: step "
                              f"{existing_steps(root)[0]}), which this run would overwrite; add --resume "
                              "to continue from them, or give an empty or new folder")
        return config
    if not root:
        raise LaunchError("--resume needs --checkpoint-dir DIR (where the checkpoints are)")
    if previous and previous.get("run") and isinstance(previous.get("stages"), int):
        for folder in complete_run(root, str(previous["run"]), previous["stages"], str(previous.get("plan_sha256")),
                                   previous.get("meta") if isinstance(previous.get("meta"), dict) else {}):
            say(f"completed {folder}: the interrupted run {previous['run']} had written every shard of it but not "
                "its manifest")
    skipped: list[str] = []
    folder = latest_complete(root, skipped.append, needs)
    if folder is None and any((Path(root) / f"step-{step:08d}" / MANIFEST).is_file() for step in existing_steps(root)):
        reason = next((line for line in skipped if "is incomplete" not in line), skipped[0])  # a complete one's
        raise LaunchError(f"--resume: no checkpoint in {root} fits this run ({reason.removeprefix('skipping checkpoint ')}"
                          "); give the --checkpoint-dir of this model's run, or drop --resume and give a new folder")
    for line in skipped:
        warn(line)
    done = read_manifest(folder).step if folder is not None else 0
    if done >= config.steps:
        raise LaunchError(f"the newest checkpoint ({folder}) is already at step {done} >= --steps "
                          f"{config.steps}; ask for more steps")
    for old, new in set_aside_after(root, done if folder is not None else -1):
        warn(f"set {old} aside as {new.name}: it is " + ("newer than the checkpoint resumed from" if folder else
             "not a complete checkpoint") + ", and this run writes only into checkpoint folders it creates")
    if folder is None:
        say(f"--resume: no complete checkpoint in {root}, so the run starts from step 0"
            + (f", from the weights of --init-from {config.init_from}" if config.init_from else ""))
        return config
    say(f"resuming from {folder} (step {done})" + (f"; --init-from {config.init_from} is not read (the checkpoint "
                                                   "holds the weights trained from it)" if config.init_from else ""))
    _compare_recipes(read_manifest(folder).meta.get("recipe"), config.recipe.summary(), folder, warn)
    return dataclasses.replace(config, resume=str(folder), first_step=done, steps=config.steps - done, init_from=None)


def _compare_recipes(saved, now: dict, folder, warn) -> None:
    """Warn when the run resumed from was trained with another recipe (optimizer, schedule,
    clipping): the learning rate goes on from the checkpoint's step by this run's settings."""
    if not isinstance(saved, dict):
        return
    changed = [f"{key} {saved.get(key)} -> {value}" for key, value in now.items() if saved.get(key) != value]
    if changed:
        warn(f"{folder} was trained with another recipe ({'; '.join(changed)}); this run goes on from step "
             f"{read_manifest(folder).step} with its own (the learning rate follows the new schedule)")


def kept(checkpoint_dir: str | None) -> str:
    """What a stopped run leaves to resume from."""
    newest = latest_complete(checkpoint_dir) if checkpoint_dir else None
    return (f"the last complete checkpoint is {newest} (--resume continues from it)" if newest else
            "no checkpoint was completed" if checkpoint_dir else "no --checkpoint-dir was given")
