"""MLPs: a residual MLP (pre-norm blocks, the block- and neuron-level SDP workhorse) and a
plain Linear/ReLU stack."""
from __future__ import annotations

import torch
import torch.nn as nn


class ResidualMLPBlock(nn.Module):
    """`x + fc2(act(fc1(norm(x))))`; x: `[*, width]`. Nothing stored is used in forward, so a
    block whose hidden width was sliced (fc1 rows, fc2 columns) still runs."""

    def __init__(self, width: int, hidden: int):
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.fc1 = nn.Linear(width, hidden)
        self.act = nn.GELU()
        self.fc2 = nn.Linear(hidden, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: [B, width] -> [B, width]."""
        return x + self.fc2(self.act(self.fc1(self.norm(x))))


class ResidualMLP(nn.Module):
    """stem -> depth residual blocks -> norm -> head. x: [B, in_features] -> logits [B, num_classes]."""

    def __init__(self, in_features: int, num_classes: int, width: int = 128, depth: int = 4,
                 hidden: int | None = None):
        super().__init__()
        self.stem = nn.Linear(in_features, width)
        self.blocks = nn.ModuleList(ResidualMLPBlock(width, hidden or 4 * width) for _ in range(depth))
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: [B, in_features] (or [B, ...], flattened) -> logits [B, num_classes]."""
        x = self.stem(x.flatten(1))
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


def plain_mlp(in_features: int, num_classes: int, hidden=(256, 256, 256)) -> nn.Sequential:
    """Linear/ReLU stack; the planner masks alternate hidden layers (docs/design.md §1.1)."""
    layers, width = [nn.Flatten()], in_features
    for h in hidden:
        layers += [nn.Linear(width, h), nn.ReLU()]
        width = h
    layers.append(nn.Linear(width, num_classes))
    return nn.Sequential(*layers)
