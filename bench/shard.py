"""Benchmark of `--shard optimizer`, `gradients` and `parameters` (issue 38 item 5): replicated
plans that do not fit a memory limit unsharded (or with less sharded) and fit sharded, trained on
the same stages; each worker's peak memory, weights, optimizer state and gradients against the
plan, and the time per minibatch against the simulator.

An MLP whose weights outweigh its activations (`pdtool.zoo:mlp`, 512 inputs, 12 hidden layers of
1024, batch 64: 50 MiB of parameters in layers of 4 MiB, AdamW's state twice that) is profiled and
planned as data parallelism over `2x10GB/s` with `--optimizer adamw` and a group of 4
microbatches (2 backwards a replica a step): unsharded, `--shard optimizer`, `gradients` and
`parameters` (no limit), then under `--memory` halfway between the needs of two of them, where
only the more sharded plan fits. The four plans are trained 8 steps of `flush` with AdamW on 2
local CPU workers (the workers' allocator returns freed blocks, `PDTOOL_MALLOC=release`, so that
a resident set follows the tensors held). Per replica: the measured peak beyond its start, the
optimizer state and the gradients it holds, beside the plan's (`prediction.planned_for_run`, the
figures `pd train` prints); what each sharding saved, measured against what the plans say; the
time per minibatch of each against the simulator; and what the replicas' collectives move per
step on gloo against NCCL's reduce-scatter and all-gather.

    python bench/shard.py            # about a minute here
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import tempfile

from record import recorded  # bench/record.py: the dated result file


def _train(plan_path: str, steps: int, shard: str, group: int):
    """pd train's checks and workers (as the CLI calls them), with AdamW: (its config, the run's result)."""
    from pdtool.artifacts.plan import Plan
    from pdtool.runtime.launcher.job import prepare
    from pdtool.runtime.launcher.session import run
    from pdtool.runtime.run import OptimizerConfig, RunConfig

    config = RunConfig(plan_path=plan_path, steps=steps, progress=False, device="cpu", mode="flush", shard=shard,
                       group=group, timeout_s=300,
                       optimizer=OptimizerConfig(name="adamw", lr=1e-3, momentum=None, weight_decay=0.1))
    job = prepare(Plan.load(plan_path), config)
    return job.plan, job.config, run(dataclasses.replace(job.config))


WAYS = ("none", "optimizer", "gradients", "parameters")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--depth", type=int, default=12)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--group", type=int, default=4)
    parser.add_argument("--smoke", action="store_true", help="tiny sizes: that it runs to its end (the tests run it), not its figures")
    args = parser.parse_args()
    if args.smoke:
        args.batch, args.hidden, args.depth, args.steps = 8, 64, 2, 4
    os.environ["PDTOOL_MALLOC"] = "release"
    from pdtool.runtime.launcher import forked

    forked.start_early("cpu", 2)  # the workers' forkserver, forked now as pd train forks it (before any torch work)

    from pdtool.artifacts.plan import Plan
    from pdtool.cli import cli
    from pdtool.sim.prediction import measured_beyond, planned_for_run
    from pdtool.sim.simulate import simulate
    from pdtool.units import format_bytes

    MiB = 2 ** 20
    with tempfile.TemporaryDirectory() as folder:
        profile = os.path.join(folder, "mlp.profile.json")
        cli.main(["profile", "-m", "pdtool.zoo:mlp", "-a", "in_features=512", "-a", f"hidden={args.hidden}",
                  "-a", f"depth={args.depth}", "-a", "classes=10", "-b", str(args.batch), "--repeats", "3", "-q",
                  "-o", profile], standalone_mode=False)

        def plan(name: str, *extra: str) -> str:
            path = os.path.join(folder, f"{name}.plan.json")
            cli.main(["plan", profile, "--cluster", "2x10GB/s", "--data-parallel", "--mode", "flush", "--optimizer",
                      "adamw", "--group", str(args.group), *extra, "-o", path], standalone_mode=False)
            return path

        free = {how: Plan.load(plan(f"{how}-free", "--shard", how)) for how in WAYS}
        needs = {how: p.stages[0].memory_bytes for how, p in free.items()}
        params = free["none"].stages[0].param_bytes
        print(f"model: mlp 512 -> {args.depth} x {args.hidden} -> 10, batch {args.batch} ({format_bytes(params)} of "
              f"parameters); data parallelism on 2 workers, flush, a group of {args.group}, AdamW, {args.steps} steps")
        print("plans need a worker: " + ", ".join(f"{how} {format_bytes(needs[how])}" for how in WAYS))
        paths = {"none": plan("none", "--shard", "none")}
        for less, more in zip(WAYS, WAYS[1:]):  # under a limit halfway, the less sharded plan is refused
            if needs[more] >= needs[less]:  # --smoke's tiny layers: two 4 MiB buckets outweigh the gradients
                paths[more] = plan(more, "--shard", more)
                print(f"--shard {more} needs no less than --shard {less} at this size: planned without a limit")
                continue
            limit = (needs[less] + needs[more]) // 2
            refused = "planned" if os.path.exists(plan(f"{less}-limited", "--memory", f"{limit}B", "--shard", less)) \
                else "refused (pd plan: no plan fits)"
            paths[more] = plan(more, "--memory", f"{limit}B", "--shard", more)
            auto = Plan.load(plan(f"auto-{more}", "--memory", f"{limit}B", "--shard", "auto"))
            same = [s.shard for s in auto.stages] == [s.shard for s in Plan.load(paths[more]).stages]
            print(f"under --memory {format_bytes(limit)}: --shard {less} {refused}, --shard {more} planned; --shard auto "
                  f"shards {', '.join(s.shard for s in auto.stages)}{' (the same plan)' if same else ''}")
        print(f"{'shard':>10} {'replica':>7} {'measured MiB':>12} {'planned MiB':>11} {'measured/planned':>16} "
              f"{'weights MiB':>11} {'planned':>7} {'optimizer MiB':>13} {'planned':>7} {'gradients MiB':>13} "
              f"{'planned':>7}")
        peaks, times, predicted = {}, {}, {}
        for how, path in paths.items():
            plan_now, config, result = _train(path, args.steps, how, args.group)
            planned = planned_for_run(plan_now, config, result.reports.values())
            for rank in sorted(result.reports):
                report = result.reports[rank]
                beyond, total = measured_beyond(report.memory), sum(planned[rank].values())
                peaks.setdefault(how, []).append((beyond, total))
                print(f"{how:>10} {report.replica:>7} {beyond / MiB:>12.1f} {total / MiB:>11.1f} {beyond / total:>16.2f} "
                      f"{report.memory['weights'] / MiB:>11.1f} {planned[rank]['weights'] / MiB:>7.1f} "
                      f"{report.memory['optimizer'] / MiB:>13.1f} {planned[rank]['optimizer'] / MiB:>7.1f} "
                      f"{report.memory['gradients'] / MiB:>13.1f} {planned[rank]['gradients'] / MiB:>7.1f}")
            times[how] = result.time_per_minibatch_ms()
            predicted[how] = simulate(plan_now, mode="flush", group=args.group).time_per_minibatch_ms
        targets = []
        for less, more in zip(WAYS, WAYS[1:]):
            saved = [(a[0] - b[0], a[1] - b[1]) for a, b in zip(peaks[less], peaks[more])]
            for replica, (measured, planned) in enumerate(saved):
                print(f"--shard {more} against {less}, replica {replica}: {measured / MiB:.1f} MiB less measured, "
                      f"{planned / MiB:.1f} MiB less planned ({measured / planned if planned > 0 else 0.0:.2f} of it)")
            targets.append((more, less, min(measured / planned if planned > 0 else 0.0 for measured, planned in saved)))
        print("time per minibatch measured (simulated): " + ", ".join(
            f"{how} {times[how]:.2f} ms ({predicted[how]:.2f})" for how in WAYS)
            + "; sharded / unsharded measured " + ", ".join(f"{times[how] / times['none']:.2f}x" for how in WAYS[1:])
            + ", simulated " + ", ".join(f"{predicted[how] / predicted['none']:.2f}x" for how in WAYS[1:]))
        r, backwards = 2, args.group // 2
        moved = {"none": (2 * params, 2 * params), "optimizer": (3 * params, 2 * params),
                 "gradients": ((2 * backwards + 1) * params, (backwards + 1) * params),
                 "parameters": (4 * backwards * params, 3 * backwards * params)}
        print("bytes a replica's collectives move per step, gloo / NCCL: " + ", ".join(
            f"{how} {format_bytes((r - 1) / r * g)} / {format_bytes((r - 1) / r * n)}" for how, (g, n) in moved.items())
            + " (gloo all-reduces where NCCL would reduce-scatter; sharded gradients reduce after each of a "
              f"replica's {backwards} backwards; sharded parameters also gather the weights for each forward and "
              "backward)")
        for more, less, worst in targets:
            print(f"- target: --shard {more} lowered each replica's measured peak below --shard {less}'s by at least "
                  f"half of what the plans say: {worst:.2f}, {'met' if worst >= 0.5 else 'NOT met'}")


if __name__ == "__main__":
    with recorded("shard"):
        main()
