"""Chrome trace event JSON of a run, one track per worker (open it in Perfetto or chrome://tracing).

`pd simulate --trace` writes the predicted run with it (`chrome_trace`), and `pd train --trace`
the measured one the same way (`measured_trace`): same event names (the actions' compact text, "0F3", "1B3", "0U"),
same tracks (thread = plan rank), so the two open side by side. Pure standard library.
"""
from __future__ import annotations

import json
import os
from typing import TYPE_CHECKING, Any

from ..jsonio import write_text_atomic

if TYPE_CHECKING:
    from ..artifacts.plan import Plan
    from ..sim.simulate import SimResult

US_PER_MS = 1e3


def chrome_trace(result: SimResult, plan: Plan) -> dict:
    """The run as Chrome trace event JSON (open it in Perfetto or chrome://tracing).

    Process 0 holds one thread per worker (tid = plan rank, named "rank R: stage S replica I")
    with one complete ("X") event per action, named as the action prints ("0F3", "1B3", "0U"),
    so that `pd train --trace` and `pd simulate --trace` compare side by side. Process 1 holds one
    thread per directed link that carried a message ("rank X -> rank Y"). `ts`/`dur` are in
    microseconds, rounded to the nanosecond; `otherData` says what was simulated.
    """
    def us(ms: float) -> float:
        return round(ms * US_PER_MS, 3)

    trace: list[dict] = [
        {"name": "process_name", "ph": "M", "pid": 0, "tid": 0, "args": {"name": "workers (simulated)"}},
    ]
    order = [(rank, s, i) for s, stage in enumerate(plan.stages) for i, rank in enumerate(stage.ranks)]
    for index, (rank, s, i) in enumerate(order):
        trace.append({"name": "thread_name", "ph": "M", "pid": 0, "tid": rank,
                      "args": {"name": f"rank {rank}: stage {s} replica {i}"}})
        trace.append({"name": "thread_sort_index", "ph": "M", "pid": 0, "tid": rank, "args": {"sort_index": index}})
    for e in result.events:
        args = {"stage": e.stage} if e.minibatch is None else {"stage": e.stage, "minibatch": e.minibatch}
        trace.append({"name": e.name, "cat": e.kind, "ph": "X", "pid": 0, "tid": e.rank, "ts": us(e.start_ms),
                      "dur": round(us(e.end_ms) - us(e.start_ms), 3), "args": args})
    links = sorted({(t.src, t.dst) for t in result.transfers})
    if links:
        trace.append({"name": "process_name", "ph": "M", "pid": 1, "tid": 0, "args": {"name": "links (simulated)"}})
    tids = {link: index for index, link in enumerate(links)}
    for (src, dst), tid in tids.items():
        trace.append({"name": "thread_name", "ph": "M", "pid": 1, "tid": tid, "args": {"name": f"rank {src} -> rank {dst}"}})
    for t in result.transfers:
        trace.append({"name": f"send {t.name}", "cat": "transfer", "ph": "X", "pid": 1, "tid": tids[(t.src, t.dst)],
                      "ts": us(t.start_ms), "dur": round(us(t.end_ms) - us(t.start_ms), 3),
                      "args": {"bytes": t.bytes, "from": t.src, "to": t.dst}})
    return {
        "traceEvents": trace,
        "displayTimeUnit": "ms",
        "otherData": {
            "source": "pd simulate", "mode": result.mode, "minibatches": result.minibatches, "group": result.group,
            "predicted_time_per_minibatch_ms": result.time_per_minibatch_ms,
            "predicted_samples_per_s": result.samples_per_s, "makespan_ms": result.makespan_ms,
            "bubble_fraction": result.bubble_fraction, "plan_time_per_minibatch_ms": plan.predicted.time_ms,
        },
    }


def measured_trace(events: dict[int, list[tuple[str, float, float]]], plan: Plan, other: dict[str, Any]) -> dict:
    """A measured run (`pd train --trace`) in the same form as `chrome_trace`'s prediction:
    `events[rank]` lists (action text, start, end) in seconds on one clock; times are shown
    from the first event."""
    start = min((began for rows in events.values() for _, began, _ in rows), default=0.0)
    trace: list[dict] = [{"name": "process_name", "ph": "M", "pid": 0, "tid": 0, "args": {"name": "workers (measured)"}}]
    order = [(rank, s, i) for s, stage in enumerate(plan.stages) for i, rank in enumerate(stage.ranks)]
    for index, (rank, s, i) in enumerate(order):
        trace.append({"name": "thread_name", "ph": "M", "pid": 0, "tid": rank,
                      "args": {"name": f"rank {rank}: stage {s} replica {i}"}})
        trace.append({"name": "thread_sort_index", "ph": "M", "pid": 0, "tid": rank, "args": {"sort_index": index}})
    for rank in sorted(events):
        for name, began, ended in events[rank]:
            ts = round((began - start) * 1e6, 3)
            trace.append({"name": name, "cat": name.lstrip("0123456789")[:1], "ph": "X", "pid": 0, "tid": rank,
                          "ts": ts, "dur": round((ended - start) * 1e6 - ts, 3), "args": {}})
    return {"traceEvents": trace, "displayTimeUnit": "ms", "otherData": {"source": "pd train", **other}}


def write_trace(path: str | os.PathLike, trace: dict[str, Any]) -> None:
    """Write `trace` to `path` atomically ("-": standard output), one event per line.

    Not `jsonio.write_json`: its rounding to 6 significant digits would move event boundaries
    by up to 10 us at 10 s into a run, making back-to-back slices overlap. Floats are written
    as they are (`chrome_trace` rounds times to the nanosecond); keys are sorted, so the same
    run gives the same bytes.
    """
    def dump(value: Any) -> str:
        return json.dumps(value, sort_keys=True, separators=(",", ":"), allow_nan=False)

    rest = {key: value for key, value in trace.items() if key != "traceEvents"}
    lines = ",\n".join(dump(event) for event in trace.get("traceEvents", ()))
    tail = f",{dump(rest)[1:]}" if rest else "}"
    write_text_atomic(path, f'{{"traceEvents":[\n{lines}\n]{tail}\n')


def write_measured_trace(path: str, result) -> None:
    """The Chrome trace of what the workers of a `pd train` run did (`session.TrainResult`)."""
    measured = result.time_per_minibatch_ms()
    write_trace(path, measured_trace({r: rep.events for r, rep in result.reports.items()}, result.plan, {
        "measured_time_per_minibatch_ms": measured, "plan_time_per_minibatch_ms": result.plan.predicted.time_ms,
        "minibatches": len(result.losses)}))
