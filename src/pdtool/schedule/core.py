"""Schedule types, their text form, the per-mode rules and the weight-version analysis.

A `Schedule` lists, for every worker (stage s, replica i), its actions: `F` (forward of one
minibatch), `B` (backward of one minibatch; in `zb` and `zb2`, only its input gradients), `W`
(`zb` and `zb2` only: the weight gradients of a minibatch whose `B` ran) and `U` (optimizer step; on a replicated stage the
replicas all-reduce their gradients first and step together). Sends and receives are implied:
forward of b on stage s > 0 needs forward of b on stage s-1, backward of b on stage s < last
needs backward of b on stage s+1. Minibatch b runs on replica b mod r_s of every stage s, forward
and backward (1F1B-RR, PipeDream SOSP'19 section 3.2).

"Minibatch" means microbatch in the modes that accumulate gradients (2bw, flush, gpipe).
Every stage steps once per *step group* of consecutive minibatches (`step_group`): r_s for
pipedream/vsync (one round of the replicas), `group` = m for 2bw/flush/gpipe. The t-th `U` of a
worker closes step group t: it follows every backward of that group on the worker and precedes
every backward of later groups. "Version v of stage s" is stage s's weights after v optimizer
steps, i.e. holding the updates of minibatches 0 .. min(N, v * g_s) - 1.

Import the public names from `pdtool.schedule`. Pure standard library.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Sequence

from ..errors import ScheduleError
from . import chunked
from .placement import make, shape_of
from .modes import (
    ALL_FORWARD, ENTRY, GROUP, NEWEST, ROUND, VERTICAL, default_group, listed, modes_where, rules, warmup_forwards,
    weight_lag,
)

# the modes sorted by their rules, for tests and docs; code reads the rules themselves (`modes.rules`)
ASYNC_MODES = modes_where(steps=ROUND)  # a step per round of a stage's replicas (the others: per group of m)
FLUSH_MODES = modes_where(flushes=True)  # the pipeline drains before every step: gradient accumulation
SPLIT_MODES = modes_where(split=True)    # every backward is B (input gradients), then W (weight gradients)
TIE_MODES = modes_where(ties=True)       # the copies of a tied weight step after the same minibatches
KINDS = ("F", "B", "W", "U")

_ACTION_RE = re.compile(r"(\d+)([FBW])(\d+)|(\d+)U")
_WORKER_RE = re.compile(r"w(\d+)\s+s([\d,]+)r(\d+):(.*)")
_HEADER_KEYS = ("mode", "replicas", "minibatches", "group")
_OPTIONAL_KEYS = ("placement",)


# ----- actions ---------------------------------------------------------------------------------
@dataclass(frozen=True)
class Action:
    """One step of one worker: `F`/`B` of `minibatch` on `stage`, or `U` (optimizer step, no minibatch)."""

    kind: str
    stage: int
    minibatch: int | None = None

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ScheduleError(f"action kind {self.kind!r} is unknown; use 'F' (forward), 'B' (backward), 'W' "
                                "(weight gradients) or 'U' (step)")
        if not _is_count(self.stage):
            raise ScheduleError(f"action stage {self.stage!r} is not a stage index; use an integer >= 0")
        if self.kind == "U" and self.minibatch is not None:
            raise ScheduleError(f"a 'U' action takes no minibatch (found {self.minibatch!r}); write it as {self.stage}U")
        if self.kind != "U" and not _is_count(self.minibatch):
            raise ScheduleError(
                f"a {self.kind!r} action needs a minibatch index >= 0 (found {self.minibatch!r}); e.g. {self.stage}{self.kind}0")

    def __str__(self) -> str:
        return f"{self.stage}U" if self.kind == "U" else f"{self.stage}{self.kind}{self.minibatch}"

    @classmethod
    def parse(cls, text: str) -> "Action":
        """Read the compact form written by `str`: "0F3", "1B3", "0U"."""
        match = _ACTION_RE.fullmatch(text.strip()) if isinstance(text, str) else None
        if match is None:
            raise ScheduleError(f"bad action {text!r}: expected <stage>F<minibatch>, <stage>B<minibatch>, "
                                f"<stage>W<minibatch> or <stage>U, e.g. 0F3, 1B3, 1W3, 0U")
        if match.group(4) is not None:
            return cls("U", int(match.group(4)))
        return cls(match.group(2), int(match.group(1)), int(match.group(3)))


# ----- the schedule ----------------------------------------------------------------------------
@dataclass(frozen=True, kw_only=True)
class Schedule:
    """Every worker's actions, in order, for a run of `minibatches` minibatches in `mode`.

    `replicas[s]` is the replica count of stage s (stage 0 takes the input). Ranks are
    stage-major: rank = sum(replicas[:s]) + i for replica i of stage s, and `workers[rank]` is
    that worker's action list. `group` is the microbatches per optimizer step for 2bw, flush and
    gpipe (m) and 1 for pipedream and vsync. Construction checks these parameters, not the
    actions: `validate` does that.

    `placement` (modes with a placement rule, `Mode.placement`): the worker of every stage, where
    a worker holds several stages (chunks, `placement.chunks`), each of one replica; ranks are
    then the workers 0 .. p - 1 and `workers[rank]` mixes the actions of its stages.
    """

    mode: str
    replicas: tuple[int, ...]
    minibatches: int
    group: int
    workers: tuple[tuple[Action, ...], ...]
    placement: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        check_parameters(self.mode, self.replicas, self.minibatches, self.group, self.placement)
        object.__setattr__(self, "replicas", tuple(self.replicas))  # lists in, tuples kept: hashable, comparable
        object.__setattr__(self, "placement", tuple(self.placement))
        object.__setattr__(self, "workers", tuple(tuple(actions) for actions in self.workers))
        if len(self.workers) != self.worker_count:
            need = f"placement {self.placement}" if self.placement else f"replicas {self.replicas}"
            raise ScheduleError(f"schedule has {len(self.workers)} workers but {need} need {self.worker_count}; "
                                "give one action list per worker")
        for rank, actions in enumerate(self.workers):
            for action in actions:
                if not isinstance(action, Action):
                    raise ScheduleError(f"{self.label(rank)}: {action!r} is not an Action; build it with Action.parse")

    # ----- ranks ---------------------------------------------------------------------------
    @property
    def stages(self) -> int:
        return len(self.replicas)

    @property
    def worker_count(self) -> int:
        """The workers: one per replica of every stage, or a placement's workers."""
        return max(self.placement) + 1 if self.placement else sum(self.replicas)

    def rank(self, stage: int, replica: int) -> int:
        """Rank of replica `replica` of stage `stage` (stage-major numbering, or the placement's worker)."""
        if not (0 <= stage < self.stages and 0 <= replica < self.replicas[stage]):
            raise ScheduleError(f"no worker s{stage}r{replica} in replicas {self.replicas}; use a stage "
                                f"0..{self.stages - 1} and a replica 0..r_s - 1 of it")
        if self.placement:
            return self.placement[stage]
        return sum(self.replicas[:stage]) + replica

    def stages_of(self, rank: int) -> tuple[int, ...]:
        """The stages that worker `rank` runs, in stage order (one unless the schedule has a placement)."""
        if self.placement:
            if not 0 <= rank < self.worker_count:
                raise ScheduleError(f"rank {rank} is out of range for {self.worker_count} workers; use "
                                    f"0..{self.worker_count - 1}")
            return tuple(s for s, w in enumerate(self.placement) if w == rank)
        return (self.position(rank)[0],)

    def position(self, rank: int) -> tuple[int, int]:
        """(stage, replica) of `rank`; a worker of several stages (a placement) has no one position."""
        if self.placement:
            raise ScheduleError(f"w{rank} runs stages {self.stages_of(rank)}, not one: ask stages_of({rank})")
        if not 0 <= rank < len(self.workers):
            raise ScheduleError(f"rank {rank} is out of range for {len(self.workers)} workers; use 0..{len(self.workers) - 1}")
        for stage, count in enumerate(self.replicas):
            if rank < count:
                return stage, rank
            rank -= count
        raise AssertionError("unreachable")

    def replica_of(self, stage: int, minibatch: int) -> int:
        """The replica of `stage` that runs `minibatch`: round robin, minibatch mod r_s (1F1B-RR)."""
        if not 0 <= stage < self.stages:
            raise ScheduleError(f"stage {stage} is out of range for {self.stages} stages; use 0..{self.stages - 1}")
        return minibatch % self.replicas[stage]

    def label(self, rank: int) -> str:
        """"w<rank> s<stage>r<replica>", how errors and the text form name a worker ("w0 s0,4r0": the
        stages of a worker of several)."""
        if self.placement:
            return f"w{rank} s{','.join(map(str, self.stages_of(rank)))}r0"
        stage, replica = self.position(rank)
        return f"w{rank} s{stage}r{replica}"

    # ----- text ----------------------------------------------------------------------------
    def to_text(self) -> str:
        """A header line, then one line per worker: "w0 s0r0: 0F0 0F1 0B0 0U ..."; `from_text` reads it back."""
        header = (f"schedule mode={self.mode} replicas={','.join(map(str, self.replicas))} "
                  f"minibatches={self.minibatches} group={self.group}")
        if self.placement:
            header += f" placement={','.join(map(str, self.placement))}"
        lines = [header]
        for rank, actions in enumerate(self.workers):
            lines.append(f"{self.label(rank)}: {' '.join(map(str, actions))}".rstrip())
        return "\n".join(lines) + "\n"

    @classmethod
    def from_text(cls, text: str) -> "Schedule":
        """Parse `to_text` output (blank lines and lines starting with '#' are skipped)."""
        lines = [(n, line.strip()) for n, line in enumerate(text.splitlines(), 1)]
        lines = [(n, line) for n, line in lines if line and not line.startswith("#")]
        if not lines:
            raise ScheduleError("schedule text is empty; expected a 'schedule mode=... replicas=... "
                                "minibatches=... group=...' line followed by one line per worker")
        params = _parse_header(*lines[0])
        workers = []
        for n, line in lines[1:]:
            match = _WORKER_RE.fullmatch(line)
            if match is None:
                raise ScheduleError(f"schedule text line {n}: expected 'w<rank> s<stage>r<replica>: <actions>', "
                                    f"found {line!r:.60}")
            rank, stages, replica = int(match.group(1)), match.group(2), int(match.group(3))
            if rank != len(workers):
                raise ScheduleError(f"schedule text line {n}: worker w{rank} out of order; expected w{len(workers)}")
            workers.append((n, f"w{rank} s{stages}r{replica}", tuple(Action.parse(a) for a in match.group(4).split())))
        schedule = cls(**params, workers=tuple(actions for *_, actions in workers))
        for rank, (n, label, _) in enumerate(workers):
            if schedule.label(rank) != label:
                raise ScheduleError(f"schedule text line {n}: w{rank} is {schedule.label(rank)} for replicas "
                                    f"{schedule.replicas}" + (f" and placement {schedule.placement}" if schedule.placement
                                                               else "") + f", not {label.split()[1]}")
        return schedule

    # ----- weight versions -----------------------------------------------------------------
    def versions(self) -> dict[tuple[str, int, int], int]:
        """The weight version of its stage that every ("F"|"B", stage, minibatch) uses.

        The backward of b uses exactly the version its forward used (weight stashing,
        PipeDream SOSP'19 section 3.3). Which version the forward uses is the mode's rule, read
        off the schedule order ("live" = the U actions before it on its worker):
        - pipedream, flush, gpipe: the newest, i.e. the live version when the forward runs.
        - vsync (SOSP'19 section 3.3, vertical sync): let v0 be stage 0's live version when b's
          forward runs there, k = min(N, v0 * g_0) the minibatches whose updates it holds; every
          stage s runs b on its newest version holding no update from a minibatch >= k, which is
          k // g_s. All stages see the same staleness.
        - 2bw (arXiv 2006.09503 section 3.1): the version is fixed when a batch enters the
          pipeline: every microbatch of batch t on every stage uses stage 0's live version when
          the batch's first microbatch t*m starts its forward there. With m >= d that is t-1
          (0 for t = 0): W(t+1) = W(t) - lr * grad f(W(t-1)), one step of delay at every stage;
          the first batch after a drain (`generate`'s `drain_every`) runs on the newest, t.
        A drain changes no rule: after it every stage has made all its versions, so the rules
        give what a fresh schedule of the remaining minibatches gives (version v there is v + the
        steps before the drain here).
        """
        live: dict[tuple[int, int], int] = {}
        for actions in self.workers:
            made: dict[int, int] = {}  # stage -> its steps so far on this worker
            for action in actions:
                if action.kind == "U":
                    made[action.stage] = made.get(action.stage, 0) + 1
                elif action.kind == "F":
                    live[(action.stage, action.minibatch)] = made.get(action.stage, 0)
        table: dict[tuple[str, int, int], int] = {}
        for (stage, minibatch), version in live.items():
            table[("F", stage, minibatch)] = self._rule(stage, minibatch, version, live)
        for actions in self.workers:
            for action in actions:
                if action.kind in ("B", "W"):
                    key = ("F", action.stage, action.minibatch)
                    if key not in table:
                        raise ScheduleError(f"{action} has no forward {Action('F', *key[1:])}, so it has no weight "
                                            "version; run validate() on the schedule first")
                    table[(action.kind, action.stage, action.minibatch)] = table[key]
        return table

    @property
    def rules(self):
        """The mode's row of the mode table (`modes.Mode`)."""
        return rules(self.mode)

    def _rule(self, stage: int, minibatch: int, live_version: int, live: dict[tuple[int, int], int]) -> int:
        rule = self.rules.version
        if rule == NEWEST:
            return live_version
        entry = minibatch if rule == VERTICAL else minibatch - minibatch % self.group
        if (0, entry) not in live:
            raise ScheduleError(f"{Action('F', stage, minibatch)}: mode {self.mode!r} fixes its version when "
                                f"{Action('F', 0, entry)} runs, which the schedule lacks; run validate() first")
        if rule == ENTRY:
            return live[(0, entry)]
        seen = min(self.minibatches, live[(0, entry)] * step_group(self, 0))
        return seen // step_group(self, stage)


# ----- per-mode rules that need a schedule ----------------------------------------------------
def step_group(schedule: Schedule, stage: int) -> int:
    """Minibatches per optimizer step of `stage`: r_s where stages step per round of their replicas
    (pipedream, vsync), m otherwise."""
    return schedule.replicas[stage] if schedule.rules.per_round else schedule.group


def steps(schedule: Schedule, stage: int) -> int:
    """How many U actions every worker of `stage` runs: one per (possibly partial, last) step group."""
    return -(-schedule.minibatches // step_group(schedule, stage))


def stash_depth(schedule: Schedule, stage: int) -> int:
    """The most minibatches a worker of `stage` may hold in flight (forward done, backward not yet).

    pipedream, vsync, 2bw: warmup + 1 (1F1B never holds more; PipeDream SOSP'19 section 3.2);
    flush: the same, within one batch of m; gpipe: the whole batch's share, ceil(m / r_s); zb:
    warmup + 1 + `weight_lag` (a minibatch is held until its W). Never more than the minibatches
    a replica of the stage gets at all (ceil(N / r_s), or per batch).
    """
    if not 0 <= stage < schedule.stages:
        raise ScheduleError(f"stage {stage} is out of range for {schedule.stages} stages; use 0..{schedule.stages - 1}")
    r, rule = schedule.replicas[stage], schedule.rules
    if schedule.placement:  # several stages a worker: what the mode's own order holds (`chunked.depths`)
        workers = schedule.worker_count
        return chunked.depths(schedule.mode, workers, schedule.stages // workers, schedule.group)[stage]
    share = -(-(schedule.group if rule.flushes else schedule.minibatches) // r)
    if rule.order == ALL_FORWARD:
        return share
    lag = weight_lag(schedule.replicas, stage, schedule.mode)
    return min(warmup_forwards(schedule.replicas, stage, schedule.mode) + 1 + lag, share)


def peak_versions(schedule: Schedule) -> dict[int, int]:
    """Per rank: the most weight versions of its stage it holds at once.

    A version is held from the step that makes it until it is both superseded by the next step
    and done with (its last forward or backward on the worker has run); the live weights count.
    """
    table = schedule.versions()
    return {rank: max(_peak(table, [a for a in actions if a.stage == stage]) for stage in schedule.stages_of(rank))
            for rank, actions in enumerate(schedule.workers)}


def stash_copies(table: dict[tuple[str, int, int], int], actions: Sequence[Action], stage: int) -> dict[int, int]:
    """Weight stashing's copies of `stage` on one worker whose actions are `actions` (in order;
    `table` is `Schedule.versions()`): version -> the index in `actions` of the step (U) that
    replaces it, for every version some action of the stage uses after that step. The worker
    copies the live weights once for each (before the step, or when a forward first needs them);
    a version whose every use comes before its step runs on the live weights themselves."""
    steps_at: list[int] = []
    last_use: dict[int, int] = {}
    for index, action in enumerate(actions):
        if action.stage != stage:
            continue
        if action.kind == "U":
            steps_at.append(index)
        else:
            last_use[table[(action.kind, action.stage, action.minibatch)]] = index
    return {v: steps_at[v] for v, last in last_use.items() if v < len(steps_at) and last > steps_at[v]}


def _peak(table: dict[tuple[str, int, int], int], actions: list[Action]) -> int:
    """The most versions of one stage that its actions on one worker (in order) hold at once."""
    created = [0]  # created[v]: the point (actions done) from which version v exists
    first, last = {}, {}
    for index, action in enumerate(actions):
        if action.kind == "U":
            created.append(index + 1)
        else:
            version = table[(action.kind, action.stage, action.minibatch)]
            first.setdefault(version, index)
            last[version] = index
    delta = [0] * (len(actions) + 2)
    for version in set(range(len(created))) | set(last):
        if version < len(created):  # made here: held until superseded (or the end) and done with
            start = created[version]
            end = created[version + 1] if version + 1 < len(created) else len(actions) + 1
        else:  # used but never made (a broken schedule; validate reports it): held while used
            start, end = first[version], 0
        delta[start] += 1
        delta[max(end, last.get(version, -1) + 1)] -= 1
    held = peak = 0
    for change in delta:
        held += change
        peak = max(peak, held)
    return peak


# ----- parameters ------------------------------------------------------------------------------
def check_parameters(mode: str, replicas: Sequence[int], minibatches: int, group: int,
                     placement: Sequence[int] = ()) -> None:
    """Raise ScheduleError (one line) unless mode, replicas, minibatches, group and placement fit together."""
    rule = rules(mode)
    if not isinstance(replicas, (tuple, list)) or not replicas:
        raise ScheduleError(f"replicas {replicas!r} is empty or not a sequence; give one replica count >= 1 "
                            "per stage, e.g. (1, 1, 1, 1) or (3, 1)")
    for stage, count in enumerate(replicas):
        if not _is_count(count) or count < 1:
            raise ScheduleError(f"replicas {tuple(replicas)!r}: stage {stage} has {count!r} replicas; "
                                "every stage needs an integer count >= 1")
    if not _is_count(minibatches) or minibatches < 1:
        raise ScheduleError(f"minibatches={minibatches!r}; the run needs an integer number of minibatches >= 1")
    if not _is_count(group) or group < 1:
        raise ScheduleError(f"group={group!r}; the microbatches per step must be an integer >= 1")
    _check_placement(rule, tuple(replicas), tuple(placement), group)
    if rule.per_round:
        if group != 1:
            raise ScheduleError(f"group={group} does not apply to mode {mode!r}, which steps after every minibatch "
                                f"(every round of the replicas); leave group unset or 1, or use "
                                f"{listed(modes_where(steps=GROUP))}")
        return
    if rule.group_floor and group < default_group(replicas):
        raise ScheduleError(
            f"group={group} is too small for mode {mode!r} on replicas {tuple(replicas)}: two weight versions suffice "
            f"only with at least {default_group(replicas)} microbatches per step (>= the {len(replicas)} stages, "
            "and >= the minibatches a worker spans in flight); pass group >= "
            f"{default_group(replicas)}")
    if minibatches % group:
        below, above = minibatches - minibatches % group, minibatches - minibatches % group + group
        hint = f"{below} or {above}" if below else f"{above}"
        raise ScheduleError(f"minibatches={minibatches} is not a multiple of group={group} for mode {mode!r} "
                            f"(every step accumulates exactly {group} microbatches); use {hint}, or another group")


def _check_placement(rule, replicas: tuple, placement: tuple, group: int) -> None:
    """A placement exactly where the mode has a placement rule, of its shape, with one replica a stage."""
    if rule.placement is None:
        if placement:
            raise ScheduleError(f"mode {rule.name!r} runs one stage per worker, but the schedule places several on "
                                f"a worker ({placement}); drop the placement, or use a mode of several chunks")
        return
    if not placement:
        raise ScheduleError(f"mode {rule.name!r} runs several stages (chunks) on every worker and needs their "
                            f"placement ({rule.placement}); give one worker per stage")
    if len(placement) != len(replicas) or any(r != 1 for r in replicas):
        raise ScheduleError(f"placement {placement} for replicas {replicas}: a worker's chunks are not replicated "
                            "here, so give every stage one replica and one worker")
    workers = max(placement) + 1
    expected = None
    try:
        expected = make(rule.placement, len(placement), workers)
    except ScheduleError:
        pass
    if expected != placement:
        found = shape_of(placement)
        raise ScheduleError(f"mode {rule.name!r} needs the {rule.placement} placement of {len(placement)} stages "
                            f"on {workers} workers" + (f" ({expected})" if expected else "") + ", but the stages are "
                            f"placed {placement}" + (f" ({found})" if found else "") + "; plan the stages for this mode")
    if workers == len(placement):
        raise ScheduleError(f"mode {rule.name!r} on {workers} stages of {workers} workers: one stage a worker is "
                            "what the modes of one chunk run (flush is interleaving with one chunk); give each worker "
                            "2 or more stages")
    if rule.group_stages and group < len(placement):
        raise ScheduleError(f"group={group} for mode {rule.name!r} on {len(placement)} stages: its warm-up and "
                            f"cool-down need at least as many microbatches as stages; use a group >= {len(placement)}")
    if rule.group_multiple and group % workers:
        raise ScheduleError(f"group={group} for mode {rule.name!r} on {workers} workers: it sends the microbatches "
                            f"through the chunks in rounds of one per worker, so the group must be a multiple of "
                            f"{workers}; use {max(workers, group - group % workers)} or "
                            f"{group - group % workers + workers}")


def _parse_header(line_number: int, line: str) -> dict:
    words = line.split()
    fields = dict(word.split("=", 1) for word in words[1:] if "=" in word)
    if (not words or words[0] != "schedule" or not set(_HEADER_KEYS) <= set(fields)
            or not set(fields) <= set(_HEADER_KEYS + _OPTIONAL_KEYS) or len(fields) != len(words) - 1):
        raise ScheduleError(f"schedule text line {line_number}: expected 'schedule mode=<mode> replicas=<r0,r1,...> "
                            f"minibatches=<N> group=<m> [placement=<w0,w1,...>]', found {line!r:.80}")
    try:
        placement = tuple(int(w) for w in fields["placement"].split(",")) if "placement" in fields else ()
        return dict(mode=fields["mode"], replicas=tuple(int(r) for r in fields["replicas"].split(",")),
                    minibatches=int(fields["minibatches"]), group=int(fields["group"]), placement=placement)
    except ValueError:
        raise ScheduleError(f"schedule text line {line_number}: replicas, minibatches and group must be integers "
                            f"(replicas comma-separated, e.g. replicas=3,1), found {line!r:.80}") from None


def _is_count(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0

