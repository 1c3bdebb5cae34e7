"""A factory language model for the tests and docs: token ids (batch, seq) -> logits (batch, seq, 256),
declared with the dict form ``{"model", "task": "lm", "vocab_size", "max_positions"}``."""

import torch
import torch.nn as nn


class TinyLM(nn.Module):
    def __init__(self, vocab: int = 256, width: int = 32, layers: int = 2, positions: int = 32):
        super().__init__()
        self.tok = nn.Embedding(vocab, width)
        self.pos = nn.Embedding(positions, width)
        self.blocks = nn.ModuleList(nn.Sequential(nn.LayerNorm(width), nn.Linear(width, width), nn.GELU())
                                    for _ in range(layers))
        self.head = nn.Linear(width, vocab)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.tok(ids) + self.pos(torch.arange(ids.shape[1], device=ids.device))
        for b in self.blocks:
            h = h + b(h)
        return self.head(h)


def lm():
    torch.manual_seed(0)
    return {"model": TinyLM(), "task": "lm", "vocab_size": 256, "max_positions": 32}


def classifier():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3))


def conv_classifier():
    """The dict form of a classifier whose shapes no nn.Linear gives: (1, 6, 6) inputs, 4 classes."""
    torch.manual_seed(0)
    return {"model": nn.Sequential(nn.Conv2d(1, 4, 6), nn.Flatten()), "task": "classify",
            "input_shape": [1, 6, 6], "num_classes": 4}


def undeclared_conv():
    """A classifier without nn.Linear or declared shapes (refused by train)."""
    return nn.Sequential(nn.Conv2d(1, 4, 6), nn.Flatten())


def with_batch_fn():
    """verify's custom form (its own batch_fn / loss_fn; refused by train)."""
    m = classifier()
    return {"model": m, "batch_fn": lambda step: (torch.zeros(8, 4), torch.zeros(8, dtype=torch.long)),
            "loss_fn": nn.functional.cross_entropy}


def lm_long():
    """`lm` with 96 positions: past the 64 tokens `verify` defaulted to before (the default is now
    max_positions in every command)."""
    torch.manual_seed(0)
    return {"model": TinyLM(positions=96), "task": "lm", "vocab_size": 256, "max_positions": 96}


class ResidualBlock(nn.Module):
    """TinyLM's block with its residual inside: ``h + f(h)``."""

    def __init__(self, width: int):
        super().__init__()
        self.f = nn.Sequential(nn.LayerNorm(width), nn.Linear(width, width), nn.GELU())

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h + self.f(h)


class PipelinedLM(TinyLM):
    """`TinyLM` with the residual inside each block: its forward only chains the blocks, so a pipeline
    stage cut keeps it (TinyLM's own forward adds the residual around each block and is refused)."""

    def __init__(self, vocab: int = 256, width: int = 32, layers: int = 2, positions: int = 32):
        super().__init__(vocab, width, layers, positions)
        self.blocks = nn.ModuleList(ResidualBlock(width) for _ in range(layers))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.tok(ids) + self.pos(torch.arange(ids.shape[1], device=ids.device))
        for b in self.blocks:
            h = b(h)
        return self.head(h)


def lm_pipelined():
    torch.manual_seed(0)
    return {"model": PipelinedLM(), "task": "lm", "vocab_size": 256, "max_positions": 32}


def lm_tied():
    """`PipelinedLM` of 4 layers whose output head is its token embedding (one tensor)."""
    torch.manual_seed(0)
    m = PipelinedLM(layers=4)
    m.head.weight = m.tok.weight
    return {"model": m, "task": "lm", "vocab_size": 256, "max_positions": 32}


def lm_unseeded():
    """A factory that does not seed itself, as each rank of a launch sees it: another RNG state on every
    rank (here made so on purpose), so every rank builds other initial weights."""
    import os

    torch.manual_seed(1000 + int(os.environ.get("RANK", "0")))
    return {"model": PipelinedLM(), "task": "lm", "vocab_size": 256, "max_positions": 32}
