"""pdtool on one GPU: profile -> plan -> train on the GPU, against a plain PyTorch loop there.

NCCL runs one rank per GPU, so one GPU trains a one-stage plan; pipelines of several stages need a
GPU per worker. On one GPU this bench measures what it can, side by side in one run:

1. `pd profile` of a GPT (`pdtool.zoo:gpt`, default 1024 wide, 12 layers, 1024 tokens, microbatch 8)
   on the GPU in bf16, layer by layer;
2. `pd plan` of that profile for one GPU (one stage) and for 8 GPUs over NVLink-class links
   (`8x400GB/s`, `--memory 120GiB`, flush), with `pd simulate`'s time per minibatch for each;
3. `pd train` of the one-stage plan on the GPU (NCCL, flush, m microbatches per step, AdamW with bf16
   autocast over fp32 master weights, clipping), its steady time per minibatch against the
   simulator's and against
4. a plain PyTorch loop of the same model on the same GPU: bf16 autocast, fp32 weights, AdamW,
   the same m microbatches accumulated per step, `torch.cuda.synchronize` around the timed steps.

The ratio pdtool / plain is what pdtool's runtime costs on one GPU (its process, data, per-action
bookkeeping); the ratio measured / simulated says how well the GPU profile predicts the run.

    python bench/gpu.py                      # on a CUDA machine, about 2 minutes
    python bench/gpu.py --smoke --device cpu  # that it runs (the tests run this), not its figures
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import tempfile
import time

from record import recorded  # bench/record.py: the dated result file


def _plain_ms(args, device) -> float:
    """Time per minibatch of a plain loop: the whole model on `device`, m microbatches a step."""
    import torch

    from pdtool.zoo.gpt import gpt

    torch.manual_seed(0)
    bundle = gpt(vocab=args.vocab, seq_len=args.seq_len, d_model=args.width, heads=args.heads, layers=args.layers)
    model = bundle.module.to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.01)
    batches = [tuple(t.to(device) for t in bundle.make_batch(args.batch)) for _ in range(args.microbatches)]
    autocast = torch.autocast(device.type, dtype=torch.bfloat16)

    def step() -> None:
        for x, y in batches:
            with autocast:
                loss = bundle.loss_fn(model(x), y) / len(batches)
            loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    for _ in range(args.warmup):
        step()
    sync()
    began = time.perf_counter()
    for _ in range(args.steps):
        step()
    sync()
    ms = (time.perf_counter() - began) * 1e3 / (args.steps * len(batches))
    del model, optimizer, batches
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return ms


def _train(plan_path: str, args):
    """pd train's checks and workers, as the CLI calls them: (the resolved config, the result)."""
    from pdtool.artifacts.plan import Plan
    from pdtool.runtime.launcher.job import prepare
    from pdtool.runtime.launcher.session import run
    from pdtool.runtime.recipe import OptimizerConfig
    from pdtool.runtime.run import RunConfig

    config = RunConfig(plan_path=plan_path, steps=args.warmup + args.steps, mode="flush", group=args.microbatches,
                       progress=False, device=args.device, precision="bf16", timeout_s=300,
                       optimizer=OptimizerConfig(name="adamw", lr=1e-4, weight_decay=0.01, clip_grad_norm=1.0))
    job = prepare(Plan.load(plan_path), config)
    return job.config, run(dataclasses.replace(job.config))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--seq-len", type=int, default=1024)
    parser.add_argument("--vocab", type=int, default=50257)
    parser.add_argument("--batch", type=int, default=8, help="samples per microbatch (the profile's batch size)")
    parser.add_argument("--microbatches", type=int, default=4, help="m, microbatches per optimizer step")
    parser.add_argument("--steps", type=int, default=20, help="optimizer steps timed, after the warm-up")
    parser.add_argument("--warmup", type=int, default=5, help="optimizer steps before timing")
    parser.add_argument("--smoke", action="store_true", help="tiny sizes: that it runs to its end, not its figures")
    args = parser.parse_args()
    if args.smoke:
        args.width, args.heads, args.layers, args.seq_len, args.vocab = 32, 2, 2, 16, 64
        args.batch, args.microbatches, args.steps, args.warmup = 4, 2, 4, 2

    import torch

    from pdtool.runtime.launcher import forked

    forked.start_early(args.device, 1)  # the workers' forkserver, forked now as pd train forks it (before any torch work)
    from pdtool.artifacts.plan import Plan
    from pdtool.artifacts.profile import Profile
    from pdtool.cli import cli
    from pdtool.sim.simulate import simulate

    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("bench/gpu.py: torch sees no CUDA GPU; run it on a GPU machine (or --device cpu --smoke)")
    model_args = [f"vocab={args.vocab}", f"seq_len={args.seq_len}", f"d_model={args.width}",
                  f"heads={args.heads}", f"layers={args.layers}"]
    print(f"model: pdtool.zoo:gpt {' '.join(model_args)}, microbatch {args.batch}, m = {args.microbatches}; "
          f"bf16 autocast, AdamW, clipping; {args.steps} steps timed after {args.warmup}")
    with tempfile.TemporaryDirectory() as folder:
        profile_path = os.path.join(folder, "gpt.profile.json")
        began = time.perf_counter()
        cli.main(["profile", "-m", "pdtool.zoo:gpt", *[a for kv in model_args for a in ("-a", kv)],
                  "-b", str(args.batch), "--device", args.device, "--precision", "bf16", "--repeats", "5", "-q",
                  "-o", profile_path], standalone_mode=False)
        profile = Profile.load(profile_path)
        compute = sum(layer.fwd_ms + layer.bwd_ms for layer in profile.layers)
        print(f"pd profile: {len(profile.layers)} layers, forward+backward {compute:.2f} ms a microbatch, "
              f"{sum(layer.param_bytes for layer in profile.layers) / 2**20:.0f} MiB of weights, "
              f"{time.perf_counter() - began:.1f} s")
        plans = {}
        for name, cluster in (("1 GPU", ["--cluster", "1x400GB/s"]),
                              ("8 GPUs", ["--cluster", "8x400GB/s", "--memory", "120GiB"])):
            path = os.path.join(folder, f"{name.split()[0]}.plan.json")
            cli.main(["plan", profile_path, *cluster, "--mode", "flush", "--optimizer", "adamw", "-o", path],
                     standalone_mode=False)
            plans[name] = path
            plan = Plan.load(path)
            group = max(args.microbatches, len(plan.stages))
            simulated = simulate(plan, "flush", group=group).time_per_minibatch_ms
            print(f"pd plan, {name}: {len(plan.stages)} stage(s), replicas {[len(s.ranks) for s in plan.stages]}, "
                  f"simulated {simulated:.2f} ms a minibatch (flush, m = {group})")
        config, result = _train(plans["1 GPU"], args)
        measured = result.time_per_minibatch_ms()
        simulated = simulate(Plan.load(plans["1 GPU"]), "flush", group=args.microbatches).time_per_minibatch_ms
        losses = [result.losses[k] for k in sorted(result.losses)]
        print(f"pd train, one stage on {args.device} ({config.device}): loss {losses[0]:.3f} -> {losses[-1]:.3f}, "
              f"measured {measured:.2f} ms a minibatch, simulated {simulated:.2f} ms "
              f"(measured / simulated {measured / simulated:.2f})")
        plain = _plain_ms(args, device)
        print(f"plain PyTorch loop on {args.device}: {plain:.2f} ms a minibatch")
        print(f"pdtool / plain: {measured / plain:.2f}")


if __name__ == "__main__":
    with recorded("gpu"):
        main()
