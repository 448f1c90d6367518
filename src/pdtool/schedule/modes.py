"""The mode table: every schedule mode's rules in one row, and `resolve`, a run's settings.

A mode is a `Mode` record; `TABLE` holds one per mode and its keys are the list of modes
(`MODES`), in the order the CLI and the schema offer them. Everything that depends on a mode
(the generator's order, the version rule, the validator, the simulator's steady state, the
runtime's learning rate, the planner's default for tied weights, every message that lists
modes) reads these fields, never a mode's name: a new mode is a row here, plus, where its
order of forwards and backwards is truly new, a branch in `generator`.

`resolve` turns plain values (the mode asked for, the plan's mode, the stages' replicas, the
group asked for) into a `Run`: the effective mode, its microbatches per step and the
minibatches one step of the input stage covers; the planner, the simulator, the launcher and
the workers all call it. Pure standard library.

    >>> resolve(None, "flush", (1, 1, 1)).group, resolve("pipedream", "flush", (2, 1)).per_step
    (3, 2)
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

from ..errors import ScheduleError

# how often a stage steps
ROUND = "round"  # once per round of its replicas (r_s minibatches), no gradient accumulation
GROUP = "group"  # once per group of m microbatches, every stage alike
# the order of a worker's forwards and backwards between two drains
ONE_F_ONE_B = "1f1b"        # warm-up forwards, then one forward and one backward, then the rest
ALL_FORWARD = "all-forward"  # every forward of the batch, then every backward (GPipe)
# which weight version a forward uses (`Schedule.versions` says each in full)
NEWEST = "newest"      # the live weights when it runs
VERTICAL = "vertical"  # one staleness at every stage, fixed when the minibatch enters stage 0
ENTRY = "entry"        # every microbatch of a batch on stage 0's live version when the batch entered


@dataclass(frozen=True, kw_only=True)
class Mode:
    """One mode's rules.

    `steps`: ROUND or GROUP. `order`: ONE_F_ONE_B or ALL_FORWARD. `flushes`: the pipeline drains
    before every step (gradient accumulation over the group). `split`: every backward is B (input
    gradients) then W (weight gradients). `warmup`: factor on 1F1B's warm-up forwards
    (`core.warmup_forwards`). `lag`: a worker of stage s runs `lag * s` backwards before its first
    W (split modes). `version`: NEWEST, VERTICAL or ENTRY. `ties`: it trains tied weights (every
    sharing stage steps after the same minibatches). `group_floor`: the group must be at least
    `core.default_group` (two versions suffice only then). `versions_kept`: the most weight
    versions a worker may hold at once (None: as many as it has minibatches in flight).
    `placement`: None (one stage per worker), or the shape of a plan with several stages (chunks)
    per worker that the mode runs (`placement.LOOPED`, `placement.V`), its order in `chunked`.
    `group_multiple`: the group must be a multiple of the workers (Megatron's interleaving).
    `group_stages`: the group must be at least the stages (DualPipeV). `some_whole`: in a split
    mode, some backwards stay whole (no W follows them; DualPipeV's).
    """

    name: str
    about: str
    steps: str
    order: str = ONE_F_ONE_B
    flushes: bool = False
    split: bool = False
    warmup: int = 1
    lag: int = 0
    version: str = NEWEST
    ties: bool = False
    group_floor: bool = False
    versions_kept: int | None = None
    placement: str | None = None
    group_multiple: bool = False
    group_stages: bool = False
    some_whole: bool = False

    @property
    def per_round(self) -> bool:
        """A stage steps once per round of its replicas: no group, and (as in the original
        PipeDream) a replicated stage's learning rate is scaled by r_s / r_0 (`lr_scale`)."""
        return self.steps == ROUND

    def lr_scale(self, replicas: Sequence[int], stage: int) -> float:
        """The learning-rate factor of `stage`: r_s / r_0 when stages step per round, else 1."""
        return replicas[stage] / replicas[0] if self.per_round else 1.0


_ROWS = (
    Mode(name="pipedream", about="1F1B with weight stashing (PipeDream SOSP'19 sections 3.2-3.3)", steps=ROUND),
    Mode(name="vsync", about="1F1B, one staleness for all stages (vertical sync, SOSP'19 section 3.3)", steps=ROUND,
         version=VERTICAL),
    Mode(name="2bw",
         about="1F1B, double-buffered weights, a step every m microbatches (arXiv 2006.09503 section 3.1)",
         steps=GROUP, version=ENTRY, ties=True, group_floor=True, versions_kept=2),
    Mode(name="flush",
         about="1F1B per batch of m, then a flush and a step (PipeDream-Flush, arXiv 2006.09503 section 3.2)",
         steps=GROUP, flushes=True, ties=True, versions_kept=1),
    Mode(name="gpipe", about="all forwards, all backwards, a step, per batch of m (GPipe)", steps=GROUP,
         order=ALL_FORWARD, flushes=True, ties=True, versions_kept=1),
    Mode(
        name="zb",
        about="flush with every backward split in two, the weight gradients filling the drain (ZB-H1, Qi et al. "
        "2023)",
        steps=GROUP,
        flushes=True,
        split=True,
        lag=1,
        ties=True,
        versions_kept=1,
    ),
    Mode(name="zb2",
         about="zb with twice the warm-up forwards and weight lag, filling the start of a batch too (ZB-H2)",
         steps=GROUP, flushes=True, split=True, warmup=2, lag=2, ties=True, versions_kept=1),
    Mode(name="interleaved",
         about="1F1B over v chunks per worker, stage s on worker s mod p, a flush and a step per batch of m "
         "(Megatron-LM's interleaved schedule, Narayanan et al. SC'21 section 2.2)",
         steps=GROUP, flushes=True, ties=True, versions_kept=1, placement="looped", group_multiple=True),
    Mode(name="zbv",
         about="two chunks per worker in a V (worker r holds stages r and 2p-1-r), every backward split in two, "
         "the weight gradients filling the bubbles, a flush and a step per batch of m (ZB-V, Qi et al. ICLR'24 "
         "section 6)",
         steps=GROUP, flushes=True, split=True, ties=True, versions_kept=1, placement="v"),
    Mode(name="dualpipev",
         about="two chunks per worker in a V, a forward of one chunk beside the backward of the other (overlapped "
         "on GPUs, one after the other on a CPU worker), some backwards split to fill the drain, a flush and a step "
         "per batch of m >= the stages (DualPipeV, after DeepSeek-V3's DualPipe)",
         steps=GROUP, flushes=True, split=True, some_whole=True, ties=True, versions_kept=1, placement="v",
         group_stages=True),
)
TABLE: dict[str, Mode] = {mode.name: mode for mode in _ROWS}


def _offered(row: Mode) -> bool:
    """Whether `pd train --mode` offers the mode (and messages list it): the multi-chunk rows (a
    `placement`) are planned with `pd plan --virtual-stages`, and `pd train` runs the mode its plan
    names (another plan's mode cannot run on their placement)."""
    return row.placement is None


MODES = tuple(m.name for m in _ROWS if _offered(m))
DEFAULT = "pipedream"     # what `pd plan` writes without --mode
DEFAULT_TIED = "2bw"      # ... when stages share a parameter: the 1F1B mode that trains tied weights
DEFAULT_CHUNKED = "interleaved"  # ... with --virtual-stages: several stages a worker, looped


def rules(mode: str) -> Mode:
    """The row of `mode`; an unknown name is a ScheduleError that lists the modes."""
    row = TABLE.get(mode) if isinstance(mode, str) else None
    if row is None:
        raise ScheduleError(f"unknown schedule mode {mode!r}; use one of {', '.join(MODES)}")
    return row


def chunked_modes() -> tuple[str, ...]:
    """The modes of several stages a worker (a `placement`), in table order."""
    return tuple(m.name for m in TABLE.values() if m.placement is not None)


AUTO_CHUNKS = (1, 2, 4)
"""`pd plan --virtual-stages auto`: the chunks per worker tried, where a mode's placement allows them."""


def synchronous_modes() -> tuple[str, ...]:
    """`pd plan --mode auto`: every mode that steps once per group after a flush (the weights of one
    process accumulating the group), in table order."""
    return tuple(m.name for m in TABLE.values() if m.steps == GROUP and m.flushes)


def modes_where(**fields) -> tuple[str, ...]:
    """The offered modes (as `MODES`) whose rows have the given field values, in table order:
    `modes_where(ties=True)`."""
    return tuple(m.name for m in TABLE.values()
                 if _offered(m) and all(getattr(m, k) == v for k, v in fields.items()))


def listed(names: Sequence[str]) -> str:
    """'a, b or c': how messages list modes."""
    return names[0] if len(names) == 1 else f"{', '.join(names[:-1])} or {names[-1]}"


def ties_refusal(mode: str) -> str | None:
    """Why `mode` cannot train tied weights (a parameter used by several stages), as the end of
    a one-line message, or None when it can."""
    if rules(mode).ties:
        return None
    return (f"mode {mode!r} would update its copies after different minibatches; use --mode "
            f"{listed(modes_where(ties=True))} (they add the copies' gradients before every step), or plan fewer "
            "stages")


@dataclass(frozen=True)
class Run:
    """A run's effective settings: `mode` (its row), `group` (microbatches per step: 1 when
    stages step per round) and `per_step` (minibatches one step of the input stage covers)."""

    mode: Mode
    group: int
    per_step: int

    @property
    def name(self) -> str:
        return self.mode.name


def resolve(mode: str | None, plan_mode: str, replicas: Sequence[int], group: int | None = None) -> Run:
    """The run of `mode` (None: `plan_mode`) on stages with `replicas`: `group` (None: the
    mode's default, `core.default_group` when it steps per group) and the minibatches per step
    of stage 0. Checks only the mode's name; the schedule's own checks judge the group."""
    row = rules(mode or plan_mode)
    if row.per_round:
        chosen = 1 if group is None else group
        return Run(row, chosen, replicas[0] if _sane(replicas) else 1)
    chosen = default_group(replicas) if group is None and _sane(replicas) else group if group is not None else 1
    return Run(row, chosen, chosen)


def warmup_forwards(replicas: Sequence[int], stage: int, mode: str | None = None) -> int:
    """Forwards a replica of `stage` runs before its first backward under 1F1B.

    floor((W - 1 - sum(r_i for i < s)) / r_s) with W workers in all: 3, 2, 1, 0 on a straight
    4-stage pipeline, 1, 0 on replicas (3, 1). This keeps NOAM = ceil(W / r_0) minibatches in
    the pipeline (PipeDream SOSP'19 section 3.2). A replica with fewer minibatches runs them all.
    Times the mode's `warmup` factor: `zb2` (ZB-H2, Qi et al. 2023 section 2.2) runs twice as
    many, the extra forwards filling the start of a batch, where a stage would wait for its first
    input gradient.
    """
    base = (sum(replicas) - 1 - sum(replicas[:stage])) // replicas[stage]
    return base * (rules(mode).warmup if mode is not None else 1)


def copies_per_step(mode: str, replicas: Sequence[int], stage: int) -> float:
    """How many copies of its weights a worker of `stage` makes per step, in the long run
    (weight stashing keeps a version some action uses after the step that replaces it; exactly:
    `core.stash_copies` of a schedule). The flushing modes never copy. NEWEST (pipedream): every
    step of a stage that holds minibatches across it (1F1B's warm-up forwards), none on the last.
    VERTICAL (vsync): one copy per version stage 0 makes, r_s / r_0 of a stage's steps (at most
    all). ENTRY (2bw): every step, on every stage (a batch runs on the version it entered with).
    None on a single stage (data parallelism: every minibatch's backward comes before the step)."""
    rule = rules(mode)
    if rule.flushes or len(replicas) == 1:
        return 0.0
    if rule.version == VERTICAL:
        return min(1.0, replicas[stage] / replicas[0])
    if rule.version == ENTRY:
        return 1.0
    return 1.0 if warmup_forwards(replicas, stage) > 0 else 0.0


def weight_lag(replicas: Sequence[int], stage: int, mode: str) -> int:
    """How many backwards a worker of `stage` runs before its first W in a mode that splits
    them (then one W after each B, and the rest at the end): the mode's `lag` times the stage's
    index. zb (ZB-H1, Qi et al. 2023 section 2.1; torch.distributed.pipelining's
    ScheduleInterleavedZeroBubble with one stage per rank): every stage holds as many minibatches
    as 1F1B's first stage; the later stages, which wait least for gradients, keep their Ws back
    to fill the drain, when the earlier stages wait for them. zb2 (ZB-H2, section 2.2): twice
    that, with twice the warm-up forwards every stage holds 2p - 1 minibatches on p stages."""
    return rules(mode).lag * stage


def default_group(replicas: Sequence[int]) -> int:
    """The smallest microbatches-per-step (m) that a mode with `group_floor` (2bw) accepts, and
    the default m of every mode that steps per group.

    max(d, max_s warmup_s * r_s): at least the d stages (arXiv 2006.09503 section 3.1, m >= d), and
    at least the span of minibatches one worker of a replicated stage has in flight
    (warmup_s * r_s); below that, some batch would need a version a stage has not made yet, or a
    worker would hold three. Equals d on a straight pipeline.
    """
    spans = (warmup_forwards(replicas, s) * r for s, r in enumerate(replicas))
    return max(len(replicas), *spans)


def checkpoint_unit(mode: str, replicas: Sequence[int], per_step: int) -> int:
    """The smallest number of steps of stage 0 between two checkpoints that fall between two
    steps of every stage: 1 where every stage steps per group, else what makes the minibatches a
    multiple of every r_s (per-round modes step a stage of r_s replicas every r_s minibatches)."""
    if not rules(mode).per_round:
        return 1
    rounds = math.lcm(*replicas)
    return rounds // math.gcd(rounds, per_step)


def _sane(replicas: Sequence[int]) -> bool:
    return (isinstance(replicas, (tuple, list)) and bool(replicas)
            and all(isinstance(r, int) and not isinstance(r, bool) and r >= 1 for r in replicas))
