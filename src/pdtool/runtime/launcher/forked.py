"""How `pd train`'s launcher starts its workers on this machine: forked from a forkserver that
has torch and the worker's modules imported (CPU workers), or spawned (GPU workers).

A forked worker starts in about 0.3 s instead of the 2-3 s a spawned one takes to import torch
and torch._dynamo, and in a process that launches more than once (the test suite) the
forkserver serves every launch. Its environment and standard streams are those of the first
launch, so every worker takes the launcher's at its own launch (`worker.entry.LaunchState`); cwd and
sys.path multiprocessing sets itself. The reaper (`launch._Reaper`) and the tests find the
workers by `worker_states`.
"""
from __future__ import annotations

import os
import sys
from pathlib import Path

FORKSERVER, SPAWN = "forkserver", "spawn"


def _workers() -> list[int]:
    """This process's worker processes: spawned children (`spawn_main` in their command line) and
    the children of its forkserver child."""
    found = []
    for child in _children("self"):
        try:
            cmdline = Path(f"/proc/{child}/cmdline").read_bytes()
        except OSError:
            continue
        if b"spawn_main" in cmdline:
            found.append(child)
        elif _FORKSERVER in cmdline or child == _forked_server():
            found.extend(_children(child))
    return found


def worker_states() -> dict[int, str]:
    """This process's live worker processes (its spawned children, or the children of its forkserver
    child): pid -> state letter (R, S, T, ...), from /proc; empty where /proc has no such files."""
    found = {}
    for pid in _workers():
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if state not in ("Z", "X"):
            found[pid] = state
    return found


_FORKSERVER = b"multiprocessing.forkserver"
"""In the command line of the forkserver that starts the workers (and of the workers it forks), unless
it is a fork of this process (`_fork_forkserver`)."""


def _forked_server() -> int | None:
    from multiprocessing import forkserver

    return forkserver._forkserver._forkserver_pid


def _children(pid: int | str) -> list[int]:
    """The child processes of `pid` ("self": this one), from /proc."""
    found = []
    for children in Path(f"/proc/{pid}/task").glob("*/children"):
        try:
            found.extend(map(int, children.read_text().split()))
        except OSError:
            continue
    return found


PRELOAD = "pdtool.runtime.worker.preload"
"""The module the workers' forkserver imports before it forks any worker."""


def start_method(device: str, local_workers: int, modules: tuple[str, ...] = ()) -> str:
    """How the workers start: from the forkserver (`FORKSERVER`) when they compute on the CPU, else
    spawned (a forked process cannot use CUDA once its parent has touched it), and the forkserver
    is readied (`_preload`, with `modules` besides the worker's own; told them: `tell`) and started
    here unless it runs (`_ensure_running`: with the file it reads before each fork, which a
    forkserver that torch's launcher started would not know)."""
    from ..device import choose

    if choose(device, 0, local_workers).device.type != "cpu":
        return SPAWN
    _preload(modules)
    tell(modules)
    _ensure_running()
    return FORKSERVER


_PRELOADED: list[str] = [PRELOAD]


def _preload(modules: tuple[str, ...] = ()) -> None:
    """The workers start from a forkserver (multiprocessing's), which imports torch and the worker's
    modules once (`PRELOAD`), and the model's (`warm`): a worker is forked ready instead of
    importing them (about 2 s of CPU each for torch, 0.6-1.5 s for transformers). The forkserver
    starts at this process's first launch (or `warm`, `start_early`) and serves every later one; its
    environment and standard streams are those of that first launch, which `worker.entry.LaunchState` corrects
    in each worker (`worker.entry.LaunchState`). (Its cwd and sys.path multiprocessing sets in each worker itself.)"""
    import multiprocessing

    _PRELOADED.extend(m for m in modules if m not in _PRELOADED)
    multiprocessing.set_forkserver_preload(list(_PRELOADED))


_SOCKET_PATH = 107 - len("/pymp-xxxxxxxx/listener-xxxxxxxx")
"""The longest temp folder whose multiprocessing socket path fits in AF_UNIX's 108 bytes."""


def _short_temp_dir() -> None:
    """multiprocessing makes its folder (the forkserver's socket, `start_early`'s file) in the temp
    folder; under a TMPDIR too long for a socket's path, make it in /tmp instead (once per process:
    multiprocessing keeps the first folder it made)."""
    import tempfile
    from multiprocessing import util

    if len(tempfile.gettempdir()) <= _SOCKET_PATH or not os.access("/tmp", os.W_OK | os.X_OK):
        return
    saved, tempfile.tempdir = tempfile.tempdir, "/tmp"
    try:
        util.get_temp_dir()
    finally:
        tempfile.tempdir = saved


def _ensure_running() -> bool:
    """Start multiprocessing's forkserver unless it runs, told where this process names the
    model's modules (`tell`); whether it runs."""
    from multiprocessing import forkserver

    from ..worker import told

    _short_temp_dir()
    os.environ[told.VARIABLE] = f"{os.getpid()}:{_modules_file()}"
    try:
        forkserver.ensure_running()
    except OSError:  # e.g. a temp folder whose path is too long for a socket: the launch says so itself
        return False
    finally:
        del os.environ[told.VARIABLE]
    return True


def _modules_file() -> str:
    """Where this process names the model's modules to its workers' forkserver (`worker.told`): in
    its own multiprocessing folder (the forkserver's socket is there too), removed at its exit."""
    from multiprocessing import util

    from ..worker import told

    _short_temp_dir()
    return os.path.join(util.get_temp_dir(), told.FILE)


def warm(device: str, local_workers: int, modules: tuple[str, ...]) -> None:
    """Start the workers' forkserver now when they will be forked from it, with `modules` (those
    the model's classes come from, e.g. transformers' modeling_gpt2 or the experiment's own:
    `preflight.model_modules`) imported, so that those imports run while pd train checks the
    plan, once per machine rather than once per worker; a forkserver started early (`start_early`)
    is told them (`tell`). The launcher names only modules it imported with the user's consent, or
    that a run of the same plan, model and folder did (`capture_cache`)."""
    if _AWAITING:
        tell(modules)
    elif start_method(device, local_workers, modules) == FORKSERVER:
        _ensure_running()


_AWAITING: list[str] = []
"""The file a forkserver started early (`start_early`) waits for, until it is told (`tell`)."""


def start_early(device: str, local_workers: int) -> None:
    """Start the workers' forkserver first thing when the job surely runs on the CPU, as a fork of this
    process once it has imported torch (`_fork_forkserver`; a process of its own where that cannot be or
    is not safe: `_fork_is_safe`):
    it imports the worker's modules (`PRELOAD`) while the launcher checks the plan, then waits to be told the model's modules
    (`worker.preload_model`, `tell`) and imports them once: as soon as the plan's model passed
    consent, from the launcher's capture cache when it holds this run (`capture_cache`: a run of
    the same plan, model and folder named them), else once the launcher has built the model (`warm`). The
    launcher tells it before it forks any worker (`start_method`); a launcher that ends first
    takes it along."""
    from multiprocessing import forkserver, resource_tracker, util

    if not _surely_cpu(device) or local_workers < 1 or forkserver._forkserver._forkserver_pid is not None:
        return
    if sys.version_info >= (3, 14):  # the default start method there: a factory's own pool would wait on it too
        return
    from ... import lazy_dynamo

    _PRELOADED.insert(0, "pdtool.runtime.worker.preload_model")  # first: it imports `PRELOAD` itself, then waits
    _preload()
    _short_temp_dir()
    resource_tracker.ensure_running()  # started by the forkserver's start otherwise, with the variable below
    # in multiprocessing's folder of this process (the forkserver's socket is there too), removed at its exit
    from .scratch import mark

    mark(util.get_temp_dir())  # a launcher killed before its exit handler leaves it: the next launch sweeps it
    if _forks_its_server() and _fork_is_safe():
        started = _fork_forkserver(_modules_file(), lazy_dynamo.installed())
    else:  # a process of its own, told as a fork would be
        from ..worker.preload_model import LAZY_VARIABLE

        os.environ[LAZY_VARIABLE] = "1" if lazy_dynamo.installed() else ""
        try:
            started = _ensure_running()
        finally:
            del os.environ[LAZY_VARIABLE]
    if not started:
        return
    _AWAITING.append(_modules_file())


def _forks_its_server() -> bool:
    """Whether multiprocessing's forkserver is the one `_fork_forkserver` knows how to run: its `main`
    with these parameters and no others (a later Python's authenticates its clients: a process of its
    own there)."""
    import inspect
    from multiprocessing import forkserver

    try:
        return list(inspect.signature(forkserver.main).parameters) == [
            "listener_fd", "alive_r", "preload", "main_path", "sys_path"]
    except (TypeError, ValueError):
        return False


def _fork_is_safe() -> bool:
    """Whether a fork of this process makes a forkserver whose workers can compute on several threads:
    torch is not imported yet (`pd train`: `_fork_forkserver` imports it and forks at once), or no thread
    has started beyond those running Python and the one importing torch starts. Once torch's intra-op
    thread pool (libgomp's, threads that run no Python) has run a parallel region, a forked child waits
    forever at its next one (a library or test process that computed before it launched); such a
    process starts a forkserver of its own."""
    if "torch" not in sys.modules:
        return True
    try:
        tasks = len(os.listdir("/proc/self/task"))
    except OSError:
        return False
    return tasks <= len(sys._current_frames()) + 1


def _fork_forkserver(path: str, lazy: bool) -> bool:
    """Start multiprocessing's forkserver as a fork of this process once it has imported torch (which
    it imports next anyway) and nothing else of the run: the forkserver then imports only the worker's
    modules and the model's (`worker.preload_model.serve`), not torch again (about 1.9 s of CPU for a
    process of its own). Nothing of this process's run exists yet (no thread but the ones importing
    torch starts, as in any forkserver; no file, lock or handler of the run): the child keeps its
    signals' defaults and ends with os._exit, running none of this process's exit handlers."""
    import signal
    import socket
    from multiprocessing import connection, forkserver

    import torch  # noqa: F401 - imported once, here, for both processes

    from ..worker import preload_model, told

    server = forkserver._forkserver
    try:
        listener = socket.socket(socket.AF_UNIX)
        address = connection.arbitrary_address("AF_UNIX")
        listener.bind(address)
        os.chmod(address, 0o600)
        listener.listen()
    except OSError:  # e.g. a temp folder whose path is too long for a socket: the launch says so itself
        return False
    alive_r, alive_w = os.pipe()
    launcher = os.getpid()
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:  # the forkserver
        code = 0
        try:
            os.close(alive_w)
            for number in signal.valid_signals():
                try:
                    if callable(signal.getsignal(number)) and number != signal.SIGINT:
                        signal.signal(number, signal.SIG_DFL)
                except (OSError, ValueError):
                    pass
            signal.signal(signal.SIGINT, signal.default_int_handler)
            os.environ[told.VARIABLE] = f"{launcher}:{path}"
            preload_model.serve(launcher, path, lazy)
            forkserver.main(listener.fileno(), alive_r, [])
        except SystemExit:
            pass
        except BaseException:  # noqa: BLE001 - the launcher sees its workers never start, and says so
            code = 1
        finally:
            os._exit(code)
    os.close(alive_r)
    listener.close()
    server._forkserver_address, server._forkserver_alive_fd, server._forkserver_pid = address, alive_w, pid
    return True


def tell(modules: tuple[str, ...] = ()) -> None:
    """Name `modules` to the workers' forkserver (`worker.told`), with this process's sys.path and
    the current folder after it (where a factory of the experiment folder is imported from:
    `consent.import_path`): one started early (`start_early`) imports them all before it forks any
    worker (the first call counts), every one imports those of installed packages before its next
    fork (a later launch of this process). The file names every module this process told (a
    forkserver may read it only after a later call). Something is written whatever happens here
    (else a forkserver started early would wait on it)."""
    from ..worker import told

    _TOLD.update(dict.fromkeys(modules))
    told.write(_modules_file(), tuple(_TOLD))
    _AWAITING.clear()


_TOLD: dict = {}
"""The modules this process named to its workers' forkserver (`tell`), in order."""


def _surely_cpu(device: str) -> bool:
    """Whether workers asking for `device` compute on the CPU, known without importing torch:
    --device cpu, or auto on a Linux machine without a GPU driver's device files."""
    if device == "cpu":
        return True
    gpu_files = ("/dev/nvidiactl", "/dev/kfd", "/dev/dxg")  # NVIDIA, AMD ROCm, WSL
    return device == "auto" and sys.platform.startswith("linux") and not any(map(os.path.exists, gpu_files))
