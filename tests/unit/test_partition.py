"""The planner's dynamic program against exhaustive search, on small random chains and DAGs.

The oracles here enumerate the state space from its definition (states.py), independently of
`build_states`: on a chain the prefixes; on a graph every down-set (a set of layers closed
under predecessors) in which each *follower* (zero time and no consumers, or zero time and
nothing to carry) is present exactly when all its producers are, plus the empty set.
"""
import dataclasses
import itertools
import math
import zlib
from types import SimpleNamespace

import numpy as np
import pytest

from pdtool.planner import partition
from pdtool.planner.costmodel import ChainCosts, DefaultModel, Memory, PipeDreamModel
from pdtool.planner.partition import Solver
from pdtool.planner.states import DOWN_SETS, PREFIXES, build_states, prefix_states

INF = math.inf


# ----- instances -------------------------------------------------------------------------------------
def random_costs(rng, n):
    """A chain of n layers with cut bytes drawn independently of the activation sizes."""
    params = rng.uniform(0, 4e8, n) * (rng.random(n) < 0.7)
    return ChainCosts(compute=rng.uniform(0.001, 0.05, n), params=params,
                      acts=rng.uniform(0, 5e7, n), cut=np.append(rng.uniform(0, 5e7, n - 1), 0.0))


def random_dag(rng, n, splits=1, followers=True):
    """n layers in topological order: a chain, `splits` times split into two parallel branches,
    plus random extra edges; with `followers`, sometimes a zero-time sink and a zero-time,
    zero-byte layer."""
    edges = {(v - 1, v) for v in range(1, n)}
    for _ in range(splits if n >= 4 else 0):
        # layers s+1..t-1 form branch A, t..e-1 branch B: both fed by s, both feed e
        s = int(rng.integers(0, n - 3))
        e = int(rng.integers(s + 3, n))
        t = int(rng.integers(s + 2, e))
        edges.discard((t - 1, t))
        edges |= {(s, t), (t - 1, e)}
    for _ in range(int(rng.integers(0, 3))):
        a, b = sorted(int(x) for x in rng.choice(n, 2, replace=False))
        edges.add((a, b))
    compute = rng.uniform(0.001, 0.05, n)
    params = rng.uniform(0, 4e8, n) * (rng.random(n) < 0.7)
    acts = rng.uniform(0, 5e7, n)
    if followers and rng.random() < 0.4:  # a zero-time sink hanging off some layer
        n += 1
        edges.add((int(rng.integers(0, n - 1)), n - 1))
        compute, params, acts = (np.append(compute, 0.0), np.append(params, rng.uniform(0, 1e8) * (rng.random() < 0.5)),
                                 np.append(acts, rng.uniform(0, 5e7)))
    if followers and rng.random() < 0.3:  # a free layer inside the graph
        v = int(rng.integers(1, n - 1))
        compute[v] = params[v] = acts[v] = 0.0
    return ChainCosts.from_layers(compute, params, acts, tuple(sorted(edges)))


class Space:
    """The state space from its definition: frozensets of layers, the cut of each."""

    def __init__(self, costs, followers=True):
        n = self.n = costs.n
        self.all = frozenset(range(n))
        self.costs = costs
        if costs.edges is None:  # a chain with given cut bytes
            self.states = [frozenset(range(k)) for k in range(n + 1)]
            self._cut = {frozenset(range(k)): (costs.cut[k - 1] if k else 0.0) for k in range(n + 1)}
            return
        preds = {v: {a for a, b in costs.edges if b == v} for v in range(n)}
        succ = {v: {b for a, b in costs.edges if a == v} for v in range(n)}
        downsets, todo = {frozenset()}, [frozenset()]
        while todo:  # every set closed under predecessors, grown one layer at a time
            d = todo.pop()
            for v in set(range(n)) - d:
                if preds[v] <= d and d | {v} not in downsets:
                    downsets.add(d | {v})
                    todo.append(d | {v})
        downsets = sorted(downsets, key=lambda d: (len(d), sorted(d)))
        if all((v, v + 1) in costs.edges for v in range(n - 1)) or not followers:
            self.states = downsets  # exactly the prefixes, or every down-set
        else:
            follower = {v for v in range(n) if costs.compute[v] == 0 and costs.params[v] == 0
                        and (not succ[v] or costs.acts[v] == 0)}
            self.states = [frozenset()] + [d for d in downsets if d - follower
                                           and all((f in d) == (preds[f] <= d) for f in follower)]
            if len(follower) == n:
                self.states = [frozenset(), self.all]
        self._cut = {d: sum(costs.acts[u] for u in d if succ[u] - d) for d in self.states}

    def cut(self, d):
        return float(self._cut[d])

    def sum(self, values, layers):
        return float(sum(values[v] for v in sorted(layers)))

    def between(self, a, b):
        """States strictly between a and b."""
        return [k for k in self.states if a < k < b]


def charge_of(model, end, space):
    """Whether the last stage of a sub-problem ending at state `end` pays its output."""
    final = model.final_charge(2)  # [a state that is not all layers, all layers]
    return bool(final[1 if end == space.all else 0]) if np.ndim(final) else bool(final)


# ----- exhaustive search ---------------------------------------------------------------------------
class BruteForce:
    """Every chain of down-sets (all of them: no layer is assumed to follow its producers) and
    every replica assignment, each stage costed on its own."""

    def __init__(self, costs, counts, bandwidths, model, straight=False, memory=None):
        self.space = Space(costs, followers=False)
        self.c, self.counts, self.bw, self.model = costs, counts, bandwidths, model
        self.straight, self.memory = straight, memory
        self.workers = math.prod(counts)
        self.inner = [math.prod(counts[:l]) for l in range(len(counts))]
        self.memo = {}

    def chains(self, a, b, most):
        """Every chain a = D0 < D1 < ... < Dk = b with k <= most, as lists of stages (Dk-1, Dk)."""
        if most >= 1:
            yield [(a, b)]
        if most >= 2:
            for k in self.space.between(a, b):
                for rest in self.chains(k, b, most - 1):
                    yield [(a, k)] + rest

    def fits(self, a, b, r, before, context):
        if self.memory is None:
            return True
        outer_before, outer = context
        k = Memory.in_flight(self.workers, outer_before + outer * before, outer * r)
        stage = b - a
        stashed = self.space.sum(self.c.stashes, stage) + self.space.cut(a)
        largest = max((self.c.params[v] for v in stage), default=0.0)
        return self.memory.need(self.space.sum(self.c.params, stage), stashed, k,
                                cut=(self.space.cut(a), self.space.cut(b)), largest=largest,
                                replicas=outer * r) <= self.memory.limit

    def best(self, level, a, b, context=(0, 1)):
        key = (level, a, b, context)
        if key in self.memo:
            return self.memo[key]
        M, sp = self.counts[level], self.space
        best = INF
        for stages in self.chains(a, b, M):
            k = len(stages)
            options = [(1,) * k] if self.straight else itertools.product(range(1, M + 1), repeat=k)
            for reps in options:
                used = sum(reps)
                if used > M or (self.model.exact_workers and used != M):
                    continue
                time, before = 0.0, 0
                for index, ((p, q), r) in enumerate(zip(stages, reps)):
                    inner_context = (context[0] + context[1] * before * self.inner[level], context[1] * r)
                    if level == 0:
                        unit = sp.sum(self.c.compute, q - p) if self.fits(p, q, r, before, context) else INF
                    else:
                        unit = self.best(level - 1, p, q, inner_context)
                    charge = charge_of(self.model, q, sp) if index == k - 1 else True
                    time = max(time, self.model.terms(unit, sp.sum(self.c.params, q - p), sp.cut(p), sp.cut(q), r,
                                                      self.bw[level], self.inner[level], index == 0, charge)["time"])
                    before += r
                best = min(best, time)
        self.memo[key] = best
        return best

    def solve(self):
        return self.best(len(self.counts) - 1, frozenset(), self.space.all)


CASES = [([1], 1), ([2], 1), ([3], 1), ([4], 1), ([2, 2], 2), ([3, 2], 2), ([2, 3], 2), ([1, 3], 2), ([2, 1, 2], 3)]


def flatten(pipeline, inner_workers):
    """The innermost stages in order, as (layers, ranks) with global ranks (unit-major: rank =
    unit * W + local), walked here independently of the planner's own walk."""
    def walk(p, bases):
        leaves = []
        size = inner_workers[p.level]
        for stage in p.stages:
            units = range(stage.units_before, stage.units_before + stage.replicas)
            here = [base + u * size for base in bases for u in units]
            leaves += [SimpleNamespace(layers=stage.layers, ranks=tuple(sorted(here)))] if stage.inner is None else \
                walk(stage.inner, here)
        return leaves

    return walk(pipeline, [0])


def check_leaves(found, solver, costs, counts, straight):
    leaves = flatten(found, solver.inner)
    layers = [l for leaf in leaves for l in leaf.layers]
    assert sorted(layers) == list(range(costs.n)) and all(leaf.layers for leaf in leaves)
    position = {l: s for s, leaf in enumerate(leaves) for l in leaf.layers}
    assert all(position[a] <= position[b] for a, b in (costs.edges or ()))  # data flows forward
    used = sorted(r for l in leaves for r in l.ranks)
    assert len(used) == len(set(used)) and all(0 <= r < math.prod(counts) for r in used)
    if straight:
        assert all(len(l.ranks) == 1 for l in leaves)


@pytest.mark.parametrize("shape", ["chain", "dag"])
@pytest.mark.parametrize("model", [DefaultModel(), PipeDreamModel(), PipeDreamModel(None)], ids=["pdtool", "pipedream", "pipedream-nocomm"])
@pytest.mark.parametrize("straight", [False, True], ids=["replicated", "straight"])
@pytest.mark.parametrize("with_memory", [False, True], ids=["no-limit", "memory-limit"])
def test_dynamic_program_equals_brute_force(shape, model, straight, with_memory):
    rng = np.random.default_rng(zlib.crc32(f"{shape}{model.name}{model.exact_workers}{straight}{with_memory}".encode()))
    checked = 0
    for trial in range(40):
        counts, _ = CASES[trial % len(CASES)]
        if shape == "chain":
            costs = random_costs(rng, int(rng.integers(1, 6)))
        else:
            costs = random_dag(rng, int(rng.integers(5, 8)), splits=int(rng.integers(1, 3)))
        n = costs.n
        bandwidths = list(rng.uniform(2e8, 2e10, len(counts)))
        memory = None
        if with_memory:  # half of them with what autograd saves measured, and Adam's step temporaries
            if trial % 2:
                costs = dataclasses.replace(costs, stash=costs.acts * rng.uniform(0.3, 3.0, n))
            total = costs.params.sum() * 4 + costs.stashes.sum() * 4 + costs.params.max() * 2
            memory = Memory(limit=float(rng.uniform(0.05, 1.0) * total + 1.0),
                            step_temporaries=2.0 if trial % 2 else 0.0, accumulates=trial % 4 == 0)
        solver = Solver(costs, counts, bandwidths, model, straight=straight, memory=memory)
        brute = BruteForce(costs, counts, bandwidths, model, straight=straight, memory=memory).solve()
        found = solver.solve()
        if brute == INF:
            assert found is None, (counts, n)
            continue
        assert found is not None and found.time == pytest.approx(brute, rel=1e-9), (counts, n, trial)
        check_leaves(found, solver, costs, counts, straight)
        checked += 1
    assert checked >= 5  # some instances are infeasible (exact worker counts, memory)


# ----- the states --------------------------------------------------------------------------------------
@pytest.mark.parametrize("seed", range(12))
def test_states_are_the_down_sets_sorted_by_compute_and_inclusion(seed):
    rng = np.random.default_rng(seed)
    costs = random_dag(rng, int(rng.integers(4, 9)))
    states = build_states(costs)
    space = Space(costs)
    got = [frozenset(states.layers(0, s)) for s in range(len(states))]
    assert len(got) == len(set(got)) and set(got) == set(space.states)
    assert got[0] == frozenset() and got[-1] == space.all
    assert np.all(np.diff(states.compute) >= 0)
    for k, j in itertools.product(range(len(got)), repeat=2):
        assert states.subset[k, j] == (got[k] < got[j])
        if got[k] < got[j]:
            assert k < j and set(states.layers(k, j)) == got[j] - got[k]
    for s, d in enumerate(got):
        assert states.compute[s] == pytest.approx(space.sum(costs.compute, d), rel=1e-12, abs=1e-15)
        assert states.params[s] == pytest.approx(space.sum(costs.params, d), rel=1e-12, abs=1e-6)
        assert states.acts[s] == pytest.approx(space.sum(costs.acts, d), rel=1e-12, abs=1e-6)
        assert states.cut[s] == pytest.approx(space.cut(d), rel=1e-12, abs=1e-6)


@pytest.mark.parametrize("seed", range(8))
def test_stage_maxima_are_each_stages_largest_layer(seed):
    """The largest layer of every stage D_j minus D_k (the optimizer's temporaries): exact for
    the `levels` largest distinct values, never below the truth for the others."""
    rng = np.random.default_rng(seed)
    costs = random_dag(rng, int(rng.integers(5, 9))) if seed % 2 else random_costs(rng, int(rng.integers(2, 9)))
    states = build_states(costs)
    exact = states.stage_maxima(costs.params)
    rough = states.stage_maxima(costs.params, levels=2)
    top = np.unique(costs.params[costs.params > 0])[-2:]
    for k, j in itertools.product(range(len(states)), repeat=2):
        if not states.subset[k, j]:
            assert exact[k, j] == 0
            continue
        truth = max([costs.params[v] for v in states.layers(k, j)] + [0.0])
        assert exact[k, j] == truth
        assert rough[k, j] >= truth and (rough[k, j] == truth or truth < top[0])


def test_a_chain_and_a_chain_with_skips_have_their_prefixes_as_states():
    rng = np.random.default_rng(1)
    chain = random_costs(rng, 9)
    skips = ChainCosts.from_layers(chain.compute, chain.params, chain.acts,
                                   tuple((v, v + 1) for v in range(8)) + ((0, 3), (3, 6), (2, 8)))
    for costs in (chain, skips):
        states = build_states(costs)
        assert states.space == DOWN_SETS and states.masks == tuple((1 << k) - 1 for k in range(10))
        prefixes = prefix_states(costs)
        for name in ("compute", "params", "acts", "cut"):
            assert np.array_equal(getattr(states, name), getattr(prefixes, name))  # the very same floats


def test_a_residual_block_cuts_between_its_branches():
    """x -> a1 -> a2 -> add, x -> d -> add: {x, a1, d} and {x, d} are states, not prefixes."""
    costs = ChainCosts.from_layers(np.full(5, 0.01), np.zeros(5), np.full(5, 1e6),
                                   ((0, 1), (1, 2), (2, 4), (0, 3), (3, 4)))
    got = {frozenset(build_states(costs).layers(0, s)) for s in range(len(build_states(costs)))}
    assert {frozenset({0, 1, 3}), frozenset({0, 3})} <= got and len(got) == 8  # {}, x, and x + 2x3 - 1 pairs, all


def test_zero_time_sinks_and_free_layers_do_not_multiply_the_states():
    """A residual block 0 -> 1 -> 2 -> 5, 0 -> 3 -> 4 -> 5 where 4 has zero time and nothing to
    carry (it follows 3) and 6 is a zero-time sink of 2 without parameters (it follows 2): still
    the block's 8 states."""
    edges = ((0, 1), (1, 2), (2, 5), (0, 3), (3, 4), (4, 5), (2, 6))
    compute = np.array([0.01, 0.01, 0.01, 0.01, 0.0, 0.01, 0.0])
    params = np.array([1e6, 1e6, 1e6, 1e6, 0.0, 1e6, 0.0])
    acts = np.array([1e6, 1e6, 1e6, 1e6, 0.0, 1e6, 5e5])
    states = build_states(ChainCosts.from_layers(compute, params, acts, edges))
    got = [frozenset(states.layers(0, s)) for s in range(len(states))]
    assert len(got) == 8 and set(got) == set(Space(ChainCosts.from_layers(compute, params, acts, edges)).states)
    assert all((4 in d) == (3 in d) and (6 in d) == (2 in d) for d in got)
    plan = Solver(states, [3], [1e12], DefaultModel(), straight=True).solve()
    assert len(plan.stages) == 3
    for stage in plan.stages:
        assert (3 in stage.layers) == (4 in stage.layers) and (2 in stage.layers) == (6 in stage.layers)
    every = build_states(ChainCosts.from_layers(compute, params, acts, edges), followers=False)
    assert len(every) > len(states)  # where every worker must be used, they may be stages of their own
    assert set(got) <= {frozenset(every.layers(0, s)) for s in range(len(every))}


def test_with_every_worker_used_a_zero_time_layer_can_be_a_stage_of_its_own():
    """A chain 0 -> 1 -> 2 plus a zero-time sink 3 of layer 0, on exactly 4 workers, straight:
    only a plan that gives the sink a worker of its own uses all four."""
    costs = ChainCosts.from_layers(np.array([0.01, 0.01, 0.01, 0.0]), np.zeros(4), np.array([1e3, 1e3, 1e3, 1e3]),
                                   ((0, 1), (1, 2), (0, 3)))
    found = Solver(costs, [4], [1e12], PipeDreamModel(), straight=True).solve()
    assert found is not None and len(found.stages) == 4 and (3,) in [tuple(s.layers) for s in found.stages]
    assert found.time == pytest.approx(BruteForce(costs, [4], [1e12], PipeDreamModel(), straight=True).solve())


def test_a_free_source_joins_the_first_stage():
    """Layer 0 (zero time, no parameters, empty output, like gnmt's `hidden`) feeds layer 2."""
    costs = ChainCosts.from_layers(np.array([0.0, 0.01, 0.01]), np.zeros(3), np.array([0.0, 1e6, 1e6]),
                                   ((0, 2), (1, 2)))
    states = build_states(costs)
    assert [states.layers(0, s) for s in range(len(states))] == [(), (0, 1), (0, 1, 2)]


def test_too_many_down_sets_fall_back_to_the_prefixes():
    # 10 independent layers joined at the end: 2**10 + 1 down-sets
    edges = tuple((v, 10) for v in range(10))
    costs = ChainCosts.from_layers(np.full(11, 0.01), np.zeros(11), np.full(11, 1e3), edges)
    assert len(build_states(costs)) == 2 ** 10 + 1
    capped = build_states(costs, max_states=1000)
    assert capped.space == PREFIXES and len(capped) == 12
    for name in ("compute", "params", "acts", "cut"):
        assert np.array_equal(getattr(capped, name), getattr(prefix_states(costs), name))
    found = Solver(capped, [4], [1e9], DefaultModel()).solve()
    assert [l for s in found.stages for l in s.layers] == list(range(11))


# ----- the DP's bookkeeping ----------------------------------------------------------------------------
def test_reconstructed_stage_times_give_the_reported_bottleneck():
    rng = np.random.default_rng(7)
    for costs in (random_costs(rng, 12), random_dag(rng, 12)):
        solver = Solver(costs, [4, 2], [1e10, 1.25e9], DefaultModel())
        found = solver.solve()
        assert found.time == pytest.approx(max(s.time for s in found.stages))
        for stage in found.stages:
            assert stage.inner.time == pytest.approx(max(s.time for s in stage.inner.stages))
            assert sorted(l for s in stage.inner.stages for l in s.layers) == list(stage.layers)


def test_same_input_same_answer():
    rng = np.random.default_rng(3)
    for costs in (random_costs(rng, 20), random_dag(rng, 20)):
        first = Solver(costs, [4, 4], [1e10, 1.25e9], DefaultModel()).solve()
        again = Solver(costs, [4, 4], [1e10, 1.25e9], DefaultModel()).solve()
        assert first == again


# ----- the plain recurrence on larger instances ----------------------------------------------------------
class ReferenceDP:
    """The recurrence of partition.py written plainly (every state, scalar cost terms): checks
    the banded search on instances too big for exhaustive search."""

    def __init__(self, costs, counts, bandwidths, model):
        self.sp = Space(costs)
        self.c, self.counts, self.bw, self.model = costs, counts, bandwidths, model
        self.inner = [math.prod(counts[:l]) for l in range(len(counts))]
        self.memo = {}

    def stage(self, level, p, q, r, first, last):
        unit = self.sp.sum(self.c.compute, q - p) if level == 0 else self.best(level - 1, p, q)
        charge = charge_of(self.model, q, self.sp) if last else True
        return self.model.terms(unit, self.sp.sum(self.c.params, q - p), self.sp.cut(p), self.sp.cut(q), r,
                                self.bw[level], self.inner[level], first, charge)["time"]

    def pipe(self, level, a, q, m, last):
        key = ("pipe", level, a, q, m, last)
        if key not in self.memo:
            best = self.stage(level, a, q, m, True, last)
            for p in self.sp.between(a, q):
                for r in range(1, m):
                    best = min(best, max(self.pipe(level, a, p, m - r, False), self.stage(level, p, q, r, False, last)))
            self.memo[key] = best
        return self.memo[key]

    def best(self, level, a, b):
        key = ("best", level, a, b)
        if key not in self.memo:
            M = self.counts[level]
            options = [M] if self.model.exact_workers else range(1, M + 1)
            self.memo[key] = min(self.pipe(level, a, b, m, True) for m in options)
        return self.memo[key]

    def solve(self):
        return self.best(len(self.counts) - 1, frozenset(), self.sp.all)


@pytest.mark.parametrize("shape", ["chain", "dag"])
@pytest.mark.parametrize("model", [DefaultModel(), PipeDreamModel()], ids=["pdtool", "pipedream"])
@pytest.mark.parametrize("counts", [[4], [3, 2]])
@pytest.mark.parametrize("guess_width", [16, 0], ids=["as-shipped", "always-guess"])
def test_banded_search_equals_the_plain_recurrence_on_larger_instances(shape, model, counts, guess_width, monkeypatch):
    monkeypatch.setattr(partition, "_GUESS_WIDTH", guess_width)
    for seed in range(3):
        rng = np.random.default_rng(seed)
        if shape == "chain":
            costs = random_costs(rng, 18)
        else:
            costs = random_dag(rng, 14, splits=2, followers=seed != 0)
            while len(Space(costs).states) > 40:
                costs = random_dag(rng, 14, splits=2, followers=seed != 0)
        bandwidths = list(rng.uniform(2e8, 2e10, len(counts)))
        found = Solver(costs, counts, bandwidths, model).solve()
        expected = ReferenceDP(costs, counts, bandwidths, model).solve()
        assert found.time == pytest.approx(expected, rel=1e-9)
