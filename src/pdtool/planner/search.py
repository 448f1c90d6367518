"""The joint search of `pd plan --mode auto|A,B,... --virtual-stages N|auto --group N --batch SAMPLES`.

A *family* is one mode at one number of stages (chunks) per worker: a mode of one stage per
worker at 1, interleaved at 2 and 4 (looped placement), zbv and dualpipev at 2 (V placement).
Each family is planned alone, as `pd plan --mode M [--virtual-stages V]` would plan it
(`make_plan`, `chunks.make_chunked_plan`: the same memory limit, recomputation and cost model),
and all of them at one group m, the microbatches of one optimizer step, which the plan records
and `pd train` then runs by default:

- m is the one asked for (`--group N`, or `--batch SAMPLES`: SAMPLES over the profile's batch,
  which is the microbatch `pd train` runs);
- else the largest default of the families searched (the stages of the most chunked one that the
  layers can fill: v x p), so that no family runs below its own default and all are compared on
  the same batch.

A mode that steps per round of its replicas (pipedream, vsync) has no group: it is planned at its
own steady state. The families are ranked by their predicted time per microbatch (the steady
state of one period of their schedule, `sim.steady`); the fastest is the plan, ties going to the
family listed first (fewer chunks). What the search can miss: within a family the candidates
are those `make_plan` compares (its best plan per number of workers, straight pipelines, data
parallelism) and a multi-chunk family is the dynamic program's best straight cut into v x p
stages, placed; a cut that is worse by the cost model but better scheduled is not tried.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Sequence

from ..artifacts.cluster import Cluster
from ..artifacts.plan import Plan
from ..artifacts.profile import Profile
from ..errors import PlanError
from ..schedule.modes import AUTO_CHUNKS, listed, rules


@dataclass(frozen=True)
class Family:
    """One mode at `chunks` stages per worker."""

    mode: str
    chunks: int

    @property
    def label(self) -> str:
        return self.mode if self.chunks == 1 else f"{self.mode} v={self.chunks}"


@dataclass(frozen=True)
class Outcome:
    """A family's best plan, or why it has none (one line)."""

    family: Family
    plan: Plan | None = None
    reason: str | None = None


def families(modes: Sequence[str], virtual: int | None) -> list[Family]:
    """The families of `modes` at `virtual` chunks per worker (None: `AUTO_CHUNKS` where each mode's
    placement allows them: 1 for a mode of one stage per worker, 2 in a V, 2 and more looped)."""
    found = []
    for mode in modes:
        shape = rules(mode).placement
        counts = (1,) if shape is None else (2,) if shape == "v" else tuple(c for c in AUTO_CHUNKS if c > 1)
        if virtual is not None:
            counts = (virtual,) if virtual in counts or (shape == "looped" and virtual > 1) else ()
        found += [Family(mode, c) for c in counts]
    if not found:
        raise PlanError(f"--virtual-stages {virtual}: none of the modes {listed(tuple(modes))} runs {virtual} "
                        f"stage{'s' if virtual != 1 else ''} on a worker; use --virtual-stages auto, or other modes")
    return found


def common_group(found: Sequence[Family], workers: int, layers: int) -> int:
    """The group every family is compared at when none is asked: the largest default (v x p stages)
    of the families whose stages the layers can fill."""
    fill = [f.chunks * workers for f in found if f.chunks == 1 or f.chunks * workers <= layers]
    return max(fill) if fill else max(f.chunks * workers for f in found)  # none fits: each says why


def search(profile: Profile, cluster: Cluster, *, modes: Sequence[str], virtual: int | None, group: int | None,
           straight: bool = False, say=lambda message: None, **options) -> tuple[Plan, list[Outcome]]:
    """The fastest family's plan, and every family's outcome in the order searched (`straight`: no
    replicated stages in the families of one stage per worker). `options` as `make_plan` takes them.
    No family with a plan is a PlanError naming each family's reason."""
    from .chunks import make_chunked_plan
    from .make import make_plan

    found = families(modes, virtual)
    m = group if group is not None else common_group(found, cluster.workers, len(profile.layers))
    notes: dict[str, None] = {}
    outcomes = []
    for family in found:
        row = rules(family.mode)
        at = None if row.per_round else m
        try:
            if family.chunks == 1:
                plan = make_plan(profile, cluster, mode=family.mode, group=at, quick=True, straight=straight,
                                 say=notes.setdefault, **options)
            else:
                plan = make_chunked_plan(profile, cluster, chunks=family.chunks, mode=family.mode, group=at,
                                         quick=True, say=notes.setdefault, **options)
        except PlanError as error:
            outcomes.append(Outcome(family, reason=str(error)))
        else:
            outcomes.append(Outcome(family, plan=plan))
    for note in notes:
        say(note)
    planned = [o for o in outcomes if o.plan is not None]
    if not planned:
        raise PlanError("no mode plans this model on this cluster: "
                        + "; ".join(f"{o.family.label}: {o.reason}" for o in outcomes[:3])
                        + (f" (and {len(outcomes) - 3} more)" if len(outcomes) > 3 else ""))
    best = min(planned, key=lambda o: o.plan.predicted.expected_ms)
    plan = best.plan
    why = (f"the fastest of {len(planned)} schedule families at {m} microbatches per step ({best.family.label}; "
           f"next: {_runner_up(planned, best)}), each planned alone: {plan.predicted.why}")
    return _explained(plan, why, sum(o.plan.predicted.candidates for o in planned)), outcomes


def _runner_up(planned: list[Outcome], best: Outcome) -> str:
    others = sorted((o for o in planned if o is not best), key=lambda o: o.plan.predicted.expected_ms)
    if not others:
        return "none"
    return f"{others[0].family.label}, {others[0].plan.predicted.expected_ms:.3f} ms per minibatch"


def _explained(plan: Plan, why: str, candidates: int) -> Plan:
    return dataclasses.replace(plan, predicted=dataclasses.replace(plan.predicted, why=why, candidates=candidates))


def table(outcomes: Sequence[Outcome], pick: Plan) -> list[str]:
    """What `pd plan` prints after a joint search: every family's best plan beside the pick."""
    lines = [f"{'family':<18} {'stages':>6} {'group':>5} {'ms/minibatch':>12}  against the pick"]
    for outcome in outcomes:
        label = outcome.family.label
        if outcome.plan is None:
            lines.append(f"{label:<18} {'-':>6} {'-':>5} {'-':>12}  no plan: {outcome.reason}")
            continue
        plan = outcome.plan
        ms = plan.predicted.expected_ms
        group = "-" if rules(plan.mode).per_round else str(plan.run().group)
        verdict = ("the pick" if outcome.plan is pick or _same(plan, pick)
                   else f"{ms / pick.predicted.expected_ms:.2f}x the pick's time")
        lines.append(f"{label:<18} {len(plan.stages):>6} {group:>5} {ms:>12.3f}  {verdict}")
    return lines


def _same(plan: Plan, pick: Plan) -> bool:
    return plan.mode == pick.mode and plan.stages == pick.stages
