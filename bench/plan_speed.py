"""Benchmark of `pd plan`: planner wall time against problem size.

Prints one table: the original PipeDream profiles and synthetic layer chains (with skip
connections every few layers, like a ResNet) of 100, 300 and 1000 layers, planned for 4
workers, 16 (4x4), 64 (8x8) and 1024 (8x8x16), with both cost models. "pdtool s" and
"pipedream s" are the optimizer's wall time (dynamic program + plan description, no
simulation, `make_plan(simulate=False)`) for each cost model; "pd plan s" is what `pd plan`
takes with the pdtool cost model: the optimizer, then the simulation of its candidates (its
best plan per number of workers, straight pipelines, data parallelism) to keep the fastest;
"candidates" how many it simulated. All measured here, in one run.

    python bench/plan_speed.py              # everything
    python bench/plan_speed.py --quick      # skip the 1000-layer rows
"""
from __future__ import annotations

import argparse
import random
import time
from pathlib import Path

from pdtool.artifacts.cluster import parse_cluster
from pdtool.artifacts.pipedream import load_pipedream_graph
from pdtool.planner import make_plan
from pdtool.artifacts.profile import Layer, Profile

ROOT = Path(__file__).resolve().parents[1]
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="skip the 1000-layer rows")
    args = parser.parse_args()
    cases = [(f"pipedream {m}", load_pipedream_graph(ROOT / "profiles" / "pipedream" / f"{m}.graph.txt",
                                                     64 if m == "gnmt" else None))
             for m in ("alexnet", "vgg16", "resnet18", "gnmt")]
    cases += [(f"synthetic {n}", synthetic(n)) for n in (100, 300) + (() if args.quick else (1000,))]
    print("| profile | layers | workers | pdtool s | pipedream s | pd plan s | candidates | stages (pd plan) |")
    print("|---|---|---|---|---|---|---|---|")
    for label, profile in cases:
        for workers, spec in CLUSTERS:
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


if __name__ == "__main__":
    main()
