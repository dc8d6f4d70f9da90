"""Small built-in models, registered as plugins (`model: {name: mlp}`).

They have no BatchNorm or dropout, so a DDP run and a single-process run with the same global
batch follow the same loss trajectory (used by the tests and the CPU demos).
"""

from __future__ import annotations

import torch
from torch import nn


def mlp(in_features: int = 3 * 32 * 32, hidden: int = 256, num_classes: int = 10, depth: int = 2) -> nn.Module:
    """A flatten -> (Linear, ReLU) x depth -> Linear classifier."""
    layers: list[nn.Module] = [nn.Flatten()]
    width = in_features
    for _ in range(depth):
        layers += [nn.Linear(width, hidden), nn.ReLU()]
        width = hidden
    layers.append(nn.Linear(width, num_classes))
    return nn.Sequential(*layers)


class SmallCNN(nn.Module):
    """Three conv blocks and a linear head; any input size (global average pooling)."""

    def __init__(self, num_classes: int = 10, width: int = 32):
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(3, width, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
            nn.Conv2d(width, 2 * width, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
            nn.Conv2d(2 * width, 4 * width, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(1),
        )
        self.head = nn.Linear(4 * width, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.flatten(self.features(x), 1))


def small_cnn(num_classes: int = 10, width: int = 32) -> nn.Module:
    return SmallCNN(num_classes=num_classes, width=width)
