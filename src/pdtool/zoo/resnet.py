"""ResNet-50 (He et al. 2016) with bottleneck blocks; each block's input skips its three convs."""
from __future__ import annotations

from torch import nn

from ..consent import factory
from ..model.spec import ModelBundle
from ._data import classifier_bundle


class Bottleneck(nn.Module):
    expansion = 4

    def __init__(self, in_channels: int, width: int, stride: int):
        super().__init__()
        out = width * self.expansion
        self.conv1 = nn.Conv2d(in_channels, width, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(width)
        self.conv2 = nn.Conv2d(width, width, 3, stride=stride, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(width)
        self.conv3 = nn.Conv2d(width, out, 1, bias=False)
        self.bn3 = nn.BatchNorm2d(out)
        self.relu = nn.ReLU()
        self.downsample = None
        if stride != 1 or in_channels != out:
            self.downsample = nn.Sequential(nn.Conv2d(in_channels, out, 1, stride=stride, bias=False),
                                            nn.BatchNorm2d(out))

    def forward(self, x):
        identity = x if self.downsample is None else self.downsample(x)
        y = self.relu(self.bn1(self.conv1(x)))
        y = self.relu(self.bn2(self.conv2(y)))
        y = self.bn3(self.conv3(y))
        return self.relu(y + identity)


class ResNet(nn.Module):
    def __init__(self, blocks: tuple[int, ...], width: int, classes: int):
        super().__init__()
        self.conv1 = nn.Conv2d(3, width, 7, stride=2, padding=3, bias=False)
        self.bn1 = nn.BatchNorm2d(width)
        self.relu = nn.ReLU()
        self.maxpool = nn.MaxPool2d(3, stride=2, padding=1)
        stages = []
        channels = width
        for index, count in enumerate(blocks):
            stage_width = width * 2 ** index
            stage = []
            for block in range(count):
                stride = 2 if index > 0 and block == 0 else 1
                stage.append(Bottleneck(channels, stage_width, stride))
                channels = stage_width * Bottleneck.expansion
            stages.append(nn.Sequential(*stage))
        self.layer1, self.layer2, self.layer3, self.layer4 = (stages + [nn.Identity()] * 4)[:4]
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(channels, classes)

    def forward(self, x):
        x = self.maxpool(self.relu(self.bn1(self.conv1(x))))
        x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
        return self.fc(self.avgpool(x).flatten(1))


@factory
def resnet50(width: int = 64, image_size: int = 224, classes: int = 1000,
             blocks: tuple[int, ...] | list[int] = (3, 4, 6, 3)) -> ModelBundle:
    """ResNet-50 on RGB images; `width` 64 and blocks (3, 4, 6, 3) are the published size."""
    blocks = tuple(blocks)
    if not 1 <= len(blocks) <= 4 or min(blocks) < 1:
        raise ValueError(f"blocks must list 1 to 4 positive counts, got {list(blocks)}")
    return classifier_bundle(ResNet(blocks, width, classes), (3, image_size, image_size), classes)
