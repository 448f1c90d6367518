"""`runtime.launcher.forked.start_early`: pd train starts its workers' forkserver before it imports
torch; the forkserver imports the model's modules only once the launcher names them, before it
forks any worker, and ends with a launcher that ends first. Each test runs a launcher in a
fresh Python process (the forkserver is one per process)."""
import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

LAUNCHER = textwrap.dedent("""
    import json, multiprocessing, os, sys, time
    from multiprocessing import forkserver
    from pdtool.runtime.launcher import forked

    forked.start_early("cpu", 2)
    server = forkserver._forkserver._forkserver_pid
    print(json.dumps({{"launcher": os.getpid(), "forkserver": server}}), flush=True)
""") + "{body}"


def _launcher(tmp_path, body: str) -> subprocess.Popen:
    (tmp_path / "marked.py").write_text("import os, time\n"
                                        "with open(os.environ['MARKS'], 'a') as f:\n"
                                        "    f.write(f'{os.getpid()} {time.time()}\\n')\n")
    env = dict(os.environ, MARKS=str(tmp_path / "marks.txt"), PDTOOL_CACHE_DIR="off")
    # marked.py is importable from the current folder only once the launcher consents (`consent.import_path`)
    # SIGINT as a terminal gives it, also when the suite runs as a background job (which ignores it)
    return subprocess.Popen([sys.executable, "-c", LAUNCHER.format(body=textwrap.dedent(body))], env=env,
                            cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True, preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))


def _marks(tmp_path) -> dict[int, float]:
    path = tmp_path / "marks.txt"
    lines = path.read_text().split("\n") if path.exists() else []
    return {int(pid): float(when) for pid, when in (line.split() for line in lines if line)}


@pytest.mark.slow
def test_the_forkserver_imports_the_models_modules_once_told_and_before_it_forks_a_worker(tmp_path):
    body = """
    import pathlib
    from pdtool.consent import import_path
    time.sleep(1.0)  # the forkserver imports torch meanwhile, and waits
    sys.path.remove("")  # python -c's entry for the current folder: pd's sys.path has none
    sys.path.append(pathlib.Path("/no/such/folder"))  # a factory may put anything there
    told = time.time()
    forked.warm("cpu", 2, ("marked",))  # named before the launcher imports it: as from the capture cache
    import_path()
    import marked  # the launcher's own import (with the user's consent)
    assert forked.start_method("cpu", 2) == forked.FORKSERVER
    context = multiprocessing.get_context("forkserver")
    workers = [context.Process(target=os.getpid) for _ in range(2)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join(60)
    print(json.dumps({"told": told, "exits": [worker.exitcode for worker in workers]}))
    """
    run = _launcher(tmp_path, body)
    out, err = run.communicate(timeout=120)
    assert run.returncode == 0, err
    started, ended = (json.loads(line) for line in out.split("\n") if line)
    assert ended["exits"] == [0, 0]
    marks = _marks(tmp_path)
    # imported by the launcher and once by its forkserver, after it was told; the workers forked ready
    assert set(marks) == {started["launcher"], started["forkserver"]}
    assert marks[started["forkserver"]] >= ended["told"]


@pytest.mark.slow
def test_a_later_launch_forks_its_workers_with_its_installed_modules_and_its_own_factory(tmp_path):
    """A process that launches twice (the Python API, the test suite): before the second launch's
    workers are forked, the forkserver imports the modules of installed packages it is told
    (here the standard library's _codecs_jp; transformers' modeling files in use), not the
    experiment folder's; and it forgets the first launch's `marked` (another folder's file of
    that name), so each worker imports the second launch's own."""
    other = tmp_path / "other"
    (other / "exp").mkdir(parents=True)
    (other / "marked.py").write_text("import os\nwith open(os.environ['MARKS'], 'a') as f:\n"
                                     "    f.write(f'{os.getpid()} -1\\n')\n")  # -1: the other folder's file
    (tmp_path / "exp").mkdir()
    for folder in (tmp_path, other):  # a package of the same name in each folder: its module says which
        (folder / "exp" / "__init__.py").write_text("")
        (folder / "exp" / "model.py").write_text(f"import os\nwith open(os.environ['MARKS'], 'a') as f:\n"
                                                 f"    f.write(f'{{os.getpid()}} {'-2' if folder == other else '2'}\\n')\n")
    body = f"""
    import importlib, pathlib
    from pdtool.consent import import_path
    context = multiprocessing.get_context("forkserver")

    def launch(modules):
        assert forked.start_method("cpu", 2, modules) == forked.FORKSERVER
        workers = [context.Process(target=importlib.import_module, args=(name,)) for name in ("marked", "exp.model")]
        for worker in workers:
            worker.start()
        for worker in workers:
            worker.join(60)
        return [worker.pid for worker in workers]

    sys.path.remove("")
    forked.warm("cpu", 2, ("marked", "exp.model"))
    import_path()
    import marked, exp.model
    first = launch(("marked", "exp.model"))  # the forkserver imported this folder's modules: the workers have them
    os.chdir({str(other)!r})
    sys.path.remove({str(tmp_path)!r})
    del sys.modules["marked"], sys.modules["exp.model"], sys.modules["exp"]
    import_path()
    import marked, exp.model
    second = launch(("marked", "exp.model", "_codecs_jp"))
    held = pathlib.Path(f"/proc/{{server}}/maps").read_text()
    print(json.dumps({{"first": first, "second": second, "codecs": "_codecs_jp" in held}}))
    """
    run = _launcher(tmp_path, body)
    out, err = run.communicate(timeout=120)
    assert run.returncode == 0, err
    started, ended = (json.loads(line) for line in out.split("\n") if line)
    assert ended["codecs"]  # imported by the forkserver for the second launch
    lines = (tmp_path / "marks.txt").read_text().split()
    marks = [(int(pid), when) for pid, when in zip(lines[::2], lines[1::2])]
    # the first folder's marked.py: the launcher and the forkserver; the other folder's: the launcher and each
    # worker of the second launch (the forkserver forgot the first one, and imports no experiment folder's module)
    assert sorted(pid for pid, when in marks if when not in ("-1", "2", "-2")) == sorted([started["launcher"],
                                                                                        started["forkserver"]])
    assert sorted(pid for pid, when in marks if when == "2") == sorted([started["launcher"], started["forkserver"]])
    assert sorted(pid for pid, when in marks if when == "-1") == sorted([started["launcher"], ended["second"][0]])
    # the other folder's exp/model.py: the forkserver forgot the first folder's whole package `exp`
    assert sorted(pid for pid, when in marks if when == "-2") == sorted([started["launcher"], ended["second"][1]])


@pytest.mark.slow  # a fresh Python that imports torch (tests/README.md)
def test_a_forkserver_never_told_ends_with_its_launcher(tmp_path):
    run = _launcher(tmp_path, "time.sleep(0.5)  # then ends (e.g. refused by its checks) without naming modules")
    out, err = run.communicate(timeout=120)
    assert run.returncode == 0, err
    server = json.loads(out.split("\n")[0])["forkserver"]
    deadline = time.monotonic() + 60  # its imports of torch first, then it sees the launcher gone
    while _alive(server) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _alive(server)
    assert _marks(tmp_path) == {}


def _alive(pid: int) -> bool:
    try:
        state = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state not in ("Z", "X")


@pytest.mark.slow  # a fresh Python that imports torch (tests/README.md)
def test_a_ctrl_c_while_the_launcher_checks_is_not_the_forkservers_to_report(tmp_path):
    """A Ctrl-C reaches the terminal's whole process group: the forkserver, still importing or
    waiting to be told, says nothing (pd says the one line) and ends with its launcher."""
    run = _launcher(tmp_path, """
    try:
        time.sleep(60)  # the launcher's checks
    except KeyboardInterrupt:
        sys.exit(130)
    """)
    server = json.loads(run.stdout.readline())["forkserver"]
    time.sleep(1.0)  # the forkserver imports torch
    assert run.poll() is None and _alive(server)
    os.killpg(run.pid, signal.SIGINT)
    _, err = run.communicate(timeout=60)
    assert run.returncode == 130 and "Traceback" not in err, err
    deadline = time.monotonic() + 10
    while _alive(server) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _alive(server)


def test_a_temp_folder_too_long_for_a_socket_path_still_starts_the_forkserver(tmp_path):
    """A TMPDIR longer than AF_UNIX's 108 bytes allow for multiprocessing's socket made pd train end in
    a traceback ('AF_UNIX path too long'); its folder goes to /tmp then, and the forkserver starts."""
    import subprocess
    import sys

    long = tmp_path / ("x" * 100)
    long.mkdir()
    code = ("from multiprocessing import util\nfrom pdtool.runtime.launcher import forked\n"
            "assert forked._ensure_running()\nprint(util.get_temp_dir())")
    done = subprocess.run([sys.executable, "-c", code], env={**__import__("os").environ, "TMPDIR": str(long)},
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().startswith("/tmp/pymp-")


@pytest.mark.slow
def test_a_forkserver_started_for_a_launch_imports_a_later_launchs_installed_modules(tmp_path):
    """`launch` (the Python API, the test suite) readies the forkserver with `start_method`, not
    `start_early`: it starts it there, told where the modules file is, so a later launch's modules
    of installed packages are imported before its workers fork (a review found it started by torch's
    launcher instead, which never told it)."""
    code = textwrap.dedent("""
        import multiprocessing, os, pathlib
        from multiprocessing import forkserver
        from pdtool.runtime.launcher import forked
        assert forked.start_method("cpu", 1) == forked.FORKSERVER  # the first launch
        server = forkserver._forkserver._forkserver_pid
        assert forked.start_method("cpu", 1, ("_codecs_kr",)) == forked.FORKSERVER  # a later one
        worker = multiprocessing.get_context("forkserver").Process(target=os.getpid)
        worker.start()
        worker.join(60)
        print(server is not None and "_codecs_kr" in pathlib.Path(f"/proc/{server}/maps").read_text())
    """)
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.split()[-1] == "True"


def test_a_forkserver_runs_no_module_of_a_folder_that_shadows_a_told_installed_one(tmp_path, monkeypatch):
    """`told.refresh` imports a told module of an installed package only when its own sys.path finds that file:
    an earlier launch's folder holding a module of the same name is never run in the forkserver."""
    from pdtool.runtime.worker import told

    import sysconfig
    installed = os.path.join(sysconfig.get_paths()["stdlib"], "colorsys.py")
    assert os.path.exists(installed)
    monkeypatch.delitem(sys.modules, "colorsys", raising=False)  # matplotlib imports it; put back after
    (tmp_path / "colorsys.py").write_text(f"open({str(tmp_path / 'ran')!r}, 'w').close()\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    told_file = tmp_path / told.FILE
    told_file.write_text(json.dumps({"path": sys.path, "modules": ["colorsys"], "files": {"colorsys": installed}}))
    try:
        told.refresh(str(told_file), {})
        assert not (tmp_path / "ran").exists() and "colorsys" not in sys.modules
    finally:
        sys.modules.pop("colorsys", None)
