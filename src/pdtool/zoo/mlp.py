"""A multi-layer perceptron: `depth` hidden Linear + ReLU layers, then a Linear classifier."""
from __future__ import annotations

from torch import nn

from ..consent import factory
from ..model.spec import ModelBundle
from ._data import classifier_bundle


@factory
def mlp(in_features: int = 784, hidden: int = 256, depth: int = 3, classes: int = 10) -> ModelBundle:
    """An MLP on flat inputs of `in_features` values, e.g. 28x28 images."""
    layers: list[nn.Module] = []
    width = in_features
    for _ in range(depth):
        layers += [nn.Linear(width, hidden), nn.ReLU()]
        width = hidden
    layers.append(nn.Linear(width, classes))
    return classifier_bundle(nn.Sequential(*layers), (in_features,), classes)
