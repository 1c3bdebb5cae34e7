"""One optimizer step over a global batch, shared by `modelpar train` and `modelpar verify`."""

from __future__ import annotations

import torch

from modelpar.parallel.compose import ParallelModel
from modelpar.train.data import global_batch_slice
from modelpar.train.grads import clip_grad_norm_


def adamw(param_groups, **kw) -> torch.optim.AdamW:
    """``torch.optim.AdamW`` with its fused kernel (``fused=True``: one pass over parameter, gradient
    and both moments per tensor, no temporaries) where torch has one for the parameters' device (CUDA,
    CPU, ...) and the parameters are of one kind (all plain tensors, or all DTensors on one mesh);
    otherwise torch's single-tensor loop (``foreach=False``: torch's multi-tensor kernels refuse lists
    that mix plain tensors and DTensors, as a partly tensor-parallel model has). On CPU the
    single-tensor loop makes two parameter-sized temporaries per tensor and 8 passes; fused measured
    5-7x faster on a 62.5M-parameter MLP (docs/planner.md)."""
    from torch.distributed.tensor import DTensor

    param_groups = list(param_groups)
    groups = param_groups if param_groups and isinstance(param_groups[0], dict) else [{"params": param_groups}]
    kinds = {id(p.device_mesh) if isinstance(p, DTensor) else None for g in groups for p in g["params"]}
    if len(kinds) <= 1:
        try:
            return torch.optim.AdamW(param_groups, fused=True, **kw)
        except (RuntimeError, ValueError):       # a device or dtype without the fused kernel
            pass
    return torch.optim.AdamW(param_groups, foreach=False, **kw)


OPTIMIZERS = ("adamw", "sgd", "sgd_momentum")   # the planner prices the same three (memory.OPTIMIZER_BYTES)


def make_optimizer(params, name: str = "adamw", *, lr: float, weight_decay: float = 0.0,
                   betas: tuple[float, float] = (0.9, 0.95)) -> torch.optim.Optimizer:
    """The one optimizer builder (`modelpar train`, `modelpar verify`, bench and measurement runs).

    ``"adamw"``: `adamw` with decoupled weight decay on parameters of >= 2 dimensions only (matrices
    and embeddings; biases and norm gains take none, as GPT-2 / Megatron-LM train), in two groups,
    matrices first. ``"sgd"``: plain SGD. ``"sgd_momentum"``: SGD with momentum 0.9 (one fp32 state per
    parameter). Only parameters that require gradients are given to it.

    Raises:
        ValueError: an unknown ``name``.
    """
    params = [p for p in params if p.requires_grad]
    if name == "sgd":
        return torch.optim.SGD(params, lr=lr)
    if name == "sgd_momentum":
        return torch.optim.SGD(params, lr=lr, momentum=0.9)
    if name != "adamw":
        raise ValueError(f"optimizer={name!r} is unknown; valid: {', '.join(OPTIMIZERS)}")
    decay = [p for p in params if p.dim() >= 2]
    no_decay = [p for p in params if p.dim() < 2]
    return adamw([{"params": decay, "weight_decay": weight_decay},
                  {"params": no_decay, "weight_decay": 0.0}], lr=lr, betas=betas)


def train_step(pm: ParallelModel, opt: torch.optim.Optimizer, xg: torch.Tensor, yg: torch.Tensor, *,
               accum_steps: int, grad_clip: float = 0.0,
               need_norm: bool = False) -> tuple[torch.Tensor, int, torch.Tensor | None]:
    """Forward/backward this rank's slices of the global batch ``(xg, yg)``, clip, and step.

    The global batch is the same on every rank; each data-parallel rank takes its disjoint slices
    (`global_batch_slice`), accumulating ``accum_steps`` local batches, each loss scaled by
    1 / accum_steps so the gradient is that of the global mean loss. Before clipping, the gradient-use
    check (case C12) runs; after the step, BatchNorm running statistics are averaged (case C15).

    Nothing the caller did not ask for runs per step: no host sync (the loss stays a tensor; the
    caller reads it when it logs) and no global gradient norm unless ``grad_clip > 0`` (clipping
    needs it) or ``need_norm`` (the caller logs it). The norm over every shard and stage costs one
    pass over the gradients plus, under FSDP / TP / PP, a reduction across ranks.

    Raises:
        ValueError: rank-divergent parameter use, or under DDP a ``requires_grad`` changed after
            wrapping (`modelpar.parallel.grad_use`), the same on every rank, before any update.

    Returns:
        ``(sum of local-batch mean losses, how many, global grad norm before clipping)``: the sum a
        0-dim float64 tensor, summed in local-batch order (the same float64 additions as summing
        ``loss.item()`` values); it is 0 with count 0 on pipeline ranks without the last stage. The
        norm is a 0-dim float32 tensor, or None when neither clipping nor ``need_norm`` asked for it.
    """
    loss_sum, n = None, 0
    for a in range(accum_steps):
        sl = global_batch_slice(len(xg), accum_step=a, num_accum=accum_steps, dp_rank=pm.mesh.dp_rank,
                                dp_degree=pm.plan.dp)
        loss = pm.forward_backward(xg[sl], yg[sl], loss_scale=1.0 / accum_steps,
                                   sync_grads=(a == accum_steps - 1))
        if loss is not None:
            lo = loss.detach().to(torch.float64)        # on its device: reading it would sync the host
            loss_sum = lo if loss_sum is None else loss_sum + lo
            n += 1
    if loss_sum is None:
        loss_sum = torch.zeros((), dtype=torch.float64)
    pm.check_grad_use()          # case C12: the data-parallel ranks used the same parameters
    gnorm = None
    if grad_clip > 0 or need_norm:
        params = list(pm.parameters())
        gnorm = clip_grad_norm_(params, grad_clip, pp_group=pm.mesh.group("pp"),
                                norm_params=pm.norm_parameters(params))
    opt.step()
    pm.after_optimizer_step()    # case C15: BatchNorm running statistics agree across dp ranks
    opt.zero_grad(set_to_none=True)
    return loss_sum, n, gnorm
