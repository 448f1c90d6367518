"""Files in shared folders, opened without following links (`pdtool.safefile`, issue 35 item 3)."""
import hashlib
import os

import pytest

from pdtool import safefile
from pdtool.safefile import NotRegular


def test_a_link_a_folder_and_a_pipe_are_refused_on_the_open_itself(tmp_path):
    (tmp_path / "real").write_bytes(b"data")
    os.symlink(tmp_path / "real", tmp_path / "link")
    os.mkfifo(tmp_path / "pipe")
    (tmp_path / "folder").mkdir()
    assert safefile.read_bytes(tmp_path / "real") == b"data"
    for name, words in (("link", "symbolic link"), ("pipe", "not a regular file"), ("folder", "not a regular file")):
        with pytest.raises(NotRegular, match=words):
            safefile.read_bytes(tmp_path / name)
    with pytest.raises(NotRegular):
        safefile.open_regular(tmp_path / "link", "a+")
    assert (tmp_path / "real").read_bytes() == b"data"


def test_a_replaced_file_is_hashed_while_written_and_replaces_a_link_not_its_target(tmp_path):
    victim = tmp_path / "victim"
    victim.write_text("keep")
    os.symlink(victim, tmp_path / "out")
    with safefile.replaced(tmp_path / "out") as out:
        out.write(b"abc")
        out.write(memoryview(b"def"))
    assert out.hexdigest() == hashlib.sha256(b"abcdef").hexdigest() == safefile.sha256(tmp_path / "out")
    assert not os.path.islink(tmp_path / "out") and victim.read_text() == "keep"
    with pytest.raises(RuntimeError):
        with safefile.replaced(tmp_path / "out") as out:
            out.write(b"half")
            raise RuntimeError("a failure part-way")
    assert (tmp_path / "out").read_bytes() == b"abcdef"  # as it was, and no temporary file left
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out", "victim"]


def test_foreign_names_what_makes_a_file_not_the_users_alone(tmp_path):
    path = tmp_path / "f"
    path.write_text("")
    os.chmod(path, 0o644)
    assert safefile.foreign(os.stat(path)) is None
    os.chmod(path, 0o664)
    assert "writable by its group (mode 664)" == safefile.foreign(os.stat(path))
    os.chmod(path, 0o646)
    assert "writable by others" in safefile.foreign(os.stat(path))
    other = os.stat(path)
    fake = os.stat_result((other.st_mode & ~0o022, *other[1:4], os.geteuid() + 1, *other[5:]))
    assert safefile.foreign(fake).startswith(f"owned by user id {os.geteuid() + 1}")
