"""Synthetic minibatches for the zoo's models (random inputs, random labels)."""
from __future__ import annotations

import torch
from torch.nn import functional as F

from ..model.spec import ModelBundle


def classifier_bundle(module: torch.nn.Module, input_shape: tuple[int, ...], classes: int) -> ModelBundle:
    """A bundle for a classifier of float inputs of `input_shape` (no batch dim) into `classes`."""

    def make_batch(batch_size: int):
        return torch.randn(batch_size, *input_shape), torch.randint(0, classes, (batch_size,))

    return ModelBundle(module=module, make_batch=make_batch, loss_fn=F.cross_entropy)
