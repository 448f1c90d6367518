"""Benchmark of `pd profile`: wall time and how well the per-layer model matches a real step.

For each model it runs the profiler once and prints, side by side from that one run:
the measured whole-step time, the sum of the per-layer forward+backward times, their ratio
(1.0 = the per-layer model is exact), and the profiler's wall time, also in steps.

    python bench/profile_speed.py                 # ResNet-50 (batch 8, 224x224) and GPT-2 small (batch 4 x 128 tokens)
    python bench/profile_speed.py --repeats 10
"""
from __future__ import annotations

import argparse
import time

import torch

from pdtool.profile import ModelRef
from pdtool.profiler import profile_model

CASES = [
    ("ResNet-50, batch 8, 224x224", ModelRef("pdtool.zoo:resnet50", {}), 8),
    ("GPT-2 small, batch 4 x 128 tokens", ModelRef("pdtool.zoo:gpt", {"seq_len": 128}), 4),
]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=2)
    args = parser.parse_args()
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, repeats {args.repeats}, warmup {args.warmup}")
    print("| model | layers | edges | step ms | layer sum ms | layer sum / step | profile wall s | wall / step |")
    print("|---|---|---|---|---|---|---|---|")
    for label, ref, batch in CASES:
        start = time.perf_counter()
        profile = profile_model(ref, batch_size=batch, repeats=args.repeats, warmup=args.warmup)
        wall = time.perf_counter() - start
        print(f"| {label} | {len(profile.layers)} | {len(profile.edges)} | {profile.step_ms:.1f} | "
              f"{profile.layer_sum_ms:.1f} | {profile.layer_sum_over_step:.3f} | {wall:.1f} | "
              f"{wall * 1000 / profile.step_ms:.0f}x |", flush=True)


if __name__ == "__main__":
    main()
