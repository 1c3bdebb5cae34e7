"""``torch.compile`` of each block, as an option on top of any plan.

`nn.Module.compile` compiles a module in place, so parameter names, state dicts and checkpoints do
not change. Blocks of the same class share one compiled graph (dynamo guards on the code, not on the
instance, with inlined built-in modules), so compile time does not grow with depth.
"""

from __future__ import annotations

import torch.nn as nn


def apply_compile(blocks: list[nn.Module], *, fullgraph: bool = False) -> int:
    """Compile every block in place; returns how many were compiled.

    Raises:
        RuntimeError: from torch.compile, when the backend cannot run here (e.g. no C++ compiler for
            inductor on CPU) -- at the first forward, not here.
    """
    for block in blocks:
        block.compile(fullgraph=fullgraph)
    return len(blocks)
