"""torch.distributed.pipelining's schedule files, both ways: one optimizer step as a CSV of one row
per rank, each cell an action string (`2F0`, `1I3`, `0W3`, `1B2`; torch's `_Action`, written by a
schedule's `_dump_csv` and read by `_PipelineScheduleRuntime._load_csv` in its "compute_only" form;
an empty cell is an idle slot).

Actions map onto pdtool's (`Action`): torch's F is pdtool's F; its B (a whole backward) pdtool's B
without a W; its I (the input gradients) pdtool's split B, whose W follows; its W pdtool's W. An
`OVERLAP_F_B` cell, `(1F2;0B1)OVERLAP_F_B`, is its sub-actions one after the other (what a CPU
worker runs; DualPipeV overlaps them on GPUs). `SEND_F`, `RECV_F`, `SEND_B` and `RECV_B` are
dropped: pdtool derives every message from the compute actions (`schedule.lower`). `UNSHARD`,
`RESHARD` and `REDUCE_GRAD` (parameter sharding) have nothing to stand for in a plan whose stages
are not sharded so: one line. A file is one step: its microbatches are the group, and each rank's
row gets the optimizer step of every stage it holds appended. Pure: no torch.
"""
from __future__ import annotations

import csv
import io
import re

from ..errors import ScheduleError
from .core import Action, Schedule

_CELL = re.compile(r"(\d+)(F|I|B|W|UNSHARD|RESHARD|REDUCE_GRAD|SEND_F|RECV_F|SEND_B|RECV_B)(\d*)")
_OVERLAP = re.compile(r"\((.*)\)OVERLAP_F_B")
MESSAGES = ("SEND_F", "RECV_F", "SEND_B", "RECV_B")
UNPRICED = ("UNSHARD", "RESHARD", "REDUCE_GRAD")


def to_csv(schedule: Schedule) -> str:
    """One step of `schedule` (made for one group: minibatches == group) as torch's CSV."""
    split = {(a.stage, a.minibatch) for actions in schedule.workers for a in actions if a.kind == "W"}
    out = io.StringIO()
    writer = csv.writer(out, lineterminator="\n")
    for actions in schedule.workers:
        writer.writerow([f"{a.stage}{'I' if a.kind == 'B' and (a.stage, a.minibatch) in split else a.kind}"
                         f"{a.minibatch}" for a in actions if a.kind != "U"])
    return out.getvalue()


def read_csv(text: str, source: str = "the schedule") -> list[list[tuple[str, int, int]]]:
    """The compute actions of each rank's row, (kind, stage, microbatch) with torch's kinds (F, I,
    B, W), in order; messages dropped; anything else is a ScheduleError naming the row and cell."""
    rows = []
    for number, row in enumerate(csv.reader(io.StringIO(text)), 1):
        actions: list[tuple[str, int, int]] = []
        for column, cell in enumerate(row, 1):
            cell = cell.strip()
            if cell in ("", "None"):
                continue
            overlap = _OVERLAP.fullmatch(cell)
            for part in (overlap.group(1).split(";") if overlap else [cell]):
                actions += _action(part.strip(), f"{source}, row {number} (rank {number - 1}), cell {column}")
        rows.append((row, actions))
    while rows and not any(cell.strip() for cell in rows[-1][0]):  # blank lines at the end are no ranks
        rows.pop()
    rows = [actions for _, actions in rows]
    if not rows:
        raise ScheduleError(f"{source} is empty; write one row of actions per rank (e.g. 0F0,0F1,0B0,0B1)")
    return rows


def _action(text: str, where: str) -> list[tuple[str, int, int]]:
    match = _CELL.fullmatch(text)
    if match is None:
        raise ScheduleError(f"{where}: {text!r} is not an action; write <stage><F|I|B|W><microbatch>, e.g. 1F0")
    stage, kind, microbatch = int(match.group(1)), match.group(2), match.group(3)
    if kind in MESSAGES:
        return []
    if kind in UNPRICED:
        raise ScheduleError(f"{where}: {text} shards parameters (FSDP), which a pdtool plan's stages do not; pdtool "
                            f"cannot price it: write the schedule without {', '.join(UNPRICED)}")
    if not microbatch:
        raise ScheduleError(f"{where}: {text} names no microbatch; write it as {stage}{kind}0")
    return [(kind, stage, int(microbatch))]


def schedule_of(rows: list[list[tuple[str, int, int]]], mode: str, replicas: tuple[int, ...],
                placement: tuple[int, ...], source: str = "the schedule") -> Schedule:
    """The pdtool schedule of one step that torch's `rows` describe, in `mode` on a plan of
    `replicas` (one each) and `placement` (the worker of each stage; () for one stage a worker).
    Raises ScheduleError (one line) where a row runs a stage its worker does not hold; the
    schedule's own checks (`schedule.check.validate`) are the caller's."""
    stages = len(replicas)
    if len(rows) != (max(placement) + 1 if placement else stages):
        raise ScheduleError(f"{source} has {len(rows)} rows (ranks), the plan {max(placement) + 1 if placement else stages} "
                            "workers; write one row per worker of the plan")
    holds = [tuple(s for s in range(stages) if (placement[s] if placement else s) == rank) for rank in range(len(rows))]
    split = {(stage, mb) for row in rows for kind, stage, mb in row if kind == "W"}
    microbatches = 1 + max((mb for row in rows for _, _, mb in row), default=-1)
    workers = []
    for rank, row in enumerate(rows):
        actions = []
        for kind, stage, mb in row:
            if stage not in holds[rank]:
                raise ScheduleError(f"{source}: rank {rank} runs {stage}{kind}{mb}, but the plan places stage {stage} on "
                                    + (f"worker {placement[stage]}" if stage < stages and placement else
                                       f"worker {stage}" if stage < stages else f"no worker (it has {stages} stages)"))
            if kind == "B" and (stage, mb) in split:
                raise ScheduleError(f"{source}: rank {rank} runs {stage}B{mb} (a whole backward) and a W of the same "
                                    f"microbatch; write {stage}I{mb} for its input gradients")
            actions.append(Action("B" if kind == "I" else kind, stage, mb))
        workers.append(tuple(actions) + tuple(Action("U", s) for s in holds[rank]))
    if microbatches < 1:
        raise ScheduleError(f"{source} holds no compute action; write one row of actions per rank (e.g. 0F0,0B0)")
    return Schedule(mode=mode, replicas=replicas, minibatches=microbatches, group=microbatches, workers=tuple(workers),
                    placement=placement)
