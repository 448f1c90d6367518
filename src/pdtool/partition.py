"""PipeDream's partitioning dynamic program (Narayanan et al., SOSP 2019, section 3.1).

Given per-layer costs, a cluster of levels (innermost first: e.g. GPUs in a server, then
servers) and a cost model, find stage boundaries and a replica count per stage that
minimise the time per minibatch of the slowest stage. As in the paper the problem is solved
level by level: the best pipeline of every layer range on one unit of level l (one server)
becomes the compute time of that range as a stage of level l + 1 (across servers).

For one level with M units and a range starting at layer a, with `stage(p..q, r)` the cost
model's time of layers p..q as one stage of r replicas (costmodel.py):

    F[m][q] = min( stage(a..q, m) ,                                     one stage
                   min over a < p <= q, 1 <= r < m of max(F[m - r][p - 1], stage(p..q, r)) )

F is the best pipeline over a..q with exactly m units whose last stage still pays its output
boundary; the answer for a..b takes the same recurrence with the last stage's output free
(or charged as the model says). Each (m, r) step is a vectorised min-max over the
boundaries p that lower bounds cannot rule out (`Solver._relax`), which keeps 1000 layers on
1024 workers within seconds.

The result is the exact optimum of the model: `tests/unit/test_partition.py` compares it
with exhaustive search on small random instances and with the plain recurrence on larger
ones. Ties between equally good partitions are broken by a fixed rule (see `_relax`), so the
answer is deterministic.

With a memory limit, a stage's in-flight minibatches depend on how many workers come before
it in the whole pipeline, so tables are solved per *context* `(before, outer)`: workers of
the global pipeline before this sub-problem's first worker, and the replication of the
enclosing stages. Without a limit there is one context and one table per level.
"""
from __future__ import annotations

from dataclasses import dataclass
from math import prod

import numpy as np

from .costmodel import ChainCosts, CostModel, Memory
from .errors import PlanError

INF = float("inf")
_GUESS_WIDTH = 16  # mean band width per q above which `_relax` tries even splits first
Context = tuple[int, int]  # (workers before, replication of the enclosing stages)


@dataclass(frozen=True)
class Stage:
    """One stage of the partition at some level: layers first..last, r units of that level.

    `time` is its modelled time per minibatch (already divided by its replicas). `inner`
    is the pipeline inside one unit (for levels above the innermost), `units_before` the
    units of this level used by earlier stages of the same pipeline.
    """

    first: int
    last: int
    replicas: int
    time: float
    units_before: int
    inner: "Pipeline | None" = None


@dataclass(frozen=True)
class Pipeline:
    """A pipeline of stages over layers first..last on the units of one level."""

    level: int
    stages: tuple[Stage, ...]
    time: float

    @property
    def units(self) -> int:
        return sum(s.replicas for s in self.stages)


@dataclass(frozen=True)
class LeafStage:
    """A stage of the flattened plan: layers, total replicas, the workers (ranks) running it,
    and its replica count at each level, innermost first."""

    first: int
    last: int
    ranks: tuple[int, ...]
    replicas_per_level: tuple[int, ...]


def flatten(pipeline: Pipeline, inner_workers: list[int]) -> list[LeafStage]:
    """The innermost stages in order, with global ranks (unit-major: rank = unit * W + local)."""

    def walk(p: Pipeline, bases: list[int], outer: tuple[int, ...]) -> list[LeafStage]:
        leaves = []
        size = inner_workers[p.level]
        for stage in p.stages:
            units = range(stage.units_before, stage.units_before + stage.replicas)
            here = [base + u * size for base in bases for u in units]
            if stage.inner is None:
                leaves.append(LeafStage(stage.first, stage.last, tuple(sorted(here)), (stage.replicas,) + outer))
            else:
                leaves.extend(walk(stage.inner, here, (stage.replicas,) + outer))
        return leaves

    return walk(pipeline, [0], ())


class Solver:
    """The dynamic program over one profile's costs on one cluster.

    `counts`/`bandwidths` describe the levels innermost first (bandwidth in bytes/s).
    `straight` forbids replication. `memory` (optional) prunes stages that do not fit.
    """

    def __init__(self, costs: ChainCosts, counts: list[int], bandwidths: list[float], model: CostModel,
                 straight: bool = False, memory: Memory | None = None):
        if not counts or min(counts) < 1:
            raise PlanError(f"every cluster level needs at least one unit, got counts {counts}")
        self.costs = costs
        self.n = costs.n
        self.counts = counts
        self.bandwidths = bandwidths
        self.model = model
        self.straight = straight
        self.memory = memory
        self.workers = prod(counts)
        self.inner = [prod(counts[:level]) for level in range(len(counts))]  # workers per unit
        self.params = costs.range_sums(costs.params)
        self.stashed = costs.range_sums(costs.acts) + costs.cut_before()[:, None]
        self.compute = costs.range_sums(costs.compute, empty=INF)  # +inf: no such range
        self.final = model.final_charge(self.n)
        self._compute_prefix = np.concatenate([[0.0], np.cumsum(costs.compute)])
        self._param_prefix = np.concatenate([[0.0], np.cumsum(costs.params)])
        self._tables: dict[tuple[int, Context | None], np.ndarray] = {}
        self._stages: dict[tuple, np.ndarray] = {}

    # ----- public --------------------------------------------------------------------------
    def solve(self) -> Pipeline | None:
        """The optimal pipeline of all layers on the whole cluster; None when nothing fits."""
        top = len(self.counts) - 1
        context = (0, 1) if self.memory else None
        return self._reconstruct(top, context, 0, self.n - 1)

    # ----- tables --------------------------------------------------------------------------
    def _unit_time(self, level: int, context: Context | None) -> np.ndarray:
        """Time of every range on one unit of `level` (one worker at level 0)."""
        if level == 0:
            return self.compute
        return self._table(level - 1, context)

    def _table(self, level: int, context: Context | None) -> np.ndarray:
        """best[a, b]: the best pipeline time of layers a..b on one unit of level + 1."""
        key = (level, context)
        if key not in self._tables:
            best = np.full((self.n, self.n), INF)
            for a in range(self.n):
                best[a] = self._row(level, context, a)[0]
            self._tables[key] = best
        return self._tables[key]

    def _stage(self, level: int, context: Context | None, r: int, before: int, first: bool, final: bool) -> np.ndarray:
        """Matrix of stage times for ranges as one stage of r units after `before` units."""
        memory_key = before if self.memory else 0
        key = (level, context, r, memory_key, first, final)
        if key not in self._stages:
            inner_context = None
            if self.memory:
                outer_before, outer = context
                inner_context = (outer_before + outer * before * self.inner[level], outer * r)
            unit = self._unit_time(level, inner_context)
            charge = self.final if final else True
            times = self.model.stage_times(self.costs, unit, self.params, r, self.bandwidths[level],
                                           self.inner[level], first, charge)
            if self.memory and level == 0:
                outer_before, outer = context
                k = Memory.in_flight(self.workers, outer_before + outer * before, outer * r)
                fits = self.memory.need(self.params, self.stashed, k) <= self.memory.limit
                times = np.where(fits, times, INF)
            self._stages[key] = times
        return self._stages[key]

    def _replica_choices(self, m: int) -> range:
        return range(1, min(2, m)) if self.straight else range(1, m)

    def _row(self, level: int, context: Context | None, a: int, track: bool = False):
        """Best pipelines of layers a..q on level `level` for every end q.

        Returns (best over allowed unit counts per q, and when `track` the tables needed to
        rebuild the argmin: F, T values and choices).
        """
        n, M = self.n, self.counts[level]
        F = np.full((M + 1, n), INF)
        T = np.full((M + 1, n), INF)
        choice_F = np.zeros((M + 1, n, 2), dtype=np.int64) if track else None
        choice_T = np.zeros((M + 1, n, 2), dtype=np.int64) if track else None
        for m in range(1, M + 1):
            if not self.straight or m == 1:
                F[m, a:] = self._stage(level, context, m, 0, True, False)[a, a:]
                T[m, a:] = self._stage(level, context, m, 0, True, True)[a, a:]
                if track:
                    choice_F[m, a:] = (a, m)
                    choice_T[m, a:] = (a, m)
            if a + 1 >= n:
                continue
            for r in self._replica_choices(m):
                for table, choices, final in ((F, choice_F, False), (T, choice_T, True)):
                    stage = self._stage(level, context, r, m - r, False, final)
                    self._relax(table, choices, F[m - r], stage, level, a, m, r)
        if self.model.exact_workers:
            best = T[M]
        else:
            best = T[1:].min(axis=0)
        return (best, F, T, choice_F, choice_T) if track else (best,)

    def _relax(self, table, choices, prev, stage, level, a, m, r) -> None:
        """table[m][q] = min(table[m][q], min over a < p <= q of max(prev[p-1], stage[p, q])).

        Only a band of boundaries p is evaluated for each q: the cost model's lower bound
        on the stage p..q (`stage_bound`, non-increasing in p) and the smallest prefix time
        over p' >= p (non-decreasing in p) must both be below the best time already known
        for q; no other p can do better, so the result is exact. With `choices`, the
        arg-min is recorded (ties keep the candidate found first: an even split when those
        were tried, else the earliest p; a later r replaces an earlier one only when strictly
        better).
        """
        n = len(prev)
        if a + 1 >= n:
            return
        q = np.arange(a + 1, n)
        lo, hi = self._band(table, prev, level, a, m, r, q)
        if np.maximum(hi - lo + 1, 0).sum() > _GUESS_WIDTH * len(q):
            # wide bands: the time known so far is poor; try the even splits first, then narrow
            self._relax_guesses(table, choices, prev, stage, a, m, r, q)
            lo, hi = self._band(table, prev, level, a, m, r, q)
        width = np.maximum(hi - lo + 1, 0)
        keep = np.nonzero(width > 0)[0]
        if len(keep) == 0:
            return
        q, lo, width = q[keep], lo[keep], width[keep]
        starts = np.concatenate([[0], np.cumsum(width)[:-1]])
        p = np.repeat(lo - starts, width) + np.arange(int(width.sum()))
        values = np.maximum(prev[p - 1], stage[p, np.repeat(q, width)])
        best = np.minimum.reduceat(values, starts)
        better = best < table[m, q]
        table[m, q] = np.where(better, best, table[m, q])
        if choices is not None and better.any():
            segment = np.repeat(np.arange(len(q)), width)
            hits = np.nonzero(values == best[segment])[0]
            first_hit = hits[np.unique(segment[hits], return_index=True)[1]]
            chosen = np.nonzero(better)[0]
            choices[m, q[chosen], 0] = p[first_hit[chosen]]
            choices[m, q[chosen], 1] = r

    def _band(self, table, prev, level, a, m, r, q) -> tuple[np.ndarray, np.ndarray]:
        """For every q, the first and last boundary p whose lower bounds stay below the best
        time known for q (see `_relax`)."""
        n = len(prev)
        known = table[m, a + 1:] * (1.0 + 1e-9)  # a little slack against rounding in the bounds
        # the prefix side: p - 1 runs over a .. n - 2; its suffix minimum does not decrease with p
        suffix_min = np.minimum.accumulate(prev[a:n - 1][::-1])[::-1]
        hi = np.minimum(a + np.searchsorted(suffix_min, known, side="left"), q)
        # the stage side: alpha * C(p..q) (+ or max) beta * P(p..q) < known, solved on prefix sums
        alpha, beta, additive = self.model.stage_bound(r, self.bandwidths[level], self.inner[level])
        compute, params = self._compute_prefix, self._param_prefix
        if additive:
            mixed = alpha * compute + beta * params
            lo = np.searchsorted(mixed, mixed[q + 1] - known, side="right")
        else:
            lo = np.searchsorted(compute, compute[q + 1] - known / alpha, side="right")
            if beta > 0:
                lo = np.maximum(lo, np.searchsorted(params, params[q + 1] - known / beta, side="right"))
        return np.maximum(lo, a + 1), hi

    def _relax_guesses(self, table, choices, prev, stage, a, m, r, q) -> None:
        """Try, for every q, the boundaries that split the compute of a..q evenly between the
        prefix's m - r units and the stage's r units: a good time found this way narrows the
        bands `_relax` has to search."""
        compute = self._compute_prefix
        even = np.searchsorted(compute, (r * compute[a] + (m - r) * compute[q + 1]) / m)
        p = np.clip(even[None, :] + np.array([[-1], [0], [1]]), a + 1, q[None, :])
        values = np.maximum(prev[p - 1], stage[p, q[None, :]])
        pick = values.argmin(axis=0)
        columns = np.arange(len(q))
        best, where = values[pick, columns], p[pick, columns]
        better = best < table[m, q]
        table[m, q[better]] = best[better]
        if choices is not None:
            choices[m, q[better], 0] = where[better]
            choices[m, q[better], 1] = r

    # ----- reconstruction ------------------------------------------------------------------
    def _reconstruct(self, level: int, context: Context | None, a: int, b: int) -> Pipeline | None:
        best, F, T, choice_F, choice_T = self._row(level, context, a, track=True)
        if not np.isfinite(best[b]):
            return None
        M = self.counts[level]
        m = M if self.model.exact_workers else int(1 + T[1:, b].argmin())
        stages = []
        table, choices, q = T, choice_T, b
        while True:
            p, r = (int(x) for x in choices[m, q])
            time = self._stage(level, context, r, m - r, p == a, table is T)[p, q]
            inner = None
            if level > 0:
                inner_context = None
                if self.memory:
                    outer_before, outer = context
                    inner_context = (outer_before + outer * (m - r) * self.inner[level], outer * r)
                inner = self._reconstruct(level - 1, inner_context, p, q)
            stages.append(Stage(p, q, r, float(time), m - r, inner))
            if p == a:
                break
            table, choices, q, m = F, choice_F, p - 1, m - r
        stages.reverse()
        return Pipeline(level, tuple(stages), float(best[b]))
