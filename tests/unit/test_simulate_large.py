"""`pd simulate` on a large plan (issue 37): the steady state of one period by default above 256
workers (the event simulation of a 448-worker plan took 38 s here, the steady state under a second);
`--events`, `--trace` or `--minibatches` ask for the event simulation."""
from click.testing import CliRunner

from pdtool.cli import cli
from pdtool.cli.simulate import EVENT_WORKERS
from pdtool.sim.simulate import simulate
from pdtool.sim.steady import steady_state
from test_simulate import make


def test_a_large_plan_gets_its_steady_state_and_a_small_one_its_events(tmp_path):
    big = make([(1.0, 2.0, 8, 4_000_000, 1_000_000)] * 40, levels=[(320, 1e10)])
    assert len(big.used_ranks) > EVENT_WORKERS
    path = tmp_path / "big.plan.json"
    big.save(path)
    result = CliRunner().invoke(cli, ["simulate", str(path)])
    assert result.exit_code == 0, result.output
    state = steady_state(big)
    assert f"predicted    {state.time_per_minibatch_ms:.3f} ms per minibatch" in result.output
    assert "the steady state of one period" in result.output and "pd simulate --events" in result.output
    small = make([(1.0, 2.0, 1)] * 4, levels=[(4, 1e10)])
    small.save(tmp_path / "small.plan.json")
    result = CliRunner().invoke(cli, ["simulate", str(tmp_path / "small.plan.json")])
    assert "busy %" in result.output  # the per-worker table of the event simulation


def test_the_steady_state_of_a_large_plan_is_its_event_simulation():
    big = make([(1.0, 2.0, 8, 4_000_000, 1_000_000)] * 40, levels=[(320, 1e10)])
    import pytest

    assert steady_state(big).time_per_minibatch_ms == pytest.approx(
        simulate(big, minibatches=64).time_per_minibatch_ms, rel=0.02)
