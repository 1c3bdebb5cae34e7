"""A small CNN classifier for 8x8 digit images (scikit-learn's bundled digits)."""

from __future__ import annotations

import torch
import torch.nn as nn


def build_cnn(num_classes: int = 10, *, channels: int = 32, seed: int | None = 0) -> nn.Sequential:
    """(batch, 1, 8, 8) float -> logits (batch, num_classes), as a Sequential of 4 blocks."""
    if seed is not None:
        torch.manual_seed(seed)
    c = channels
    return nn.Sequential(
        nn.Sequential(nn.Conv2d(1, c, 3, padding=1), nn.ReLU()),                      # (B, c, 8, 8)
        nn.Sequential(nn.Conv2d(c, 2 * c, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2)),  # (B, 2c, 4, 4)
        nn.Sequential(nn.Flatten(), nn.Linear(2 * c * 16, 128), nn.ReLU()),
        nn.Linear(128, num_classes),
    )
