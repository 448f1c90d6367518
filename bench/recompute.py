"""Benchmark of activation recomputation (issue 24 item 5): the memory a recomputing plan saves on
every worker, measured against what the plan says, and the time it costs, measured against the
simulator.

An MLP whose activations outweigh its weights (`pdtool.zoo:mlp`, 256 inputs, 8 hidden layers of
512, batch 2048: 4 MiB of output per layer and minibatch, 1 MiB of weights per layer) is profiled,
planned for `4x10GB/s --straight` twice, `pd plan --recompute none` and `--recompute all` (no
memory limit, so the cuts are the planner's own; the bench says when they differ), and each plan
is trained 8 steps of `pipedream` with plain SGD on 4 local CPU workers. Per stage it prints each
worker's measured peak beyond its start (`WorkerReport.memory`: training's peak RSS, VmHWM reset
when training starts, less the RSS before its stage was built; the workers run with `PDTOOL_MALLOC=release`, so that freed blocks go
back to the kernel and the resident set follows the tensors held, `pdtool.allocator`) with its `activations` term (what remains of the peak beyond weights,
their stashed versions, gradients and optimizer state), beside the plan's activations and message
buffers (`messages`: what the runtime's links keep, `planner.costmodel.Memory.terms`) for the same
(`prediction.planned_for_run`, the figures `pd train` prints), then what recomputation saved
measured against what the plans say it saves, and each run's time per minibatch against the
simulator's.

    python bench/recompute.py                 # about 2 minutes here
    python bench/recompute.py --batch 512     # a smaller run of the same
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import tempfile
from record import recorded  # bench/record.py: the dated result file


def _train(plan_path: str, steps: int):
    """pd train's checks and workers (as the CLI calls them): the run's result."""
    from pdtool.artifacts.plan import Plan
    from pdtool.runtime.launcher.job import prepare
    from pdtool.runtime.launcher.session import run
    from pdtool.runtime.run import OptimizerConfig, RunConfig

    config = RunConfig(plan_path=plan_path, steps=steps, progress=False, device="cpu",
                       optimizer=OptimizerConfig(name="sgd", lr=0.001, momentum=0.0, weight_decay=0.0), timeout_s=300)
    job = prepare(Plan.load(plan_path), config)
    return job.config, run(dataclasses.replace(job.config))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", type=int, default=2048)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--depth", type=int, default=8)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--smoke", action="store_true", help="tiny sizes: that it runs to its end (the tests run it), not its figures")
    args = parser.parse_args()
    if args.smoke:
        args.batch, args.hidden, args.depth, args.steps = 64, 32, 4, 6
    # the workers' allocator returns freed blocks, so that their resident sets follow the tensors they hold
    os.environ["PDTOOL_MALLOC"] = "release"
    from pdtool.runtime.launcher import forked

    forked.start_early("cpu", 4)  # the workers' forkserver, forked now as pd train forks it (before any torch work)

    from pdtool.artifacts.plan import Plan, compact_ranges
    from pdtool.cli import cli
    from pdtool.sim.prediction import measured_beyond, planned_for_run
    from pdtool.sim.simulate import simulate

    MiB = 2 ** 20
    with tempfile.TemporaryDirectory() as folder:
        profile = os.path.join(folder, "mlp.profile.json")
        cli.main(["profile", "-m", "pdtool.zoo:mlp", "-a", "in_features=256", "-a", f"hidden={args.hidden}",
                  "-a", f"depth={args.depth}", "-a", "classes=10", "-b", str(args.batch), "--repeats", "3", "-q",
                  "-o", profile], standalone_mode=False)
        plans, results, configs = {}, {}, {}
        for how in ("none", "all"):
            path = os.path.join(folder, f"{how}.plan.json")
            cli.main(["plan", profile, "--cluster", "4x10GB/s", "--straight", "--recompute", how, "-o", path],
                     standalone_mode=False)
            plans[how] = Plan.load(path)
            configs[how], results[how] = _train(path, args.steps)
        cuts = {how: [compact_ranges(s.layers) for s in plan.stages] for how, plan in plans.items()}
        print(f"model: mlp 256 -> {args.depth} x {args.hidden} -> 10, batch {args.batch}; 4 straight stages, "
              f"pipedream, {args.steps} steps, SGD; cuts {cuts['none']}"
              + ("" if cuts["none"] == cuts["all"] else f" (recomputing: {cuts['all']})"))
        print(f"{'stage':>5} {'recompute':>9} {'in flight':>9} {'measured MiB':>12} {'planned MiB':>11} "
              f"{'measured/planned':>16} {'measured rest MiB':>17} {'planned act MiB':>15} {'planned msg MiB':>15}")
        saved = {}
        for how in ("none", "all"):
            planned = planned_for_run(plans[how], configs[how], results[how].reports.values())
            for stage, spec in enumerate(plans[how].stages):
                rank = spec.ranks[0]
                report = results[how].reports[rank]
                beyond = measured_beyond(report.memory)
                total = sum(planned[rank].values())
                act, act_plan = report.memory["activations"], planned[rank]["activations"]
                saved.setdefault(stage, {})[how] = (beyond, total)
                print(f"{stage:>5} {how:>9} {spec.in_flight:>9} {beyond / MiB:>12.1f} {total / MiB:>11.1f} "
                      f"{beyond / total:>16.2f} {act / MiB:>17.1f} {act_plan / MiB:>15.1f} {planned[rank]['messages'] / MiB:>15.1f}")
        print("saved by recomputing, per worker:")
        for stage, figures in saved.items():
            measured = figures["none"][0] - figures["all"][0]
            planned = figures["none"][1] - figures["all"][1]
            print(f"  stage {stage}: {measured / MiB:.1f} MiB measured, {planned / MiB:.1f} MiB planned "
                  f"(difference {(measured - planned) / MiB:+.1f} MiB)")
        times = {how: results[how].time_per_minibatch_ms() for how in plans}
        predicted = {how: simulate(plan).time_per_minibatch_ms for how, plan in plans.items()}
        print(f"time per minibatch: keeping {times['none']:.1f} ms, recomputing {times['all']:.1f} ms measured "
              f"({times['all'] / times['none']:.2f}x); simulated {predicted['none']:.1f} and {predicted['all']:.1f} ms "
              f"({predicted['all'] / predicted['none']:.2f}x)")


if __name__ == "__main__":
    with recorded("recompute"):
        main()
