"""Where the stages of a multi-chunk plan live: several stages (chunks) on each worker.

A placement is a tuple with one worker index per stage (`placement[s]` is the worker of stage s);
every stage has one replica there. Two shapes are known, each a mode's rule (`Mode.placement`):

- LOOPED (Megatron-LM's interleaved 1F1B, torch's ScheduleInterleaved1F1B): stage s on worker
  s mod p; worker r holds stages r, r + p, r + 2p, ... (v chunks each, v * p stages);
- V (Zero Bubble's ZB-V, DeepSeek-V3's DualPipeV): 2p stages, worker r holds stages r and
  2p - 1 - r, so the first and the last stage share worker 0 and the middle two worker p - 1.

Pure standard library.

    >>> looped(6, 3), v_shape(6)
    ((0, 1, 2, 0, 1, 2), (0, 1, 2, 2, 1, 0))
"""
from __future__ import annotations

from typing import Sequence

from ..errors import ScheduleError

LOOPED, V = "looped", "v"
SHAPES = (LOOPED, V)


def looped(stages: int, workers: int) -> tuple[int, ...]:
    """Stage s on worker s mod `workers`; `stages` must be a multiple of `workers`."""
    if workers < 1 or stages < workers or stages % workers:
        raise ScheduleError(f"{stages} stages cannot be looped over {workers} workers: every worker holds the same "
                            f"number of chunks, so the stages must be a multiple of the workers (e.g. "
                            f"{2 * max(workers, 1)})")
    return tuple(s % workers for s in range(stages))


def v_shape(stages: int) -> tuple[int, ...]:
    """Worker r holds stages r and 2p - 1 - r, p = stages / 2; `stages` must be even."""
    if stages < 2 or stages % 2:
        raise ScheduleError(f"{stages} stages cannot be placed in a V: it puts 2 chunks on each of p workers, so it "
                            "needs an even number of stages (2p)")
    p = stages // 2
    return tuple(s if s < p else 2 * p - 1 - s for s in range(stages))


def make(shape: str, stages: int, workers: int) -> tuple[int, ...]:
    """The placement of `shape` (LOOPED or V) for `stages` stages on `workers` workers."""
    if shape == LOOPED:
        return looped(stages, workers)
    if shape == V:
        if stages != 2 * workers:
            raise ScheduleError(f"a V placement puts 2 chunks on each worker: {workers} workers take {2 * workers} "
                                f"stages, not {stages}")
        return v_shape(stages)
    raise ScheduleError(f"unknown placement {shape!r}; use {' or '.join(SHAPES)}")


def shape_of(placement: Sequence[int]) -> str | None:
    """LOOPED or V when `placement` is that shape (LOOPED first where both fit), else None."""
    workers = max(placement, default=-1) + 1
    stages = len(placement)
    for shape in SHAPES:
        try:
            if make(shape, stages, workers) == tuple(placement):
                return shape
        except ScheduleError:
            continue
    return None


def chunks(placement: Sequence[int], worker: int) -> tuple[int, ...]:
    """The stages of `worker`, in stage order."""
    return tuple(s for s, w in enumerate(placement) if w == worker)
