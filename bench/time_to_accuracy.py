"""Time to accuracy: PipeDream's headline (SOSP'19, section 5.2) at this machine's scale.

The same model (pdtool.zoo:mlp on the UCI digits shipped with pdtool), the same data order, the
same initial weights, optimizer and learning rate, trained for the same number of epochs:

- `pipedream`, `vsync`, `2bw` and `flush` on the 2-stage plan `make_plan(..., straight=True)`
  picks for 2 workers (1 thread each, gloo), started as `pd train` starts them
  (`runtime.launcher.session.run`); a checkpoint after every epoch (on /dev/shm where it exists) gives
  the weights the held-out accuracy is measured on afterwards, in this process;
- one process training the whole model on the same minibatches (a step per minibatch, as
  `pipedream` without staleness): with one thread (one worker's share of the machine, the
  paper's single-worker baseline) and with as many threads as the pipeline has workers (the
  same cores as the pipeline). It writes its weights after every epoch as the pipelines do
  (`checkpoint.save_shard`, the same place), so both pay for the same checkpoints.

`flush` and `2bw` take a step every `--group` minibatches (gradient accumulation: the mean
gradient of the group), the others after every minibatch; so that a step of g minibatches moves
the weights as far as g steps of one, their learning rate is `--lr` x g (the linear scaling
rule of Goyal et al. 2017; `--no-scale-lr` keeps `--lr`). Time is training time: from the first
action of any worker (the first minibatch in one process) to the end of the epoch's checkpoint
write on every stage (the one process writes its weights after every epoch too), without the
workers' start-up (about 3 s per launch here) and without the evaluations. The table gives, per
run, the first epoch whose held-out accuracy reaches `--target`, the training time to it, and
the ratio of that time to the first one-process run's; the PNG plots accuracy against time and
against epochs (`pip install -e '.[plot]'` for matplotlib; without it the table is printed and
the plot skipped).

    python bench/time_to_accuracy.py                     # 15 epochs, target 90%, writes bench/results/time_to_accuracy.png
    python bench/time_to_accuracy.py --epochs 10 --target 0.85 --plot /tmp/tta.png
"""
from __future__ import annotations

import argparse
import dataclasses
import math
import os
import tempfile
import time
from pathlib import Path

import torch

from pdtool.artifacts.checkpoint import load_checkpoint, read_manifest, save_shard
from pdtool.artifacts.cluster import parse_cluster
from pdtool.model.data import digits, evaluate, load_source
from pdtool.model.spec import load_model
from pdtool.artifacts.plan import Plan
from pdtool.planner import make_plan
from pdtool.artifacts.profile import ModelRef
from pdtool.profiler import profile_model
from pdtool.runtime.launcher import forked, session
from pdtool.runtime.optimizers import build_optimizer
from pdtool.runtime.run import OptimizerConfig, RunConfig, checked_run
from pdtool.schedule import rules
from record import recorded  # bench/record.py: the dated result file

MODES = ("pipedream", "vsync", "2bw", "flush")
SINGLE = "one process"
SEED = 0


@dataclasses.dataclass
class Curve:
    """Held-out accuracy after each epoch, and the training time (s) at each epoch's end."""

    name: str
    accuracy: list[float]
    seconds: list[float]

    def first_reaching(self, target: float) -> int | None:
        """The first epoch (1-based) whose accuracy reaches target."""
        return next((e + 1 for e, a in enumerate(self.accuracy) if a >= target), None)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--epochs", type=int, default=15)
    parser.add_argument("--target", type=float, default=0.90, help="held-out top-1 accuracy to reach")
    parser.add_argument("--batch", type=int, default=32, help="minibatch size")
    parser.add_argument("--group", type=int, default=4, help="minibatches per step of flush and 2bw")
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--depth", type=int, default=3)
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--momentum", type=float, default=0.5)
    parser.add_argument("--workers", type=int, default=2, help="pipeline stages (one worker each)")
    parser.add_argument("--no-scale-lr", dest="scale_lr", action="store_false",
                        help="flush and 2bw keep --lr instead of --lr x --group")
    parser.add_argument("--modes", default=",".join(MODES), help="pipeline modes to run, comma-separated")
    parser.add_argument("--no-single", dest="single", action="store_false", help="skip the one-process runs")
    parser.add_argument("--plot", default=str(Path(__file__).parent / "results" / "time_to_accuracy.png"))
    args = parser.parse_args()
    forked.start_early("cpu", args.workers)  # the workers' forkserver, forked now as pd train forks it (before any torch work)

    ref = ModelRef("pdtool.zoo:mlp", {"in_features": 64, "hidden": args.hidden, "depth": args.depth, "classes": 10})
    optimizer = OptimizerConfig(name="sgd", lr=args.lr, momentum=args.momentum, weight_decay=0.0)
    batches_per_epoch = len(digits(train=True)) // args.batch
    torch.set_num_threads(1)
    profile = profile_model(ref, batch_size=args.batch, repeats=5, warmup=2)
    plan = make_plan(profile, parse_cluster(f"{args.workers}x2GB/s"), straight=True, mode="pipedream")
    print(f"torch {torch.__version__}, {os.cpu_count()} cores; {ref.spec} {ref.kwargs}; digits: "
          f"{batches_per_epoch} minibatches of {args.batch} per epoch, {args.epochs} epochs; SGD lr {args.lr} "
          f"momentum {args.momentum}; plan: {len(plan.stages)} stages "
          f"({', '.join(str(len(s.layers)) + ' layers' for s in plan.stages)}), 1 thread per worker")
    scratch = "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else None
    curves = []
    with tempfile.TemporaryDirectory(dir=scratch) as tmp:
        for threads in (1, args.workers) if args.single else ():
            torch.set_num_threads(threads)
            curves.append(single_process_curve(f"{SINGLE}, {threads} thread{'s' if threads > 1 else ''}", ref, optimizer,
                                               args.batch, batches_per_epoch, args.epochs, Path(tmp) / f"single{threads}"))
            print(f"  {curves[-1].name}: {describe(curves[-1], args.target)}", flush=True)
        plan_path = Path(tmp) / "plan.json"
        plan.save(plan_path)
        for mode in args.modes.split(","):
            grouped = not rules(mode).per_round
            lr = args.lr * args.group if grouped and args.scale_lr else args.lr
            config = RunConfig(plan_path=str(plan_path), steps=1, mode=mode, group=args.group if grouped else None,
                               seed=SEED, optimizer=dataclasses.replace(optimizer, lr=lr), threads=1, data="digits", progress=False,
                               checkpoint_dir=str(Path(tmp) / mode))
            curves.append(pipeline_curve(mode, config, ref, batches_per_epoch, args.epochs))
            print(f"  {mode}: {describe(curves[-1], args.target)}", flush=True)
    print()
    print(table(curves, args.target))
    plot(curves, args.target, args.plot)


def pipeline_curve(mode: str, config: RunConfig, ref: ModelRef, batches_per_epoch: int, epochs: int) -> Curve:
    per_step = checked_run(Plan.load(config.plan_path), config).per_step
    if batches_per_epoch % per_step:
        raise SystemExit(f"{mode}: {per_step} minibatches per step do not divide an epoch of {batches_per_epoch}; "
                         "change --group or --batch")
    steps_per_epoch = batches_per_epoch // per_step
    config = dataclasses.replace(config, steps=epochs * steps_per_epoch, checkpoint_every=steps_per_epoch)
    result = session.run(config)
    start = min(began for report in result.reports.values() for _, began, _ in report.events)
    # an epoch ends when its checkpoint is written on every stage (the one process's epochs end
    # with its write too)
    saves = [[end for name, _, end in report.events if name == "checkpoint"] for report in result.reports.values()]
    saves = [ends for ends in saves if ends]
    assert saves and all(len(ends) == epochs for ends in saves), [len(ends) for ends in saves]
    accuracy, seconds = [], []
    for epoch in range(1, epochs + 1):
        folder = Path(config.checkpoint_dir) / f"step-{epoch * steps_per_epoch:08d}"
        assert read_manifest(folder).step == epoch * steps_per_epoch
        _, tensors, _ = load_checkpoint(folder)
        accuracy.append(held_out_accuracy(ref, tensors))
        seconds.append(max(ends[epoch - 1] for ends in saves) - start)
    return Curve(mode, accuracy, seconds)


def single_process_curve(name: str, ref: ModelRef, optimizer: OptimizerConfig, batch: int, batches_per_epoch: int,
                         epochs: int, folder: Path) -> Curve:
    torch.manual_seed(SEED)  # the workers' initial weights
    bundle = load_model(ref)
    model = bundle.module
    step = build_optimizer(optimizer, list(model.named_parameters()))
    source = load_source("digits", bundle, batch, SEED)
    accuracy, seconds, elapsed = [], [], 0.0
    for epoch in range(epochs):
        began = time.perf_counter()
        for b in range(epoch * batches_per_epoch, (epoch + 1) * batches_per_epoch):
            inputs, target = source.batch(b)
            step.zero_grad()
            bundle.loss_fn(model(*inputs), target).backward()
            step.step()
        (folder / f"epoch-{epoch + 1}").mkdir(parents=True)
        state = {f"{n}::{key}": value for n, p in model.named_parameters() for key, value in step.state[p].items()}
        save_shard(folder / f"epoch-{epoch + 1}", 0, {n: p.detach() for n, p in model.named_parameters()}, state)
        elapsed += time.perf_counter() - began
        seconds.append(elapsed)
        accuracy.append(evaluate(model, digits(train=False)))
    return Curve(name, accuracy, seconds)


def held_out_accuracy(ref: ModelRef, tensors: dict[str, torch.Tensor]) -> float:
    model = load_model(ref).module
    names = dict(model.named_parameters()) | dict(model.named_buffers())
    missing = set(names) - set(tensors)
    if missing:
        raise SystemExit(f"the checkpoint lacks {sorted(missing)[:3]}")
    model.load_state_dict({name: tensors[name] for name in names}, strict=False)
    return evaluate(model, digits(train=False))


def describe(curve: Curve, target: float) -> str:
    return (f"accuracy {' '.join(f'{a:.2f}' for a in curve.accuracy)}; {curve.seconds[-1]:.1f} s for "
            f"{len(curve.accuracy)} epochs")


def table(curves: list[Curve], target: float) -> str:
    single = curves[0]  # one process, one thread (when it ran)
    single_epoch = single.first_reaching(target)
    single_time = single.seconds[single_epoch - 1] if single_epoch else math.nan
    rows = [f"| run | epochs to {target:.0%} | time to {target:.0%} (s) | that time / {curves[0].name}'s | "
            "s per epoch | final accuracy |", "|---|---:|---:|---:|---:|---:|"]
    for curve in curves:
        epoch = curve.first_reaching(target)
        at = curve.seconds[epoch - 1] if epoch else math.nan
        ratio = f"{at / single_time:.2f}x" if epoch and single_epoch else "-"
        rows.append(f"| {curve.name} | {epoch or 'not reached'} | {at:.1f} | {ratio} | "
                    f"{curve.seconds[-1] / len(curve.seconds):.2f} | {curve.accuracy[-1]:.1%} |".replace("nan", "-"))
    return "\n".join(rows)


def plot(curves: list[Curve], target: float, path: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print(f"\nmatplotlib is not installed, so no plot: pip install -e '.[plot]' and run again for {path}")
        return
    figure, (by_time, by_epoch) = plt.subplots(1, 2, figsize=(11, 4.2), sharey=True)
    for curve in curves:
        style = {"linestyle": "--"} if curve.name.startswith(SINGLE) else {}
        by_time.plot(curve.seconds, curve.accuracy, marker=".", label=curve.name, **style)
        by_epoch.plot(range(1, len(curve.accuracy) + 1), curve.accuracy, marker=".", label=curve.name, **style)
    for axes, label in ((by_time, "training time (s)"), (by_epoch, "epoch")):
        axes.axhline(target, color="grey", linewidth=0.8, linestyle=":")
        axes.set_xlabel(label)
        axes.grid(alpha=0.3)
    by_time.set_ylabel("held-out top-1 accuracy (digits)")
    by_epoch.legend(loc="lower right")
    figure.suptitle(f"Time to {target:.0%} accuracy: 2-stage pipelines (2 workers) and one process")
    figure.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=110)
    print(f"\nplot: {path}")


if __name__ == "__main__":
    with recorded("time_to_accuracy"):
        main()
