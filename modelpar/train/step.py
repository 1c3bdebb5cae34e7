"""One optimizer step over a global batch, shared by `modelpar train` and `modelpar verify`."""

from __future__ import annotations

import torch

from modelpar.parallel.compose import ParallelModel
from modelpar.train.data import global_batch_slice
from modelpar.train.grads import clip_grad_norm_


def train_step(pm: ParallelModel, opt: torch.optim.Optimizer, xg: torch.Tensor, yg: torch.Tensor, *,
               accum_steps: int, grad_clip: float = 0.0) -> tuple[float, int, torch.Tensor]:
    """Forward/backward this rank's slices of the global batch ``(xg, yg)``, clip, and step.

    The global batch is the same on every rank; each data-parallel rank takes its disjoint slices
    (`global_batch_slice`), accumulating ``accum_steps`` local batches, each loss scaled by
    1 / accum_steps so the gradient is that of the global mean loss.

    Returns:
        ``(sum of local-batch mean losses, how many, global grad norm before clipping)``; the loss sum
        is 0 with count 0 on pipeline ranks without the last stage.
    """
    loss_sum, n = 0.0, 0
    for a in range(accum_steps):
        sl = global_batch_slice(len(xg), accum_step=a, num_accum=accum_steps, dp_rank=pm.mesh.dp_rank,
                                dp_degree=pm.plan.dp)
        loss = pm.forward_backward(xg[sl], yg[sl], loss_scale=1.0 / accum_steps,
                                   sync_grads=(a == accum_steps - 1))
        if loss is not None:
            loss_sum += loss.item()
            n += 1
    gnorm = clip_grad_norm_(pm.parameters(), grad_clip, pp_group=pm.mesh.group("pp"))
    opt.step()
    opt.zero_grad(set_to_none=True)
    return loss_sum, n, gnorm
