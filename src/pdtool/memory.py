"""The per-worker memory model, which the planner plans with and `pd train` compares its workers
with (`planner.costmodel` describes it with the cost models; `prediction.planned_memory` applies
it to a plan). Below both the planner and the runtime, so that neither imports the other.

Pure: no torch.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from .schedule.chunked import depths
from .schedule.modes import DEFAULT, GROUP, rules

if TYPE_CHECKING:
    from .artifacts.plan import Plan
    from .sim.simulate import SimResult


OPTIMIZER_SLOTS = {"sgd": 1, "adam": 2, "adamw": 2}  # buffers per parameter: SGD's momentum; Adam's two moments
COMPUTE_COPY = {"fp32": 0.0, "bf16": 0.5, "fp16": 0.5}  # bytes of autocast's weight copy per fp32 weight byte
WHOLE_UNITS = ("export", "modules")
"""The profile methods whose stages FSDP gathers whole (`--shard parameters`): torch.export's graphs
read every weight by attribute, and a module that is not a graph may read a child's weight without
calling the child (`runtime.worker.parameter_shard.units`)."""
GRADIENT_BUCKET_BYTES = 4 * 2 ** 20
"""`--shard gradients`: the gradients a bucket reduces at once (`runtime.worker.gradient_shard`;
a larger parameter is a bucket of its own)."""


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
                 weight_decay: bool = False, decoupled: bool = True, rings: bool = True,
                 shard: str = "none", method: str | None = None) -> "Memory":
    """The memory model of a run: `limit` bytes per worker (None: no limit), the optimizer's state
    and step temporaries, autocast's weight copies in `precision`, and what `mode` keeps (its
    weight versions; whether a worker accumulates gradients over a group); `rings`: whether
    messages travel through shared-memory rings (copied out of them) or, False, over a process
    group (a received activation is the stashed input itself); `shard`: what the planner's
    replicated stages shard (`pd plan --shard optimizer|gradients`; `auto` decides per stage:
    none here); `method`: how the profile captured the model (`WHOLE_UNITS`: sharded parameters
    are gathered a whole stage at a time)."""
    rows = rules(mode or DEFAULT)
    return Memory(limit=float("inf") if limit is None else float(limit), optimizer_slots=optimizer_slots,
                  copies=COMPUTE_COPY[precision], versions_kept=rows.versions_kept,
                  step_temporaries=step_temporaries(optimizer_slots, weight_decay, decoupled),
                  accumulates=rows.steps == GROUP, rings=rings, shard=shard if shard != "auto" else "none",
                  splits=rows.split, whole_units=method in WHOLE_UNITS)


@dataclass(frozen=True, kw_only=True)
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
    shard: str = "none"            # what the planner's replicated stages shard among their replicas (PlanStage.shard)
    splits: bool = False           # the mode splits its backward (B, then W computes the weight gradients at once)
    whole_units: bool = False      # sharded parameters are gathered a whole stage at a time (an exported graph's)

    @staticmethod
    def in_flight(workers: int, before: int, replicas: int) -> int:
        """Minibatches a replica holds at once under 1F1B-RR (docs/schedules.md)."""
        return (workers - 1 - before) // replicas + 1

    def need(self, params: np.ndarray | float, stashed: np.ndarray | float, in_flight: int, versions: int | None = None,
             recompute: np.ndarray | float | None = None, cut: tuple | None = None, largest: np.ndarray | float = 0.0,
             sharing: int = 1, shard: str | None = None, replicas: int = 1):
        """Bytes one worker needs: weight versions (under 1F1B as many as minibatches in flight),
        gradient and optimizer state, stashed activations, messages and temporaries (the sum of `terms`)."""
        return sum(self.terms(params, stashed, in_flight, versions, recompute, cut, largest, sharing, shard,
                              replicas).values())

    def sharing(self, replicas: int) -> int:
        """The replicas that share a stage's state in the planner's plans."""
        return replicas if self.shard != "none" else 1

    def terms(self, params, stashed, in_flight: int, versions: int | None = None, recompute=None,
              cut: tuple | None = None, largest=0.0, sharing: int = 1, shard: str | None = None,
              replicas: int = 1) -> dict:
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
        the larger of the two, as they never run at once.

        `sharing`: the replicas that shard the optimizer state among themselves (`--shard
        optimizer`, `runtime.worker.optimizer_shard`): each keeps 1/sharing of it (the weights are
        gathered in place: nothing more). `shard` (default: the model's `shard`) `gradients`
        (`runtime.worker.gradient_shard`): each also keeps 1/sharing of the gradients, and while a
        backward runs the gradients of the bucket being filled and the bucket's buffer, two
        buckets of `GRADIENT_BUCKET_BYTES` or the largest layer; where the mode `splits` its
        backward, its W makes the stage's gradients at once: the whole gradient and the buffer.
        `parameters` (`runtime.worker.parameter_shard`, FSDP2): each keeps 1/sharing of the weights
        too, and gathers a unit (a layer; `largest` bounds it) at a time for its forward and its
        backward, the next one's gather begun: two units of weights, and two of gradients (a
        unit's, and the buffer it is reduce-scattered from); where the mode `splits` its backward,
        the weights stay gathered from the step's first forward to the step and the gradients
        accumulate whole: a whole stage of each beside the shards. A graph captured by torch.export
        reads every weight by attribute, not through its module (`whole_units`): FSDP gathers the
        stage as one unit, a whole stage of weights and of gradients at a time; so does a stage that
        is not a graph (`WHOLE_UNITS`).

        `replicas`: the stage's replicas. Where there are several and they do not shard their
        gradients, each keeps, beside the gradients it accumulates, the flat buffer it all-reduces
        them in, from one step to the next (`runtime.worker.stepper.Stepper.gradient_buffer`): two
        gradients."""
        if versions is None:
            versions = in_flight if self.versions_kept is None else np.minimum(in_flight, self.versions_kept)
        held = in_flight if recompute is None else 1
        activations = in_flight * stashed if recompute is None else (in_flight - 1) * recompute + stashed
        kind = shard or self.shard
        weights = params * versions
        if kind == "gradients" and sharing > 1:
            bucket = np.minimum(params, np.maximum(GRADIENT_BUCKET_BYTES, largest))
            transient = (params if self.splits else bucket) + bucket  # what waits for its bucket, and the buffer
            gradients = params / sharing + transient
        elif kind == "parameters" and sharing > 1:
            gathered = params if self.splits or self.whole_units else np.minimum(params, 2 * largest)
            weights = params / sharing + gathered
            gradients = params / sharing + (params + np.minimum(params, largest) if self.splits else gathered)
        else:
            gradients = params * (2 if replicas > 1 else 1)
        terms = {"weights": weights, "gradients": gradients,
                 "optimizer": params * self.optimizer_slots / sharing, "activations": activations}
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
        return {rank: int(sum(terms.values())) for rank, terms in self.worker_terms(plan, result).items()}

    def worker_terms(self, plan: "Plan", result: "SimResult") -> dict[int, dict[str, float]]:
        """Per plan rank, `terms` for the schedule a simulation ran. A worker of several stages
        holds all of its chunks', each with the minibatches the mode's order keeps in flight on it
        (`schedule.chunked.depths`)."""
        if plan.profile.method in WHOLE_UNITS and not self.whole_units:
            return dataclasses.replace(self, whole_units=True).worker_terms(plan, result)
        if not plan.placement:
            return {rank: self.stage_terms(stage, result.peak_in_flight[rank], result.peak_versions[rank])
                    for stage in plan.stages for rank in stage.ranks}
        workers = len(plan.used_ranks)
        held = depths(result.mode, workers, len(plan.stages) // workers, result.group)
        found: dict[int, dict[str, float]] = {}
        for s, stage in enumerate(plan.stages):
            rank = stage.ranks[0]
            terms = self.stage_terms(stage, held[s], result.peak_versions[rank])
            mine = found.setdefault(rank, dict.fromkeys(terms, 0))
            for term, value in terms.items():
                mine[term] += value
        return found

    def stage_terms(self, stage, in_flight: int, versions: int) -> dict:
        """`terms` of a worker of plan stage `stage` (recomputing as the plan says)."""
        return self.terms(stage.param_bytes, stage.activation_bytes, in_flight, versions,
                          stage.in_bytes if stage.recompute else None, (stage.in_bytes, stage.out_bytes),
                          stage.largest_layer_bytes, stage.replicas if stage.shard != "none" else 1, stage.shard,
                          stage.replicas)
