"""ResNet with torchvision's attribute names and a small-image stem (3x3 conv, no max-pool).

Nothing stored is used in forward, so blocks whose inner channels were sliced (conv1
out-channels, bn1 entries, conv2 in-channels) still run.
"""
from __future__ import annotations

import torch
import torch.nn as nn


def _conv3x3(cin, cout, stride=1):
    return nn.Conv2d(cin, cout, 3, stride=stride, padding=1, bias=False)


class BasicBlock(nn.Module):
    """Two 3x3 conv-BN layers plus a shortcut (identity or `downsample`), ReLU after the sum."""

    expansion = 1

    def __init__(self, inplanes: int, planes: int, stride: int = 1, downsample: nn.Module | None = None):
        super().__init__()
        self.conv1 = _conv3x3(inplanes, planes, stride)
        self.bn1 = nn.BatchNorm2d(planes)
        self.relu = nn.ReLU(inplace=True)
        self.conv2 = _conv3x3(planes, planes)
        self.bn2 = nn.BatchNorm2d(planes)
        self.downsample = downsample
        self.stride = stride

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: [B, inplanes, H, W] -> [B, planes, H/stride, W/stride]."""
        identity = x if self.downsample is None else self.downsample(x)
        out = self.relu(self.bn1(self.conv1(x)))
        return self.relu(self.bn2(self.conv2(out)) + identity)


class Bottleneck(nn.Module):
    """1x1, 3x3 (strided), 1x1 conv-BN layers (planes -> 4 x planes) plus a shortcut, ReLU after the sum."""

    expansion = 4

    def __init__(self, inplanes: int, planes: int, stride: int = 1, downsample: nn.Module | None = None):
        super().__init__()
        self.conv1 = nn.Conv2d(inplanes, planes, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(planes)
        self.conv2 = _conv3x3(planes, planes, stride)
        self.bn2 = nn.BatchNorm2d(planes)
        self.conv3 = nn.Conv2d(planes, planes * 4, 1, bias=False)
        self.bn3 = nn.BatchNorm2d(planes * 4)
        self.relu = nn.ReLU(inplace=True)
        self.downsample = downsample
        self.stride = stride

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: [B, inplanes, H, W] -> [B, 4 * planes, H/stride, W/stride]."""
        identity = x if self.downsample is None else self.downsample(x)
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.relu(self.bn2(self.conv2(out)))
        return self.relu(self.bn3(self.conv3(out)) + identity)


class ResNet(nn.Module):
    """x: [B, in_channels, H, W] -> logits [B, num_classes]; stage widths w, 2w, 4w, 8w."""

    def __init__(self, block, layers, num_classes: int = 10, in_channels: int = 3, width: int = 64):
        super().__init__()
        self.inplanes = width
        self.conv1 = _conv3x3(in_channels, width)
        self.bn1 = nn.BatchNorm2d(width)
        self.relu = nn.ReLU(inplace=True)
        self.layer1 = self._stage(block, width, layers[0], 1)
        self.layer2 = self._stage(block, 2 * width, layers[1], 2)
        self.layer3 = self._stage(block, 4 * width, layers[2], 2)
        self.layer4 = self._stage(block, 8 * width, layers[3], 2)
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(8 * width * block.expansion, num_classes)

    def _stage(self, block, planes, blocks, stride):
        downsample = None
        if stride != 1 or self.inplanes != planes * block.expansion:
            downsample = nn.Sequential(nn.Conv2d(self.inplanes, planes * block.expansion, 1, stride=stride, bias=False),
                                       nn.BatchNorm2d(planes * block.expansion))
        layers = [block(self.inplanes, planes, stride, downsample)]
        self.inplanes = planes * block.expansion
        layers += [block(self.inplanes, planes) for _ in range(1, blocks)]
        return nn.Sequential(*layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: [B, in_channels, H, W] -> logits [B, num_classes]."""
        x = self.relu(self.bn1(self.conv1(x)))
        x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
        return self.fc(torch.flatten(self.avgpool(x), 1))


def resnet18(num_classes: int = 10, in_channels: int = 3, width: int = 64) -> ResNet:
    """ResNet-18 (BasicBlock, [2, 2, 2, 2]) with stage widths width .. 8 x width."""
    return ResNet(BasicBlock, [2, 2, 2, 2], num_classes, in_channels, width)
