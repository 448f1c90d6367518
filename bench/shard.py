"""Benchmark of `--shard optimizer` (issue 38 item 5): a replicated plan that does not fit a memory
limit unsharded and fits sharded, trained both ways on the same stages; each worker's peak
memory and optimizer state against the plan, and the time per minibatch against the simulator.

An MLP whose weights outweigh its activations (`pdtool.zoo:mlp`, 512 inputs, 4 hidden layers of
2048, batch 64: 51 MiB of parameters, AdamW's state twice that) is profiled and planned as data
parallelism over `2x10GB/s` with `--optimizer adamw`, unsharded and `--shard optimizer` (no
limit), then again under `--memory` halfway between the two plans' needs, where only the sharded
plan fits. Both plans are trained 8 steps of `flush` with AdamW on 2 local CPU workers (the
workers' allocator returns freed blocks, `PDTOOL_MALLOC=release`, so that a resident set follows
the tensors held). Per replica: the measured peak beyond its start and the optimizer state it
holds, beside the plan's (`prediction.planned_for_run`, the figures `pd train` prints); what
sharding saved, measured against what the plans say; the time per minibatch of each against
the simulator; and what the replicas' collectives move per step on gloo (an all-reduce, then
the all-gather of the weights: 3 (r - 1) / r of the parameters) against NCCL's reduce-scatter
and all-gather (2 (r - 1) / r, an unsharded all-reduce's bytes).

    python bench/shard.py            # about a minute here
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import tempfile

from record import recorded  # bench/record.py: the dated result file


def _train(plan_path: str, steps: int, shard: str):
    """pd train's checks and workers (as the CLI calls them), with AdamW: (its config, the run's result)."""
    from pdtool.artifacts.plan import Plan
    from pdtool.runtime.launcher.job import prepare
    from pdtool.runtime.launcher.session import run
    from pdtool.runtime.run import OptimizerConfig, RunConfig

    config = RunConfig(plan_path=plan_path, steps=steps, progress=False, device="cpu", mode="flush", shard=shard,
                       optimizer=OptimizerConfig(name="adamw", lr=1e-3, momentum=None, weight_decay=0.1),
                       timeout_s=300)
    job = prepare(Plan.load(plan_path), config)
    return job.plan, job.config, run(dataclasses.replace(job.config))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--smoke", action="store_true", help="tiny sizes: that it runs to its end (the tests run it), not its figures")
    args = parser.parse_args()
    if args.smoke:
        args.batch, args.hidden, args.steps = 8, 64, 6
    os.environ["PDTOOL_MALLOC"] = "release"

    from pdtool.artifacts.plan import Plan
    from pdtool.cli import cli
    from pdtool.sim.prediction import measured_beyond, planned_for_run
    from pdtool.sim.simulate import simulate
    from pdtool.units import format_bytes

    MiB = 2 ** 20
    with tempfile.TemporaryDirectory() as folder:
        profile = os.path.join(folder, "mlp.profile.json")
        cli.main(["profile", "-m", "pdtool.zoo:mlp", "-a", "in_features=512", "-a", f"hidden={args.hidden}",
                  "-a", "depth=4", "-a", "classes=10", "-b", str(args.batch), "--repeats", "3", "-q",
                  "-o", profile], standalone_mode=False)

        def plan(name: str, *extra: str) -> str:
            path = os.path.join(folder, f"{name}.plan.json")
            cli.main(["plan", profile, "--cluster", "2x10GB/s", "--data-parallel", "--mode", "flush", "--optimizer",
                      "adamw", *extra, "-o", path], standalone_mode=False)
            return path

        free = {how: Plan.load(plan(f"{how}-free", "--shard", how)) for how in ("none", "optimizer")}
        needs = {how: p.stages[0].memory_bytes for how, p in free.items()}
        limit = (needs["none"] + needs["optimizer"]) // 2
        refused = "planned" if os.path.exists(plan("none-limited", "--memory", f"{limit}B")) else \
            "refused (pd plan: no plan fits)"
        paths = {"none": plan("none", "--shard", "none"), "optimizer": plan("optimizer", "--memory", f"{limit}B",
                                                                           "--shard", "optimizer")}
        params = free["none"].stages[0].param_bytes
        print(f"model: mlp 512 -> 4 x {args.hidden} -> 10, batch {args.batch} ({format_bytes(params)} of parameters); "
              f"data parallelism on 2 workers, flush, AdamW, {args.steps} steps")
        print(f"plans: unsharded needs {format_bytes(needs['none'])} a worker, sharded {format_bytes(needs['optimizer'])}; "
              f"under --memory {format_bytes(limit)} the unsharded plan is {refused}, the sharded one planned")
        print(f"{'shard':>9} {'replica':>7} {'measured MiB':>12} {'planned MiB':>11} {'measured/planned':>16} "
              f"{'optimizer MiB':>13} {'planned opt MiB':>15}")
        peaks, times, predicted = {}, {}, {}
        for how, path in paths.items():
            plan_now, config, result = _train(path, args.steps, how)
            planned = planned_for_run(plan_now, config, result.reports.values())
            for rank in sorted(result.reports):
                report = result.reports[rank]
                beyond, total = measured_beyond(report.memory), sum(planned[rank].values())
                peaks.setdefault(how, []).append((beyond, total))
                print(f"{how:>9} {report.replica:>7} {beyond / MiB:>12.1f} {total / MiB:>11.1f} {beyond / total:>16.2f} "
                      f"{report.memory['optimizer'] / MiB:>13.1f} {planned[rank]['optimizer'] / MiB:>15.1f}")
            times[how] = result.time_per_minibatch_ms()
            predicted[how] = simulate(plan_now, mode="flush").time_per_minibatch_ms
        saved = [(a[0] - b[0], a[1] - b[1]) for a, b in zip(peaks["none"], peaks["optimizer"])]
        for replica, (measured, planned) in enumerate(saved):
            print(f"saved by sharding, replica {replica}: {measured / MiB:.1f} MiB measured, {planned / MiB:.1f} MiB "
                  f"planned ({measured / planned:.2f} of it)")
        r = 2
        print(f"time per minibatch: unsharded {times['none']:.2f} ms, sharded {times['optimizer']:.2f} ms measured "
              f"({times['optimizer'] / times['none']:.2f}x); simulated {predicted['none']:.2f} and "
              f"{predicted['optimizer']:.2f} ms ({predicted['optimizer'] / predicted['none']:.2f}x)")
        print(f"bytes a replica's collectives move per step: gloo (all-reduce + all-gather) "
              f"{format_bytes(3 * (r - 1) / r * params)}, NCCL (reduce-scatter + all-gather) "
              f"{format_bytes(2 * (r - 1) / r * params)}, unsharded all-reduce {format_bytes(2 * (r - 1) / r * params)}")
        worst = min(measured / planned for measured, planned in saved)
        print(f"- target: each replica's measured peak lowered by at least half of what the plan says: "
              f"{worst:.2f}, {'met' if worst >= 0.5 else 'NOT met'}")


if __name__ == "__main__":
    with recorded("shard"):
        main()
