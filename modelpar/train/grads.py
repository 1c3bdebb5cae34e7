"""Gradient norm and clipping over every shard and pipeline stage.

The norm is the L2 norm of the whole model's gradient, as one device would compute it: DTensor
gradients (FSDP / TP shards, also TP shards that DDP holds as local tensors) are reduced through
their own mesh by DTensor, plain gradients are
counted once (they are replicated across TP and DP ranks), and the squared norms of the pipeline
stages are summed over the ``pp`` group (case C3). Every rank then applies the same clip factor.
"""

from __future__ import annotations

from collections import defaultdict

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor


@torch.no_grad()
def global_grad_norm(params, *, pp_group=None) -> torch.Tensor:
    """L2 norm (0-dim float32 tensor) of all gradients of ``params`` across shards and stages."""
    plain: list[torch.Tensor] = []
    groups: dict[tuple, list[torch.Tensor]] = defaultdict(list)
    for p in params:
        g = p.grad
        if g is None:
            continue
        if isinstance(g, DTensor):
            groups[(id(g.device_mesh), g.placements)].append(g)
        else:
            plain.append(g)
    dev = (plain[0].device if plain else next(iter(groups.values()))[0].device) if (plain or groups) else "cpu"
    sq = torch.zeros((), dtype=torch.float32, device=dev)
    for g in plain:
        # the norm in fp32 without a squared (or upcast) copy of the gradient: on CPU a copy of a
        # large gradient is a fresh allocation (page faults), as costly as the arithmetic
        sq += torch.linalg.vector_norm(g.detach(), 2.0, dtype=torch.float32).pow(2)
    for gs in groups.values():
        n = torch.nn.utils.get_total_norm(gs, 2.0)
        n = n.full_tensor() if isinstance(n, DTensor) else n
        sq += n.float().to(dev).pow(2)
    if pp_group is not None:
        dist.all_reduce(sq, group=pp_group)
    return sq.sqrt()


@torch.no_grad()
def clip_grad_norm_(params, max_norm: float, *, pp_group=None, norm_params=None) -> torch.Tensor:
    """Scale gradients so their global norm is at most ``max_norm``; returns the norm before clipping.

    ``max_norm <= 0`` only measures. Clip factor min(1, max_norm / (norm + 1e-6)) as in
    `torch.nn.utils.clip_grad_norm_`. ``norm_params``: the parameters this rank counts in the norm
    (default ``params``); a tied parameter held on several pipeline ranks is counted on one of them
    (`ParallelModel.norm_parameters`, case C13) and clipped on all.
    """
    params = list(params)
    norm = global_grad_norm(params if norm_params is None else norm_params, pp_group=pp_group)
    if max_norm > 0:
        coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
        grads = [p.grad for p in params if p.grad is not None]
        plain = [g for g in grads if not isinstance(g, DTensor)]
        shards = [g.to_local() for g in grads if isinstance(g, DTensor)]
        by_device: dict[torch.device, list[torch.Tensor]] = defaultdict(list)
        for g in plain:
            by_device[g.device].append(g)
        for dev, gs in by_device.items():
            # one foreach call per device: on CPU each tensor gets the mul_ kernel a loop would run
            torch._foreach_mul_(gs, coef.to(dev))
        if shards:
            # DTensor gradients: scale the local shards by the one coefficient (a scalar factor
            # commutes with every placement), without one DTensor dispatch per tensor; the factor
            # stays a device tensor: reading it on the host (``.item()``) would make every step wait
            # here for the backward on a GPU before the optimizer's kernels are queued
            torch._foreach_mul_(shards, coef.to(shards[0].device))
    return norm
