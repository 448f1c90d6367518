"""Benchmark of `pd plan`: planner wall time against problem size.

Prints one table: the original PipeDream profiles and synthetic layer chains (with skip
connections every few layers, like a ResNet) of 100, 300 and 1000 layers, planned for 4
workers, 16 (4x4), 64 (8x8) and 1024 (8x8x16), with both cost models. "pdtool s" and
"pipedream s" are the optimizer's wall time (dynamic program + plan description, no
simulation, `make_plan(simulate=False)`) for each cost model; "pd plan s" is what `pd plan`
takes with the pdtool cost model: the optimizer, then the simulation of its candidates (its
best plan per number of workers, straight pipelines, data parallelism) to keep the fastest;
"candidates" how many it simulated. All measured here, in one run.

Then the scale table (issue 25): chains shaped like transformer blocks (100, 300 and 1000
layers, each 1-2 ms forward, twice that backward, 28 MB of parameters, 4 MB of activations,
batch 8) on clusters of 16, 256, 1024 and 4096 workers on 2 and 3 levels (8 per server at
300 GB/s; servers at 25 GB/s; racks at 10 GB/s): `pd plan`'s wall time, its pick's simulated
time per minibatch (the steady state from one period, `pdtool.sim.steady`, as pd plan ranks), data
parallelism's and the cost model's optimum's (`make_plan(simulate=False)`, the same figure), and
whether the pick is no slower than either. Target: 1000 layers on 4096 workers in at most 60 s.

    python bench/plan_speed.py              # everything
    python bench/plan_speed.py --quick      # skip the 1000-layer rows
    python bench/plan_speed.py --scale      # the scale table only
    python bench/plan_speed.py --joint      # the joint search's table only (pd plan --mode auto)

Then the joint search's tables (issue 37): `pd plan --mode auto` on transformer blocks over 8 to
4096 workers, its wall time, pick and every family's best; and on the shipped GPT and ResNet-50
profiles over 8 to 64 workers, its pick against every family planned alone.
"""
from __future__ import annotations

import argparse
import random
import sys
import time
from pathlib import Path

from pdtool.artifacts.cluster import parse_cluster
from pdtool.artifacts.pipedream import load_pipedream_graph
from pdtool.planner import make_plan
from pdtool.artifacts.profile import Layer, Profile
from record import recorded  # bench/record.py: the dated result file

ROOT = Path(__file__).resolve().parents[1]
SCALE_CLUSTERS = [("16 (8x2)", "8x300GB/s,2x25GB/s"), ("256 (8x32)", "8x300GB/s,32x25GB/s"),
                  ("1024 (8x8x16)", "8x300GB/s,8x25GB/s,16x10GB/s"), ("4096 (8x16x32)", "8x300GB/s,16x25GB/s,32x10GB/s")]
CLUSTERS = [("4", "4x12GB/s"), ("16 (4x4)", "4x12GB/s,4x10Gbit/s"), ("64 (8x8)", "8x25GB/s,8x25Gbit/s"),
            ("1024 (8x8x16)", "8x25GB/s,8x25Gbit/s,16x10Gbit/s")]


def synthetic(n: int, seed: int = 0) -> Profile:
    """A chain of n layers with a skip edge over every block of 3, costs drawn at random."""
    rng = random.Random(seed)
    layers = tuple(Layer(id=i, name=f"layer{i}", kind="Conv2d", fwd_ms=rng.uniform(0.5, 5), bwd_ms=rng.uniform(1, 10),
                         act_bytes=rng.randrange(10**5, 10**8), param_bytes=rng.randrange(0, 10**7))
                   for i in range(n))
    edges = {(i, i + 1) for i in range(n - 1)} | {(i, i + 3) for i in range(0, n - 3, 3)}
    return Profile(model=None, batch_size=32, inputs=(), device="synthetic", torch_version="", fingerprint="0" * 64,
                   method="pipedream", granularity="module", depth=None, repeats=0, step_ms=0.0, step_ms_spread=0.0,
                   layers=layers, edges=tuple(sorted(edges)))


def transformer(n: int, seed: int = 0) -> Profile:
    """A chain of n transformer-like blocks: 1-2 ms forward, twice that backward, 28 MB of
    parameters and 4 MB of activations each (no skip edges: a block's residual stays inside it)."""
    rng = random.Random(seed)
    layers = []
    for i in range(n):
        fwd = rng.uniform(1, 2)
        layers.append(Layer(id=i, name=f"block{i}", kind="Block", fwd_ms=fwd, bwd_ms=2 * fwd, act_bytes=4_000_000,
                            param_bytes=28_000_000))
    return Profile(model=None, batch_size=8, inputs=(), device="synthetic", torch_version="", fingerprint="0" * 64,
                   method="pipedream", granularity="module", depth=None, repeats=0, step_ms=0.0, step_ms_spread=0.0,
                   layers=tuple(layers), edges=tuple((i, i + 1) for i in range(n - 1)))


def scale_table(sizes, clusters=SCALE_CLUSTERS) -> None:
    from pdtool.sim.steady import steady_state

    print("| layers | workers | pd plan s | pick ms | data parallel ms | cost model optimum ms | pick | "
          "pick <= both |")
    print("|---|---|---|---|---|---|---|---|")
    for n in sizes:
        profile = transformer(n)
        for workers, spec in clusters:
            cluster = parse_cluster(spec)
            start = time.perf_counter()
            chosen = make_plan(profile, cluster)
            whole = time.perf_counter() - start
            optimum = make_plan(profile, cluster, simulate=False)
            found = steady_state(optimum)
            optimum_ms = found.time_per_minibatch_ms if found is not None else float("nan")
            pick = chosen.predicted.simulated_ms
            dp = chosen.predicted.simulated_data_parallel_ms
            shape = f"{len(chosen.stages)} stages x{max(s.replicas for s in chosen.stages)}"
            ok = pick <= dp * (1 + 1e-5) and pick <= optimum_ms * (1 + 1e-5)  # plans keep 6 digits
            print(f"| {n} | {workers} | {whole:.1f} | {pick:.4f} | {dp:.4f} | {optimum_ms:.4f} | {shape} | "
                  f"{'yes' if ok else 'NO'} |", flush=True)


JOINT_CASES = [(32, "8 (one level)", "8x10GB/s"), (100, "64 (one level)", "64x25GB/s"), (100, "64 (8x8)", "8x25GB/s,8x10GB/s"),
               (300, "1024 (8x8x16)", "8x300GB/s,8x25GB/s,16x10GB/s"),
               (1000, "4096 (8x16x32)", "8x300GB/s,16x25GB/s,32x10GB/s")]
"""The joint search's cases (issue 37): transformer blocks, clusters of 8 to 4096 workers."""


def joint_table(cases=JOINT_CASES) -> None:
    """`pd plan --mode auto` (`planner.search`: every synchronous mode at 1, 2 and 4 chunks a
    worker, planned alone at one group, ranked by steady states): wall time, the pick, and each
    family's time per minibatch (or - where it has no plan). Targets: 30 s at 100 layers x 64
    workers, 5 minutes at 1000 x 4096."""
    from pdtool.planner.search import families, search
    from pdtool.schedule.modes import synchronous_modes

    labels = [f.label for f in families(synchronous_modes(), None)]
    print("| layers | workers | pd plan --mode auto s | group | pick | pick ms | " + " | ".join(labels) + " |")
    print("|---|---|---|---|---|---|" + "---|" * len(labels))
    for n, workers, spec in cases:
        start = time.perf_counter()
        plan, outcomes = search(transformer(n), parse_cluster(spec), modes=synchronous_modes(), virtual=None,
                                group=None)
        seconds = time.perf_counter() - start
        pick = next(o.family.label for o in outcomes if o.plan is not None and o.plan.mode == plan.mode
                    and o.plan.stages == plan.stages)
        cells = [f"{o.plan.predicted.expected_ms:.3f}" if o.plan is not None else "-" for o in outcomes]
        print(f"| {n} | {workers} | {seconds:.1f} | {plan.group} | {pick} ({len(plan.stages)} stages) | "
              f"{plan.predicted.expected_ms:.3f} | " + " | ".join(cells) + " |", flush=True)


SHIPPED_CASES = [("gpt", "8x1GB/s"), ("gpt", "64x10GB/s"), ("gpt", "8x25GB/s,8x1GB/s"), ("resnet50", "8x10Gbit/s"),
                 ("resnet50", "64x10GB/s"), ("resnet50", "8x25GB/s,8x1GB/s")]
"""The joint search's check on the shipped profiles (issue 37): 8 to 64 workers, fast and slow links."""


def joint_check_table(cases=SHIPPED_CASES) -> None:
    """On the shipped GPT and ResNet-50 profiles: `pd plan --mode auto`'s pick against every family
    planned alone as `pd plan --mode M [--virtual-stages V] --group m` plans it (the event
    simulation of its finalists up to 64 workers), and whether the pick is no slower than the
    best of them (within the 2% by which the steady state may differ from the simulation)."""
    from pdtool.planner.chunks import make_chunked_plan
    from pdtool.planner.search import search
    from pdtool.schedule.modes import synchronous_modes
    from pdtool.errors import PlanError

    print("| profile | cluster | group | pick | pick ms | best family alone | its ms | pick <= best (2%) | "
          "search s | families alone s |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for name, spec in cases:
        profile, cluster = Profile.load(ROOT / "profiles" / f"{name}.profile.json"), parse_cluster(spec)
        start = time.perf_counter()
        plan, outcomes = search(profile, cluster, modes=synchronous_modes(), virtual=None, group=None)
        searched = time.perf_counter() - start
        start, alone = time.perf_counter(), []
        for outcome in outcomes:
            family = outcome.family
            try:
                made = (make_plan(profile, cluster, mode=family.mode, group=plan.group) if family.chunks == 1 else
                        make_chunked_plan(profile, cluster, chunks=family.chunks, mode=family.mode, group=plan.group))
            except PlanError:
                continue
            alone.append((made.predicted.expected_ms, family.label))
        best_ms, best = min(alone)
        pick = next(o.family.label for o in outcomes if o.plan is not None and o.plan.mode == plan.mode
                    and o.plan.stages == plan.stages)
        ok = plan.predicted.expected_ms <= best_ms * 1.02
        print(f"| {name} | {spec} | {plan.group} | {pick} ({len(plan.stages)} stages) | {plan.predicted.expected_ms:.3f} "
              f"| {best} | {best_ms:.3f} | {'yes' if ok else 'NO'} | {searched:.1f} | {time.perf_counter() - start:.1f} |",
              flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="skip the 1000-layer rows")
    parser.add_argument("--scale", action="store_true", help="the scale table only")
    parser.add_argument("--joint", action="store_true", help="the joint search's table only (pd plan --mode auto)")
    parser.add_argument("--smoke", action="store_true", help="tiny sizes: that it runs to its end (the tests run it), not its figures")
    args = parser.parse_args()
    sizes = (30,) if args.smoke else (100, 300) + (() if args.quick else (1000,))
    clusters = CLUSTERS[:1] if args.smoke else CLUSTERS
    scales = SCALE_CLUSTERS[:1] if args.smoke else SCALE_CLUSTERS
    joint = [c for c in JOINT_CASES if c[0] in sizes or c[0] < 100] if not args.smoke else [(12, "4", "4x10GB/s")]
    if args.scale:
        scale_table(sizes, scales)
        return
    if args.joint:
        joint_table(joint)
        print()
        joint_check_table(SHIPPED_CASES[:1] if args.smoke else SHIPPED_CASES)
        return
    cases = [(f"pipedream {m}", load_pipedream_graph(ROOT / "profiles" / "pipedream" / f"{m}.graph.txt",
                                                     64 if m == "gnmt" else None))
             for m in (("alexnet",) if args.smoke else ("alexnet", "vgg16", "resnet18", "gnmt"))]
    cases += [(f"synthetic {n}", synthetic(n)) for n in sizes]
    print("| profile | layers | workers | pdtool s | pipedream s | pd plan s | candidates | stages (pd plan) |")
    print("|---|---|---|---|---|---|---|---|")
    for label, profile in cases:
        for workers, spec in clusters:
            cluster = parse_cluster(spec)
            seconds, plans = [], []
            for model in ("pdtool", "pipedream"):
                start = time.perf_counter()
                plans.append(make_plan(profile, cluster, cost_model=model, simulate=False))
                seconds.append(time.perf_counter() - start)
            start = time.perf_counter()
            chosen = make_plan(profile, cluster)
            whole = time.perf_counter() - start
            print(f"| {label} | {len(profile.layers)} | {workers} | {seconds[0]:.3f} | {seconds[1]:.3f} | "
                  f"{whole:.3f} | {chosen.predicted.candidates} | {len(chosen.stages)} |", flush=True)
    print()
    scale_table(sizes, scales)
    print()
    joint_table(joint)
    print()
    joint_check_table(SHIPPED_CASES[:1] if args.smoke else SHIPPED_CASES)


if __name__ == "__main__":
    with recorded("plan_speed_joint" if "--joint" in sys.argv[1:] else "plan_speed"):
        main()
