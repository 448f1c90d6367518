"""Benchmark of `pd profile`: wall time and how well the per-layer model matches a real step.

For each model it runs the profiler once and prints, side by side from that one run:
the measured whole-step time, the sum of the per-layer forward+backward times, their ratio
(1.0 = the per-layer model is exact; the target is 0.85-1.15 on every family), and the
profiler's wall time, also in steps. The Hugging Face rows (`transformers` models from configs,
random weights: GPT-2 small and BERT base, then one of each other family at a small size: an
encoder-decoder (T5, its batches dicts of keyword inputs with the labels, the model's own loss),
a mixture of experts (Mixtral), a state-space model (Mamba, whose scan is one layer per time
step) and a vision transformer (ViT)) are captured by torch.export; they are skipped when
`transformers` is missing (`pip install -e '.[hf]'`).

    python bench/profile_speed.py                 # every row
    python bench/profile_speed.py --only hf       # rows whose label contains "hf"
    python bench/profile_speed.py --repeats 10
"""
from __future__ import annotations

import argparse
import time

import torch

from pdtool.artifacts.profile import SUM_BAND, ModelRef
from pdtool.profiler import profile_model
from record import recorded  # bench/record.py: the dated result file

CASES = [
    ("ResNet-50, batch 8, 224x224", ModelRef("pdtool.zoo:resnet50", {}), 8),
    ("GPT-2 small, batch 4 x 128 tokens", ModelRef("pdtool.zoo:gpt", {"seq_len": 128}), 4),
    ("hf GPT-2 small (GPT2LMHeadModel), batch 4 x 128 tokens",
     ModelRef("pdtool.zoo.hf:gpt2", {"vocab": 50257, "seq_len": 128, "n_embd": 768, "n_head": 12, "n_layer": 12}), 4),
    ("hf BERT base (BertForSequenceClassification), batch 4 x 128 tokens",
     ModelRef("pdtool.zoo.hf:bert", {"vocab": 30522, "seq_len": 128, "hidden": 768, "heads": 12, "layers": 12}), 4),
    ("hf T5 encoder-decoder (T5ForConditionalGeneration, 4+4 blocks of 256), batch 4 x 128 tokens",
     ModelRef("pdtool.zoo.hf:t5", {"vocab": 8192, "seq_len": 128, "d_model": 256, "heads": 4, "layers": 4}), 4),
    ("hf Mixtral mixture of experts (8 experts, 2 per token, 4 blocks of 256), batch 4 x 128 tokens",
     ModelRef("pdtool.zoo.hf:mixtral", {"vocab": 8192, "seq_len": 128, "hidden": 256, "layers": 4, "experts": 8}), 4),
    ("hf Mamba state-space model (4 blocks of 256), batch 4 x 128 tokens",
     ModelRef("pdtool.zoo.hf:mamba", {"vocab": 8192, "seq_len": 128, "hidden": 256, "layers": 4}), 4),
    ("hf ViT vision transformer (4 blocks of 256, 16x16 patches), batch 8 x 128x128 images",
     ModelRef("pdtool.zoo.hf:vit", {"image_size": 128, "patch": 16, "hidden": 256, "layers": 4}), 8),
]
SMOKE_CASES = [  # --smoke: a zoo model and a Hugging Face one, tiny
    ("zoo GPT, tiny", ModelRef("pdtool.zoo:gpt", {"vocab": 64, "seq_len": 8, "d_model": 16, "heads": 2, "layers": 2}), 2),
    ("hf GPT-2, tiny", ModelRef("pdtool.zoo.hf:gpt2", {"vocab": 64, "seq_len": 8, "n_embd": 16, "n_head": 2,
                                                         "n_layer": 2}), 2),
]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--only", default="", help="run only the rows whose label contains this text")
    parser.add_argument("--smoke", action="store_true", help="tiny sizes: that it runs to its end (the tests run it), not its figures")
    args = parser.parse_args()
    cases = SMOKE_CASES if args.smoke else CASES
    if args.smoke:
        args.repeats, args.warmup = 1, 0
    try:
        import transformers  # noqa: F401
        has_hf = True
    except ImportError:
        has_hf = False
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, repeats {args.repeats}, warmup {args.warmup}")
    print("| model | tracer | layers | edges | step ms | layer sum ms | layer sum / step | within 0.85-1.15 | "
          "profile wall s | wall / step |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for label, ref, batch in cases:
        if args.only not in label:
            continue
        if label.startswith("hf ") and not has_hf:
            print(f"| {label} | skipped: transformers is not installed | | | | | | | | |")
            continue
        start = time.perf_counter()
        profile = profile_model(ref, batch_size=batch, repeats=args.repeats, warmup=args.warmup)
        wall = time.perf_counter() - start
        ratio = profile.layer_sum_over_step
        print(f"| {label} | {profile.method} | {len(profile.layers)} | {len(profile.edges)} | {profile.step_ms:.1f} | "
              f"{profile.layer_sum_ms:.1f} | {ratio:.3f} | {'yes' if SUM_BAND[0] <= ratio <= SUM_BAND[1] else 'NO'} | "
              f"{wall:.1f} | {wall * 1000 / profile.step_ms:.0f}x |", flush=True)


if __name__ == "__main__":
    with recorded("profile_speed"):
        main()
