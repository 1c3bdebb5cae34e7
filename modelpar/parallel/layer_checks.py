"""The checks and notes `parallelize` attaches to a model (cases C12, C15): kept here so that
`modelpar.parallel.compose` only calls two functions.

- `prepare_batchnorm` (before any wrapping): refuse ``sync_batchnorm`` without CUDA, convert to
  SyncBatchNorm over the data-parallel group on request, else warn once (rank 0) that BatchNorm
  statistics are per rank / micro-batch (`modelpar.parallel.batchnorm`).
- `attach` (after wrapping, before any forward): the per-step gradient-use check
  (`modelpar.parallel.grad_use`) and the averaging of BatchNorm running statistics.
"""

from __future__ import annotations

import warnings

import torch
import torch.distributed as dist
import torch.nn as nn

from modelpar.parallel import batchnorm
from modelpar.parallel.grad_use import GradUseCheck


class ParallelLayoutWarning(UserWarning):
    """A model whose results differ from one device under this layout by design (BatchNorm, dropout)."""


def _is_rank0() -> bool:
    return not dist.is_initialized() or dist.get_rank() == 0


def dp_groups(mesh) -> list:
    """The 1-D process groups of the data-parallel mesh axes that exist (``dp_shard``, ``dp_replicate``)."""
    if mesh is None or mesh.mesh is None:
        return []
    return [g for g in (mesh.group("dp_shard"), mesh.group("dp_replicate")) if g is not None]


def dp_process_group(mesh):
    """One process group spanning data parallelism (the 2-D HSDP mesh flattened), or None."""
    sub = mesh.sub("dp_replicate", "dp_shard") if mesh is not None else None
    if sub is None:
        return None
    return sub._flatten().get_group() if sub.ndim > 1 else sub.get_group()


def prepare_batchnorm(model: nn.Module, plan, mesh, device: torch.device, *, sync: bool) -> nn.Module:
    """See the module docstring; returns the (possibly converted) model.

    Raises:
        ValueError: ``sync`` (or SyncBatchNorm layers in the model) on a non-CUDA device.
    """
    batchnorm.check_sync_batchnorm(sync, device.type, [model])
    bns = [n for n, m in batchnorm.batchnorm_modules([model]) if m.training]
    if not bns or (plan.dp <= 1 and plan.pp <= 1):
        return model
    if sync and plan.dp > 1:
        model = batchnorm.convert_sync_batchnorm(model, dp_process_group(mesh))
    if _is_rank0():
        warnings.warn(batchnorm.batchnorm_warning(bns, plan, sync=sync and plan.dp > 1), ParallelLayoutWarning,
                      stacklevel=3)
    return model


def attach(pm, *, check_unused_params: bool, find_unused: bool, ddp: bool) -> None:
    """Give ``pm`` its per-step gradient-use check and BatchNorm buffer averaging (multi-rank only)."""
    if pm.mesh.mesh is None or not dist.is_initialized() or dist.get_world_size() < 2:
        return
    if check_unused_params:
        pm.grad_check = GradUseCheck(pm.named_parameters(), (pm.mesh.pp_rank, pm.mesh.tp_rank), ddp=ddp,
                                     find_unused=find_unused)
        if ddp:
            pm.grad_check.attach_reset(pm.wrapped)
    sync = batchnorm.BatchNormBufferSync(pm.modules, dp_groups(pm.mesh))
    pm.buffer_sync = sync if sync else None


def parity_hints(model: nn.Module) -> list[str]:
    """Why a parity check of ``model`` is expected to fail, for `modelpar verify`'s FAIL report."""
    hints = []
    bns = [n for n, m in batchnorm.batchnorm_modules([model])]
    if bns:
        hints.append(f"the model has {len(bns)} BatchNorm layer(s) ({', '.join(bns[:4])}): in train mode they "
                     f"normalise with per-rank (per micro-batch) batch statistics, not the global batch's as on "
                     f"one process (case C15; --sync-batchnorm on CUDA makes them data-parallel-wide)")
    drops = batchnorm.dropout_modules([model])
    if drops:
        hints.append(f"the model has {len(drops)} dropout layer(s) with p > 0 ({', '.join(n for n, _ in drops[:4])}): "
                     f"their random masks differ between layouts; verify needs dropout 0")
    return hints


def dropout_note(model_modules, plan, dropout: float = 0.0) -> str | None:
    """The note `modelpar train` prints once for dropout > 0 under TP or PP (None otherwise)."""
    drops = batchnorm.dropout_modules(model_modules)
    if not (plan.tp > 1 or plan.pp > 1) or not (drops or dropout > 0):
        return None
    p = dropout or max(p for _, p in drops)
    return (f"  note: dropout {p:g} under {'tensor' if plan.tp > 1 else 'pipeline'} parallelism: the dropout "
            f"masks are drawn per rank, so losses differ from a one-device run by design (each layout is a "
            f"valid, differently seeded run; docs/parallelism.md, \"Seeds\")")
