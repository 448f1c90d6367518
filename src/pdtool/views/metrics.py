"""The metrics CSV of a `pd train` run: one row per optimizer step of stage 0, written as the run
goes (`runtime.launcher.live`) and once more, whole, at its end."""
from __future__ import annotations

import math

from ..jsonio import write_text_atomic


COLUMNS = ("step", "minibatches", "loss", "samples_per_s", "lr", "grad_norm", "eval_loss", "eval_accuracy")


def write_metrics(path: str, result) -> None:
    """The whole metrics CSV of `result` (`session.TrainResult`), written atomically (`metric_rows`)."""
    write_text_atomic(path, "\n".join([header(sorted(result.reports))] + [row for row, _ in metric_rows(result)]) + "\n")


def settings_path(path: str) -> str:
    """The JSON beside a metrics CSV that holds the run's settings (`m.csv` -> `m.csv.json`)."""
    return f"{path}.json"


def write_settings(path: str, record: dict) -> None:
    """The run's settings (`runtime.run.recorded_settings`) beside the metrics CSV `path`, so the
    CSV stays a plain table (pandas, pd plot) and the run that made it is known."""
    import json

    write_text_atomic(settings_path(path), json.dumps(record, indent=1, sort_keys=True, default=str) + "\n")


def header(ranks: list[int]) -> str:
    return ",".join(list(COLUMNS) + [f"busy_rank{r}" for r in ranks] + [f"memory_mb_rank{r}" for r in ranks])


def metric_rows(result, start: int = 0, known: dict[int, float] | None = None):
    """(row, values) per optimizer step of stage 0 of `result`, from its `start`-th step on: step,
    mean loss, samples/s, stage 0's learning rate and the gradient norm (`_recipe`), per worker the
    share of that step's wall time it spent computing (busy; the rest is idle or waiting), and per
    worker the memory it held (MB: its resident set, or on a GPU what torch allocated there) at the
    end of its own step nearest in time to the end of this one (empty for a worker that never
    stepped). `eval_loss` and `eval_accuracy` are the held-out split's, on the rows of the steps after
    which the run evaluated through the pipeline (`--eval-every`, `--evaluate`; else empty). `values`
    holds the named columns as numbers. While a run goes on (`known`: per rank, the time up to which
    its work is known), the rows stop at the first step not yet known on every worker, or whose
    evaluation has not ended."""
    losses, finished, evals = result.losses, result.finished, result.evals
    ranks = sorted(result.reports)
    batch = result.plan.profile.batch_size
    previous = min((began for r in result.reports.values() for _, began, _ in r.events), default=0.0)
    for k in range(result.steps):
        ids = range((result.first_step + k) * result.per_step, (result.first_step + k + 1) * result.per_step)
        if not all(b in finished and b in losses for b in ids):
            return
        end = max(finished[b] for b in ids)
        step = result.first_step + k + 1
        if known is not None and (any(known.get(r, 0.0) < end for r in ranks) or not _stepped(result, k)
                                  or (step in result.eval_steps and step not in evals)):
            return
        window = max(end - previous, 1e-9)
        if k >= start:
            loss = sum(losses[b] for b in ids) / len(ids)
            busy = [sum(max(0.0, min(e, end) - max(s, previous)) for _, s, e in result.reports[r].events) / window
                    for r in ranks]
            held = [_held(result.reports[r].step_memory, end) for r in ranks]
            lr, norm = _recipe(result, k)
            held_loss, accuracy = evals[step][:2] if step in evals else (None, None)
            values = {"step": step, "loss": loss, "samples_per_s": batch * len(ids) / window,
                      "lr": lr, "grad_norm": norm, "eval_loss": held_loss, "eval_accuracy": accuracy}
            yield (",".join([str(step), str(len(ids)), f"{loss:.6g}", f"{values['samples_per_s']:.6g}", f"{lr:.6g}"]
                            + ["" if values[name] is None else f"{values[name]:.6g}"
                               for name in ("grad_norm", "eval_loss", "eval_accuracy")]
                            + [f"{x:.4f}" for x in busy]
                            + ["" if x is None else f"{x / 1e6:.1f}" for x in held]), values)
        previous = max(end, evals[step][4]) if step in evals else end  # an evaluation's time is not the next step's


def _stepped(result, k: int) -> bool:
    """Whether stage 0's first replica has reported its k-th step of the run."""
    return any(r.stage == 0 and r.replica == 0 and len(r.step_log) > k for r in result.reports.values())


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
