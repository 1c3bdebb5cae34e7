"""Activation checkpointing: recompute each block's activations in backward instead of storing them.

Non-reentrant `torch.utils.checkpoint` (Chen et al. 2016, "Training Deep Nets with Sublinear Memory
Cost"). Non-reentrant is the default on purpose (case C8): the reentrant variant gives no gradient to
a block's parameters when the block's input does not require grad.

The block's ``forward`` is replaced in place (no wrapper module), so parameter names, state dicts and
checkpoints are the same with and without checkpointing.
"""

from __future__ import annotations

import functools

import torch.nn as nn
from torch.utils.checkpoint import checkpoint


def _checkpointed(forward, *args, **kwargs):
    return checkpoint(forward, *args, use_reentrant=False, **kwargs)


def apply_ac(blocks: list[nn.Module], *, mode: str = "full") -> int:
    """Checkpoint every block in ``blocks`` (``mode="full"``); ``"none"`` does nothing.

    Returns the number of blocks checkpointed. Raises ValueError for an unknown mode.
    """
    if mode == "none":
        return 0
    if mode != "full":
        raise ValueError(f"activation_checkpointing={mode!r} is unknown; valid: none, full")
    for block in blocks:
        if getattr(block, "_modelpar_ac", False):
            continue
        block.forward = functools.partial(_checkpointed, block.forward)
        block._modelpar_ac = True
    return len(blocks)
