"""bench/record.py: a benchmark's output lands in a dated result file with its command and machine."""
import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
import record  # noqa: E402


def test_a_benchmark_writes_what_it_printed_with_the_command_and_the_machine(tmp_path, monkeypatch, capsys):
    monkeypatch.delenv("PDTOOL_BENCH_RESULTS")  # the suite's "off" (tests/conftest.py)
    monkeypatch.setattr(record, "RESULTS", tmp_path / "results")
    with record.recorded("train_speed", ["bench/train_speed.py", "--only", "main"]):
        print("| pdtool flush | 90.7 |")
        assert os.environ["PDTOOL_BENCH_RESULTS"] == "off"  # a child process of the bench records nothing
    assert "PDTOOL_BENCH_RESULTS" not in os.environ
    files = list((tmp_path / "results").glob("train_speed_*.md"))
    assert len(files) == 1 and files[0].name.count("_") >= 2 and files[0].name.endswith(".md")
    text = files[0].read_text()
    assert "`python bench/train_speed.py --only main`" in text and "| pdtool flush | 90.7 |" in text
    assert "cores" in text and "torch" in text
    assert "| pdtool flush | 90.7 |" in capsys.readouterr().out  # the terminal still sees it


@pytest.mark.parametrize("argv", [["bench/x.py", "--smoke"], ["bench/x.py", "--help"]])
def test_smoke_runs_write_nothing(tmp_path, monkeypatch, argv):
    monkeypatch.setattr(record, "RESULTS", tmp_path / "results")
    with record.recorded("x", argv):
        print("tiny")
    assert not (tmp_path / "results").exists()


def test_a_failed_run_writes_nothing(tmp_path, monkeypatch):
    monkeypatch.delenv("PDTOOL_BENCH_RESULTS")
    monkeypatch.setattr(record, "RESULTS", tmp_path / "results")
    with pytest.raises(RuntimeError):
        with record.recorded("x", ["bench/x.py"]):
            print("half a table")
            raise RuntimeError("broke")
    assert not (tmp_path / "results").exists()
    assert sys.stdout is not None and not isinstance(sys.stdout, record._Tee)


def test_the_test_suite_writes_no_result_file(tmp_path, monkeypatch):
    monkeypatch.setattr(record, "RESULTS", tmp_path / "results")
    with record.recorded("x", ["bench/x.py"]):
        print("a full run, under the suite")
    assert not (tmp_path / "results").exists()
