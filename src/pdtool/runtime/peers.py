"""A worker's view of the other workers of its job, from start-up on.

Start-up (`pd train`'s workers import the model, build it, cut their stage, then make their
process groups) is where a stopped or slow worker used to surface as torch's raw
`DistStoreError` after an unrelated wait. Here every worker:

1. joins the job's store first (`join`: the rendezvous store torch's launcher, torchrun or
   SLURM set up, `MASTER_ADDR`/`MASTER_PORT`), and publishes its machine, process id and
   launcher (`process_of` reads them: the runtime's shared-memory links and `stop_silent` use it);
2. beats while it starts (`Beacon`: a counter in the store, every `BEAT_S` seconds, from a thread,
   so that a worker busy importing or tracing still shows it is alive);
3. says when its stage is built and waits for the others (`wait_for_peers`): a peer whose beat
   stops for `--timeout` seconds (stopped, hung in C code, on a dead machine) or that has not
   finished start-up after `--startup-timeout` seconds ends the job with one line naming it;
   a silent peer on the same machine is killed (it can no longer answer a request to stop);
4. then makes the process group (`init_process_group` on the same store), which no longer waits.
"""
from __future__ import annotations

import os
import signal
import socket
import threading
import time
from datetime import timedelta

from ..errors import LaunchError

BEAT_S = 0.5
"""Seconds between a starting worker's beats."""


class PeerTimeout(LaunchError):
    """A peer (rank `peer`) stopped answering; `store` is the job's store from `join`, where its
    process is published (the worker fills it in when the raiser had none at hand)."""

    def __init__(self, message: str, peer: int, store=None):
        super().__init__(message)
        self.peer = peer
        self.store = store


NODE_ENV = "PDTOOL_NODE"
"""Set by `pd train`'s launcher to one value for all the workers it starts (one machine): the
scratch folder and the shared-memory rings of those workers carry it."""


def running(pid: int) -> bool:
    """Whether a process `pid` exists (of any user)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def join(rank: int, world: int, timeout_s: float):
    """The job's store (the default process group's, under a prefix of its own for each attempt
    torchrun makes) once this worker joined it and published its process; one `LaunchError` line
    when the rendezvous cannot be reached."""
    import torch.distributed as dist

    where = f"{os.environ.get('MASTER_ADDR', '?')}:{os.environ.get('MASTER_PORT', '?')}"
    try:
        store, _, _ = next(dist.rendezvous("env://", rank, world, timeout=timedelta(seconds=timeout_s)))
    except Exception as exc:  # noqa: BLE001 - torch raises several kinds, with long texts
        if "EADDRINUSE" in str(exc) or "address already in use" in str(exc).lower():
            raise LaunchError(f"rank {rank} cannot host the job's store at {where}: the port is in use (by another "
                              "job, or another program); give this job another MASTER_PORT") from None
        raise LaunchError(f"rank {rank} cannot join the job's rendezvous at {where} within {timeout_s:g} s "
                          f"({_first_line(exc)}); check the launcher's address and port") from None
    store.set_timeout(timedelta(seconds=timeout_s))
    _check_job(store, rank, where)
    store = attempt_store(store, os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    store.set(f"pdtool/process/{rank}", f"{socket.gethostname()} {os.getpid()} {os.environ.get(NODE_ENV) or '-'}")
    return store


JOB_KEY = "pdtool/job"
"""The key of the store that names the job it serves (`job_id`): the first rank to join sets it."""


def job_id(env=os.environ) -> str | None:
    """The id of the job this process belongs to, as its launcher names it: SLURM's job and step,
    torchrun's run id, or pd's own (`PDTOOL_JOB_ID`); None where none is set."""
    if env.get("SLURM_JOB_ID"):
        return f"slurm-{env['SLURM_JOB_ID']}.{env.get('SLURM_STEP_ID', '-')}"
    if env.get("TORCHELASTIC_RUN_ID"):
        return f"torchrun-{env['TORCHELASTIC_RUN_ID']}"
    return env.get("PDTOOL_JOB_ID") or None


def _check_job(store, rank: int, where: str) -> None:
    """Refuse a store that serves another job (two jobs given one MASTER_PORT: this rank reached the
    other's store, whose rank 0 would never answer it) in one line, at once."""
    job = job_id()
    if job is None:
        return
    try:
        found = store.compare_set(JOB_KEY, "", job)
    except Exception as exc:  # noqa: BLE001 - the store went away: the caller's next use says so
        raise LaunchError(f"rank {rank} lost the job's store at {where} right after joining it ({_first_line(exc)}); "
                          "check the launcher's address and port") from None
    found = found.decode() if isinstance(found, bytes) else str(found)
    if found != job:
        raise LaunchError(f"rank {rank} reached the store of another job at {where} ({found}; this one is {job}): two "
                          "jobs were given the same MASTER_PORT; give each job its own MASTER_PORT")


LIVE_KEY = "pdtool/live/{rank}/{n}"
"""Where a worker publishes the n-th record of its live metrics (`launcher.live` reads them)."""


def publisher(store, rank: int):
    """A worker's publisher of live metrics: each call stores the next record (JSON values)."""
    import json

    count = [0]

    def publish(record: dict) -> None:
        store.set(LIVE_KEY.format(rank=rank, n=count[0]), json.dumps(record))
        count[0] += 1

    return publish


def attempt_store(store, attempt: str = "0"):
    """The keys of one attempt of the job in `store` (the rendezvous store, as the launcher holds it
    or a worker joined it): torchrun keeps its store across restarts of the workers (--max-restarts),
    so each attempt's keys stay apart."""
    import torch.distributed as dist

    return dist.PrefixStore(f"default_pg/attempt-{attempt}", store)


def process_of(store, rank: int) -> tuple[str, int, str]:
    """(machine, process id, launcher id or "-") that worker `rank` published."""
    host, pid, node = store.get(f"pdtool/process/{rank}").decode().split()
    return host, int(pid), node


class Beacon:
    """Beats for this worker while it starts: `with Beacon(store, rank): ...`."""

    def __init__(self, store, rank: int):
        self.store, self.key = store, f"pdtool/alive/{rank}"
        self.done = threading.Event()
        self.thread = threading.Thread(target=self._beat, daemon=True)

    def __enter__(self) -> "Beacon":
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.done.set()
        self.thread.join(timeout=2 * BEAT_S)

    def _beat(self) -> None:
        while True:
            try:
                self.store.add(self.key, 1)
            except Exception:  # noqa: BLE001 - the store is gone: the job is ending, peers see the silence
                return
            if self.done.wait(BEAT_S):
                return


def wait_for_peers(store, rank: int, world: int, silence_s: float, startup_s: float) -> None:
    """Say this worker's stage is built; return once every worker's is. A peer that gives no beat
    for `silence_s` seconds is `PeerTimeout`; one not done after `startup_s` is `LaunchError`."""
    store.set(f"pdtool/ready/{rank}", "1")
    wait_for(store, rank=rank, keys={r: f"pdtool/ready/{r}" for r in range(world) if r != rank}, silence_s=silence_s,
             startup_s=startup_s, task="start", during="while it imported, built or cut the model",
             tasks="build their stages (import, model, stage)")


def wait_for(store, *, rank: int, keys: dict[int, str], silence_s: float, startup_s: float, task: str, during: str,
             tasks: str) -> None:
    """Return once every peer of `keys` (rank -> the key it sets when done) has set its key, while
    they beat (`Beacon`). One that gives no beat for `silence_s` seconds is `PeerTimeout` ("rank
    R waited for rank P to `task`, which stopped answering (... `during`)"); one not done after
    `startup_s` seconds is `LaunchError` ("... for rank(s) P to `tasks`")."""
    began = time.monotonic()
    seen: dict[int, tuple[int, float]] = {r: (-1, began) for r in keys}  # beats, when
    while True:
        if not keys or store.check(list(keys.values())):
            return
        now = time.monotonic()
        waiting = [r for r, key in keys.items() if not store.check([key])]
        for r in waiting:
            beats = store.add(f"pdtool/alive/{r}", 0)
            if beats != seen[r][0]:
                seen[r] = (beats, now)
        silent = [r for r in waiting if now - seen[r][1] > silence_s]
        if silent:
            raise PeerTimeout(f"rank {rank} waited for rank {silent[0]} to {task}, which stopped answering "
                              f"({_whereabouts(store, silent[0])}, no sign of life for {silence_s:g} s {during}); "
                              "the job was stopped (--timeout sets how long a silent worker is waited for)",
                              silent[0], store)
        if now - began > startup_s:
            raise LaunchError(f"rank {rank} waited {startup_s:g} s for rank(s) {', '.join(map(str, waiting))} to "
                              f"{tasks}; the job was stopped (--startup-timeout sets how long start-up may take)")
        time.sleep(0.1)


def _whereabouts(store, rank: int) -> str:
    try:
        host, pid, _ = process_of(store, rank) if store.check([f"pdtool/process/{rank}"]) else (None, 0, "")
    except Exception:  # noqa: BLE001 - the store may be going away
        return "not reachable"
    return f"pid {pid} on {host}" if host else "it never joined the rendezvous"


def stop_silent(peer: int, store) -> None:
    """A peer stopped answering (hung or stopped, e.g. by SIGSTOP): it can no longer handle the
    launcher's SIGTERM, which would then wait its grace period before a SIGKILL. When it runs on
    this machine, end it now, so that the whole job stops within the timeout plus seconds. Called
    once this worker's error is recorded, so that the launcher reports the silence, not the kill."""
    try:
        if not store.check([f"pdtool/process/{peer}"]):
            return  # it never joined: the launcher stops it
        host, pid, _ = process_of(store, peer)
        if host == socket.gethostname() and pid != os.getpid():
            os.kill(pid, signal.SIGKILL)
    except Exception:  # noqa: BLE001 - best effort: the launcher still stops it after its grace period
        pass


def _first_line(exc: Exception) -> str:
    text = str(exc).strip()
    return (text.splitlines()[0] if text else type(exc).__name__)[:160]
