"""Starting the workers of a plan with torch.distributed's own launcher (torchelastic).

On one machine `launch` starts one process per rank of the plan and waits for them; across
machines every machine runs the same command with `--nnodes`, `--node-rank` and the address
of the rendezvous, and the launcher forms one job: with `--master-addr`/`--master-port` a static
rendezvous (ranks are node-major, `node_rank * nproc_per_node + local_rank`), with
`--rdzv-endpoint HOST:PORT` torch's c10d rendezvous, which numbers the machines itself in the
order they join (no `--node-rank`; the first machine whose address is HOST hosts the store). A worker that fails makes the launcher stop the
others at once; the failing rank's error comes back as one `LaunchError` line.
"""
from __future__ import annotations

import contextlib
import errno
import importlib
import json
import logging
import os
import re
import shutil
import signal
import sys
import socket
import threading
import time
import uuid
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING
from pathlib import Path

from ...errors import Interrupted, LaunchError, PdtoolError
from ...signals import SIGNALS
from . import forked, scratch
from ..worker.entry import LaunchState, echoes_a_peer, entry
from .. import peers
from ..worker import shm
from ..run import Nodes, RunConfig, WorkerReport

if TYPE_CHECKING:
    from .job import Job


"""Seconds a worker whose error only reports a peer's disappearance waits before it exits."""
SHUTDOWN_S = 2
"""Seconds the workers get to exit after SIGTERM when pd train itself is interrupted; then SIGKILL."""


def _shutdown(launch_config) -> dict:
    """torch 2.13's `shutdown_timeout` (older torch, e.g. a GPU image's, lacks it and waits its default)."""
    return {"shutdown_timeout": SHUTDOWN_S} if "shutdown_timeout" in {f.name for f in fields(launch_config)} else {}


def launch(config: RunConfig, workers: int, nodes: Nodes = Nodes(), verbose: bool = False,
           talk=lambda message: None, warn=lambda message: None, job: Job | None = None) -> dict[int, WorkerReport]:
    """Run the plan's workers; returns this machine's reports by global rank (`warn` hears what
    the live metrics could not write; `job`: the plan and run `job.prepare` resolved, which the
    live metrics read; without one, as config says).

    The launcher's own logging (and a failing worker's traceback) is shown only when
    `verbose`; otherwise a failure is the one line of `LaunchError`.
    """
    from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch
    from .job import with_capture

    config = with_capture(config, warn)  # (`job.prepare` made it already for pd train)
    per_node = nodes.nproc_per_node or workers // nodes.nnodes
    if per_node * nodes.nnodes != workers:
        raise LaunchError(f"the plan needs {workers} workers but {nodes.nnodes} machines x {per_node} workers "
                          f"make {per_node * nodes.nnodes}; set --nproc-per-node so that they match")
    join_timeout = int(config.timeout_s) + 60
    store, network_env = _meet(nodes, join_timeout, talk)
    rendezvous = _rendezvous(nodes, store, join_timeout)
    # the workers' error files; removed when the job ends (or, after a SIGKILL, by the next launch, which also
    # removes the shared-memory files of that launcher's workers)
    logs = scratch.make(lambda gone: shm.remove_node(scratch.launcher_id(gone)))
    node = scratch.launcher_id(logs)  # the workers of this launcher: their links may use shared memory (runtime.worker.shm)
    network_env[peers.NODE_ENV] = node
    method = forked.start_method(config.device, per_node, config.modules)
    settings = LaunchConfig(min_nodes=nodes.nnodes, max_nodes=nodes.nnodes, nproc_per_node=per_node, **rendezvous,
                            max_restarts=0, monitor_interval=0.1, start_method=method,
                            logs_specs=DefaultLogsSpecs(log_dir=logs), **_shutdown(LaunchConfig))
    talk(f"starting {per_node} worker process(es) on this machine: each builds its stage, then training begins")
    handlers = {signum: signal.getsignal(signum) for signum in SIGNALS}  # torch's launcher replaces them
    reaper = _Reaper(logs)
    reaper.start()
    live = _live(store, config, nodes, warn, job)
    try:
        with _quiet(verbose), _environment(network_env):
            results = elastic_launch(settings, entry)(config, LaunchState() if method == forked.FORKSERVER else None)
    except ChildFailedError as failure:
        line, raised = _explain(failure, logs)
        if verbose and raised:
            print(_callstack(failure, logs), file=sys.stderr, flush=True)
        raise LaunchError(line + (" (--verbose shows its traceback)" if raised and not verbose else "")) from None
    except SignalException as stop:  # the agent has stopped the workers (SHUTDOWN_S of grace, then SIGKILL)
        name = signal.Signals(stop.sigval).name
        raise Interrupted(f"interrupted by {name}: every worker was stopped", int(stop.sigval)) from None
    finally:
        reaper.stop()
        if live is not None:
            live.stop()
        for signum, handler in handlers.items():
            if handler is not None:
                signal.signal(signum, handler)
        del store  # the rendezvous store's server closes with its last reference
        shutil.rmtree(logs, ignore_errors=True)
        shm.remove_node(node)  # rings of workers that were killed before they removed their files
    return {report.rank: report for report in results.values()}


def _rendezvous(nodes: Nodes, store, join_timeout: int) -> dict:
    """torchelastic's rendezvous settings: torch's c10d rendezvous at `--rdzv-endpoint`, else the
    static one on the store this launcher holds or joins (`_meet`)."""
    if nodes.rdzv_endpoint:
        return dict(run_id=nodes.rdzv_id, rdzv_backend="c10d", rdzv_endpoint=nodes.rdzv_endpoint,
                    rdzv_configs={"join_timeout": join_timeout, "last_call_timeout": 1})
    port = store.port  # a free one on one machine; --master-port across machines
    return dict(run_id=f"pdtool-{uuid.uuid4().hex[:8]}" if nodes.nnodes == 1 else "pdtool",
                rdzv_backend="static", rdzv_endpoint=f"{nodes.master_addr}:{port}",
                rdzv_configs={"rank": nodes.node_rank, "timeout": join_timeout})


@contextlib.contextmanager
def _quiet(verbose: bool):
    """torch's launcher logs nothing meanwhile unless `verbose` (a failure is pdtool's one line)."""
    quiet = [] if verbose else [logging.getLogger(name) for name in _NOISY] + [
        logging.getLogger(name) for name in list(logging.root.manager.loggerDict) if name.startswith(_NOISY)]
    levels = [logger.level for logger in quiet]
    for logger in quiet:
        logger.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        for logger, level in zip(quiet, levels):
            logger.setLevel(level)


@contextlib.contextmanager
def _environment(variables: dict[str, str]):
    """This process's environment with `variables` set meanwhile (the workers inherit it)."""
    saved = {name: os.environ.get(name) for name in variables}
    os.environ.update(variables)
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def _live(store, config: RunConfig, nodes: Nodes, warn=lambda message: None, job: Job | None = None):
    """The live metrics writer of this launcher's job (`launcher.live`): where it holds the store."""
    if not config.live or store is None or nodes.node_rank != 0:
        return None
    from .live import LiveMetrics

    plan, run = (job.plan, job.run) if job is not None else _read(config)
    live = LiveMetrics(peers.attempt_store(store), plan, config, run, warn)  # the workers' keys
    live.start()
    return live


def _read(config: RunConfig):
    """(plan, run) of a launch without a `job` (tests and benches call `launch` directly)."""
    from ...artifacts.plan import Plan
    from ..run import resolved

    plan = Plan.load(config.plan_path)
    return plan, resolved(plan, config)


class _Reaper(threading.Thread):
    """Once a worker of this launcher has failed (it recorded its error under `logs`, or it is gone
    while another is stopped), SIGKILL the ones still alive `SHUTDOWN_S` + 1 seconds later. torch's
    launcher gives them 30 s after its SIGTERM, which a stopped or hung worker never answers (e.g.
    one stopped during start-up, before its peers know its pid)."""

    def __init__(self, logs: str):
        super().__init__(daemon=True)
        self.logs = Path(logs)
        self.done = threading.Event()

    def stop(self) -> None:
        self.done.set()
        self.join(timeout=1)

    def run(self) -> None:
        failed_at, seen = None, set()
        while not self.done.wait(0.2):
            workers = forked.worker_states()
            gone = seen - set(workers)
            seen |= set(workers)
            if failed_at is None and (any(self.logs.glob("**/error.json")) or
                                      (gone and any(state == "T" for state in workers.values()))):
                failed_at = time.monotonic()
            if failed_at is not None and time.monotonic() - failed_at > SHUTDOWN_S + 1:
                for pid in workers:
                    try:
                        os.kill(pid, signal.SIGKILL)
                    except ProcessLookupError:
                        pass


_IFNAME_ENV = ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME")


def _meet(nodes: Nodes, timeout_s: int, talk) -> tuple[object | None, dict[str, str]]:
    """The rendezvous store this launcher holds (None where torch's c10d rendezvous hosts it) and
    the environment that puts the workers' traffic on the job's interface. One machine: the
    store and every socket on loopback only. Several: the interface that routes to the
    rendezvous (or --iface, or a GLOO_SOCKET_IFNAME the user set), and with a static rendezvous
    a check that every machine reaches every other one (`network.check_reachable`)."""
    from . import network

    if nodes.nnodes == 1 and not nodes.rdzv_endpoint:  # nothing listens on other interfaces
        chosen = network.pick_interface("127.0.0.1", nodes.interface)[0] if nodes.interface else "lo"
        return _listening_store("127.0.0.1", nodes.master_port, timeout_s, "drop --master-port (pd train picks a "
                                "free port) or give another one"), {name: chosen for name in _IFNAME_ENV}
    host = nodes.rdzv_endpoint.rsplit(":", 1)[0] if nodes.rdzv_endpoint else nodes.master_addr
    interface, address = network.pick_interface(host, nodes.interface or os.environ.get("GLOO_SOCKET_IFNAME"))
    env = {name: interface for name in _IFNAME_ENV}
    if nodes.rdzv_endpoint:
        return None, env
    if nodes.node_rank == 0:  # this machine hosts the rendezvous, on the master address
        store = _listening_store(network.resolve(nodes.master_addr), nodes.master_port, timeout_s,
                                 "give a free --master-port, the same on every machine")
    else:
        store = _client_store(nodes.master_addr, nodes.master_port, timeout_s, talk)
    network.check_reachable(store, nodes.nnodes, nodes.node_rank, address, interface, timeout_s, talk)
    return store, env


def _listening_store(host: str, port: int | None, timeout_s: int, fix: str):
    """A rendezvous store listening on `host` only (torch's own store listens on every interface):
    a socket bound there, handed to a multi-tenant TCPStore that torchelastic's static rendezvous
    then shares (same port, same process). `port` None picks a free one, so that no other process
    can take it in between."""
    from datetime import timedelta

    import torch.distributed as dist

    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # the last job's port may be in TIME_WAIT
    try:
        sock.bind((host, port or 0))
    except OSError as exc:
        sock.close()
        if exc.errno == errno.EADDRNOTAVAIL:
            raise LaunchError(f"--master-addr {host} is not an address of this machine, and node rank 0 hosts the "
                              "rendezvous: run node rank 0 on the machine at --master-addr") from None
        raise LaunchError(f"cannot listen on {host}:{port} ({exc.strerror}): another program uses the port; "
                          f"{fix}") from None
    sock.listen(128)
    store = dist.TCPStore(host, sock.getsockname()[1], None, True, timedelta(seconds=timeout_s),
                          wait_for_workers=False, multi_tenant=True, master_listen_fd=sock.detach())
    return store


def _client_store(host: str, port: int, timeout_s: int, talk):
    from datetime import timedelta

    import torch.distributed as dist

    talk(f"connecting to the rendezvous at {host}:{port} (node rank 0 hosts it; waiting up to {timeout_s} s)")
    try:
        return dist.TCPStore(host, port, None, False, timedelta(seconds=timeout_s))
    except Exception as exc:  # noqa: BLE001 - torch raises DistNetworkError/RuntimeError with a long text
        raise LaunchError(f"cannot reach the rendezvous at {host}:{port} within {timeout_s} s "
                          f"({str(exc).splitlines()[0][:120]}); start node rank 0 there, or check --master-addr, "
                          "--master-port and the network") from None


_NOISY = ("torch.distributed.elastic", "torch.multiprocessing", "torch.distributed.launcher")


def _explain(failure, logs: str | None = None) -> tuple[str, bool]:
    """One line: which rank failed first and its error message; and whether it raised (so
    that a traceback exists) rather than died. A worker's own error wins over a peer's
    "connection closed", then one that recorded an error (e.g. "waited for rank 1, which stopped
    answering") over one that died without (rank 1, which that worker then killed: failure times
    have a resolution of a second, so the kill may seem to come first); among those, the first.
    When every worker only echoes a lost connection, the line says so in pdtool's words. Errors
    that workers recorded under `logs` count too: torch's launcher reports the first worker it
    sees end (e.g. one its peer killed for its silence) and stops the rest, whose errors it then
    leaves out."""
    failures = dict(failure.failures)
    messages = {rank: _message(info) for rank, info in failures.items()}
    for rank, info in _recorded(failures, logs).items():
        failures[rank], messages[rank] = info, _message(info)
    rank = _first(failures, messages)
    info, message = failures[rank], messages[rank]
    raised = bool(message)
    if not message:
        message = f"exit code {info.exitcode}" + (f" ({info.signal_name()})" if info.exitcode < 0 else "")
    first, echo = in_own_words(message)
    return f"worker rank {rank} failed: {first}; the other workers were stopped", raised and not echo


def _first(failures: dict, messages: dict) -> int:
    """The rank whose failure `_explain` reports; among those that recorded no error, one a signal
    ended (killed from outside: the cause) before one that exited on its own (its peer went away: a
    consequence, which a slow machine may see end first)."""
    return min(failures, key=lambda r: (echoes_a_peer(messages[r]), not messages[r],
                                        not messages[r] and failures[r].exitcode >= 0, failures[r].timestamp, r))


def _callstack(failure, logs: str | None = None) -> str:
    """The traceback the reported worker (`_explain`) recorded in its error file, for --verbose."""
    failures = dict(failure.failures)
    failures.update(_recorded(failures, logs))
    rank = _first(failures, {r: _message(info) for r, info in failures.items()})
    stack = _error_data(failures[rank]).get("message", {})
    stack = stack.get("extraInfo", {}).get("py_callstack", "") if isinstance(stack, dict) else ""
    return f"worker rank {rank}'s traceback:\n{stack.rstrip()}" if stack else f"worker rank {rank} left no traceback"


def in_own_words(message: str) -> tuple[str, bool]:
    """A worker's error message (`Class: text`, possibly over several lines) as one line in
    pdtool's words: its last line, without the class name of pdtool's own errors (one-line
    messages already); a transport's text for a lost connection (gloo's ends in "GLHF!") said as
    what it means. And whether it was such an echo of another worker's disappearance."""
    first = message.strip().splitlines()[-1] if message.strip() else message
    own = _own_error().match(first)
    first = _own_error().sub("", first, count=1)
    if not own and echoes_a_peer(first):
        return ("it lost its connection to another worker of the job, which went away (its process ended or its "
                "machine is gone; on several machines, that machine's pd train says why)"), True
    return first, False


def _own_error() -> re.Pattern:
    """`SomeError: ` at the start of a message, for pdtool's error classes (all of them, wherever
    defined: `pdtool.model.data.DataError` too)."""
    importlib.import_module("pdtool.model.data")  # defines DataError

    names, todo = [], [PdtoolError]
    while todo:
        cls = todo.pop()
        names.append(cls.__name__)
        todo.extend(cls.__subclasses__())
    return re.compile(r"^([\w.]+\.)?(" + "|".join(sorted(names)) + r"): ")


@dataclass(frozen=True)
class _Recorded:
    """A worker's error file that torch's launcher did not report (the fields `_explain` reads)."""

    error_file: str
    timestamp: int
    exitcode: int = 1


def _recorded(failures: dict, logs: str | None) -> dict[int, _Recorded]:
    """Error files under `logs` (torch's layout: .../attempt_N/<local rank>/error.json) of workers
    that `failures` (global rank -> failure) leaves out, by global rank."""
    if not logs or not failures:
        return {}
    offset = {rank - info.local_rank for rank, info in failures.items() if hasattr(info, "local_rank")}
    if len(offset) != 1:
        return {}
    found = {}
    for path in Path(logs).glob("**/error.json"):
        if path.parent.name.isdigit() and int(path.parent.name) + min(offset) not in failures:
            found[int(path.parent.name) + min(offset)] = _Recorded(str(path), int(path.stat().st_mtime))
    return found


def _message(info) -> str:
    """The error message a worker recorded before it ended ("" when it died without one)."""
    message = _error_data(info).get("message", "")
    return message.get("message", "") if isinstance(message, dict) else str(message)


def _error_data(info) -> dict:
    """The JSON a worker recorded in its error file ({} when none)."""
    if not (info.error_file and Path(info.error_file).is_file()):
        return {}
    try:
        data = json.loads(Path(info.error_file).read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}
