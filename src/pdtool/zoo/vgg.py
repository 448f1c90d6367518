"""VGG-16 (Simonyan and Zisserman 2014, configuration D), with a width knob for small runs."""
from __future__ import annotations

from torch import nn

from ..consent import factory
from ..model.spec import ModelBundle
from ._data import classifier_bundle

# Output channels per convolution at width 64; "M" is a 2x2 max pool.
_CONFIG_D = (64, 64, "M", 128, 128, "M", 256, 256, 256, "M", 512, 512, 512, "M", 512, 512, 512, "M")


class VGG(nn.Module):
    def __init__(self, width: int, image_size: int, hidden: int, classes: int, dropout: float):
        super().__init__()
        layers: list[nn.Module] = []
        channels = 3
        for item in _CONFIG_D:
            if item == "M":
                layers.append(nn.MaxPool2d(2))
            else:
                out = max(1, item * width // 64)
                layers += [nn.Conv2d(channels, out, 3, padding=1), nn.ReLU()]
                channels = out
        self.features = nn.Sequential(*layers)
        side = max(1, min(7, image_size // 32))
        self.avgpool = nn.AdaptiveAvgPool2d(side)
        self.flatten = nn.Flatten()
        self.classifier = nn.Sequential(
            nn.Linear(channels * side * side, hidden), nn.ReLU(), nn.Dropout(dropout),
            nn.Linear(hidden, hidden), nn.ReLU(), nn.Dropout(dropout),
            nn.Linear(hidden, classes),
        )

    def forward(self, x):
        return self.classifier(self.flatten(self.avgpool(self.features(x))))


@factory
def vgg16(width: int = 64, image_size: int = 224, hidden: int = 4096, classes: int = 1000,
          dropout: float = 0.5) -> ModelBundle:
    """VGG-16 on `image_size`x`image_size` RGB images; `width` 64 is the published size."""
    return classifier_bundle(VGG(width, image_size, hidden, classes, dropout), (3, image_size, image_size), classes)
