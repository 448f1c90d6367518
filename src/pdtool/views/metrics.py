"""The metrics CSV of a `pd train` run: one row per optimizer step of stage 0."""
from __future__ import annotations

import math

from ..jsonio import write_text_atomic


def write_metrics(path: str, result) -> None:
    """One row per optimizer step of stage 0 of `result` (`session.TrainResult`): step, mean
    loss, samples/s, stage 0's learning rate and the gradient norm (`_recipe`), per worker the share of that step's wall time it spent computing (busy;
    the rest is idle or waiting), and per worker the memory it held (MB: its resident set, or on
    a GPU what torch allocated there) at the end of its own step nearest in time to the end of
    this one (empty for a worker that never stepped)."""
    losses, finished = result.losses, result.finished
    ranks = sorted(result.reports)
    header = (["step", "minibatches", "loss", "samples_per_s", "lr", "grad_norm"] + [f"busy_rank{r}" for r in ranks]
              + [f"memory_mb_rank{r}" for r in ranks])
    rows = [",".join(header)]
    batch = result.plan.profile.batch_size
    previous = min((began for r in result.reports.values() for _, began, _ in r.events), default=0.0)
    for k in range(result.steps):
        ids = range((result.first_step + k) * result.per_step, (result.first_step + k + 1) * result.per_step)
        if not all(b in finished for b in ids):
            break
        end = max(finished[b] for b in ids)
        window = max(end - previous, 1e-9)
        loss = sum(losses[b] for b in ids) / len(ids)
        busy = [sum(max(0.0, min(e, end) - max(s, previous)) for _, s, e in result.reports[r].events) / window
                for r in ranks]
        held = [_held(result.reports[r].step_memory, end) for r in ranks]
        lr, norm = _recipe(result, k)
        rows.append(",".join([str(result.first_step + k + 1), str(len(ids)), f"{loss:.6g}",
                              f"{batch * len(ids) / window:.6g}", f"{lr:.6g}", "" if norm is None else f"{norm:.6g}"]
                             + [f"{x:.4f}" for x in busy]
                             + ["" if x is None else f"{x / 1e6:.1f}" for x in held]))
        previous = end
    write_text_atomic(path, "\n".join(rows) + "\n")


def _recipe(result, k: int) -> tuple[float, float | None]:
    """Stage 0's learning rate at its k-th step of the run, and the gradient norm clipped at then
    (--clip-grad-norm; None without): the whole model's where stages clip together, else the root
    of the sum of the squares of each stage's own norm at its step nearest in time."""
    firsts = [r for r in result.reports.values() if r.replica == 0]
    head = next((r for r in firsts if r.stage == 0), None)
    if head is None or k >= len(head.step_log):
        return 0.0, None
    end, lr, norm, whole = head.step_log[k][:4]
    if norm is None or whole:
        return lr, norm
    nearest = [min(r.step_log, key=lambda entry: abs(entry[0] - end))[2] for r in firsts if r.step_log]
    return lr, math.sqrt(sum(n * n for n in nearest if n is not None))


def _held(samples: list[tuple[float, int]], end: float) -> int | None:
    """Bytes in use at the end of the step nearest in time to `end` (None: no step)."""
    return min(samples, key=lambda sample: abs(sample[0] - end))[1] if samples else None
