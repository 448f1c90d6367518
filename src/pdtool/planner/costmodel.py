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
from typing import TYPE_CHECKING

import numpy as np

from ..artifacts.profile import Profile
from ..schedule.modes import DEFAULT, GROUP, rules

if TYPE_CHECKING:
    from ..artifacts.plan import Plan
    from ..simulate import SimResult


SECONDS_PER_MS = 1e-3  # profiles are in ms, the planner works in seconds


@dataclass(frozen=True)
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
        return cls.from_layers(np.array([l.total_ms * SECONDS_PER_MS for l in profile.layers], dtype=float),
                               np.array([l.param_bytes for l in profile.layers], dtype=float),
                               np.array([l.act_bytes for l in profile.layers], dtype=float), profile.edges,
                               forward=np.array([l.fwd_ms * SECONDS_PER_MS for l in profile.layers], dtype=float),
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



OPTIMIZER_SLOTS = {"sgd": 1, "adam": 2, "adamw": 2}  # buffers per parameter: SGD's momentum; Adam's two moments
COMPUTE_COPY = {"fp32": 0.0, "bf16": 0.5, "fp16": 0.5}  # bytes of autocast's weight copy per fp32 weight byte


def step_temporaries(optimizer_slots: int, weight_decay: bool = False, decoupled: bool = True) -> float:
    """What an optimizer step allocates while it runs, in units of the largest layer's parameters
    (torch's optimizers on CPU update one parameter at a time): Adam and AdamW make two tensors of
    a parameter's size (the square root of its second moment, then that divided), SGD none (its
    momentum is updated in place); weight decay added to the gradient (SGD's, Adam's) one more.
    Measured with torch 2.13 on a 4096x4096 layer: AdamW 2.0, SGD with momentum 0.0. On GPUs
    torch's foreach kernels make the same temporaries for a whole parameter group at once
    (not modelled)."""
    return (2.0 if optimizer_slots >= 2 else 0.0) + (1.0 if weight_decay and not (optimizer_slots >= 2 and decoupled)
                                                     else 0.0)


def memory_model(limit: float | None, optimizer_slots: int, precision: str, mode: str | None = None,
                 weight_decay: bool = False, decoupled: bool = True, rings: bool = True) -> "Memory":
    """The memory model of a run: `limit` bytes per worker (None: no limit), the optimizer's state
    and step temporaries, autocast's weight copies in `precision`, and what `mode` keeps (its
    weight versions; whether a worker accumulates gradients over a group); `rings`: whether
    messages travel through shared-memory rings (copied out of them) or, False, over a process
    group (a received activation is the stashed input itself)."""
    rows = rules(mode or DEFAULT)
    return Memory(float("inf") if limit is None else float(limit), optimizer_slots, COMPUTE_COPY[precision],
                  rows.versions_kept, step_temporaries(optimizer_slots, weight_decay, decoupled),
                  accumulates=rows.steps == GROUP, rings=rings)


@dataclass(frozen=True)
class Memory:
    """The per-worker memory model: limit in bytes and optimizer buffers per parameter."""

    limit: float
    optimizer_slots: int = 1  # SGD with momentum; Adam keeps 2
    copies: float = 0.0       # mixed precision: autocast's half-size weight copy, saved by every minibatch in flight
    versions_kept: int | None = None  # the mode's most weight versions (`schedule.modes.Mode.versions_kept`; None:
    # one per minibatch in flight, PipeDream's stashing): flush, gpipe and zb keep one, 2bw two
    step_temporaries: float = 0.0  # the optimizer step's temporaries, x the largest layer's parameters
    accumulates: bool = False      # the mode adds several backwards' gradients before a step (GROUP modes)
    rings: bool = True             # messages are copied out of shared-memory rings (False: a process group's)

    @staticmethod
    def in_flight(workers: int, before: int, replicas: int) -> int:
        """Minibatches a replica holds at once under 1F1B-RR (docs/schedules.md)."""
        return (workers - 1 - before) // replicas + 1

    def need(self, params: np.ndarray | float, stashed: np.ndarray | float, in_flight: int, versions: int | None = None,
             recompute: np.ndarray | float | None = None, cut: tuple | None = None, largest: np.ndarray | float = 0.0):
        """Bytes one worker needs: weight versions (under 1F1B as many as minibatches in flight),
        gradient and optimizer state, stashed activations, messages and temporaries (the sum of `terms`)."""
        return sum(self.terms(params, stashed, in_flight, versions, recompute, cut, largest).values())

    def terms(self, params, stashed, in_flight: int, versions: int | None = None, recompute=None,
              cut: tuple | None = None, largest=0.0) -> dict:
        """`need` by term: `weights` (its fp32 versions: the master weights), `gradients`,
        `optimizer` (its state), `activations` (what the minibatches in flight stash), `messages`
        (see below) and, in mixed precision, `compute copies` (the bf16/fp16 weights autocast
        makes in each forward, which its backward keeps).

        `recompute` (the stage's input bytes) says the stage recomputes its forward during the
        backward (`pd plan --recompute`): each minibatch in flight then stashes only its input,
        and the one whose backward runs holds its whole set again (and its compute copy) while it does.

        `cut` = (in_bytes, out_bytes), what a minibatch's message brings the stage and what it
        sends on: the runtime's message buffers (`runtime.worker.comm`). Each direction of a link
        keeps as many messages as the deeper of its two workers holds in flight (`Lowered.windows`),
        in a ring both workers map or, over a process group, in unconfirmed sends and posted
        receives: activations and gradients both ways, `2 * ((k + 1) * in_bytes + k * out_bytes)`
        (the stage before holds one minibatch more under 1F1B; exact for a straight pipeline). A
        recomputing stage also holds the outputs of its sends in flight, which its stash no longer
        shares: `k * out_bytes` more. Over a process group (`rings` False) a received activation is
        the stage's input itself, which the stash counts: `k * in_bytes` less.

        `temporaries`: what autograd and the optimizer allocate for a moment, in units of `largest`
        (the stage's largest layer's parameter bytes, an upper bound of its largest tensor): a
        backward into gradients that already hold earlier minibatches' makes each gradient anew and
        adds it (one, where the mode `accumulates`), and the optimizer step its `step_temporaries`;
        the larger of the two, as they never run at once."""
        if versions is None:
            versions = in_flight if self.versions_kept is None else np.minimum(in_flight, self.versions_kept)
        held = in_flight if recompute is None else 1
        activations = in_flight * stashed if recompute is None else (in_flight - 1) * recompute + stashed
        terms = {"weights": params * versions, "gradients": params, "optimizer": params * self.optimizer_slots,
                 "activations": activations}
        if cut is not None:
            received, sent = cut
            terms["messages"] = 2 * ((in_flight + 1) * received + in_flight * sent) + \
                (0 if recompute is None else in_flight * sent) - (0 if self.rings else in_flight * received)
        if self.copies:
            terms["compute copies"] = params * self.copies * held
        factor = max(self.step_temporaries, 1.0 if self.accumulates else 0.0)
        if factor:
            terms["temporaries"] = largest * factor
        return terms

    def per_worker(self, plan: "Plan", result: "SimResult") -> dict[int, int]:
        """Bytes each worker (plan rank) needs for the schedule a simulation ran: its peak weight
        versions and minibatches in flight, as that mode and group hold them (the planner's own
        counts are 1F1B's)."""
        return {rank: int(sum(self.stage_terms(stage, result.peak_in_flight[rank], result.peak_versions[rank]).values()))
                for stage in plan.stages for rank in stage.ranks}

    def stage_terms(self, stage, in_flight: int, versions: int) -> dict:
        """`terms` of a worker of plan stage `stage` (recomputing as the plan says)."""
        return self.terms(stage.param_bytes, stage.activation_bytes, in_flight, versions,
                          stage.in_bytes if stage.recompute else None, (stage.in_bytes, stage.out_bytes),
                          stage.largest_layer_bytes)


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
        allreduce = 2.0 * (r - 1) / r * params / bandwidth
        cut_in = 0.0 if first else cut[:, None]
        cut_out = np.where(charge_out, cut[None, :], 0.0)
        transfer = (cut_in + cut_out) / bandwidth
        return np.maximum(np.maximum(unit, allreduce), transfer) / r

    def stage_bound(self, r, bandwidth, inner):
        # a unit of `inner` workers needs at least compute / inner for any pipeline of a range
        return 1.0 / (r * inner), 2.0 * (r - 1) / (r * r * bandwidth), False

    def terms(self, unit, params, cut_in, cut_out, r, bandwidth, inner, first, charge_out):
        parts = {
            "compute": unit / r,
            "allreduce": 2.0 * (r - 1) / r * params / bandwidth / r,
            "transfer": ((0.0 if first else cut_in) + (cut_out if charge_out else 0.0)) / bandwidth / r,
        }
        return {**parts, "time": max(parts.values())}

    def data_parallel(self, costs, counts, bandwidths):
        time = float(costs.compute.sum())
        total = float(costs.params.sum())
        for count, bandwidth in zip(counts, bandwidths):
            time = max(time, 2.0 * (count - 1) / count * total / bandwidth) / count
        return time


class PipeDreamModel(CostModel):
    """The original optimizer's formulas (reference, section 2), quirks included."""

    name = "pipedream"
    exact_workers = True

    def __init__(self, activation_compression_ratio: float | None = 1.0):
        self.ratio = activation_compression_ratio

    def stage_times(self, cut, unit, params, r, bandwidth, inner, first, charge_out):
        if first:  # the base case: one replicated stage, sync divided by the inner workers
            return (unit + 4.0 * (r - 1) * params / (bandwidth * r) / inner) / r
        time = (unit + 4.0 * (r - 1) * params / (bandwidth * r)) / r
        if self.ratio is None:
            return time
        transfer_in = 2.0 * cut[:, None] / (bandwidth * r) / self.ratio
        transfer_out = np.where(charge_out, 2.0 * cut[None, :] / (bandwidth * r) / self.ratio, 0.0)
        return np.maximum(time, np.maximum(transfer_in, transfer_out))

    def stage_bound(self, r, bandwidth, inner):
        return 1.0 / (r * inner), 4.0 * (r - 1) / (bandwidth * r * r), True

    def final_charge(self, count):
        return np.arange(count) != count - 1  # the original charges every output but the model's (all layers)

    def terms(self, unit, params, cut_in, cut_out, r, bandwidth, inner, first, charge_out):
        sync = 4.0 * (r - 1) * params / (bandwidth * r) / (inner if first else 1) / r
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
            time = (time + 4.0 * (count - 1) * total / (bandwidth * count) / inner) / count
            inner *= count
        return time


MODELS = {"pdtool": DefaultModel, "pipedream": PipeDreamModel}  # by the names of `artifacts.plan.COST_MODELS`

