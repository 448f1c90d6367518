"""A plain stack of 3x3 convolutions at one resolution: activations large, parameters small
(the opposite of an MLP's big fully connected layers), so data parallelism wins on any link."""
from __future__ import annotations

from torch import nn

from ..consent import factory
from ..model.spec import ModelBundle
from ._data import classifier_bundle


@factory
def convnet(channels: int = 16, depth: int = 6, image_size: int = 32, classes: int = 10) -> ModelBundle:
    """`depth` Conv2d(channels, channels, 3) + ReLU layers on `image_size`^2 RGB images, no pooling
    until the classifier: every cut carries batch x channels x image_size^2 activations."""
    layers: list[nn.Module] = [nn.Conv2d(3, channels, 3, padding=1), nn.ReLU()]
    for _ in range(depth - 1):
        layers += [nn.Conv2d(channels, channels, 3, padding=1), nn.ReLU()]
    model = nn.Sequential(*layers, nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(channels, classes))
    return classifier_bundle(model, (3, image_size, image_size), classes)
