"""pdtool's `--cost-model pipedream` against an independent reference of the ORIGINAL optimizer.

`reference_pipedream` (tests/) rebuilds the original's antichain state space and DP from
pipedream-reference.md section 2. The issue asks that, with the pipedream cost model, pdtool
gives the original's times on chain-shaped models and "on branchy ones a time no worse than the
original's". Both plan over down-sets of the layer graph (pdtool: every down-set, with zero-time
sinks and zero-byte layers following their producers, states.py; the original: those its
antichain BFS reaches), and pdtool charges the true cut bytes where the original's augmented
antichains count some outputs twice, so pdtool is never worse and sometimes better.
"""
from __future__ import annotations

import functools
import itertools
from pathlib import Path

import pytest

from pdtool.artifacts.cluster import Cluster, Level
from pdtool.planner.costmodel import ChainCosts, PipeDreamModel
from pdtool.jsonio import round_sig
from pdtool.planner.partition import Solver
from pdtool.artifacts.pipedream import load_pipedream_graph
from pdtool.planner import make_plan
from pdtool.planner.states import build_states as pdtool_states

from reference_pipedream import build_states, first_source_in_file, solve

PROFILES = Path(__file__).resolve().parents[2] / "profiles" / "pipedream"
MODELS = ("alexnet", "vgg16", "resnet18", "gnmt")
STATE_COUNTS = {"alexnet": 22, "vgg16": 40, "resnet18": 100, "gnmt": 99}
PDTOOL_STATE_COUNTS = {"alexnet": 23, "vgg16": 41, "resnet18": 101, "gnmt": 48}  # with the empty set

# (counts innermost first, bandwidths bytes/s)
CLUSTERS = {
    "4": ([4], [1.25e9]),
    "8": ([8], [1.25e9]),
    "16": ([16], [1.25e9]),
    "2x2": ([2, 2], [1e10, 1.25e9]),
    "4x2": ([4, 2], [1e10, 1.25e9]),
    "4x4": ([4, 4], [1e10, 1.25e9]),
    "2x4": ([2, 4], [1e10, 1.25e9]),
    "8x2": ([8, 2], [1e10, 1.25e9]),
}


def graph_file(model: str) -> Path:
    return PROFILES / f"{model}.graph.txt"


@functools.lru_cache(maxsize=None)
def profile(model: str):
    return load_pipedream_graph(graph_file(model), 64 if model == "gnmt" else None)


@functools.lru_cache(maxsize=None)
def states(model: str):
    return build_states(profile(model), first_source_in_file(graph_file(model)))


def pdtool_time(model: str, counts, bandwidths) -> tuple[float, float]:
    """pdtool's optimum, unrounded (the planner's own figure) and as the plan records it
    (`predicted.time_ms`, 6 significant digits), both in seconds."""
    exact = Solver(ChainCosts.from_profile(profile(model)), list(counts), list(bandwidths),
                   PipeDreamModel()).solve().time
    cluster = Cluster(tuple(Level(c, b) for c, b in zip(counts, bandwidths)))
    plan = make_plan(profile(model), cluster, cost_model="pipedream", simulate=False)
    return exact, plan.predicted.time_ms / 1000


# ----- the reference itself ---------------------------------------------------------------------------
def _literal_antichain_dag(prof, start: str):
    """The original's BFS, literally as pipedream-reference.md s2 "Preprocessing" 3 describes it
    (augment, swap one augmented member for an out-neighbour with no descendant in the augmented
    set, drop members that are ancestors of others), on node-name sets. Returns the reached
    down-sets and the DAG edges between them, to check `build_states`' reformulation."""
    succ = {l.name: set() for l in prof.layers}
    pred = {l.name: set() for l in prof.layers}
    for s, d in prof.edges:
        succ[prof.layers[s].name].add(prof.layers[d].name)
        pred[prof.layers[d].name].add(prof.layers[s].name)
    for layer in prof.layers:  # the original removes __getitem__ sinks
        if not succ[layer.name] and layer.ops[0].startswith("__getitem__"):
            for p in pred.pop(layer.name):
                succ[p].discard(layer.name)
            del succ[layer.name]

    @functools.lru_cache(maxsize=None)
    def ancestors(v):
        return frozenset(pred[v]).union(*(ancestors(p) for p in pred[v]))

    @functools.lru_cache(maxsize=None)
    def descendants(v):
        return frozenset(succ[v]).union(*(descendants(s) for s in succ[v]))

    def augment(antichain):
        extra = {p for a in antichain for p in ancestors(a) if any(o not in ancestors(a) and o != a for o in succ[p])}
        return extra | set(antichain)

    def downset(antichain):
        return frozenset(antichain).union(*(ancestors(a) for a in antichain))

    first = frozenset([start])
    seen, queue, edges = {first}, [first], set()
    while queue:
        antichain = queue.pop(0)
        aug = augment(antichain)
        for x in aug:
            for n in succ[x]:
                if n in antichain or descendants(n) & aug:
                    continue
                swapped = (aug - {x}) | {n}
                nxt = frozenset(v for v in swapped if not any(v in ancestors(w) for w in swapped))
                edges.add((downset(antichain), downset(nxt)))
                if nxt not in seen:
                    seen.add(nxt)
                    queue.append(nxt)
    return {downset(a) for a in seen}, edges


@pytest.mark.parametrize("model", MODELS)
def test_down_set_bfs_matches_the_literal_antichain_rule(model):
    space = states(model)
    downsets, edges = _literal_antichain_dag(profile(model), first_source_in_file(graph_file(model)))
    assert set(space.downsets) == downsets
    assert {(space.downsets[a], space.downsets[b]) for a, b in space.dag_edges} == edges
    assert len(space) == STATE_COUNTS[model]


@pytest.mark.parametrize("model", MODELS)
def test_states_are_ordered_and_add_up(model):
    space = states(model)
    count = len(space)
    masks = space.masks
    # ancestor in the antichain DAG <=> strictly smaller down-set; the order is topological
    for j, k in itertools.product(range(count), repeat=2):
        assert space.ancestors[j, k] == (masks[k] != masks[j] and masks[k] & ~masks[j] == 0)
        if space.ancestors[j, k]:
            assert k < j
    kept = [l for l in profile(model).layers if l.name in space.downsets[-1]]
    assert len(space.downsets[-1]) == len(space.nodes)
    assert space.downsets[0] == {first_source_in_file(graph_file(model))}
    assert space.compute[-1] == pytest.approx(sum(l.total_ms for l in kept) / 1000, rel=1e-12)
    assert space.compute[-1] == pytest.approx(profile(model).layer_sum_ms / 1000, rel=1e-12)  # sinks cost 0
    assert space.params[-1] == sum(l.param_bytes for l in kept)


def test_gnmt_drops_getitem_sinks_and_starts_from_the_encoder_embedding():
    space = states("gnmt")
    assert first_source_in_file(graph_file("gnmt")) == "node4"
    assert len(space.nodes) == 37 == len(profile("gnmt").layers) - 8
    assert {"node9", "node13", "node18", "node25", "node27", "node33", "node39", "node46"}.isdisjoint(space.nodes)
    # The other sources (decoder Embedding node21, `hidden` node20) only come in with a consumer.
    assert not any("node21" in d and "node23" not in d for d in space.downsets)


def test_augmented_antichain_is_tested_per_member(tmp_path):
    """x feeds a and b, both in the down-set {x, a, b}: the original still counts x's output,
    because for member a, x's out-edge to b leaves Pred(a) (and symmetrically for b)."""
    text = "\n".join([
        "node1 -- Input -- forward_compute_time=0.000, backward_compute_time=0.000, activation_size=1.0, parameter_size=0.000",
        "node2 -- X -- forward_compute_time=1.000, backward_compute_time=1.000, activation_size=100.0, parameter_size=0.000",
        "node3 -- A -- forward_compute_time=1.000, backward_compute_time=1.000, activation_size=10.0, parameter_size=0.000",
        "node4 -- B -- forward_compute_time=1.000, backward_compute_time=1.000, activation_size=20.0, parameter_size=0.000",
        "node5 -- C -- forward_compute_time=1.000, backward_compute_time=1.000, activation_size=1.0, parameter_size=0.000",
        "\tnode1 -- node2", "\tnode2 -- node3", "\tnode2 -- node4", "\tnode3 -- node5", "\tnode4 -- node5", ""])
    path = tmp_path / "diamond.graph.txt"
    path.write_text(text)
    space = build_states(load_pipedream_graph(path, 1))
    out = dict(zip(space.downsets, space.out))
    assert len(space) == 5  # {x}, {x,a}, {x,b}, {x,a,b}, all
    assert out[frozenset({"node2"})] == 100
    assert out[frozenset({"node2", "node3"})] == 110                # a + x (x still feeds b): a true cut
    assert out[frozenset({"node2", "node3", "node4"})] == 130       # a + b + x: x is over-counted
    assert out[frozenset({"node2", "node3", "node4", "node5"})] == 1  # the last state: its sink counts


@pytest.mark.parametrize(("model", "expected"), [("vgg16", 0.176349), ("gnmt", 0.025868)])
def test_reference_gives_the_published_figures(model, expected):
    """The original's published "Time per stage in pipeline" at 4 workers, 1.25e9 B/s, ratio 1."""
    assert solve(states(model), [4], [1.25e9]) == pytest.approx(expected, rel=5e-6)


@pytest.mark.parametrize("model", MODELS)
@pytest.mark.parametrize("cluster", ["2x2", "4x4"])
def test_hierarchical_result_does_not_depend_on_the_state_order(model, cluster):
    """Lower levels solve rows i > 0, whose ranges i..j are differences of *index* ranges of the
    state order (quirk of the original, see reference_pipedream.solve_level): check that the
    order, and the ranges that are not differences of nested down-sets, do not change Tp here."""
    counts, bandwidths = CLUSTERS[cluster]
    base = solve(states(model), counts, bandwidths)
    for seed in range(3):
        shuffled = build_states(profile(model), first_source_in_file(graph_file(model)), order_seed=seed)
        assert solve(shuffled, counts, bandwidths) == pytest.approx(base, rel=1e-12)
    assert solve(states(model), counts, bandwidths, faithful_rows=False) == pytest.approx(base, rel=1e-12)


# ----- pdtool against the reference --------------------------------------------------------------------
@pytest.mark.parametrize("model", MODELS)
def test_pdtool_states_contain_the_originals(model):
    """Every state of the original, completed with the layers that follow their producers in
    pdtool (gnmt's `__getitem__` sinks, `hidden` and its zero-byte `__getitem__`s), is a state
    of pdtool's, so pdtool's optimum can only be as good or better."""
    prof = profile(model)
    ours = pdtool_states(ChainCosts.from_profile(prof))
    assert ours.space == "down-sets" and len(ours) == PDTOOL_STATE_COUNTS[model]
    names = [l.name for l in prof.layers]
    our_sets = {frozenset(names[i] for i in ours.layers(0, s)) for s in range(len(ours))}
    preds = {name: set() for name in names}
    for src, dst in prof.edges:
        preds[names[dst]].add(names[src])
    consumers = {src for src, _ in prof.edges}
    followers = [l.name for l in prof.layers if l.total_ms == 0
                 and (l.id not in consumers or (l.param_bytes == 0 and l.act_bytes == 0))]
    for down in states(model).downsets:
        closed = set(down)
        for name in followers:  # layer order is topological: one pass completes the set
            if preds[name] <= closed:
                closed.add(name)
        assert frozenset(closed) in our_sets


@pytest.mark.parametrize("model", MODELS)
@pytest.mark.parametrize("cluster", CLUSTERS)
def test_pdtool_is_no_worse_than_the_original(model, cluster):
    counts, bandwidths = CLUSTERS[cluster]
    reference = solve(states(model), counts, bandwidths)
    exact, recorded = pdtool_time(model, counts, bandwidths)
    assert exact <= reference * (1 + 1e-6), f"pdtool {exact:.7g} s > original {reference:.7g} s"
    # The plan records 6 significant digits; compare like with like (rounding is monotonic).
    assert recorded * 1000 <= round_sig(reference * 1000) * (1 + 1e-12)


@pytest.mark.parametrize("model", ["vgg16", "gnmt"])
def test_pdtool_equals_the_original_on_the_published_chain_runs(model):
    counts, bandwidths = CLUSTERS["4"]
    assert pdtool_time(model, counts, bandwidths)[0] == pytest.approx(solve(states(model), counts, bandwidths), rel=1e-9)


def test_gnmt_straight_on_every_worker_equals_the_original():
    """The original optimizer gives 19.7132 ms per minibatch for gnmt (batch 64) on 16 workers at
    1.25 GB/s, straight. Where every worker must be used, zero-time layers can be stages of their
    own, so pdtool keeps them as layers of their own there (states.py, `_followers`)."""
    cluster = Cluster((Level(16, 1.25e9),))
    plan = make_plan(profile("gnmt"), cluster, cost_model="pipedream", straight=True, simulate=False)
    assert len(plan.stages) == 16
    assert plan.predicted.time_ms == pytest.approx(19.7132, rel=1e-5)
