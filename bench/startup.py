"""Benchmark of `pd train`'s start-up: the time to the first completed minibatch, before and after
the launcher captures the model once and each worker builds only its own stage (issue 23).

Side by side in one run, for GPT-2 small as pdtool's zoo builds it (`pdtool.zoo:gpt`, fx-traced)
and as Hugging Face `transformers` builds it from a config (`pdtool.zoo.hf:gpt2`, captured with
torch.export), both 124M parameters with 128-token sequences, on straight pipelines of 2 and 4
local CPU workers (`make_plan(..., straight=True)` for `Nx10GB/s`), 2 steps in the plan's mode
(`pipedream` for the zoo GPT; `2bw` for Hugging Face's GPT-2, whose head is tied to its embedding):

- **before**: as near what `pd train` did until issue 23 as today's code goes (`--init factory`):
  the launcher builds the whole model with the factory's weights; every worker builds the whole
  model with them too and cuts its stage out of it; the workers' forkserver starts when they are
  launched, with torch and pdtool's worker modules imported (each worker imports the model's
  modules itself), as it did then. Until 2026-12-05 every worker also captured the model
  itself (torch.fx or torch.export), which no worker does any more (`launch` captures once when
  its caller has not: `runtime.launcher.job.with_capture`): rows from before then
  (bench/results/startup_cpu2_2026-12-03.md) include that;
- **after**: `pd train` today: the model waits on `meta` everywhere (`model.build`), the
  launcher captures the stages once and checks the first minibatch on fake tensors
  (`model.capture`, `model.dryrun`), and each worker decodes its own stage's program and gives
  only that stage's parameters their values (the initialization rule); the workers' forkserver
  starts first thing and imports torch while the launcher does, then the model's modules once
  the launcher names them (`runtime.launcher.forked.start_early`); its capture cache is empty (a
  plan run for the first time);
- **cached**: `pd train` of the same plan again: the launcher takes the stages from its capture
  cache (`runtime.launcher.capture_cache`) and starts the workers' forkserver at once.

Each row runs in a fresh process that acts as `pd train` (`runtime.launcher.forked.start_early`,
`runtime.launcher.job.prepare`, then `runtime.launcher.launch.launch`, as the CLI calls them), so
no row inherits another's imports. Columns: "first minibatch" is the time from the row process's
start (its imports of pdtool and torch included) to the end of the backward of minibatch 0 on
stage 0 (event `0B0`, when the first minibatch is complete on every stage); "checks" when
`prepare` was done; "started" when the first worker began, "building" the slowest worker's time
from its start to its stage built (`WorkerReport.startup`: began -> built), "joined" when the
last worker had joined the process group, all from the process's start; "worker RSS" the largest peak resident
set of a worker over the whole run (training included), "launcher RSS" the row process's own
(both VmHWM from the OS).

    python bench/startup.py            # both models, 2 and 4 workers (about 6 minutes here)
    python bench/startup.py --rounds 3 # every row three times, interleaved: medians and ranges
    python bench/startup.py --quick    # the zoo GPT only, 2 and 4 workers
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from record import recorded  # bench/record.py: the dated result file

START = time.time()  # this process's start: a row's times count from here, its imports included

MODELS = {
    "zoo gpt": ("pdtool.zoo:gpt", dict(vocab=50257, seq_len=128, d_model=768, heads=12, layers=12)),
    "hf gpt2": ("pdtool.zoo.hf:gpt2", dict(vocab=50257, seq_len=128, n_embd=768, n_head=12, n_layer=12)),
}
WORKERS = (2, 4)
WAYS = ("before", "after", "cached")


def _plan(folder: str, name: str, workers: int) -> str:
    from pdtool.artifacts.cluster import parse_cluster
    from pdtool.artifacts.profile import ModelRef
    from pdtool.planner import make_plan
    from pdtool.profiler import profile_model

    spec, kwargs = MODELS[name]
    profile = profile_model(ModelRef(spec, kwargs), batch_size=1, repeats=1, warmup=0)
    path = os.path.join(folder, f"{name.replace(' ', '_')}-{workers}.plan.json")
    make_plan(profile, parse_cluster(f"{workers}x10GB/s"), straight=True, simulate=False).save(path)
    return path


def _row(plan_path: str, way: str, workers: int) -> dict:
    """One row, in this process (a fresh one): pd train's checks, then its workers, timed from
    this process's start, as `pd train` (`runtime.launcher.train`) runs them."""
    from pdtool.artifacts.plan import Plan
    from pdtool.runtime.launcher import forked
    from pdtool.runtime.run import RunConfig

    plan = Plan.load(plan_path)
    config = RunConfig(plan_path=plan_path, steps=2, progress=False, device="cpu", timeout_s=120,
                       init="factory" if way == "before" else "rule")
    if way != "before":  # before issue 23 the forkserver started at the launch, with torch and pdtool's modules
        forked.start_early(config.device, workers)  # before torch is imported, as pd train does
    from pdtool.runtime.launcher.job import prepare
    from pdtool.runtime.launcher.launch import launch
    from pdtool.runtime.worker.memory import peak_resident_bytes

    job = prepare(plan, config, imports=(lambda modules: None) if way == "before" else
                  lambda modules: forked.warm(config.device, workers, modules))  # as pd train
    checked = time.time()
    reports = launch(job.config, len(plan.used_ranks))
    first = max(end for report in reports.values() for action, _, end in report.events if action == "0B0")
    return {"stages": len(plan.stages), "first_s": first - START, "checks_s": checked - START,
            "started_s": min(r.startup["began"] for r in reports.values()) - START,
            "joined_s": max(r.startup["joined"] for r in reports.values()) - START,
            "building_s": max(r.startup["built"] - r.startup["began"] for r in reports.values()),
            "worker_mb": max(r.memory["peak"] for r in reports.values()) / 2 ** 20,
            "launcher_mb": peak_resident_bytes() / 2 ** 20}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="the zoo GPT only")
    parser.add_argument("--rounds", type=int, default=1, help="run every row this many times, interleaved; "
                        "the table shows medians, the ratios their median and range over the rounds")
    parser.add_argument("--row", nargs=3, metavar=("PLAN", "WAY", "WORKERS"), help=argparse.SUPPRESS)
    parser.add_argument("--smoke", action="store_true",
                        help="tiny sizes: that it runs to its end (the tests run it), not its figures")
    args = parser.parse_args()
    if args.row:
        print(json.dumps(_row(args.row[0], args.row[1], int(args.row[2]))))
        return
    models = ["zoo gpt"] if args.quick or args.smoke else list(MODELS)
    workers_counts = (2,) if args.smoke else WORKERS
    if args.smoke:
        MODELS["zoo gpt"] = ("pdtool.zoo:gpt", dict(vocab=64, seq_len=8, d_model=16, heads=2, layers=2))
    results: dict[tuple, list[dict]] = {}
    with tempfile.TemporaryDirectory() as folder:
        plans = {(name, workers): _plan(folder, name, workers) for name in models for workers in workers_counts}
        for round_ in range(args.rounds):
            for (name, workers), path in plans.items():
                # empty for "after" (a plan's first run), filled by it for "cached"
                cache = os.path.join(folder, f"cache-{name.replace(' ', '_')}-{workers}-{round_}")
                for way in WAYS:
                    env = dict(os.environ, PDTOOL_CACHE_DIR="off" if way == "before" else cache)
                    out = subprocess.run([sys.executable, __file__, "--row", path, way, str(workers)], check=True,
                                         capture_output=True, text=True, env=env).stdout
                    results.setdefault((name, workers, way), []).append(json.loads(out.strip().splitlines()[-1]))
    print(f"{'model':9} {'workers':>7} {'stages':>6} {'way':7} {'first minibatch':>15} {'checks':>7} {'started':>8} "
          f"{'building':>8} {'joined':>7} {'worker RSS':>11} {'launcher RSS':>12}")
    for (name, workers, way), rows in results.items():
        row = {column: statistics.median(r[column] for r in rows) for column in rows[0]}
        print(f"{name:9} {workers:7d} {row['stages']:6.0f} {way:7} {row['first_s']:13.2f} s {row['checks_s']:5.2f} s "
              f"{row['started_s']:6.2f} s {row['building_s']:6.2f} s {row['joined_s']:5.2f} s {row['worker_mb']:8.0f} MB "
              f"{row['launcher_mb']:9.0f} MB")
    print()

    def ratio(top, bottom, column="first_s") -> str:  # per round, side by side
        values = [t[column] / b[column] for t, b in zip(results[top], results[bottom])]
        spread = f" ({min(values):.2f}-{max(values):.2f})" if len(values) > 1 else ""
        return f"{statistics.median(values):.2f}{spread}"
    for name in models:
        for workers in workers_counts:
            before, after, cached = ((name, workers, way) for way in WAYS)
            print(f"{name}, {workers} workers: start-up after/before {ratio(after, before)}, "
                  f"cached/before {ratio(cached, before)}, stage building after/before "
                  f"{ratio(after, before, 'building_s')}")
        for way in WAYS[1:] if len(workers_counts) > 1 else ():
            print(f"{name}: start-up with 4 workers / with 2 ({way}) {ratio((name, 4, way), (name, 2, way))}")
    if args.rounds > 1:
        print(f"(medians over {args.rounds} rounds; ratios per round, their range in brackets)")


if __name__ == "__main__":
    with recorded("startup"):
        main()
