"""A training job as `pd train` runs it on the launching machine.

Around `launch` it holds the checkpoint folder's lock (one writer per folder), resolves
`--resume` to the newest complete checkpoint, completes
checkpoints while the workers write their shards (a manifest is written once every stage's
shard of a step is there: the checkpoint becomes complete atomically, and a crash leaves it
incomplete, never corrupt), and afterwards writes the metrics CSV and the measured trace.
"""
from __future__ import annotations

import dataclasses
import hashlib
import math
import re
import shutil
import threading
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

from ...artifacts.checkpoint import (
    MANIFEST, complete_checkpoint, complete_run, existing_steps, has_shards, latest_complete, read_manifest, set_aside_after,
)
from ...errors import Interrupted, LaunchError, PdtoolError
from ...jsonio import write_text_atomic
from ...artifacts.plan import Plan
from ...views.trace import measured_trace, write_trace
from .folder_lock import FolderLock
from .launch import Nodes, launch
from ..run import RunConfig, WorkerReport


@dataclass
class TrainResult:
    plan: Plan
    reports: dict[int, WorkerReport]
    wall_s: float
    first_step: int
    steps: int
    per_step: int

    @property
    def losses(self) -> dict[int, float]:
        return {b: loss for r in self.reports.values() for b, loss in r.losses.items()}

    @property
    def finished(self) -> dict[int, float]:
        return {b: t for r in self.reports.values() for b, t in r.finished.items()}

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
        return span / k * here / self.plan.stages[-1].replicas * 1000 if span > 0 else None


def plan_sha256(path: str) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


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
    from ..run import checked_run

    plan = Plan.load(config.plan_path)
    run = checked_run(plan, config)  # a schedule it cannot run: refused here
    per_step = run.per_step
    config = dataclasses.replace(config, run_id=config.run_id or _run_id(config, nodes))
    meta = {"mode": run.name, "data": config.data, "seed": config.seed}
    lock = FolderLock.acquire(config.checkpoint_dir) if config.checkpoint_dir and nodes.node_rank == 0 else None
    try:
        config = _starting_point(config, plan, resume, lock.previous if lock else None, warn, needs, say)
        writer = {"run": config.run_id, "stages": len(plan.stages), "plan_sha256": plan_sha256(config.plan_path),
                  "meta": meta}
        if lock is not None:
            lock.claim(writer)
        for restart in range(restarts + 1):
            try:
                return _run_from(config, plan, per_step, nodes, verbose, meta, talk)
            except LaunchError as failure:
                if restart == restarts or not config.checkpoint_dir:
                    if lock is None:
                        raise
                    raise LaunchError(f"{failure}; {_kept(config.checkpoint_dir)}") from None
                config = _restart_point(config, plan, writer, needs)
                say(f"{failure}; restart {restart + 1} of {restarts} from " +
                    (f"{config.resume} (step {config.first_step})" if config.resume else "step 0"))
        raise AssertionError("unreachable")
    finally:
        if lock is not None:
            lock.release()


def _run_id(config: RunConfig, nodes: Nodes) -> str:
    """A new run's id: random on one machine; across machines the same on every one (each
    launcher derives it from the job's command line: rendezvous, plan, steps, seed)."""
    if nodes.nnodes == 1:
        return uuid.uuid4().hex[:12]
    job = f"{nodes.rdzv_id}|{nodes.rdzv_endpoint or nodes.master_addr}|{nodes.master_port}|{config.steps}|{config.seed}"
    return hashlib.sha256(f"{job}|{plan_sha256(config.plan_path)}".encode()).hexdigest()[:12]


def _restart_point(config: RunConfig, plan: Plan, writer: dict, needs) -> RunConfig:
    """`config` for a restart of this very run after a failure (`--max-restarts`): from the newest
    complete checkpoint (completing what its workers left with every shard written), aiming at
    the same last step; its own unfinished folders are set aside without a word."""
    whole = dataclasses.replace(config, steps=config.first_step + config.steps, first_step=0, resume=None)
    return _starting_point(whole, plan, True, writer, lambda message: None, needs, lambda message: None)


def _starting_point(config: RunConfig, plan: Plan, resume: bool, previous: dict | None, warn, needs,
                    say) -> RunConfig:
    """`config` from where the run starts: step 0, or with `resume` the newest good checkpoint;
    `previous` is the last run that wrote into the folder (`FolderLock.previous`)."""
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
        say(f"--resume: no complete checkpoint in {root}, so the run starts from step 0")
        return config
    say(f"resuming from {folder} (step {done})")
    return dataclasses.replace(config, resume=str(folder), first_step=done, steps=config.steps - done)


def _run_from(config: RunConfig, plan: Plan, per_step: int, nodes: Nodes, verbose: bool, meta: dict,
              talk) -> TrainResult:
    """Launch the workers of a run whose starting point is settled, completing its checkpoints."""
    writer = None
    if config.checkpoint_dir and nodes.node_rank == 0:
        writer = _ManifestWriter(Path(config.checkpoint_dir), len(plan.stages), plan_sha256(config.plan_path), meta,
                                 config.run_id)
        writer.start()
    began = time.perf_counter()
    try:
        reports = launch(config, len(plan.used_ranks), nodes, verbose=verbose, talk=talk)
    except Interrupted as stop:
        if writer is not None:
            writer.stop()
        raise Interrupted(f"{stop}; {_kept(config.checkpoint_dir)}", stop.exit_code - 128) from None
    finally:
        if writer is not None:
            writer.stop()
    if writer is not None and writer.error is not None:  # e.g. a full disk after the workers' last shard
        raise writer.error
    return TrainResult(plan, reports, time.perf_counter() - began, config.first_step, config.steps, per_step)


def _kept(checkpoint_dir: str | None) -> str:
    """What a stopped run leaves to resume from."""
    newest = latest_complete(checkpoint_dir) if checkpoint_dir else None
    return (f"the last complete checkpoint is {newest} (--resume continues from it)" if newest else
            "no checkpoint was completed" if checkpoint_dir else "no --checkpoint-dir was given")


class _ManifestWriter(threading.Thread):
    """Writes the manifest of every checkpoint folder whose shards are all written. The first
    error (a full disk) stops it and is kept in `error`; the workers meet the same disk."""

    def __init__(self, root: Path, stages: int, plan_hash: str, meta: dict, run: str | None):
        super().__init__(daemon=True)
        self.root, self.stages, self.plan_hash, self.meta, self.run_id = root, stages, plan_hash, meta, run
        self.done = threading.Event()
        self.error: PdtoolError | None = None
        self.before = {path.name for path in root.glob("step-*")}  # never completes a folder it did not see made

    def run(self) -> None:
        while not self.done.wait(0.2) and self._completed():
            pass

    def stop(self) -> None:
        """With the workers gone: complete what can be; on a full disk, keep the newest checkpoint
        that fits (this run's unfinished folders make room for it), and the error. Once."""
        if self.done.is_set():
            return
        self.done.set()
        self.join()
        self.error = None
        if not self._completed():
            self._make_room()

    def _make_room(self) -> None:
        unfinished = list(self._unfinished())[::-1]  # newest first
        for folder in unfinished:  # shards missing: they can never complete now
            if not self._has_shards(folder):
                shutil.rmtree(folder, ignore_errors=True)
        for folder in unfinished:  # one that cannot be completed makes room for the next older one
            if folder.exists():
                try:
                    self._complete_one(folder)
                    return
                except PdtoolError:
                    shutil.rmtree(folder, ignore_errors=True)

    def _unfinished(self):
        """This run's checkpoint folders without a manifest, oldest first."""
        for folder in sorted(self.root.glob("step-*")):
            if folder.name not in self.before and not folder.is_symlink() and not (folder / MANIFEST).exists():
                yield folder

    def _has_shards(self, folder: Path) -> bool:
        return has_shards(folder, self.stages, self.run_id)

    def _completed(self) -> bool:
        """complete(), keeping its first error; whether it succeeded."""
        if self.error is not None:
            return False
        try:
            self.complete()
        except PdtoolError as exc:
            self.error = exc
        return self.error is None

    def complete(self) -> None:
        for folder in self._unfinished():
            if self._has_shards(folder):
                self._complete_one(folder)

    def _complete_one(self, folder: Path) -> None:
        complete_checkpoint(folder, self.stages, self.plan_hash, self.meta, self.run_id)


def write_metrics(path: str, result: TrainResult) -> None:
    """One row per optimizer step of stage 0: step, mean loss, samples/s, and per worker the
    share of that step's wall time it spent computing (busy; the rest is idle or waiting)."""
    losses, finished = result.losses, result.finished
    ranks = sorted(result.reports)
    header = ["step", "minibatches", "loss", "samples_per_s"] + [f"busy_rank{r}" for r in ranks]
    rows = [",".join(header)]
    batch = result.plan.profile.batch_size
    previous = min((began for r in result.reports.values() for _, began, _ in r.events), default=0.0)
    for k in range(result.steps):
        ids = range((result.first_step + k) * result.per_step, (result.first_step + k + 1) * result.per_step)
        if not all(b in finished for b in ids):
            break
        end = max(finished[b] for b in ids)
        window = max(end - previous, 1e-9)
        loss = sum(losses[b] for b in ids) / len(ids)
        busy = [sum(max(0.0, min(e, end) - max(s, previous)) for _, s, e in result.reports[r].events) / window
                for r in ranks]
        rows.append(",".join([str(result.first_step + k + 1), str(len(ids)), f"{loss:.6g}",
                              f"{batch * len(ids) / window:.6g}"] + [f"{x:.4f}" for x in busy]))
        previous = end
    write_text_atomic(path, "\n".join(rows) + "\n")


def write_measured_trace(path: str, result: TrainResult) -> None:
    measured = result.time_per_minibatch_ms()
    write_trace(path, measured_trace({r: rep.events for r, rep in result.reports.items()}, result.plan, {
        "measured_time_per_minibatch_ms": measured, "plan_time_per_minibatch_ms": result.plan.predicted.time_ms,
        "minibatches": len(result.losses)}))


def held_out_accuracy(result: TrainResult, config: RunConfig) -> tuple[float, int] | None:
    """Top-1 accuracy of the trained model on the data set's held-out split, and its size;
    None when the data set has none or this machine does not hold every stage's weights."""
    import torch

    from ...model.data import evaluate, held_out
    from ...model.spec import file_model

    dataset = held_out(config.data)
    model_ref = result.plan.profile.model
    if dataset is None or model_ref is None:
        return None
    weights = {}
    for report in result.reports.values():
        if report.replica == 0:
            weights.update(report.weights)
    torch.manual_seed(config.seed)
    module = file_model(model_ref, config.model).module
    missing = {name for name, _ in module.named_parameters()} - set(weights)
    if missing:
        return None  # other stages ran on other machines
    module.load_state_dict(weights, strict=False)
    return evaluate(module, dataset), len(dataset)


GAP = 1.5
"""Measured over predicted time per minibatch beyond which (either way) pd train says why."""


def gap_reasons(measured_ms: float, predicted_ms: float, plan: Plan, threads: int | None, local_workers: int,
                cores: int, on_cpu: bool) -> list[str]:
    """Why the measured time per minibatch is more than `GAP` times off the prediction, from what
    pdtool knows (none when it is not): cores shared by the workers, a profile measured with
    other threads than the workers have, a profile whose layer times do not add up to a step."""
    if not (measured_ms > 0 and predicted_ms > 0) or 1 / GAP <= measured_ms / predicted_ms <= GAP:
        return []
    reasons, explained = [], 1.0
    if on_cpu and threads and local_workers * threads > cores:
        explained *= local_workers * threads / cores
        reasons.append(f"{local_workers} workers x {threads} thread(s) share {cores} cores "
                       f"({local_workers * threads / cores:.1f}x oversubscribed; the prediction gives each worker its own)")
    profiled = re.match(r"cpu \((\d+) threads?\)", plan.profile.device or "")
    if on_cpu and threads and profiled and int(profiled.group(1)) != threads:
        explained *= max(int(profiled.group(1)) / threads, 1.0)
        reasons.append(f"the profile was measured with {profiled.group(1)} thread(s), the workers have {threads} "
                       "(profile with pd profile --threads to match)")
    ratio = plan.profile.layer_sum_over_step
    if ratio is not None and not 0.8 <= ratio <= 1.25:
        explained *= 1 / ratio
        reasons.append(f"the profile's layer times sum to {ratio:.2f} of a measured step, so its costs are off by "
                       "that much")
    rest = measured_ms / predicted_ms / explained
    if not 1 / GAP <= rest <= GAP:
        reasons.append(("about " + f"{rest:.1f}x " if reasons else "") + "outside what pdtool models: the runtime's "
                       "own overhead per action (about 0.4 ms on small layers), message latency and processes "
                       "competing for memory bandwidth; pd simulate --trace beside pd train --trace shows where")
    return reasons


def steps_for_epochs(epochs: int, batches_per_epoch: int | None, per_step: int) -> int:
    if not batches_per_epoch:
        raise LaunchError("--epochs needs a data set with a size; --data synthetic is endless, use --steps")
    return math.ceil(epochs * batches_per_epoch / per_step)
