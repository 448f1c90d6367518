"""The planner's dynamic program against exhaustive search, on small random instances."""
import itertools
import math
import zlib

import numpy as np
import pytest

from pdtool.costmodel import ChainCosts, DefaultModel, Memory, PipeDreamModel
from pdtool import partition
from pdtool.partition import Solver, flatten

INF = math.inf


def random_costs(rng, n):
    params = rng.uniform(0, 4e8, n) * (rng.random(n) < 0.7)
    return ChainCosts(compute=rng.uniform(0.001, 0.05, n), params=params,
                      acts=rng.uniform(0, 5e7, n), cut=np.append(rng.uniform(0, 5e7, n - 1), 0.0))


def compositions(a, b, most):
    """Every split of layers a..b into at most `most` contiguous ranges."""
    inner = list(range(a + 1, b + 1))
    for k in range(0, min(most, b - a + 1) - 1 + 1):
        for cuts in itertools.combinations(inner, k):
            starts = (a,) + cuts
            ends = tuple(c - 1 for c in cuts) + (b,)
            yield list(zip(starts, ends))


class BruteForce:
    """Exhaustive search over the same model, evaluating each configuration from scratch."""

    def __init__(self, costs, counts, bandwidths, model, straight=False, memory=None):
        self.costs, self.counts, self.bw, self.model = costs, counts, bandwidths, model
        self.straight, self.memory = straight, memory
        self.n = costs.n
        self.workers = math.prod(counts)
        self.inner = [math.prod(counts[:l]) for l in range(len(counts))]

    def stage_time(self, level, p, q, r, unit, first, last):
        U = np.full((self.n, self.n), INF)
        U[p, q] = unit
        params = self.costs.range_sums(self.costs.params)
        charge = self.model.final_charge(self.n) if last else True
        return self.model.stage_times(self.costs, U, params, r, self.bw[level], self.inner[level], first, charge)[p, q]

    def fits(self, p, q, r, before, context):
        if self.memory is None:
            return True
        outer_before, outer = context
        k = Memory.in_flight(self.workers, outer_before + outer * before, outer * r)
        params = self.costs.params[p:q + 1].sum()
        stashed = self.costs.acts[p:q + 1].sum() + (self.costs.cut[p - 1] if p > 0 else 0.0)
        return self.memory.need(params, stashed, k) <= self.memory.limit

    def best(self, level, a, b, context=(0, 1)):
        M = self.counts[level]
        best = INF
        for ranges in compositions(a, b, M):
            k = len(ranges)
            options = [(1,) * k] if self.straight else itertools.product(range(1, M + 1), repeat=k)
            for reps in options:
                used = sum(reps)
                if used > M or (self.model.exact_workers and used != M):
                    continue
                time, before = 0.0, 0
                for index, ((p, q), r) in enumerate(zip(ranges, reps)):
                    inner_context = (context[0] + context[1] * before * self.inner[level], context[1] * r)
                    if level == 0:
                        unit = self.costs.compute[p:q + 1].sum() if self.fits(p, q, r, before, context) else INF
                    else:
                        unit = self.best(level - 1, p, q, inner_context)
                    time = max(time, self.stage_time(level, p, q, r, unit, index == 0, index == k - 1))
                    before += r
                best = min(best, time)
        return best


CASES = [([1], 1), ([2], 1), ([3], 1), ([4], 1), ([2, 2], 2), ([3, 2], 2), ([2, 3], 2), ([1, 3], 2), ([2, 1, 2], 3)]


@pytest.mark.parametrize("model", [DefaultModel(), PipeDreamModel(), PipeDreamModel(None)], ids=["pdtool", "pipedream", "pipedream-nocomm"])
@pytest.mark.parametrize("straight", [False, True], ids=["replicated", "straight"])
@pytest.mark.parametrize("with_memory", [False, True], ids=["no-limit", "memory-limit"])
def test_dynamic_program_equals_brute_force(model, straight, with_memory):
    rng = np.random.default_rng(zlib.crc32(f"{model.name}{model.exact_workers}{straight}{with_memory}".encode()))
    checked = 0
    for trial in range(40):
        counts, _ = CASES[trial % len(CASES)]
        n = int(rng.integers(1, 6))
        costs = random_costs(rng, n)
        bandwidths = list(rng.uniform(2e8, 2e10, len(counts)))
        memory = None
        if with_memory:
            total = costs.params.sum() * 4 + costs.acts.sum() * 4
            memory = Memory(limit=float(rng.uniform(0.05, 1.0) * total + 1.0))
        solver = Solver(costs, counts, bandwidths, model, straight=straight, memory=memory)
        brute = BruteForce(costs, counts, bandwidths, model, straight=straight, memory=memory).best(len(counts) - 1, 0, n - 1)
        found = solver.solve()
        if brute == INF:
            assert found is None, (counts, n)
            continue
        assert found is not None and found.time == pytest.approx(brute, rel=1e-9), (counts, n, trial)
        leaves = flatten(found, solver.inner)
        assert [l.first for l in leaves][0] == 0 and leaves[-1].last == n - 1
        assert all(x.last + 1 == y.first for x, y in zip(leaves, leaves[1:]))
        used = sorted(r for l in leaves for r in l.ranks)
        assert len(used) == len(set(used)) and all(0 <= r < math.prod(counts) for r in used)
        if straight:
            assert all(len(l.ranks) == 1 for l in leaves)
        checked += 1
    assert checked >= 5  # some instances are infeasible (exact worker counts, memory)


def test_reconstructed_stage_times_give_the_reported_bottleneck():
    rng = np.random.default_rng(7)
    costs = random_costs(rng, 12)
    solver = Solver(costs, [4, 2], [1e10, 1.25e9], DefaultModel())
    found = solver.solve()
    assert found.time == pytest.approx(max(s.time for s in found.stages))
    for stage in found.stages:
        assert stage.inner.time == pytest.approx(max(s.time for s in stage.inner.stages))


def test_same_input_same_answer():
    rng = np.random.default_rng(3)
    costs = random_costs(rng, 20)
    first = Solver(costs, [4, 4], [1e10, 1.25e9], DefaultModel()).solve()
    again = Solver(costs, [4, 4], [1e10, 1.25e9], DefaultModel()).solve()
    assert first == again


class ReferenceDP:
    """The recurrence of partition.py written plainly (every boundary, scalar cost terms):
    checks the banded search on instances too big for exhaustive search."""

    def __init__(self, costs, counts, bandwidths, model):
        self.c, self.counts, self.bw, self.model = costs, counts, bandwidths, model
        self.inner = [math.prod(counts[:l]) for l in range(len(counts))]
        self.final = model.final_charge(costs.n)
        self.memo = {}

    def stage(self, level, p, q, r, first, last):
        unit = self.c.compute[p:q + 1].sum() if level == 0 else self.best(level - 1, p, q)
        charge = (bool(np.asarray(self.final).reshape(-1)[q]) if np.ndim(self.final) else bool(self.final)) if last else True
        return self.model.terms(unit, self.c.params[p:q + 1].sum(), self.c.cut[p - 1] if p else 0.0, self.c.cut[q], r,
                                self.bw[level], self.inner[level], first, charge)["time"]

    def pipe(self, level, a, q, m, last):
        key = ("pipe", level, a, q, m, last)
        if key not in self.memo:
            best = self.stage(level, a, q, m, True, last)
            for p in range(a + 1, q + 1):
                for r in range(1, m):
                    best = min(best, max(self.pipe(level, a, p - 1, m - r, False), self.stage(level, p, q, r, False, last)))
            self.memo[key] = best
        return self.memo[key]

    def best(self, level, a, b):
        M = self.counts[level]
        options = [M] if self.model.exact_workers else range(1, M + 1)
        return min(self.pipe(level, a, b, m, True) for m in options)


@pytest.mark.parametrize("model", [DefaultModel(), PipeDreamModel()], ids=["pdtool", "pipedream"])
@pytest.mark.parametrize("counts", [[4], [3, 2]])
@pytest.mark.parametrize("guess_width", [16, 0], ids=["as-shipped", "always-guess"])
def test_banded_search_equals_the_plain_recurrence_on_larger_instances(model, counts, guess_width, monkeypatch):
    monkeypatch.setattr(partition, "_GUESS_WIDTH", guess_width)
    for seed in range(3):
        rng = np.random.default_rng(seed)
        costs = random_costs(rng, 18)
        bandwidths = list(rng.uniform(2e8, 2e10, len(counts)))
        found = Solver(costs, counts, bandwidths, model).solve()
        expected = ReferenceDP(costs, counts, bandwidths, model).best(len(counts) - 1, 0, costs.n - 1)
        assert found.time == pytest.approx(expected, rel=1e-9)
