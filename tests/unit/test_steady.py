"""The steady state from one period of the schedule (`pdtool.sim.steady`) against the event simulation."""
import dataclasses
from pathlib import Path

import pytest

from pdtool.artifacts.cluster import parse_cluster
from pdtool.artifacts.pipedream import load_pipedream_graph
from pdtool.artifacts.profile import Profile
from pdtool.planner import make_plan
from pdtool.schedule import resolve
from pdtool.sim.simulate import simulate
from pdtool.sim.steady import _Graph, applies, steady_state
from test_plan import chain_profile

ROOT = Path(__file__).resolve().parents[2]
CLUSTERS = ["4x12GB/s", "3x100Mbit/s", "cluster-a:1", "8x25GB/s,2x25Gbit/s+20us"]


def _profiles():
    for path in sorted((ROOT / "profiles").glob("*.profile.json")):
        yield path.name, lambda path=path: Profile.load(path)
    for path in sorted((ROOT / "profiles" / "pipedream").glob("*.graph.txt")):
        yield path.name, lambda path=path: load_pipedream_graph(path, 64 if "gnmt" in path.name else None)


@pytest.mark.slow
@pytest.mark.parametrize("name,load", list(_profiles()), ids=[name for name, _ in _profiles()])
def test_the_steady_state_of_every_shipped_profile_and_cluster_is_the_simulations_within_two_percent(name, load):
    """The cost model's optimum and the straight pipeline, in pipedream and vsync (their steady
    order written out) and in the modes that flush (one batch as the period), on every shipped
    profile and a set of clusters (one machine, slow links, a paper preset, two levels), with
    weight stashing's copies priced (the steady state takes their average per step, the
    simulation each one)."""
    profile = dataclasses.replace(load(), copy_ms_per_mib=0.1)  # weight stashing's copies priced, as measured
    for cluster in CLUSTERS:
        for straight in (False, True):
            plan = make_plan(profile, parse_cluster(cluster), straight=straight, simulate=False)
            flushing = ("flush", "gpipe", "zb", "zb2") if cluster == CLUSTERS[1] else ()  # slow links: bubbles matter
            for mode in ("pipedream", "vsync", "2bw") + flushing:
                steady = steady_state(plan, mode)
                replicas = [s.replicas for s in plan.stages]
                if steady is None and mode == "2bw":  # steps inside a replica's own minibatches: no period
                    assert any(resolve(mode, plan.mode, replicas).group % r for r in replicas)
                    continue
                simulated = simulate(plan, mode).time_per_minibatch_ms
                assert steady is not None
                assert steady.time_per_minibatch_ms == pytest.approx(simulated, rel=0.02), (cluster, straight, mode)


def test_replicas_with_a_common_factor_are_computed_on_one_sub_pipeline():
    """Replicas (4, 4, 8) share a factor 4: the period is that of replicas (1, 1, 2), 2 minibatches,
    standing for 8, and its figure still equals the simulation's."""
    plan = make_plan(Profile.load(ROOT / "profiles" / "gpt.profile.json"), parse_cluster("4x12GB/s,4x10Gbit/s"),
                     simulate=False)
    assert [s.replicas for s in plan.stages] == [4, 4, 8]
    steady = steady_state(plan)
    assert steady.period_minibatches == 8
    assert steady.time_per_minibatch_ms == pytest.approx(simulate(plan).time_per_minibatch_ms, rel=0.002)


def test_every_mode_has_a_period_except_2bw_stepping_inside_a_replicas_own_minibatches():
    """On a straight pipeline every mode's steady state is computed; 2bw with fewer minibatches per
    step than a stage's replicas steps several times inside each of a replica's own minibatches,
    which no period of whole minibatches holds: left to the simulation."""
    plan = make_plan(chain_profile([1.0] * 4, [1000] * 4, [100] * 4), parse_cluster("2x1GB/s"), straight=True,
                     simulate=False)
    for mode in ("pipedream", "vsync", "2bw", "flush", "gpipe", "zb", "zb2"):
        assert applies(plan, mode) and steady_state(plan, mode) is not None
    replicated = make_plan(chain_profile([1.0] * 4, [1000] * 4, [100] * 4), parse_cluster("4x1GB/s"),
                           data_parallel=True, simulate=False)
    assert replicated.stages[0].replicas == 4 and steady_state(replicated, "2bw") is None


def test_the_largest_cycle_ratio_of_a_small_event_graph():
    """Two cycles: a -> b -> a carries 3 + 5 ms over 2 tokens (4 ms), a -> a 3.5 ms over 1 token;
    the largest ratio is 4. A cycle without a token means a deadlock: None."""
    graph = _Graph()
    a, b = graph.node(), graph.node()
    graph.arc(a, b, 3.0, 1)
    graph.arc(b, a, 5.0, 1)
    graph.arc(a, a, 3.5, 1)
    assert graph.max_cycle_ratio() == pytest.approx(4.0)
    graph.arc(a, a, 9.0, 1)
    assert graph.max_cycle_ratio() == pytest.approx(9.0)
    stuck = _Graph()
    c, d = stuck.node(), stuck.node()
    stuck.arc(c, d, 1.0, 0)
    stuck.arc(d, c, 1.0, 0)
    assert stuck.max_cycle_ratio() is None


@pytest.mark.parametrize("mode, chunks", [("flush", 1), ("gpipe", 1), ("zb", 1), ("zb2", 1), ("interleaved", 2),
                                          ("zbv", 2), ("dualpipev", 2)])
def test_a_batch_too_large_for_one_graph_is_extrapolated_from_two_smaller(monkeypatch, mode, chunks):
    """Past its warm-up a flushing batch grows by one steady cycle a microbatch: the batch of m = 128
    extrapolated from two that fit a smaller graph equals the one computed whole, within 0.5%."""
    from pathlib import Path

    from pdtool.artifacts.cluster import parse_cluster
    from pdtool.artifacts.profile import Profile
    from pdtool.planner import make_plan as plan_of
    from pdtool.planner.chunks import make_chunked_plan
    from pdtool.sim import steady

    profile = Profile.load(Path(__file__).resolve().parents[2] / "profiles" / "gpt-small.profile.json")
    cluster = parse_cluster("4x1GB/s")
    plan = (plan_of(profile, cluster, mode=mode, straight=True, simulate=False) if chunks == 1
            else make_chunked_plan(profile, cluster, chunks=chunks, mode=mode))
    whole = steady.steady_state(plan, group=128)
    assert whole is not None and whole.period_minibatches == 128
    monkeypatch.setattr(steady, "MAX_NODES", len(plan.stages) * 10 * 40)  # a batch of 40 microbatches at most
    assert steady._one_period(plan, None, 128, ()) is None
    guessed = steady.steady_state(plan, group=128)
    assert guessed.time_per_minibatch_ms == pytest.approx(whole.time_per_minibatch_ms, rel=0.005)
    assert guessed.bubble_fraction == pytest.approx(whole.bubble_fraction, abs=0.005)
