"""Running `pd train` under a cluster's own launcher: torchrun, or SLURM's srun.

There every process that runs `pd train` is one worker of the plan: the launcher started it,
numbered it and set up where the job meets. `detect` tells which launcher (`--launcher auto`):
torchrun when TORCHELASTIC_RUN_ID and RANK are set; SLURM when SLURM_PROCID is set in a job step
(SLURM_STEP_ID) of more than one task (SLURM_NTASKS); else pd train's own (`runtime.launcher.launch`).
`place` reads where this process sits (`runtime.launcher.cluster_env`: torchrun's or SLURM's variables).

`train` then runs the job as pd train's own launcher does, split over the processes:

1. every process checks the plan against the world size and joins the job's store (rank 0
   hosts it under SLURM, torchrun's agent under torchrun);
2. rank 0 alone does the launcher's part: the checks before any worker (`job.prepare`: model,
   split, data, memory) and, with --checkpoint-dir, the folder's lock, --resume and the run id
   (as `session.run` does); it publishes what it decided (steps, first step, checkpoint to
   resume from, run id, threads) in the store, and the others wait for it (while rank 0 beats,
   up to --startup-timeout). When the checks fail, every process ends with the same one line;
3. every process runs its worker (`worker.worker_main`); rank 0 also completes the checkpoints
   (`manifests.ManifestWriter`: every machine's shards land in the one shared folder);
4. every worker puts its report (JSON: losses, times, events) in the store, and rank 0 returns
   them all for the summary, --metrics and --trace.

A failing worker prints `pd: error: worker rank R failed: ...` and exits 1 (torchrun, and srun
with --kill-on-bad-exit, then stop the others). SIGINT or SIGTERM ends each process with one
line and exit 128 + the signal, whatever it is doing (`Ending`); rank 0 first completes what
checkpoints it can.
"""
from __future__ import annotations

import dataclasses
import json
import os
import signal
import sys
import threading
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Callable

from ...errors import LaunchError, PdtoolError
from ...signals import SIGNALS
from .cluster_env import Place

_DECISION = "pdtool/launch/decision"  # rank 0's decision (JSON), in the job's store
_READ = "pdtool/launch/read"          # how many other ranks have read it


class Ending:
    """How this process ends before its work is done: one line on stderr and an exit code, once,
    from whichever thread gets there first (`end`). SIGINT and SIGTERM are answered by a thread
    of their own, woken through the signal wakeup fd whichever thread the kernel gave the signal
    to: Python runs signal handlers only in the main thread and between bytecodes, so a worker
    blocked in a transfer or in the store would not answer before its timeout."""

    def __init__(self, rank: int):
        self.rank = rank
        self.before: list[Callable[[], None]] = []  # what runs first: rank 0 completes the checkpoints it can
        self.checkpoint_dir: str | None = None       # rank 0's, once it holds it: the line names what is kept
        self._once = threading.Lock()

    def answer_signals(self) -> None:
        """From now on SIGINT and SIGTERM end this process with one line (call from the main thread)."""
        read, write = os.pipe()
        os.set_blocking(write, False)
        for signum in SIGNALS:
            signal.signal(signum, _ignore)  # a Python handler keeps Python's C handler, which writes to the fd
        signal.set_wakeup_fd(write, warn_on_full_buffer=False)
        threading.Thread(target=self._wait, args=(read,), daemon=True, name="pdtool-signals").start()

    def _wait(self, fd: int) -> None:
        signum = 0
        while signum not in SIGNALS:
            signum = os.read(fd, 1)[0]
        self.end(f"interrupted by {signal.Signals(signum).name}: worker rank {self.rank} stopped", 128 + signum)

    def end(self, message: str, code: int):
        """Run `before`, print `pd: error: message` (on rank 0 with the checkpoint kept) and exit
        with `code`, without the process group's teardown (it waits for peers that may be gone)."""
        from .resume import kept

        with self._once:  # a second caller waits here until the process is gone
            for step in self.before:
                try:
                    step()
                except Exception:  # noqa: BLE001 - already ending; the line is what matters
                    pass
            if self.checkpoint_dir is not None:
                message += f"; {kept(self.checkpoint_dir)}"
            sys.stderr.write(f"pd: error: {message}\n")
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)


def _ignore(signum, frame) -> None:
    """The main thread's handler of SIGINT/SIGTERM under `Ending`: nothing (its thread answers)."""


_CAPTURE = "pdtool/capture"
"""Where rank 0 publishes the stages' capture (`model.capture.Capture`) for the other ranks."""
_DECIDED = ("steps", "first_step", "resume", "run_id", "threads", "init_from")
"""The RunConfig fields rank 0 decides for every worker (`job.prepare`, --resume and whether
--init-from is read, the run id)."""


@dataclass
class _Folder:
    """Rank 0's hold on the checkpoint folder: its lock, and the thread completing manifests."""

    lock: object    # folder_lock.FolderLock
    writer: object  # manifests.ManifestWriter

    def close(self) -> None:
        """With every worker done: complete what can be, let the folder go; the writer's error (a full disk)."""
        self.writer.stop()
        self.lock.release()
        if self.writer.error is not None:
            raise self.writer.error


def train(where: Place, plan, config, *, epochs: int | None = None, resume: bool = False, iface: str | None = None,
          verbose: bool = False, warn=lambda message: None, say=lambda message: None, talk=lambda message: None):
    """Run this process's worker of a job that `where.launcher` started (see the module
    docstring). Rank 0 returns (`session.TrainResult` of the whole job, its `job.Job`); the
    others return None. Errors before the workers start are one `PdtoolError` line, the same on
    every rank; a worker's failure or a signal ends the process with one line (`Ending`; with
    `verbose`, a failing worker's traceback first)."""
    from .. import peers
    from ..run import TrainResult
    from ..worker.main import worker_main
    from ..run import check_world, eval_steps

    ending = Ending(where.rank)
    ending.answer_signals()
    where.export()
    check_world(plan, where.world, config.plan_path)
    _use_interface(where, iface)
    store = peers.join(where.rank, where.world, config.startup_timeout_s)
    if where.rank == 0:
        job, config, per_step, folder = _decide(
            store, where=where, plan=plan, config=config, epochs=epochs, resume=resume, warn=warn, say=say
        )
        if folder is not None:
            ending.before.append(folder.writer.stop)
            ending.checkpoint_dir = config.checkpoint_dir
        talk(f"{where.launcher} started {where.world} worker(s) on {where.machines} machine(s); each builds its "
             "stage, then training begins")
    else:
        config = _decision(store, where.rank, config)
    began = time.perf_counter()
    try:
        report = worker_main(config, store)
    except BaseException as exc:  # noqa: BLE001 - every way a worker fails is one line
        _fail(exc, ending, where.rank, verbose)
    try:
        store.set(f"pdtool/report/{where.rank}", _report_json(report))
    except Exception as exc:  # noqa: BLE001 - as in _decision
        raise _store_lost(where.rank, "after training, reporting to rank 0", exc) from None
    if where.rank != 0:
        return None
    try:
        reports = _gather(store, where.world, config.timeout_s)
        wall_s = time.perf_counter() - began
    finally:
        if folder is not None:
            folder.close()
    return (
        TrainResult(plan=plan, reports=reports, wall_s=wall_s, first_step=config.first_step, steps=config.steps,
                    per_step=per_step, eval_steps=eval_steps(config, per_step)),
        job,
    )


def _use_interface(where: Place, named: str | None) -> None:
    """Put the workers' traffic (gloo, NCCL) on `named` (--iface); else, unless GLOO_SOCKET_IFNAME
    is set, on loopback when the job has one machine (as pd train's own launcher does), or on the
    interface that routes to MASTER_ADDR across machines (gloo's default, the address the host
    name resolves to, is often loopback: Debian's 127.0.1.1)."""
    import ipaddress

    from . import network

    if named is None and os.environ.get("GLOO_SOCKET_IFNAME"):
        return
    if named is None and where.machines == 1:
        interface = "lo"
    else:
        interface, address = network.pick_interface(where.master_addr, named)
        if named is None and ipaddress.ip_address(address).is_loopback:
            return  # MASTER_ADDR names this machine by a loopback address: leave it to gloo
    os.environ.update(GLOO_SOCKET_IFNAME=interface, NCCL_SOCKET_IFNAME=interface)


def _decide(store, *, where: Place, plan, config, epochs, resume, warn, say):
    """Rank 0: the launcher's part (`job.prepare`'s checks, the checkpoint folder, --resume, the
    run id), published in the store for the other ranks, also when it fails (then the others end
    with the same line). (job, config, minibatches per step, `_Folder` or None)."""
    from .. import peers
    from .job import prepare

    try:
        with peers.Beacon(store, 0):  # the others wait while it beats
            job = prepare(plan, config, epochs=epochs, nproc_per_node=where.local_world, warn=warn)
            config, per_step, folder = _start(job, resume, warn, say)
    except PdtoolError as exc:
        store.set(_DECISION, json.dumps({"error": str(exc)}))
        _wait_until_read(store, where.world, config.timeout_s)  # the store is rank 0's under SLURM
        raise
    store.set(_CAPTURE, config.capture.to_json())
    store.set(_DECISION, json.dumps({"config": {name: getattr(config, name) for name in _DECIDED}}))
    return job, config, per_step, folder


def _start(job, resume: bool, warn, say):
    """Where the run of `job` (`job.prepare`'s) starts, as `session.run` settles it: (config with
    its run id and starting point, minibatches per step, `_Folder` holding the checkpoint folder or None)."""
    from pathlib import Path

    from ..run import Nodes
    from .manifests import ManifestWriter
    from .resume import plan_sha256, settle

    plan = job.plan
    start = settle(plan, job.config, Nodes(), resume, warn, job.checked.parameters, say,  # the run id is random:
                   run=job.run)  # only rank 0 decides it
    config, per_step, lock = start.config, start.per_step, start.lock
    if lock is None:
        return config, per_step, None
    writer = ManifestWriter(Path(config.checkpoint_dir), len(plan.stages), plan_sha256(config.plan_path), start.meta,
                            config.run_id)
    writer.start()
    return config, per_step, _Folder(lock, writer)


def _wait_until_read(store, world: int, timeout_s: float) -> None:
    """Rank 0: wait (up to `timeout_s`) until the other ranks have read its decision."""
    deadline = time.monotonic() + timeout_s
    while store.add(_READ, 0) < world - 1 and time.monotonic() < deadline:
        time.sleep(0.05)


def _decision(store, rank: int, config):
    """Another rank: config as rank 0 decided it, once it has (while rank 0 beats, up to
    --startup-timeout); rank 0's error line when its checks failed."""
    from .. import peers

    try:
        peers.wait_for(store, rank=rank, keys={0: _DECISION}, silence_s=config.timeout_s,
                       startup_s=config.startup_timeout_s, task="check the plan",
                       during="while it ran pd train's checks", tasks="check the plan (pd train's checks)")
        decision = json.loads(store.get(_DECISION))
        capture = store.get(_CAPTURE).decode() if "error" not in decision else None
        store.add(_READ, 1)
    except peers.PeerTimeout as silent:  # rank 0 stopped (SIGSTOP) or hung: end it, as pd train's workers do
        peers.stop_silent(silent.peer, silent.store)
        raise
    except PdtoolError:
        raise
    except Exception as exc:  # noqa: BLE001 - the store's connection broke (under SLURM rank 0 hosts it)
        raise _store_lost(rank, "while rank 0 checked the plan", exc) from None
    if "error" in decision:
        raise LaunchError(decision["error"])
    from ...model.capture import Capture

    return dataclasses.replace(config, **decision["config"], capture=Capture.from_json(capture))


def _store_lost(rank: int, when: str, exc: Exception) -> LaunchError:
    return LaunchError(f"rank {rank} lost the job's store {when} ({str(exc).strip().splitlines()[0][:120]}); the "
                       "store's host (rank 0 under SLURM, torchrun's agent) went away: its own line says why")


def _fail(exc: BaseException, ending: Ending, rank: int, verbose: bool):
    """A worker failed with `exc` (called in its `except`): its traceback when `verbose`, its
    line in torchrun's error file (torchrun's report of the failure shows it), then settle as
    `worker.entry.after_failure` says and end with the line."""
    import traceback

    from ..worker.entry import after_failure
    from .launch import in_own_words

    message = f"worker rank {rank} failed: {in_own_words(f'{type(exc).__name__}: {exc}')[0]}"
    if verbose:
        traceback.print_exc()
    _record(message)
    after_failure(exc)
    ending.end(message, 1)


def _record(message: str) -> None:
    """Write `message` where torchrun reads a worker's error (TORCHELASTIC_ERROR_FILE, if set)."""
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if path:
        try:
            with open(path, "w", encoding="utf-8") as file:
                json.dump({"message": f"pd: error: {message}", "timestamp": int(time.time())}, file)
        except OSError:
            pass  # torchrun then reports the exit code alone


def _report_json(report) -> str:
    """A worker's report as JSON: everything but its weights (which stay in its process)."""
    return json.dumps({f.name: getattr(report, f.name) for f in dataclasses.fields(report) if f.name != "weights"})


def _gather(store, world: int, timeout_s: float) -> dict:
    """Rank 0: every worker's report, by rank (they follow the last barrier within moments)."""
    from ..run import WorkerReport

    keys = [f"pdtool/report/{r}" for r in range(world)]
    try:
        store.wait(keys, timedelta(seconds=timeout_s))
    except Exception as exc:  # noqa: BLE001 - torch raises DistStoreError with a long text
        raise LaunchError(f"rank 0 waited {timeout_s:g} s for the other workers' reports after training "
                          f"({str(exc).strip().splitlines()[0][:120]}); its checkpoints are kept, but pd train's "
                          "summary, --metrics and --trace are missing") from None
    reports = {}
    for rank, key in enumerate(keys):
        data = json.loads(store.get(key))
        data.update(losses={int(b): v for b, v in data["losses"].items()},
                    finished={int(b): t for b, t in data["finished"].items()},
                    events=[tuple(event) for event in data["events"]])
        reports[rank] = WorkerReport(**data)
    return reports
