"""Bring your own model: a tiny Hugging Face GPT-2 learning Python's own source code, byte by byte.

Copy this folder for your model. pdtool needs two things from it, both named by a
`pkg.module:factory` string:

- a **model factory** (`model` below, for `pd profile -m gpt2_text:model`): returns the module
  (built from a config, random weights), a sample minibatch or a function making one, and the
  loss function `loss_fn(output, target)`;
- a **dataset factory** (`text` below, for `pd train --data gpt2_text:text`): returns a torch
  Dataset of `(input, target)` items; with a `train` argument, `train=False` is the held-out split.

The text is the source of a few modules of Python's standard library, read from this Python's
installation: nothing is downloaded. Tokens are bytes (a vocabulary of 256).
"""
from __future__ import annotations

import importlib
import inspect

import torch

import pdtool
from pdtool import ModelBundle
from pdtool.zoo.hf import gpt2

SEQ_LEN = 64
MODULES = ("textwrap", "string", "fractions", "heapq", "bisect", "colorsys", "calendar")


def _corpus() -> torch.Tensor:
    source = "\n".join(inspect.getsource(importlib.import_module(name)) for name in MODULES)
    return torch.tensor(list(source.encode("utf-8")), dtype=torch.long)


class Windows(torch.utils.data.Dataset):
    """Non-overlapping windows of SEQ_LEN + 1 bytes: input the first SEQ_LEN, target the next byte of each."""

    def __init__(self, tokens: torch.Tensor):
        self.tokens = tokens
        self.count = (len(tokens) - 1) // SEQ_LEN

    def __len__(self) -> int:
        return self.count

    def __getitem__(self, i: int):
        window = self.tokens[i * SEQ_LEN: (i + 1) * SEQ_LEN + 1]
        return window[:-1], window[1:]


@pdtool.factory
def text(train: bool = True) -> Windows:
    """The first 90% of the corpus for training, the rest held out."""
    tokens = _corpus()
    cut = len(tokens) * 9 // 10
    return Windows(tokens[:cut] if train else tokens[cut:])


@pdtool.factory
def model(n_embd: int = 128, n_head: int = 4, n_layer: int = 4) -> ModelBundle:
    """GPT-2 over bytes, its output head tied to the token embedding as in GPT-2; the sample
    minibatches are windows of the training text, so profiling sees real shapes."""
    bundle = gpt2(vocab=256, seq_len=SEQ_LEN, n_embd=n_embd, n_head=n_head, n_layer=n_layer)
    data = text(train=True)

    def make_batch(batch_size: int):
        picks = torch.randint(0, len(data), (batch_size,))
        inputs, targets = zip(*(data[int(i)] for i in picks))
        return torch.stack(inputs), torch.stack(targets)

    return ModelBundle(module=bundle.module, make_batch=make_batch, loss_fn=bundle.loss_fn)
