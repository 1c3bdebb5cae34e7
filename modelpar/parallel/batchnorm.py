"""BatchNorm and dropout under parallel layouts (case C15): what differs from one device, and why.

BatchNorm in train mode normalises with the statistics of the batch it is given. Under data
parallelism that is each rank's local batch (and, under a pipeline or gradient accumulation, each
micro-batch), so losses and gradients differ from one device that sees the whole global batch:
parity cannot hold, by design. `batchnorm_warning` says so once at `parallelize` (rank 0), and what
``sync_batchnorm`` would do.

- ``sync_batchnorm=True`` converts the model's BatchNorm layers to `torch.nn.SyncBatchNorm` over
  the data-parallel group (`convert_sync_batchnorm`): statistics are then those of the whole
  data-parallel batch (per micro-batch still under pp / accumulation). torch's SyncBatchNorm runs on
  CUDA only, so on CPU it is refused before any process starts (`check_sync_batchnorm`).
- Running statistics (``running_mean``, ``running_var``, the buffers evaluation uses): every rank
  updates its own from its local batches, so without care the ranks evaluate with different buffers
  (this project's DDP is built with ``broadcast_buffers=False``; FSDP2 never touches buffers).
  `BatchNormBufferSync` averages them over the data-parallel group after every optimizer step,
  under DDP and FSDP alike. The running mean is an exponential average, linear in the batch means,
  so the average of the per-rank running means is the running mean of the data-parallel batch
  (equal local batch sizes); the averaged running variance lacks the spread of the rank means
  (the mean of per-rank variances, not the variance of the union).
- Dropout with p > 0 draws its masks per rank: layouts that split a sample's computation (TP, PP)
  draw different masks than one device, so their losses differ by design (`dropout_modules`).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.modules.batchnorm import _BatchNorm


def batchnorm_modules(modules) -> list[tuple[str, nn.Module]]:
    """``(name, module)`` of every BatchNorm layer (1d/2d/3d, not SyncBatchNorm) in ``modules``."""
    out = []
    for mod in modules:
        out += [(n, m) for n, m in mod.named_modules() if isinstance(m, _BatchNorm)
                and not isinstance(m, nn.SyncBatchNorm)]
    return out


def dropout_modules(modules) -> list[tuple[str, float]]:
    """``(name, p)`` of every dropout layer with p > 0 (nn.Dropout*, and modules with a float
    ``dropout`` / ``p`` attribute of a ``*Dropout*`` class)."""
    out = []
    for mod in modules:
        for n, m in mod.named_modules():
            p = getattr(m, "p", None)
            if "Dropout" in type(m).__name__ and isinstance(p, float) and p > 0:
                out.append((n, p))
    return out


def batchnorm_warning(names: list[str], plan, *, sync: bool) -> str:
    """The one warning `parallelize` gives (rank 0) for a model with BatchNorm layers ``names``."""
    head = (f"{len(names)} BatchNorm layer(s) ({', '.join(names[:4])}{' ...' if len(names) > 4 else ''}) use "
            f"batch statistics in train mode: ")
    if sync:
        return head + ("SyncBatchNorm (sync_batchnorm) computes them over the whole data-parallel batch; they "
                       "are still per micro-batch under pipelining or gradient accumulation, so losses differ "
                       "from one device there")
    ranks = f"each rank's local batch ({plan.dp} data-parallel ranks)" if plan.dp > 1 else "each local batch"
    return head + (f"here those of {ranks} and, under pipelining or gradient accumulation, of each "
                   f"micro-batch; not those of the global batch as on one device, so losses and gradients "
                   f"differ from one device (parity cannot hold). --sync-batchnorm (sync_batchnorm=True) "
                   f"would make them SyncBatchNorm over the data-parallel group: statistics of the whole "
                   f"data-parallel batch (CUDA only). Running statistics are averaged over the data-parallel "
                   f"ranks after every optimizer step, so every rank evaluates alike.")


def check_sync_batchnorm(sync: bool, device_type: str, modules=None) -> None:
    """Refuse SyncBatchNorm where torch cannot run it (before any process starts).

    Raises:
        ValueError: ``sync`` (or a `torch.nn.SyncBatchNorm` already in ``modules``) without CUDA.
    """
    have = [n for mod in (modules or []) for n, m in mod.named_modules() if isinstance(m, nn.SyncBatchNorm)]
    if (sync or have) and device_type != "cuda":
        what = (f"the model holds SyncBatchNorm layers ({', '.join(have[:4])})" if have
                else "sync_batchnorm=True (--sync-batchnorm) was asked for")
        raise ValueError(f"{what}, but torch's SyncBatchNorm runs on CUDA tensors only and this run is on "
                         f"{device_type}. " + ("Use plain BatchNorm layers (per-rank statistics) here" if have else
                                               "Drop --sync-batchnorm: BatchNorm then uses per-rank statistics"))


def convert_sync_batchnorm(module: nn.Module, group) -> nn.Module:
    """``module`` with its BatchNorm layers replaced by `torch.nn.SyncBatchNorm` over ``group``
    (the data-parallel process group); call before any wrapping."""
    return nn.SyncBatchNorm.convert_sync_batchnorm(module, process_group=group)


class BatchNormBufferSync:
    """Average BatchNorm running statistics over the data-parallel group (module docstring).

    Args:
        modules: this rank's modules.
        groups: the 1-D process groups spanning data parallelism (``dp_shard`` and/or
            ``dp_replicate``); an average over each in turn is the average over their product.
    """

    def __init__(self, modules, groups: list):
        self.bufs = [b for _, m in batchnorm_modules(modules) if m.track_running_stats
                     for b in (m.running_mean, m.running_var) if b is not None]
        self.groups = [g for g in groups if g is not None]

    def __bool__(self) -> bool:
        return bool(self.bufs and self.groups)

    @torch.no_grad()
    def __call__(self) -> None:
        """One coalesced all-reduce per group (collective: every data-parallel rank calls it)."""
        if not self:
            return
        flat = torch.cat([b.reshape(-1).float() for b in self.bufs])
        for g in self.groups:
            dist.all_reduce(flat, group=g)          # gloo has no AVG: sum, then divide
            flat /= dist.get_world_size(g)
        i = 0
        for b in self.bufs:
            b.copy_(flat[i:i + b.numel()].view_as(b))
            i += b.numel()
