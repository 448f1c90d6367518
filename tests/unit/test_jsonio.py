import json
import os

import pytest

from pdtool.errors import ArtifactError
from pdtool.jsonio import canonical_json, read_json, write_json


def test_canonical_text_sorts_keys_indents_and_ends_with_newline():
    text = canonical_json({"b": 1, "a": [1, 2]})
    assert text == '{\n  "a": [\n    1,\n    2\n  ],\n  "b": 1\n}\n'


def test_floats_are_rounded_to_six_significant_digits():
    assert json.loads(canonical_json({"x": 1.23456789, "y": 123456789.0, "z": -0.0}))== {
        "x": 1.23457, "y": 123457000.0, "z": 0.0}


def test_same_data_gives_same_bytes_whatever_the_insertion_order():
    assert canonical_json({"a": 1, "b": {"c": 2.0, "d": 3}}) == canonical_json({"b": {"d": 3, "c": 2.0}, "a": 1})


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_non_finite_numbers_are_refused_naming_the_place(bad):
    with pytest.raises(ArtifactError, match=r"\.layers\[1\]"):
        canonical_json({"layers": [0.0, bad]})


def test_atomic_write_leaves_the_old_file_when_writing_fails(tmp_path):
    target = tmp_path / "out.json"
    write_json(target, {"ok": 1})
    with pytest.raises(ArtifactError):
        write_json(target, {"bad": object()})
    assert json.loads(target.read_text()) == {"ok": 1}
    assert os.listdir(tmp_path) == ["out.json"]  # no temporary file left behind


def test_written_files_get_the_usual_permissions(tmp_path):
    umask = os.umask(0o022)
    try:
        write_json(tmp_path / "x.json", {})
    finally:
        os.umask(umask)
    assert (tmp_path / "x.json").stat().st_mode & 0o777 == 0o644


def test_writing_into_a_missing_folder_is_one_clear_error(tmp_path):
    with pytest.raises(ArtifactError, match="does not exist"):
        write_json(tmp_path / "nope" / "x.json", {})


def test_dash_writes_to_stdout(capsys):
    write_json("-", {"a": 1})
    assert capsys.readouterr().out == '{\n  "a": 1\n}\n'


def test_read_errors_name_the_file_and_the_fix(tmp_path):
    with pytest.raises(ArtifactError, match="no such file"):
        read_json(tmp_path / "missing.json")
    bad = tmp_path / "bad.json"
    bad.write_text('{"a": ')
    with pytest.raises(ArtifactError, match=r"bad\.json: not valid JSON \(line 1"):
        read_json(bad)
    with pytest.raises(ArtifactError, match="is a folder"):
        read_json(tmp_path)


def test_a_full_disk_is_one_line_and_leaves_the_old_file(tmp_path, monkeypatch):
    import errno

    from pdtool.errors import ArtifactError
    from pdtool.jsonio import write_json

    out = tmp_path / "p.json"
    write_json(out, {"a": 1})
    before = out.read_bytes()

    def full(fd):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr("os.fsync", full)
    with pytest.raises(ArtifactError, match="No space left on device; free space") as info:
        write_json(out, {"a": 2})
    assert "\n" not in str(info.value)
    assert out.read_bytes() == before and [p.name for p in tmp_path.iterdir()] == ["p.json"]  # no temporary left
