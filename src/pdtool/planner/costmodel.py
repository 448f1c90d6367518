"""The planner's cost models: how long a stage takes per minibatch and how much memory it needs.

Everything here is per minibatch of the profile's batch size, in seconds and bytes. A stage is
the difference `D_j \\ D_k` of two states of the planner, down-sets of the layer graph with
`D_k` a strict subset of `D_j` (states.py; on a chain, a contiguous range of layers), and the
models see it through per-state totals: its compute is `compute[j] - compute[k]`, and so on.

**Cut bytes.** `cut(D)` is what leaves a state: the bytes of every output of a layer in D read
by some layer outside D, each output counted once however many consumers it has (a skip
connection over the boundary is sent too). A stage receives `cut(D_k)` and sends `cut(D_j)`.
On the prefixes of the layer order, `ChainCosts.cut[k]` is the cut after layer k.

**pdtool's default model** (`DefaultModel`). A stage of `r` replicas on units of one level
of the cluster (bandwidth `B` bytes/s per unit link) takes per minibatch

    max(unit_time / r, allreduce / r, (in_bytes + out_bytes) / (B * r))

where `unit_time` is the stage's compute on one unit (at the innermost level the sum of its
layers' forward + backward times; at an outer level the best pipeline of those layers inside
one unit), `allreduce = 2 (r - 1) / r * param_bytes / B` is one ring all-reduce of the
stage's parameters, done once per round of r minibatches, and `in_bytes`/`out_bytes` are the
cut bytes of the stage's two states (activations one way, gradients the other, on
full-duplex links; a boundary at the edge of the model, or of the range a unit of the outer
level owns, is not charged here). Communication overlaps compute, hence the max.

**The original's model** (`PipeDreamModel`, `--cost-model pipedream`), copied from
`optimizer_graph_hierarchical.py` (see ../shared/pipedream-reference.md, section 2): compute
and sync add up, sync is `4 (r - 1) |w| / (r B)`; a range that is one whole stage of a level
divides that sync by the workers inside a unit (`W`), a later stage does not (quirk 2);
activation transfers `2 a / (B r)` are charged on the consuming stage's `r` replicas, for
its input and (unless it ends the model: `D_j` = all layers) its output, and the first stage
pays none. Its cut bytes are the true cut (each output once); the original's "augmented
antichain" counts some outputs that stay inside the state too, so it charges at least as much.

**Memory** (both models): a worker of a stage holding `k` minibatches in flight keeps
`k` weight versions (weight stashing), one gradient and `optimizer_slots` optimizer buffers
of its parameters, `k` sets of stashed activations (the cut bytes it receives plus what its
layers save for their backward: the profile's `saved_bytes`, measured by `pd profile`, or
`act_bytes` in a profile without them), and the messages its links keep (activations and
gradients both ways, as many as the deeper worker of each link holds in flight: `Memory.terms`):

    param_bytes * (k + 1 + optimizer_slots) + k * (in_bytes + sum of its layers' saved_bytes)
        + 2 * ((k + 1) * in_bytes + k * out_bytes)

Under 1F1B with round-robin replication, a stage with `R` replicas after `before` workers of
earlier stages, in a pipeline of `W` workers, has `k = floor((W - 1 - before) / R) + 1`
(stage s of a straight d-stage pipeline: d - s).

**Recomputation** (`pd plan --recompute`): a stage that recomputes runs its forward without
keeping activations and again, keeping them, just before each backward (on the same weight
version). Its minibatches in flight stash only their inputs, and one holds its whole set:

    param_bytes * (k + 1 + optimizer_slots) + (k - 1) * in_bytes + (in_bytes + sum of saved_bytes)
        + messages + k * out_bytes (its sends in flight no longer share their outputs with a stash)

and its compute per minibatch is forward + backward + forward again. With `auto` the planner
recomputes a stage only where it would not fit otherwise (so never without a memory limit);
`all` recomputes every stage, `none` no stage.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..artifacts.profile import Profile
from ..memory import COMPUTE_COPY, OPTIMIZER_SLOTS, Memory, memory_model, step_temporaries  # noqa: F401 - the planner's too

SECONDS_PER_MS = 1e-3  # profiles are in ms, the planner works in seconds


@dataclass(frozen=True, kw_only=True)
class ChainCosts:
    """Per-layer costs of a profile in planner units (seconds, bytes), and its layer graph.

    `compute[i]` is layer i's forward + backward seconds; `cut[k]` the bytes crossing the
    boundary after layer k of the layer order (`cut[n-1]` = 0); `edges` the layer graph
    (producer, consumer) with producer < consumer, None for a chain in layer order.
    """

    compute: np.ndarray
    params: np.ndarray
    acts: np.ndarray
    cut: np.ndarray
    edges: tuple[tuple[int, int], ...] | None = None
    forward: np.ndarray | None = None  # the forward part of `compute` (what recomputation runs again); None: 0
    stash: np.ndarray | None = None    # what each layer saves for its backward (`Layer.saved_bytes`); None: `acts`

    @classmethod
    def from_profile(cls, profile: Profile) -> "ChainCosts":
        """The profile's costs, its layers' times scaled to its measured step (`Profile.compute_scale`)."""
        scale = profile.compute_scale * SECONDS_PER_MS
        return cls.from_layers(np.array([l.total_ms * scale for l in profile.layers], dtype=float),
                               np.array([l.param_bytes for l in profile.layers], dtype=float),
                               np.array([l.act_bytes for l in profile.layers], dtype=float), profile.edges,
                               forward=np.array([l.fwd_ms * scale for l in profile.layers], dtype=float),
                               stash=np.array([l.act_bytes if l.saved_bytes is None else l.saved_bytes
                                               for l in profile.layers], dtype=float))

    @classmethod
    def from_layers(cls, compute: np.ndarray, params: np.ndarray, acts: np.ndarray,
                    edges: tuple[tuple[int, int], ...], forward: np.ndarray | None = None,
                    stash: np.ndarray | None = None) -> "ChainCosts":
        """Costs of a layer graph: per-layer arrays in topological order and its edges."""
        n = len(compute)
        last_use = list(range(n))
        for src, dst in edges:
            last_use[src] = max(last_use[src], dst)
        alive = np.zeros(n + 1)
        for layer in range(n):  # output of u crosses boundaries u .. last_use[u] - 1
            if last_use[layer] > layer:
                alive[layer] += acts[layer]
                alive[last_use[layer]] -= acts[layer]
        return cls(compute=compute, params=params, acts=acts, cut=np.cumsum(alive)[:n],
                   edges=tuple(sorted({(int(s), int(d)) for s, d in edges})), forward=forward, stash=stash)

    @property
    def forwards(self) -> np.ndarray:
        """Per-layer forward seconds (zeros where the costs carry none)."""
        return np.zeros(self.n) if self.forward is None else self.forward

    @property
    def stashes(self) -> np.ndarray:
        """Per-layer bytes a minibatch in flight keeps for the backward (`acts` where not measured)."""
        return self.acts if self.stash is None else self.stash

    @property
    def n(self) -> int:
        return len(self.compute)



class CostModel:
    """Stage times for the dynamic program; subclasses are the pluggable models.

    `stage_times` returns, for every pair of states (k, j) (a matrix; +inf where `unit` is,
    as where D_k is not a strict subset of D_j), the time per minibatch of the stage
    `D_j \\ D_k` with `r` replicas at a level of bandwidth `bandwidth` whose units hold `inner`
    workers each. `cut` holds the bytes crossing each state's cut, `unit` is the stage's time on
    one unit, `params` its parameter bytes. `first` says the stage starts its sub-problem (no stage before it), `charge_out` whether its
    output is paid (a later stage follows it, or the original's rule; a vector over j).
    """

    name = "abstract"
    exact_workers = False  # True: a level must use all its units (the original's rule)

    def __init__(self, sync_scale: float = 1.0):
        self.sync = sync_scale  # the replicas' synchronisation as a multiple of one all-reduce (`SYNC_SCALE`)

    def stage_times(self, cut: np.ndarray, unit: np.ndarray, params: np.ndarray, r: int, bandwidth: float,
                    inner: int, first: bool, charge_out: bool | np.ndarray) -> np.ndarray:
        raise NotImplementedError

    def data_parallel(self, costs: ChainCosts, counts: list[int], bandwidths: list[float]) -> float:
        """Time per minibatch of plain data parallelism over every worker of the cluster."""
        raise NotImplementedError

    def terms(self, unit: float, params: float, cut_in: float, cut_out: float, r: int, bandwidth: float,
              inner: int, first: bool, charge_out: bool) -> dict[str, float]:
        """One stage's time split into `compute`, `allreduce` and `transfer` (seconds per
        minibatch, each already divided by the replicas) and their combination `time`,
        which equals `stage_times` for the same stage."""
        raise NotImplementedError

    def stage_bound(self, r: int, bandwidth: float, inner: int) -> tuple[float, float, bool]:
        """(alpha, beta, additive): a later (not first) stage of r units of `inner` workers
        takes at least `alpha * compute + beta * params` when `additive`, else at least
        `max(alpha * compute, beta * params)` (compute in worker-seconds, params in bytes).
        The planner prunes with it, so it must never exceed `stage_times`."""
        raise NotImplementedError

    def final_charge(self, count: int) -> bool | np.ndarray:
        """Whether the last stage of a sub-problem ending at state j (of `count`) pays its output."""
        return False


class DefaultModel(CostModel):
    """pdtool's model: max(compute / r, all-reduce / r, transfers / r); see the module doc."""

    name = "pdtool"

    def stage_times(self, cut, unit, params, r, bandwidth, inner, first, charge_out):
        allreduce = self.sync * 2.0 * (r - 1) / r * params / bandwidth
        cut_in = 0.0 if first else cut[:, None]
        cut_out = np.where(charge_out, cut[None, :], 0.0)
        transfer = (cut_in + cut_out) / bandwidth
        return np.maximum(np.maximum(unit, allreduce), transfer) / r

    def stage_bound(self, r, bandwidth, inner):
        # a unit of `inner` workers needs at least compute / inner for any pipeline of a range
        return 1.0 / (r * inner), self.sync * 2.0 * (r - 1) / (r * r * bandwidth), False

    def terms(self, unit, params, cut_in, cut_out, r, bandwidth, inner, first, charge_out):
        parts = {
            "compute": unit / r,
            "allreduce": self.sync * 2.0 * (r - 1) / r * params / bandwidth / r,
            "transfer": ((0.0 if first else cut_in) + (cut_out if charge_out else 0.0)) / bandwidth / r,
        }
        return {**parts, "time": max(parts.values())}

    def data_parallel(self, costs, counts, bandwidths):
        time = float(costs.compute.sum())
        total = float(costs.params.sum())
        for count, bandwidth in zip(counts, bandwidths):
            time = max(time, self.sync * 2.0 * (count - 1) / count * total / bandwidth) / count
        return time


class PipeDreamModel(CostModel):
    """The original optimizer's formulas (reference, section 2), quirks included."""

    name = "pipedream"
    exact_workers = True

    def __init__(self, activation_compression_ratio: float | None = 1.0, sync_scale: float = 1.0):
        super().__init__(sync_scale)
        self.ratio = activation_compression_ratio

    def stage_times(self, cut, unit, params, r, bandwidth, inner, first, charge_out):
        if first:  # the base case: one replicated stage, sync divided by the inner workers
            return (unit + self.sync * 4.0 * (r - 1) * params / (bandwidth * r) / inner) / r
        time = (unit + self.sync * 4.0 * (r - 1) * params / (bandwidth * r)) / r
        if self.ratio is None:
            return time
        transfer_in = 2.0 * cut[:, None] / (bandwidth * r) / self.ratio
        transfer_out = np.where(charge_out, 2.0 * cut[None, :] / (bandwidth * r) / self.ratio, 0.0)
        return np.maximum(time, np.maximum(transfer_in, transfer_out))

    def stage_bound(self, r, bandwidth, inner):
        return 1.0 / (r * inner), self.sync * 4.0 * (r - 1) / (bandwidth * r * r), True

    def final_charge(self, count):
        return np.arange(count) != count - 1  # the original charges every output but the model's (all layers)

    def terms(self, unit, params, cut_in, cut_out, r, bandwidth, inner, first, charge_out):
        sync = self.sync * 4.0 * (r - 1) * params / (bandwidth * r) / (inner if first else 1) / r
        transfer = 0.0
        if not first and self.ratio is not None:
            transfer = 2.0 * max(cut_in, cut_out if charge_out else 0.0) / (bandwidth * r) / self.ratio
        return {"compute": unit / r, "allreduce": sync, "transfer": transfer,
                "time": max(unit / r + sync, transfer)}

    def data_parallel(self, costs, counts, bandwidths):
        time = float(costs.compute.sum())
        total = float(costs.params.sum())
        inner = 1
        for count, bandwidth in zip(counts, bandwidths):
            time = (time + self.sync * 4.0 * (count - 1) * total / (bandwidth * count) / inner) / count
            inner *= count
        return time


MODELS = {"pdtool": DefaultModel, "pipedream": PipeDreamModel}  # by the names of `artifacts.plan.COST_MODELS`


