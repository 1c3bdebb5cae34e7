"""Layer placement: one process, consecutive parts of the model on different devices.

The classic model parallelism (e.g. ``cuda:0`` then ``cuda:1``): each part's parameters live on its
device, and a forward pre-hook moves the incoming activations there, so the model's own ``forward``
is unchanged. Only one device works at a time (no micro-batching); pipelining removes that idle time.
"""

from __future__ import annotations

import torch

from modelpar.parallel.parts import ModelParts, balanced_partition, block_param_costs, stage_ranges


def _to_device_hook(device: torch.device):
    """Move every tensor argument (nested in tuples / lists / dicts too: a Hugging Face block gets its
    rotary tables as a tuple keyword) to ``device``."""
    from torch.utils import _pytree as pytree

    def hook(module, args, kwargs):
        move = lambda t: t.to(device, non_blocking=True) if isinstance(t, torch.Tensor) else t
        return pytree.tree_map(move, args), pytree.tree_map(move, kwargs)
    return hook


def apply_placement(parts: ModelParts, devices: tuple[str, ...] | list[str], *,
                    boundaries: list[int] | None = None,
                    block_costs: list[float] | None = None) -> list[tuple[str, tuple[int, int]]]:
    """Put consecutive blocks on ``devices`` (pre with the first, post with the last).

    Args:
        parts: the model's parts (`get_model_parts`).
        devices: one device string per segment, e.g. ``("cuda:0", "cuda:1")`` or ``("cpu", "cpu")``.
        boundaries: first-block index of every segment after the first; None balances by
            ``block_costs`` (default: parameter count) with an exact contiguous partition.
        block_costs: per-block cost (parameters or FLOPs) used for balancing.

    Returns:
        ``[(device, (first_block, end_block)), ...]``, one entry per segment.

    Raises:
        ValueError: more devices than blocks, bad boundaries, or an unknown device.
    """
    devs = [torch.device(d) for d in devices]
    if parts.form == "forward" and parts.root is not None:
        parts.root.to(devs[0])               # the glue of the model's own forward (rotary tables) runs there
    if boundaries is None:
        boundaries = balanced_partition(block_costs or block_param_costs(parts), len(devs))
    ranges = stage_ranges(parts.num_blocks, boundaries)
    if len(ranges) != len(devs):
        raise ValueError(f"{len(devs)} placement devices need {len(devs) - 1} boundaries, got {boundaries}")
    layout = []
    for dev, (a, b) in zip(devs, ranges):
        for _, m in parts.blocks[a:b]:
            m.to(dev)
            m.register_forward_pre_hook(_to_device_hook(dev), with_kwargs=True)
        layout.append((str(dev), (a, b)))
    for plist, dev in ((parts.pre, devs[0]), (parts.post, devs[-1])):
        for _, m in plist:
            m.to(dev)
            m.register_forward_pre_hook(_to_device_hook(dev), with_kwargs=True)
    return layout
