"""A small model zoo in plain torch, each with a configurable size.

Use them as `pd profile --model pdtool.zoo:NAME [--model-arg key=value ...]`:

- `mlp`: a stack of Linear + ReLU layers (a chain);
- `convnet`: 3x3 convolutions at one resolution (large activations, small parameters);
- `vgg16`: VGG-16 (13 convolutions, 3 fully connected layers);
- `resnet50`: ResNet-50 with bottleneck blocks (skip connections cross layers);
- `gpt`: a GPT-style decoder-only transformer language model;
- `llama`: Llama-3 written the way torchtitan writes it (`pd export-plan --to torchtitan` finds its names).

Every factory returns a `ModelBundle` whose batch maker draws synthetic data of the right
shape; default sizes are the published ones, small sizes are a keyword away.
"""
from .convnet import convnet
from .gpt import gpt
from .llama import llama
from .mlp import mlp
from .resnet import resnet50
from .vgg import vgg16

__all__ = ["convnet", "gpt", "llama", "mlp", "resnet50", "vgg16"]
