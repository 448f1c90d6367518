"""PipeDream's partitioning dynamic program (Narayanan et al., SOSP 2019, section 3.1).

Given per-layer costs, a cluster of levels (innermost first: e.g. GPUs in a server, then
servers) and a cost model, find stages and a replica count per stage that minimise the time
per minibatch of the slowest stage. As in the paper, the DP's states are the down-sets of the
layer graph (states.py: sets of layers closed under predecessors, sorted so that a subset comes
first), and a stage is the difference `D_j \\ D_k` of two states, D_k a strict subset of D_j; on a
chain these are the prefixes and the contiguous ranges of layers. The problem is solved level
by level: the best pipeline of every stage `D_b \\ D_a` on one unit of level l (one
server) becomes its compute time as a stage of level l + 1 (across servers).

For one level with M units and a sub-problem starting at state a, with `stage(k, j, r)` the cost
model's time of `D_j \\ D_k` as one stage of r replicas (costmodel.py):

    F[m][j] = min( stage(a, j, m) ,                                      one stage
                   min over D_a < D_k < D_j (strict subsets), 1 <= r < m of max(F[m - r][k], stage(k, j, r)) )

F is the best pipeline from state a to state j with exactly m units whose last stage still pays
its output; the answer for a..b takes the same recurrence with the last stage's output free
(or charged as the model says). Each (m, r) step is a vectorised min-max over the states k that
lower bounds cannot rule out (`Solver._relax`), which keeps 1000 layers on 1024 workers within
seconds; a k that is not a subset of j costs +inf there.

The result is the exact optimum of the model over its states: `tests/unit/test_partition.py`
compares it with exhaustive search on small random chains and DAGs and with the plain
recurrence on larger ones. Ties between equally good partitions are broken by a fixed rule
(see `_relax`), so the answer is deterministic.

With a memory limit, a stage's in-flight minibatches depend on how many workers come before
it in the whole pipeline, so tables are solved per *context* `(before, outer)`: workers of
the global pipeline before this sub-problem's first worker, and the replication of the
enclosing stages. Without a limit there is one context and one table per level.
"""
from __future__ import annotations

import copy
from dataclasses import dataclass
from math import prod

import numpy as np

from .costmodel import ChainCosts, CostModel, Memory
from ..artifacts.plan import RECOMPUTE, SHARDS, SYNC_SCALE, LayerSet
from ..errors import PlanError
from .states import States, build_states

INF = float("inf")
_GUESS_WIDTH = 16  # mean band width per j above which `_relax` tries even splits first
_AROUND = np.array([[-1], [0], [1]])  # the even split's state and its two neighbours (`_relax_guesses`)
Context = tuple[int, int]  # (workers before, replication of the enclosing stages)


@dataclass(frozen=True, kw_only=True)
class PipelineStage(LayerSet):
    """One stage of the partition at some level: the layers of state `end` not in state
    `start` (`layers`, ascending), on r units of that level.

    `time` is its modelled time per minibatch (already divided by its replicas). `inner`
    is the pipeline inside one unit (for levels above the innermost), `units_before` the
    units of this level used by earlier stages of the same pipeline.
    """

    start: int
    end: int
    layers: tuple[int, ...]
    replicas: int
    time: float
    units_before: int
    inner: "Pipeline | None" = None
    recompute: bool = False  # recomputes its forward during the backward (worker level only)
    shard: str = "none"  # what its replicas shard (`shard` auto; worker level only): artifacts.plan.SHARDS


@dataclass(frozen=True)
class Pipeline:
    """A pipeline of stages from one state to another on the units of one level."""

    level: int
    stages: tuple[PipelineStage, ...]
    time: float

    @property
    def units(self) -> int:
        return sum(s.replicas for s in self.stages)


class Solver:
    """The dynamic program over one profile's costs on one cluster.

    `costs` are per-layer costs (their down-sets are enumerated here, `build_states`) or
    ready-made `States`. `counts`/`bandwidths` describe the levels innermost first (bandwidth
    in bytes/s). `straight` forbids replication. `memory` (optional) prunes stages that do
    not fit. `every_worker` uses every unit of every level (the pipedream cost model always does).
    `recompute` (`RECOMPUTE`) says which stages recompute their forward during the backward: `none`,
    `all`, or `auto`: those that fit the memory limit only so (`costmodel` module doc); a stage of
    the answer says whether it does (`PipelineStage.recompute`). `shard` auto lets each
    replicated worker-level stage shard its optimizer state where it fits the limit only so
    (`PipelineStage.shard`; `optimizer`: the cost model and `memory` shard every one already).
    """

    def __init__(self, costs: ChainCosts | States, counts: list[int], bandwidths: list[float], model: CostModel,
                 straight: bool = False, memory: Memory | None = None, every_worker: bool = False,
                 recompute: str = "none", shard: str = "none", auto_shards: tuple[str, ...] = SHARDS):
        if recompute not in RECOMPUTE:
            raise PlanError(f"unknown --recompute {recompute!r}; use one of {', '.join(RECOMPUTE)}")
        if not counts or min(counts) < 1:
            raise PlanError(f"every cluster level needs at least one unit, got counts {counts}")
        self.exact = every_worker or model.exact_workers
        # zero-time layers follow their producers only where that is safe (states.py, `_followers`)
        self.states = costs if isinstance(costs, States) else build_states(
            costs, followers=not self.exact and memory is None)
        self.S = len(self.states)
        self.counts = counts
        self.bandwidths = bandwidths
        self.model = model
        self.straight = straight
        self.memory = memory
        self.workers = prod(counts)
        self.inner = [prod(counts[:level]) for level in range(len(counts))]  # workers per unit
        states = self.states
        self.params = states.stage_sums(states.params)
        # the largest layer's parameters of each stage (`Memory.terms`' temporaries), where they count
        self.largest = states.stage_maxima(states.layer_params) if memory is not None and (
            memory.step_temporaries or memory.accumulates or shard in ("parameters", "auto")) \
            and states.layer_params is not None else 0.0
        self.stashed = states.stage_sums(states.acts if states.stash is None else states.stash) + states.cut[:, None]
        self.compute = states.stage_sums(states.compute, empty=INF)  # +inf: no such stage
        self.recompute = recompute
        self.again = None  # a recomputing stage's compute: its forward runs twice
        if recompute != "none":
            self.again = self.compute + states.stage_sums(states.forward if states.forward is not None
                                                          else np.zeros(self.S))
        self._recomputing: dict[tuple, np.ndarray | bool] = {}  # per stage key: a matrix, or one answer for all
        self.shard = shard
        self.auto_shards = auto_shards  # `shard` auto: the ones it chooses among
        self.sharded_models = {}  # `shard` auto: the stages that shard pay the gather too, by SHARDS index
        for kind in range(1, len(SHARDS)):
            self.sharded_models[kind] = copy.copy(model)
            self.sharded_models[kind].sync = SYNC_SCALE[SHARDS[kind]]
        self._sharding: dict[tuple, np.ndarray | int] = {}  # as `_recomputing`: what the replicas shard (SHARDS index)
        self.final = model.final_charge(self.S)
        self._params_sorted = states.params_sorted
        self._tables: dict[tuple[int, Context | None], np.ndarray] = {}
        self._stages: dict[tuple, np.ndarray] = {}
        self._bounds: dict[tuple[int, int], tuple] = {}  # `CostModel.stage_bound` by (replicas, level)
        self._top_rows: dict[tuple, tuple] = {}  # `_tracked_row` of the top level
        self._pipelines: dict[tuple, Pipeline | None] = {}  # `_reconstruct`'s answers: candidates share stages
        self._js: dict[int, np.ndarray] = {}  # `_targets`

    # ----- public --------------------------------------------------------------------------
    def solve(self) -> Pipeline | None:
        """The optimal pipeline of all layers on the whole cluster; None when nothing fits."""
        top = len(self.counts) - 1
        context = (0, 1) if self.memory else None
        return self._reconstruct(top, context, 0, self.S - 1)

    def candidates(self, limit: int) -> list[Pipeline]:
        """The optimal pipeline for each number of top-level units it may use (all of them where
        every worker must be used), fastest first by the cost model, at most `limit`: the
        plans the planner compares in simulation."""
        top = len(self.counts) - 1
        context = (0, 1) if self.memory else None
        _, _, T, _, _ = self._tracked_row(top, context, 0)
        b = self.S - 1
        counts = [self.counts[top]] if self.exact else range(1, self.counts[top] + 1)
        finite = sorted((float(T[m, b]), m) for m in counts if np.isfinite(T[m, b]))
        return [self._reconstruct(top, context, 0, b, units=m) for _, m in finite[:limit]]

    # ----- tables --------------------------------------------------------------------------
    def _unit_time(self, level: int, context: Context | None) -> np.ndarray:
        """Time of every stage (k, j) on one unit of `level` (one worker at level 0)."""
        if level == 0:
            return self.compute
        return self._table(level - 1, context)

    def _table(self, level: int, context: Context | None) -> np.ndarray:
        """best[a, b]: the best pipeline time of `D_b \\ D_a` on one unit of level + 1."""
        key = (level, context)
        if key not in self._tables:
            best = np.full((self.S, self.S), INF)
            for a in range(self.S - 1):
                best[a] = self._row(level, context, a)[0]
            self._tables[key] = best
        return self._tables[key]

    def _stage(self, level: int, context: Context | None, r: int, before: int, first: bool, final: bool) -> np.ndarray:
        """Matrix of stage times for every (k, j) as one stage of r units after `before` units."""
        key = self._stage_key(level, context, r, before, first, final)
        if key not in self._stages:
            inner_context = None
            if self.memory:
                outer_before, outer = context
                inner_context = (outer_before + outer * before * self.inner[level], outer * r)
            unit = self._unit_time(level, inner_context)
            charge = self.final if final else True
            times = self.model.stage_times(self.states.cut, unit, self.params, r, self.bandwidths[level],
                                           self.inner[level], first, charge)
            if level == 0:
                times = self._with_recomputation(key, times, context, r, before, first, charge)
            self._stages[key] = times
        return self._stages[key]

    def _stage_key(self, level: int, context: Context | None, r: int, before: int, first: bool, final: bool) -> tuple:
        return (level, context, r, before if self.memory else 0, first, final)

    def _with_recomputation(self, key, times, context, r, before, first, charge) -> np.ndarray:
        """Worker-level stage times with the memory limit, `recompute` and `shard` applied: +inf
        where a stage does not fit; per stage the fastest of the allowed ways that fits (keeping
        its activations or recomputing them; its replicas sharding the optimizer state or not,
        `shard` auto), the earlier of equals (keeping, unsharded), recorded under `key`."""
        def priced(unit, kind: int):
            model = self.sharded_models[kind] if kind else self.model
            return model.stage_times(self.states.cut, unit, self.params, r, self.bandwidths[0], self.inner[0], first,
                                     charge)

        if not self.memory:
            self._recomputing[key] = self.recompute == "all"
            self._sharding[key] = 0
            return priced(self.again, 0) if self.recompute == "all" else times
        outer_before, outer = context
        k = Memory.in_flight(self.workers, outer_before + outer * before, outer * r)
        cut = (self.states.cut[:, None], self.states.cut[None, :])
        kinds = ([SHARDS.index(s) for s in self.auto_shards] if self.shard == "auto" and outer * r > 1
                 else (0,))  # SHARDS' indices
        ways = [(again, kind) for again in {"none": (False,), "all": (True,), "auto": (False, True)}[self.recompute]
                for kind in kinds]
        best, recomputing, sharding = np.full_like(times, INF), False, 0
        for again, kind in ways:
            sharing = outer * r if kind else self.memory.sharing(outer * r)
            need = self.memory.need(self.params, self.stashed, k, recompute=self.states.cut[:, None] if again else None,
                                    cut=cut, largest=self.largest, sharing=sharing, shard=SHARDS[kind] if kind else None,
                                    replicas=outer * r)
            way = times if not (again or kind) else priced(self.again if again else self.compute, kind)
            better = (need <= self.memory.limit) & (way < best)
            best = np.where(better, way, best)
            recomputing, sharding = np.where(better, again, recomputing), np.where(better, kind, sharding)
        self._recomputing[key] = recomputing
        self._sharding[key] = sharding
        return best

    def recomputes(self, *, level: int, context: Context | None, r: int, before: int, first: bool, final: bool,
                   k: int, j: int) -> bool:
        """Whether the worker-level stage (k, j) recomputes in that place of the pipeline."""
        self._stage(level, context, r, before, first, final)
        recomputing = self._recomputing[self._stage_key(level, context, r, before, first, final)]
        return bool(recomputing if np.ndim(recomputing) == 0 else recomputing[k, j])

    def shards(self, *, level: int, context: Context | None, r: int, before: int, first: bool, final: bool,
               k: int, j: int) -> str:
        """What the replicas of the worker-level stage (k, j) shard there (`shard` auto; SHARDS)."""
        self._stage(level, context, r, before, first, final)
        sharding = self._sharding[self._stage_key(level, context, r, before, first, final)]
        return SHARDS[int(sharding if np.ndim(sharding) == 0 else sharding[k, j])]

    def _replica_choices(self, m: int) -> range:
        return range(1, min(2, m)) if self.straight else range(1, m)

    def _row(self, level: int, context: Context | None, a: int, track: bool = False):
        """Best pipelines from state a to every state j on level `level`.

        Returns (best over allowed unit counts per j, and when `track` the tables needed to
        rebuild the argmin: F, T values and choices (k, r) of the last stage).
        """
        S, M = self.S, self.counts[level]
        F = np.full((M + 1, S), INF)
        T = np.full((M + 1, S), INF)
        choice_F = np.zeros((M + 1, S, 2), dtype=np.int64) if track else None
        choice_T = np.zeros((M + 1, S, 2), dtype=np.int64) if track else None
        suffixes: dict[int, np.ndarray] = {}
        for m in range(1, M + 1):
            if not self.straight or m == 1:
                F[m, a + 1:] = self._stage(level, context, m, 0, True, False)[a, a + 1:]
                T[m, a + 1:] = self._stage(level, context, m, 0, True, True)[a, a + 1:]
                if track:
                    choice_F[m, a + 1:] = (a, m)
                    choice_T[m, a + 1:] = (a, m)
            if a + 2 >= S:
                continue
            for r in self._replica_choices(m):
                if m - r not in suffixes:  # F[m - r] is final: its suffix minima, once for every r that reads it
                    suffixes[m - r] = np.minimum.accumulate(F[m - r][a + 1:S - 1][::-1])[::-1]
                for table, choices, final in ((F, choice_F, False), (T, choice_T, True)):
                    stage = self._stage(level, context, r, m - r, False, final)
                    self._relax(table=table, choices=choices, prev=F[m - r], stage=stage, level=level, a=a, m=m, r=r,
                                suffix_min=suffixes[m - r])
        if self.exact:
            best = T[M]
        else:
            best = T[1:].min(axis=0)
        return (best, F, T, choice_F, choice_T) if track else (best,)

    def _relax(self, *, table, choices, prev, stage, level, a, m, r, suffix_min) -> None:
        """table[m][j] = min(table[m][j], min over a < k < j of max(prev[k], stage[k, j])).

        Only a band of states k is evaluated for each j: the cost model's lower bound on the
        stage (k, j) (`stage_bound`, on the compute totals, which do not decrease with k) and
        the smallest prefix time over k' >= k (non-decreasing in k) must both be below the
        best time already known for j; no other k can do better, so the result is exact. A
        k in the band that is not a subset of j costs +inf (`stage`). With `choices`, the
        arg-min is recorded (ties keep the candidate found first: an even split when those
        were tried, else the earliest k; a later r replaces an earlier one only when strictly
        better).
        """
        S = len(prev)
        if a + 2 >= S:
            return
        j = self._targets(a)
        lo, hi = self._band(table, suffix_min, level, a, m, r, j)
        width = np.maximum(hi - lo + 1, 0)
        if width.sum() > _GUESS_WIDTH * len(j):
            # wide bands: the time known so far is poor; try the even splits first, then narrow
            self._relax_guesses(table=table, choices=choices, prev=prev, stage=stage, a=a, m=m, r=r, j=j)
            lo, hi = self._band(table, suffix_min, level, a, m, r, j)
            width = np.maximum(hi - lo + 1, 0)
        keep = np.flatnonzero(width)
        if len(keep) == 0:
            return
        if len(keep) < len(j):
            j, lo, width = j[keep], lo[keep], width[keep]
        cumulative = width.cumsum()
        starts = cumulative - width
        k = (lo - starts).repeat(width) + np.arange(int(cumulative[-1]))
        values = np.maximum(prev[k], stage[k, j.repeat(width)])
        best = np.minimum.reduceat(values, starts)
        better = best < table[m, j]
        if not better.any():
            return
        table[m, j[better]] = best[better]
        if choices is not None:
            segment = np.repeat(np.arange(len(j)), width)
            hits = np.nonzero(values == best[segment])[0]
            first_hit = hits[np.unique(segment[hits], return_index=True)[1]]
            chosen = np.nonzero(better)[0]
            choices[m, j[chosen], 0] = k[first_hit[chosen]]
            choices[m, j[chosen], 1] = r

    def _band(self, table, suffix_min, level, a, m, r, j) -> tuple[np.ndarray, np.ndarray]:
        """For every j, the first and last state k whose lower bounds stay below the best
        time known for j (see `_relax`). `suffix_min`: the prefix times' suffix minima over
        k = a + 1 .. S - 2 (they do not decrease with k)."""
        known = table[m, a + 2:] * (1.0 + 1e-9)  # a little slack against rounding in the bounds
        hi = np.minimum(a + suffix_min.searchsorted(known, side="left"), j - 1)  # j: every state from a + 2
        # the stage side: alpha * C(k, j) (+ or max) beta * P(k, j) < known, solved on the totals
        # (the params part only when the params totals are sorted too; it is only pruning)
        bound = (r, level)
        if bound not in self._bounds:
            alpha, beta, additive = self.model.stage_bound(r, self.bandwidths[level], self.inner[level])
            mixed = alpha * self.states.compute + beta * self.states.params \
                if additive and self._params_sorted else None
            self._bounds[bound] = (alpha, beta, additive, mixed)
        alpha, beta, additive, mixed = self._bounds[bound]
        compute, params = self.states.compute, self.states.params
        if mixed is not None:
            lo = mixed.searchsorted(mixed[a + 2:] - known, side="right")
        else:
            lo = compute.searchsorted(compute[a + 2:] - known / alpha, side="right")
            if beta > 0 and not additive and self._params_sorted:
                lo = np.maximum(lo, params.searchsorted(params[a + 2:] - known / beta, side="right"))
        return np.maximum(lo, a + 1), hi

    def _targets(self, a: int) -> np.ndarray:
        """The states a + 2 .. S - 1 (`_relax`'s j), made once per a (read only)."""
        found = self._js.get(a)
        if found is None:
            found = self._js[a] = np.arange(a + 2, self.S)
            found.flags.writeable = False
        return found

    def _relax_guesses(self, *, table, choices, prev, stage, a, m, r, j) -> None:
        """Try, for every j, the states that split the compute from a to j evenly between the
        prefix's m - r units and the stage's r units: a good time found this way narrows the
        bands `_relax` has to search."""
        compute = self.states.compute
        even = compute.searchsorted((r * compute[a] + (m - r) * compute[j]) / m)
        k = np.minimum(np.maximum(even[None, :] + _AROUND, a + 1), j[None, :] - 1)
        values = np.maximum(prev[k], stage[k, j[None, :]])
        pick = values.argmin(axis=0)
        columns = np.arange(len(j))
        best, where = values[pick, columns], k[pick, columns]
        better = best < table[m, j]
        table[m, j[better]] = best[better]
        if choices is not None:
            choices[m, j[better], 0] = where[better]
            choices[m, j[better], 1] = r

    # ----- reconstruction ------------------------------------------------------------------
    def _tracked_row(self, level: int, context: Context | None, a: int):
        """`_row(..., track=True)`; the top level's (one row, which `candidates` and every candidate's
        reconstruction read) is kept, the others are made again where needed (they are many)."""
        if level < len(self.counts) - 1:
            return self._row(level, context, a, track=True)
        key = (level, context, a)
        if key not in self._top_rows:
            self._top_rows[key] = self._row(level, context, a, track=True)
        return self._top_rows[key]

    def _reconstruct(self, level: int, context: Context | None, a: int, b: int,
                     units: int | None = None) -> Pipeline | None:
        key = (level, context, a, b, units)
        if key not in self._pipelines:
            self._pipelines[key] = self._reconstructed(level, context, a, b, units)
        return self._pipelines[key]

    def _reconstructed(self, level: int, context: Context | None, a: int, b: int,
                       units: int | None = None) -> Pipeline | None:
        best, F, T, choice_F, choice_T = self._tracked_row(level, context, a)
        if not np.isfinite(best[b]):
            return None
        M = self.counts[level]
        m = units if units is not None else M if self.exact else int(1 + T[1:, b].argmin())
        stages = []
        table, choices, j = T, choice_T, b
        while True:
            k, r = (int(x) for x in choices[m, j])
            time = self._stage(level, context, r, m - r, k == a, table is T)[k, j]
            inner = None
            if level > 0:
                inner_context = None
                if self.memory:
                    outer_before, outer = context
                    inner_context = (outer_before + outer * (m - r) * self.inner[level], outer * r)
                inner = self._reconstruct(level - 1, inner_context, k, j)
            place = dict(level=level, context=context, r=r, before=m - r, first=k == a, final=table is T, k=k, j=j)
            stages.append(
                PipelineStage(start=k, end=j, layers=self.states.layers(k, j), replicas=r, time=float(time),
                              units_before=m - r, inner=inner, recompute=level == 0 and self.recomputes(**place),
                              shard=self.shards(**place) if level == 0 else "none")
            )
            if k == a:
                break
            table, choices, j, m = F, choice_F, k, m - r
        stages.reverse()
        return Pipeline(level, tuple(stages), float(best[b] if units is None else T[units, b]))
