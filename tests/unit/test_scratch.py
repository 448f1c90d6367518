"""The launcher's scratch folder: what a SIGKILLed launcher left is swept by the next launch,
and nothing else is (a live launcher's folder, another machine's, files pdtool did not make)."""
import json
import os
import subprocess
import sys
import tempfile

import pytest

from pdtool.runtime.launcher import scratch

KILLED = ("from pdtool.runtime.launcher import scratch; import os, signal; print(scratch.make(), flush=True); "
          "os.kill(os.getpid(), signal.SIGKILL)")


@pytest.fixture
def temp(tmp_path, monkeypatch):
    """A temp folder of the test's own, for this process and its children."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    return tmp_path


def left_by_killed_launcher():
    """The scratch folder of a process that made it and was then killed with SIGKILL."""
    done = subprocess.run([sys.executable, "-c", KILLED], capture_output=True, text=True)
    assert done.returncode == -9, done.stderr
    return done.stdout.strip()


def test_a_scratch_folder_names_its_launcher(temp):
    folder = scratch.make()
    assert os.path.dirname(folder) == str(temp)
    assert os.path.basename(folder).startswith(f"pdtool-workers-{os.getpid()}-")
    with open(os.path.join(folder, scratch.OWNER)) as file:
        owner = json.load(file)
    assert owner["pid"] == os.getpid() and owner["host"]
    assert scratch.sweep() == [] and os.path.isdir(folder)  # its launcher (this process) runs


def test_the_next_launch_sweeps_what_a_killed_launcher_left(temp):
    left = left_by_killed_launcher()
    assert os.path.isdir(left) and left.startswith(str(temp))
    mine = scratch.make()
    assert sorted(os.listdir(temp)) == [os.path.basename(mine)]


def test_the_shared_memory_files_of_a_killed_launchers_workers_go_with_its_folder(temp):
    """Workers killed before they mapped their rings leave /dev/shm files named by their launcher."""
    from pdtool.runtime.worker import shm

    left = left_by_killed_launcher()
    ring = shm.ring_path(scratch.launcher_id(left), 0, 1, 0)
    if not os.path.isdir(os.path.dirname(ring)):
        pytest.skip("no /dev/shm")
    other = shm.ring_path(scratch.launcher_id(left) + "9", 0, 1, 0)  # another launcher's (an id one longer)
    for path in (ring, other):
        with open(path, "wb") as file:
            file.write(b"ring")
    try:
        scratch.make(lambda gone: shm.remove_node(scratch.launcher_id(gone)))  # as the launcher makes its own
        assert not os.path.exists(left) and not os.path.exists(ring) and os.path.exists(other)
    finally:
        for path in (ring, other):
            if os.path.exists(path):
                os.unlink(path)


def test_a_live_launchers_folder_is_kept_until_it_dies(temp):
    child = subprocess.Popen([sys.executable, "-c", "from pdtool.runtime.launcher import scratch; import time; "
                              "print(scratch.make(), flush=True); time.sleep(60)"], stdout=subprocess.PIPE, text=True)
    try:
        folder = child.stdout.readline().strip()
        assert scratch.sweep() == [] and os.path.isdir(folder)
    finally:
        child.kill()
        child.wait()
    assert scratch.sweep() == [folder] and not os.path.exists(folder)


def test_a_pid_now_running_another_process_does_not_keep_a_dead_launchers_folder(temp):
    folder = scratch.make()
    path = os.path.join(folder, scratch.OWNER)
    with open(path) as file:
        owner = json.load(file)
    with open(path, "w") as file:  # this pid, but started at another time: the launcher that made it is gone
        json.dump({**owner, "started": owner["started"] - 1}, file)
    assert scratch.sweep() == [folder]


@pytest.mark.parametrize("change", [
    lambda o: o.update(host="another-machine"),   # a temp folder shared over the network
    lambda o: o.update(namespace="pid:[1]"),      # another container of this machine
    lambda o: o.update(pid="12"),
    lambda o: o.pop("pid"),
])
def test_folders_of_other_machines_or_unreadable_owners_are_kept(temp, change):
    left = left_by_killed_launcher()
    path = os.path.join(left, scratch.OWNER)
    with open(path) as file:
        owner = json.load(file)
    change(owner)
    with open(path, "w") as file:
        json.dump(owner, file)
    assert scratch.sweep() == [] and os.path.isdir(left)


def test_what_pdtool_did_not_make_is_kept(temp):
    left = left_by_killed_launcher()
    owner = os.path.join(left, scratch.OWNER)
    for name in ("pdtool-workers-abc", "pdtool-workers-1-x.y", "other-1-x"):  # other names, same owner file
        os.mkdir(temp / name)
        os.link(owner, temp / name / scratch.OWNER)
    (temp / "pdtool-workers-7-file").write_text("a file, not a folder")
    os.symlink(left, temp / "pdtool-workers-8-link")
    os.mkdir(temp / "pdtool-workers-9-noowner")
    assert scratch.sweep() == [left]
    assert sorted(os.listdir(temp)) == ["other-1-x", "pdtool-workers-1-x.y", "pdtool-workers-7-file",
                                        "pdtool-workers-8-link", "pdtool-workers-9-noowner", "pdtool-workers-abc"]


STARTED_EARLY = ("import os, signal; from multiprocessing import util; "
                 "from pdtool.runtime.launcher import forked; "
                 "forked.start_early('cpu', 2); "
                 "print(util.get_temp_dir(), flush=True); os.kill(os.getpid(), signal.SIGKILL)")


def test_the_forkservers_folder_of_a_killed_launcher_is_swept_and_other_programs_are_kept(temp):
    """Issue 35 item 15: a SIGKILL of the launcher while its early forkserver waits left `pymp-*` behind."""
    done = subprocess.run([sys.executable, "-c", STARTED_EARLY], capture_output=True, text=True,
                          env=dict(os.environ, PDTOOL_CACHE_DIR="off"))
    assert done.returncode == -9, done.stderr
    left = done.stdout.strip()
    assert os.path.basename(left).startswith("pymp-") and os.path.isfile(os.path.join(left, scratch.FORKSERVER_OWNER))
    theirs = temp / "pymp-theirs"  # another program's multiprocessing folder, whatever became of that program
    theirs.mkdir()
    (theirs / "listener-1").write_text("")
    mine = temp / "pymp-mine"  # a live launcher's (this process's)
    mine.mkdir()
    scratch.mark(str(mine))
    assert scratch.sweep() == [left]
    assert sorted(os.listdir(temp)) == ["pymp-mine", "pymp-theirs"]
