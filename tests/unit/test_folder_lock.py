"""One writer per checkpoint folder (`runtime.launcher.folder_lock`)."""
import os
import socket

import pytest

from pdtool.errors import LaunchError
from pdtool.runtime.launcher.folder_lock import LOCK, FolderLock


def test_a_second_holder_is_refused_with_the_first_ones_pid_and_host(tmp_path):
    first = FolderLock.acquire(tmp_path / "ckpt")
    first.claim({"run": "aaaa"})
    try:
        with pytest.raises(LaunchError) as info:
            FolderLock.acquire(tmp_path / "ckpt")
        line = str(info.value)
        assert f"in use by another pd train (pid {os.getpid()} on {socket.gethostname()})" in line
        assert "\n" not in line and "another --checkpoint-dir" in line
    finally:
        first.release()
    second = FolderLock.acquire(tmp_path / "ckpt")  # free once released
    assert second.previous == {"run": "aaaa"}
    second.release()
    third = FolderLock.acquire(tmp_path / "ckpt")  # a run that stopped before it claimed keeps the writer
    assert third.previous == {"run": "aaaa"}
    third.release()
    assert (tmp_path / "ckpt" / LOCK).exists()  # the record stays for the next --resume


def test_a_folder_that_cannot_hold_the_lock_is_one_line(tmp_path):
    (tmp_path / "file").write_text("not a folder")
    with pytest.raises(LaunchError, match="cannot create .pdtool.lock in it") as info:
        FolderLock.acquire(tmp_path / "file" / "ckpt")
    assert "\n" not in str(info.value)


def test_a_lock_file_that_is_not_ours_reads_as_no_previous_run(tmp_path):
    (tmp_path / LOCK).write_text("garbage")
    lock = FolderLock.acquire(tmp_path)
    assert lock.previous is None
    lock.release()


def test_a_symlinked_lock_is_refused_and_its_target_untouched(tmp_path):
    """Issue 35 item 3: `ckl/.pdtool.lock -> ../victim.txt` replaced victim.txt with the lock's JSON."""
    victim = tmp_path / "victim.txt"
    victim.write_text("precious\n")
    folder = tmp_path / "ckl"
    folder.mkdir()
    os.symlink("../victim.txt", folder / LOCK)
    with pytest.raises(LaunchError, match=r"\.pdtool\.lock is a symbolic link.*remove it") as info:
        FolderLock.acquire(folder)
    assert "\n" not in str(info.value)
    assert victim.read_text() == "precious\n"
    (folder / LOCK).unlink()
    os.symlink(tmp_path / "nowhere", folder / LOCK)  # a dangling link: nothing is created at its target
    with pytest.raises(LaunchError, match="symbolic link"):
        FolderLock.acquire(folder)
    assert not (tmp_path / "nowhere").exists()
    (folder / LOCK).unlink()
    os.mkfifo(folder / LOCK)  # a pipe in its place: refused at once, never a blocked open
    with pytest.raises(LaunchError, match="not a regular file"):
        FolderLock.acquire(folder)
