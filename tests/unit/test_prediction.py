"""One prediction (issue 11): the time `pd plan` prints is the simulator's for the plan it
chose, and neither data parallelism nor the best straight pipeline simulates faster (beyond the
3% that ranking candidates on short simulations can miss)."""
import functools
from pathlib import Path

import pytest

from pdtool.artifacts.cluster import parse_cluster
from pdtool.artifacts.pipedream import load_pipedream_graph
from pdtool.planner import make_plan
from pdtool.artifacts.profile import Profile
from pdtool.sim.simulate import simulate

pytestmark = pytest.mark.slow  # the planner on every shipped profile and cluster: the full suite's, not the fast tier's

ROOT = Path(__file__).resolve().parents[2] / "profiles"
PROFILES = {name: (lambda n=name: load_pipedream_graph(ROOT / "pipedream" / f"{n}.graph.txt", 64 if n == "gnmt" else None))
            for name in ("alexnet", "vgg16", "resnet18", "gnmt")}
PROFILES.update({path.name.split(".")[0]: (lambda p=path: Profile.load(p)) for path in ROOT.glob("*.profile.json")})
CLUSTERS = ["cluster-a:1", "cluster-b:2", "16x1.25GB/s"]


@functools.lru_cache(maxsize=None)
def planned(name, cluster, cost_model):
    """The plan `pd plan` makes of profile `name` for `cluster` (planning is deterministic and
    plans are immutable: the baseline test below reads the plans of the parametrised test)."""
    return make_plan(PROFILES[name](), parse_cluster(cluster), cost_model=cost_model)


@pytest.mark.parametrize("cluster", CLUSTERS)
@pytest.mark.parametrize("name", sorted(PROFILES))
@pytest.mark.parametrize("cost_model", ["pdtool", "pipedream"])
def test_the_printed_prediction_is_the_simulators_and_nothing_simulates_faster(name, cluster, cost_model):
    profile, spec = PROFILES[name](), parse_cluster(cluster)
    try:
        plan = planned(name, cluster, cost_model)
    except Exception as error:  # the pipedream cost model uses every worker: some shapes have no partition
        pytest.skip(f"no plan: {error}")
    pred = plan.predicted
    assert pred.expected_ms == pred.simulated_ms and pred.candidates >= 1 and pred.why
    again = simulate(plan, events=False).time_per_minibatch_ms  # a longer run than the planner's (it caps minibatches)
    assert again == pytest.approx(pred.expected_ms, rel=0.15)
    others = [make_plan(profile, spec, cost_model=cost_model, data_parallel=True)]
    if cost_model == "pdtool":
        others.append(make_plan(profile, spec, cost_model=cost_model, straight=True))
    for other in others:  # candidates are ranked on short runs, the best 3 in full: near ties within 3%
        assert other.predicted.simulated_ms >= pred.expected_ms * 0.97, (other.stages, plan.stages)
    assert pred.simulated_data_parallel_ms == pytest.approx(others[0].predicted.simulated_ms)


def test_the_data_parallel_baseline_is_the_same_whichever_cost_model():
    baselines = {planned("gnmt", "cluster-b:2", m).predicted.baseline_ms for m in ("pdtool", "pipedream")}
    assert len(baselines) == 1
