"""Benchmark of `pd profile`: wall time and how well the per-layer model matches a real step.

For each model it runs the profiler once and prints, side by side from that one run:
the measured whole-step time, the sum of the per-layer forward+backward times, their ratio
(1.0 = the per-layer model is exact), and the profiler's wall time, also in steps. The
Hugging Face rows (GPT-2 small and BERT base from `transformers`, random weights) are captured
by torch.export; they are skipped when `transformers` is missing (`pip install -e '.[hf]'`).

    python bench/profile_speed.py                 # every row
    python bench/profile_speed.py --only hf       # rows whose label contains "hf"
    python bench/profile_speed.py --repeats 10
"""
from __future__ import annotations

import argparse
import time

import torch

from pdtool.artifacts.profile import ModelRef
from pdtool.profiler import profile_model

CASES = [
    ("ResNet-50, batch 8, 224x224", ModelRef("pdtool.zoo:resnet50", {}), 8),
    ("GPT-2 small, batch 4 x 128 tokens", ModelRef("pdtool.zoo:gpt", {"seq_len": 128}), 4),
    ("hf GPT-2 small (GPT2LMHeadModel), batch 4 x 128 tokens",
     ModelRef("pdtool.zoo.hf:gpt2", {"vocab": 50257, "seq_len": 128, "n_embd": 768, "n_head": 12, "n_layer": 12}), 4),
    ("hf BERT base (BertForSequenceClassification), batch 4 x 128 tokens",
     ModelRef("pdtool.zoo.hf:bert", {"vocab": 30522, "seq_len": 128, "hidden": 768, "heads": 12, "layers": 12}), 4),
]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--only", default="", help="run only the rows whose label contains this text")
    args = parser.parse_args()
    try:
        import transformers  # noqa: F401
        has_hf = True
    except ImportError:
        has_hf = False
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, repeats {args.repeats}, warmup {args.warmup}")
    print("| model | tracer | layers | edges | step ms | layer sum ms | layer sum / step | profile wall s | wall / step |")
    print("|---|---|---|---|---|---|---|---|---|")
    for label, ref, batch in CASES:
        if args.only not in label:
            continue
        if label.startswith("hf ") and not has_hf:
            print(f"| {label} | skipped: transformers is not installed | | | | | | | |")
            continue
        start = time.perf_counter()
        profile = profile_model(ref, batch_size=batch, repeats=args.repeats, warmup=args.warmup)
        wall = time.perf_counter() - start
        print(f"| {label} | {profile.method} | {len(profile.layers)} | {len(profile.edges)} | {profile.step_ms:.1f} | "
              f"{profile.layer_sum_ms:.1f} | {profile.layer_sum_over_step:.3f} | {wall:.1f} | "
              f"{wall * 1000 / profile.step_ms:.0f}x |", flush=True)


if __name__ == "__main__":
    main()
