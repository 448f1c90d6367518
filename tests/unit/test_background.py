"""`planner.background`: a piece of planning in a forked child, the same answer either way."""
import os

import pytest

from pdtool.planner import background as bg


@pytest.fixture
def fork_allowed(monkeypatch):
    monkeypatch.setattr(bg, "forkable", lambda: True)  # the test process has torch and threads: forced


def test_the_childs_result_comes_back(fork_allowed):
    parent = os.getpid()
    with bg.background(lambda: ("computed in", os.getpid())) as result:
        where = result()
    assert where[0] == "computed in" and where[1] != parent


def test_without_a_fork_the_work_runs_here_when_asked(monkeypatch):
    monkeypatch.setattr(bg, "forkable", lambda: False)
    with bg.background(lambda: os.getpid()) as result:
        assert result() == os.getpid()
    with bg.background(lambda: os.getpid(), worth=False) as result:
        assert result() == os.getpid()


def test_a_failing_child_is_computed_here(fork_allowed):
    calls = []

    def work():
        calls.append(os.getpid())
        if len(calls) == 1 and os.getpid() != parent:
            raise RuntimeError("child fails")  # only in the child: the parent's call list stays empty
        return "here"

    parent = os.getpid()
    with bg.background(work) as result:
        assert result() == "here"
    assert calls == [parent]


def test_a_child_whose_result_is_not_asked_for_is_killed_and_reaped(fork_allowed, monkeypatch):
    import time

    pids = []
    fork = os.fork
    monkeypatch.setattr(os, "fork", lambda: pids.append(fork()) or pids[-1])
    began = time.monotonic()
    with pytest.raises(ValueError):
        with bg.background(lambda: time.sleep(60)):
            raise ValueError("the caller failed")
    assert time.monotonic() - began < 10
    with pytest.raises(ChildProcessError):
        os.waitpid(pids[0], os.WNOHANG)  # reaped already: not even a zombie left


def test_plans_are_the_same_with_the_straight_pipelines_solved_in_a_child(fork_allowed, monkeypatch):
    from pdtool.artifacts.cluster import parse_cluster
    from pdtool.planner import make, make_plan

    monkeypatch.syspath_prepend(os.path.join(os.path.dirname(__file__), "..", "..", "bench"))
    from plan_speed import transformer

    profile, cluster = transformer(60), parse_cluster("8x300GB/s,16x25GB/s")
    here = make_plan(profile, cluster)
    monkeypatch.setattr(make, "BACKGROUND_SIZE", 0)
    children = []
    fork = os.fork
    monkeypatch.setattr(os, "fork", lambda: children.append(1) or fork())
    assert make_plan(profile, cluster).to_json() == here.to_json()
    assert children == [1]
