"""The entry point of every worker process that `pd train`'s launcher starts (`entry`), what a
worker takes from the launcher at its launch when it was forked from the forkserver
(`LaunchState`, `runtime.launcher.forked`), and what a failed worker does before it leaves
(`after_failure`). Runs in the worker; the launcher only hands `entry` and a `LaunchState` to
torch's launcher."""
from __future__ import annotations

import os
import sys
import time

from ..peers import PeerTimeout, stop_silent
from ..run import RunConfig, WorkerReport

ECHO_DELAY_S = 2.0
"""A failed worker whose error only echoes a peer's disappearance waits this long before it
leaves, so that the launcher reports the worker that failed first."""


def entry(config: RunConfig, launcher: LaunchState | None = None) -> WorkerReport:
    """What every worker process that `pd train`'s launcher starts runs: the launcher's state at
    this launch first (a forked worker), then `worker_main`, its error recorded where the
    launcher reads it; a failed worker settles (`after_failure`) and leaves at once."""
    if launcher is not None:
        launcher.restore()
    from torch.distributed.elastic.multiprocessing.errors import record

    from .main import worker_main

    try:
        return record(worker_main)(config)  # record: the error file the launcher reads, written first
    except BaseException as exc:
        after_failure(exc)
        # Leave without the process group's teardown, which waits for pending transfers that a
        # peer that stopped answering never completes.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(1)


def after_failure(exc: BaseException) -> None:
    """What a failed worker does once its error is recorded, before it leaves: end a silent peer
    of this machine (`peers.stop_silent`), release NCCL, and, when its error only echoes a peer's
    disappearance ("connection closed"), wait `ECHO_DELAY_S`: the launcher reports the first
    worker it sees exit, and so the worker that failed first is the one reported."""

    if isinstance(exc, PeerTimeout):
        stop_silent(exc.peer, exc.store)
    _release_nccl()
    if echoes_a_peer(str(exc)):
        time.sleep(ECHO_DELAY_S)


def _release_nccl() -> None:
    """After a worker's error is recorded: tear down an NCCL process group, whose communicators
    can otherwise hang the process at exit. (A gloo group is left to the process's end, so that
    peers see this worker's error before its connections close.)"""
    import torch.distributed as dist

    if dist.is_initialized() and dist.get_backend() == "nccl":
        try:
            dist.destroy_process_group()
        except Exception:  # noqa: BLE001 - already failing; the recorded error is what matters
            pass


class LaunchState:
    """What a worker takes from the launcher at this launch rather than from the forkserver it was
    forked from: the launcher's environment (with the job's network variables) and its standard
    output and error (passed as file descriptors)."""

    def __init__(self):
        self.env = dict(os.environ)
        self.streams = {fd: _Fd(fd) for fd in (1, 2) if _is_open(fd)}

    def restore(self) -> None:
        """In the worker, before anything else: the launcher's environment, overlaid by what torch's
        launcher set for this worker (the variables whose values differ from the forkserver's own,
        and those it always sets), random seeds of its own, and the launcher's standard streams.
        The forkserver's `alive` pipe, whose end multiprocessing hands every forked process, is
        closed: held by a worker, it would keep the forkserver alive after a SIGKILLed launcher,
        and the worker with it (a worker ends when the forkserver does: torch sets it a
        parent-death signal; the forkserver ends when that pipe closes)."""
        import tempfile
        from multiprocessing import forkserver

        base = getattr(sys.modules.get("pdtool.runtime.worker.preload"), "BASE_ENV", None)
        own = {name: value for name, value in os.environ.items()
               if name in _ELASTIC_ENV or (base is not None and base.get(name) != value)}
        os.environ.clear()
        os.environ.update({**self.env, **own})
        tempfile.tempdir = None  # the forkserver's may come from another TMPDIR
        # random seeds as a fresh process has them, not the forkserver's (which every worker would share;
        # Python's `random` reseeds itself after a fork)
        import torch

        torch.default_generator.seed()
        if "numpy" in sys.modules:
            sys.modules["numpy"].random.seed()
        sys.stdout.flush()
        sys.stderr.flush()
        for target, fd in self.streams.items():
            if isinstance(fd, int):
                os.dup2(fd, target)
                os.close(fd)
        alive = getattr(forkserver._forkserver, "_forkserver_alive_fd", None)
        if alive is not None:
            os.close(alive)
            forkserver._forkserver._forkserver_alive_fd = None


_ELASTIC_ENV = ("RANK", "LOCAL_RANK", "GROUP_RANK", "ROLE_RANK", "ROLE_NAME", "LOCAL_WORLD_SIZE", "WORLD_SIZE",
                "GROUP_WORLD_SIZE", "ROLE_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "TORCH_NCCL_ASYNC_ERROR_HANDLING",
                "TORCHELASTIC_RESTART_COUNT", "TORCHELASTIC_MAX_RESTARTS", "TORCHELASTIC_RUN_ID",
                "TORCHELASTIC_USE_AGENT_STORE", "TORCHELASTIC_ERROR_FILE")
"""Variables torch's launcher sets for every worker, whatever their values (`_start_workers` of its
local agent, and `start_processes`)."""


class _Fd:
    """A file descriptor of the launcher that a forked worker receives as its own (multiprocessing
    passes it to the forkserver while it sends the worker's arguments); unpickles as that number."""

    def __init__(self, fd: int):
        self.fd = fd

    def __reduce__(self):
        from multiprocessing import context, reduction

        if context.get_spawning_popen() is None:  # not on the way to a worker: nothing to pass
            return _no_fd, ()
        return _detach, (reduction.DupFd(self.fd),)


def _detach(dup) -> int:
    return dup.detach()


def _no_fd() -> None:
    return None


def _is_open(fd: int) -> bool:
    try:
        os.fstat(fd)
    except OSError:
        return False
    return True


_PEER_FAILED = ("Connection closed by peer", "Connection reset by peer", "remote worker crashing",
                "communicator was aborted", "Broken pipe", "remote process exited", "Socket unexpectedly closed",
                "GLHF")


def echoes_a_peer(message: str) -> bool:
    """Whether a worker's error only reports that another worker went away."""
    return any(marker in message for marker in _PEER_FAILED)
