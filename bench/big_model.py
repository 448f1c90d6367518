"""Benchmark of memory: a model of about 1.9 GB of fp32 parameters on 4 pipeline stages, and what
each process of pdtool holds of it (issue 23).

The model is pdtool's zoo MLP made deep and wide (`pdtool.zoo:mlp`, 4096 inputs, 28 hidden layers
of 4096, 10 classes: 470M parameters, 1.88 GB), profiled whole (`pd profile`) and one layer's
weights at a time (`pd profile --memory` half the model's parameter bytes: the layer times of the
two are compared, and again on the same model 8 layers deep, which profiles whole with room to
spare), planned from the second as a straight
4-stage pipeline (2 with --smoke) for `4x10GB/s` (`pd plan --straight`) and trained 2 steps of `flush` with 4
microbatches a step, plain SGD (no momentum: an optimizer state would add a copy of each stage,
and `flush` stashes no weight versions), on 4 local CPU workers (`pd train`, in-process calls).
Every process runs in a fresh Python process of its own (with --smoke, whose figures mean nothing, a
fork of the bench's, which imported torch once); its peak resident set is VmHWM from
/proc/self/status when it ends (a worker's is `WorkerReport.memory["peak"]`, the same figure).

Then the same plan trained 2 steps with AdamW and a checkpoint after each step (what a real run
keeps: 16 bytes a parameter on its stage), `pd export` of that checkpoint, and the same recipe run
under torchrun (4 processes: every rank is a worker, and rank 0 also completes the checkpoints,
hashing every shard).

Printed: each process's peak RSS and its ratio to the model's parameter bytes (the target: every
one below 1; the workers' beside what the plan gives them), and the first steps' losses of the pipeline against one process training the whole
model, built by the same initialization rule (`model.build.initial_model`), with gradient
accumulation over the same minibatches (`torch.testing.assert_close`, rtol 1e-5, atol 1e-6).

    python bench/big_model.py              # the 1.9 GB model (about 4 minutes here)
    python bench/big_model.py --hidden 512 --depth 6 --in-features 512   # a small run of the same
"""
from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
from record import recorded  # bench/record.py: the dated result file


def _peak() -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    return 0


def _pd(args: list[str]) -> None:
    """Run `pd args` in this process, then print this process's peak RSS as JSON (with its rank
    under torchrun)."""
    from pdtool.cli import cli

    try:
        cli.main(args, standalone_mode=False)
    finally:
        print(json.dumps({"peak": _peak(), "rank": os.environ.get("RANK")}), flush=True)


WORKERS = 4  # the pipeline's stages and workers (--smoke: 2)


def _torchrun(plan_path: str, checkpoints: str) -> dict[str, int]:
    """The recipe run (AdamW, a checkpoint after each step) under torchrun, 4 processes on this
    machine: each rank's peak RSS (rank 0 also completes the checkpoints: hashes every shard)."""
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(WORKERS),
               __file__, "--as", "pd", "train", plan_path, "--mode", "flush", "--group", "4", "--steps", "2",
               "--optimizer", "adamw", "--lr", "1e-4", "--weight-decay", "0.01", "--checkpoint-dir", checkpoints,
               "--checkpoint-every", "1", "--threads", "1", "--quiet"]
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode:
        raise SystemExit(f"torchrun failed:\n{done.stdout[-2000:]}\n{done.stderr[-3000:]}")
    # the ranks share one stdout: their lines may run into one another
    peaks = [json.loads(found) for found in re.findall(r'\{"peak": \d+, "rank": "\d+"\}', done.stdout)]
    if len(peaks) != WORKERS:
        raise SystemExit(f"torchrun: {len(peaks)} of its {WORKERS} ranks reported their peak:\n{done.stdout[-2000:]}")
    return {str(p["rank"]): p["peak"] for p in sorted(peaks, key=lambda p: int(p["rank"]))}


def _train(plan_path: str, checkpoints: str | None = None) -> None:
    """pd train's launcher in this process, called as the CLI calls it (`runtime.launcher.train.train`:
    its workers' forkserver forked first, then the checks and the workers); prints the losses, every
    worker's peak (and what the plan gives it) and this launcher's. `checkpoints`: the recipe run
    instead, AdamW with a checkpoint after each step into that folder."""
    from pdtool.artifacts.plan import Plan
    from pdtool.sim.prediction import measured_beyond, planned_for_run
    from pdtool.runtime.launcher.train import train
    from pdtool.runtime.run import Nodes, OptimizerConfig, RunConfig

    plan = Plan.load(plan_path)
    optimizer = (
        OptimizerConfig(name="adamw", lr=1e-4, momentum=None, weight_decay=0.01)
        if checkpoints
        else OptimizerConfig(name="sgd", lr=0.01, momentum=0.0, weight_decay=0.0)
    )
    config = RunConfig(plan_path=plan_path, steps=2, mode="flush", group=4, progress=False, device="cpu",
                       optimizer=optimizer, timeout_s=300, checkpoint_dir=checkpoints,
                       checkpoint_every=1 if checkpoints else 0)
    result, _ = train(plan, config, where=None, nodes=Nodes())
    planned = planned_for_run(plan, config, result.reports.values())
    print(json.dumps({"losses": {str(b): loss for b, loss in sorted(result.losses.items())},
                      "beyond": {str(r): measured_beyond(rep.memory) for r, rep in sorted(result.reports.items())},
                      "planned": {str(r): sum(planned[r].values()) for r in sorted(result.reports)},
                      "workers": {str(r): rep.memory["peak"] for r, rep in sorted(result.reports.items())},
                      "stages": {str(r): rep.stage for r, rep in sorted(result.reports.items())},
                      "launcher": _peak()}))


def _reference(plan_path: str) -> None:
    """One process, the whole model by the initialization rule, flush's steps as gradient
    accumulation over the same minibatches; prints the losses."""
    import torch

    from pdtool.artifacts.plan import Plan
    from pdtool.model.build import initial_model
    from pdtool.model.data import synthetic_source

    plan = Plan.load(plan_path)
    bundle = initial_model(plan.profile.model, 0)
    batch = synthetic_source(bundle, plan.profile.batch_size, 0).batch
    optimizer = torch.optim.SGD(bundle.module.parameters(), lr=0.01)
    losses = {}
    for step in range(2):
        optimizer.zero_grad()
        for k in range(4):
            b = step * 4 + k
            inputs, target = batch(b)
            loss = bundle.loss_fn(bundle.module(*inputs), target)
            losses[str(b)] = float(loss.detach())
            (loss / 4).backward()
        optimizer.step()
    print(json.dumps({"losses": losses, "peak": _peak()}))


def _agreement(whole_path: str, layers_path: str) -> str:
    """How the layer-by-layer profile's times compare with the whole-model profile's."""
    whole, layers = (json.load(open(p))["layers"] for p in (whole_path, layers_path))
    ratios = sorted((b["fwd_ms"] + b["bwd_ms"]) / (a["fwd_ms"] + a["bwd_ms"]) for a, b in zip(whole, layers)
                    if a["fwd_ms"] + a["bwd_ms"] >= 1.0)
    total = sum(b["fwd_ms"] + b["bwd_ms"] for b in layers) / sum(a["fwd_ms"] + a["bwd_ms"] for a in whole)
    return (f"sum of layer times {total:.3f}x; per layer (those of 1 ms or more, {len(ratios)}) median "
            f"{ratios[len(ratios) // 2]:.3f}x, range {ratios[0]:.3f}-{ratios[-1]:.3f}x") if ratios else f"sum {total:.3f}x"


def _child(*args: str) -> dict:
    """Run one measured process (`--as ROLE ...`): a fresh Python, or with --smoke a fork of this
    one (`_forked`); the JSON it printed last."""
    if FORK_CHILDREN:
        return _forked(*args)
    out = subprocess.run([sys.executable, __file__, *args], check=True, capture_output=True, text=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


FORK_CHILDREN = False  # --smoke: its figures mean nothing, and a fresh Python a process costs 2 CPU-s of imports


def _forked(*args: str) -> dict:
    """`_child` as a fork of this process, which has imported torch and pdtool's launcher once
    (`_preimport`); what it prints goes to a file, read once it has ended."""
    import multiprocessing

    with tempfile.NamedTemporaryFile("r") as out:
        child = multiprocessing.get_context("fork").Process(target=_role_into, args=(list(args[1:]), out.name))
        child.start()
        child.join()
        if child.exitcode:
            raise SystemExit(f"big_model {' '.join(args)} failed (exit {child.exitcode})")
        return json.loads(out.read().strip().splitlines()[-1])


def _role_into(argv: list[str], path: str) -> None:
    with open(path, "w") as out:
        sys.stdout = out
        try:
            _role(argv)
        finally:
            sys.stdout = sys.__stdout__


def _preimport() -> None:
    """What the forked children use, imported once before the first fork."""
    import torch  # noqa: F401

    import pdtool.cli  # noqa: F401
    import pdtool.runtime.launcher.train  # noqa: F401


def _role(argv: list[str]) -> None:
    """Act as one measured process: `ROLE ARGS...` (pd, train or reference)."""
    role, rest = argv[0], argv[1:]
    {"pd": lambda: _pd(rest), "train": lambda: _train(*rest), "reference": lambda: _reference(rest[0])}[role]()


def main() -> None:
    if sys.argv[1:2] == ["--as"]:  # one of the processes measured (_child)
        _role(sys.argv[2:])
        return
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--in-features", type=int, default=4096)
    parser.add_argument("--hidden", type=int, default=4096)
    parser.add_argument("--depth", type=int, default=28)
    parser.add_argument("--smoke", action="store_true", help="tiny sizes: that it runs to its end (the tests run it), not its figures")
    args = parser.parse_args()
    if args.smoke:
        global WORKERS, FORK_CHILDREN
        args.in_features, args.hidden, args.depth = 64, 64, 4
        WORKERS, FORK_CHILDREN = 2, True
        _preimport()
    kwargs = dict(in_features=args.in_features, hidden=args.hidden, depth=args.depth, classes=10)
    params = args.in_features * args.hidden + args.hidden + (args.depth - 1) * (args.hidden ** 2 + args.hidden) \
        + args.hidden * 10 + 10
    model_bytes = 4 * params
    with tempfile.TemporaryDirectory() as folder:
        profile, plan = os.path.join(folder, "big.profile.json"), os.path.join(folder, "big.plan.json")
        model_args = [a for k, v in kwargs.items() for a in ("-a", f"{k}={v}")]
        whole = os.path.join(folder, "whole.profile.json")
        common = ["profile", "-m", "pdtool.zoo:mlp", *model_args, "-b", "8", "--repeats", "3", "--warmup", "1", "-q"]
        profiled_whole = _child("--as", "pd", *common, "-o", whole)
        budget = f"{max(1, model_bytes // 2 ** 21)}MiB"  # half the model's parameters
        profiled = _child("--as", "pd", *common, "--memory", budget, "-o", profile)
        agreement = _agreement(whole, profile)
        # the same comparison on a model of the same layers that profiles whole with room to spare
        small_agreement = agreement  # at depth 8 or less (--smoke) the model above is that model
        if args.depth > 8:
            small_args = [a for k, v in dict(kwargs, depth=8).items() for a in ("-a", f"{k}={v}")]
            small = [os.path.join(folder, f"small-{how}.profile.json") for how in ("whole", "layers")]
            small_common = ["profile", "-m", "pdtool.zoo:mlp", *small_args, "-b", "8", "--repeats", "3", "--warmup",
                            "1", "-q"]
            _child("--as", "pd", *small_common, "-o", small[0])
            _child("--as", "pd", *small_common, "--layerwise", "-o", small[1])
            small_agreement = _agreement(*small)
        planned = _child("--as", "pd", "plan", profile, "-c", f"{WORKERS}x10GB/s", "--straight", "-o", plan)
        trained = _child("--as", "train", plan)
        reference = _child("--as", "reference", plan)
        checkpoints = os.path.join(folder, "ckpt")
        recipe = _child("--as", "train", plan, checkpoints)  # AdamW, a checkpoint after each step
        exported = _child("--as", "pd", "export", checkpoints, "-o", os.path.join(folder, "export"))
        ranks = _torchrun(plan, os.path.join(folder, "torchrun-ckpt"))
    print(f"model: pdtool.zoo:mlp {kwargs}: {params / 1e6:.0f}M parameters, {model_bytes / 2 ** 30:.2f} GiB of fp32")
    rows = [("pd profile (whole model)", profiled_whole["peak"]),
            (f"pd profile --memory {budget} (by layer)", profiled["peak"]),
            ("pd plan", planned["peak"]), ("pd train launcher", trained["launcher"])]
    rows += [(f"worker rank {r} (stage {trained['stages'][r]})", peak) for r, peak in trained["workers"].items()]
    rows += [("one-process reference (not pdtool)", reference["peak"]),
             ("pd train launcher, AdamW + checkpoints", recipe["launcher"])]
    rows += [(f"  worker rank {r} (stage {recipe['stages'][r]})", peak) for r, peak in recipe["workers"].items()]
    rows += [("pd export of the checkpoint", exported["peak"])]
    rows += [(f"torchrun rank {r}, AdamW + checkpoints" + (" (completes them)" if r == "0" else ""), peak)
             for r, peak in ranks.items()]
    for name, peak in rows:
        print(f"  {name:40} peak RSS {peak / 2 ** 20:8.0f} MiB  = {peak / model_bytes:.2f} x the model's parameters")
    print("workers beyond their start, measured / planned (AdamW with checkpoints; flush, 4 microbatches a step):")
    for r in recipe["beyond"]:
        print(f"  rank {r} (stage {recipe['stages'][r]}): {recipe['beyond'][r] / 2 ** 20:.0f} MiB / "
              f"{recipe['planned'][r] / 2 ** 20:.0f} MiB = {recipe['beyond'][r] / recipe['planned'][r]:.2f}")
    print(f"layer by layer against whole-model profiling: {agreement}")
    print(f"  the same with depth {min(args.depth, 8)} (whole profiling with room to spare): {small_agreement}")
    got = [trained["losses"][b] for b in sorted(trained["losses"], key=int)]
    want = [reference["losses"][b] for b in sorted(reference["losses"], key=int)]
    import math

    close = all(math.isclose(g, w, rel_tol=1e-5, abs_tol=1e-6) for g, w in zip(got, want)) and len(got) == len(want)
    print(f"losses, pipeline:      {' '.join(f'{x:.6f}' for x in got)}")
    print(f"losses, one process:   {' '.join(f'{x:.6f}' for x in want)}  ({'equal' if close else 'DIFFERENT'} "
          "within rtol 1e-5)")


if __name__ == "__main__":
    with recorded("big_model"):
        main()
