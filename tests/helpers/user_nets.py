"""User models written as a user would, for `modelpar verify --model helpers.user_nets:<factory>`
(`tests/test_hybrid_verify_cmd.py` runs the command with ``tests/`` as the working directory)."""

import torch
import torch.nn as nn


class UserNet(nn.Module):
    """A user model in the ModuleList form: stem -> layers -> classifier."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(3)
        self.stem = nn.Linear(12, 24)
        self.layers = nn.ModuleList(nn.Sequential(nn.Linear(24, 24), nn.Tanh()) for _ in range(4))
        self.classifier = nn.Linear(24, 5)

    def forward(self, x):
        x = self.stem(x)
        for layer in self.layers:
            x = layer(x)
        return self.classifier(x)


def make_user_net():
    return UserNet()


def make_mislabelled_loss():
    """A sum loss declared as a mean: the data-parallel gradient is off by the DP degree -> FAIL."""
    return {"model": UserNet(), "loss_fn": lambda out, y: nn.functional.cross_entropy(out, y, reduction="sum"),
            "loss_reduction": "mean"}
