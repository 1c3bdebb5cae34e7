"""The classic MLP examples of model-parallel teaching material, as ``nn.Sequential`` chains.

Each is Linear -> ReLU -> ... -> Linear; the blocks are (Linear, ReLU) pairs so every pipeline stage
and every tensor-parallel colwise/rowwise pair falls on a block boundary.
"""

from __future__ import annotations

import torch
import torch.nn as nn

MLP_PRESETS: dict[str, list[int]] = {
    "mlp-small": [1000, 500, 100, 10],
    "mlp-large": [10000, 5000, 2000, 1000, 500, 10],
    "mlp-deep": [100] * 101 + [10],     # 100 layers of width 100, then 10 classes
}


def build_mlp(widths: str | list[int] = "mlp-small", *, seed: int | None = 0,
              device: str | torch.device = "cpu", bias: bool = True) -> nn.Sequential:
    """``widths=[in, h1, ..., out]`` -> Sequential of Linear(+ReLU) blocks.

    Input (batch, in) float32 -> logits (batch, out). Every hidden Linear is followed by ReLU inside
    its block (``nn.Sequential(Linear, ReLU)``); the last block is the bare output Linear.

    Raises:
        ValueError: unknown preset or fewer than two widths.
    """
    if isinstance(widths, str):
        if widths not in MLP_PRESETS:
            raise ValueError(f"unknown MLP preset {widths!r}; valid: {', '.join(MLP_PRESETS)}")
        widths = MLP_PRESETS[widths]
    if len(widths) < 2:
        raise ValueError(f"an MLP needs at least 2 widths (in, out), got {widths}")
    if seed is not None and str(device) != "meta":
        torch.manual_seed(seed)
    blocks = []
    with torch.device(device):
        for i, (a, b) in enumerate(zip(widths[:-1], widths[1:])):
            last = i == len(widths) - 2
            blocks.append(nn.Linear(a, b, bias=bias) if last else nn.Sequential(nn.Linear(a, b, bias=bias), nn.ReLU()))
    return nn.Sequential(*blocks)
