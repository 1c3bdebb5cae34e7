"""Data parallel: DDP (replicated model states) and FSDP2 (sharded model states, ZeRO-3).

- DDP: `torch.nn.parallel.DistributedDataParallel`; gradients are averaged by bucketed all-reduce
  overlapped with backward (Li et al. 2020, "PyTorch Distributed"). The buckets are the gradients'
  storage (``gradient_as_bucket_view=True``): no second copy of the gradients (4 B/param) and no
  copy into and out of the buckets.
- FSDP2: `torch.distributed.fsdp.fully_shard` on every block and then the root, so each block's
  parameters are all-gathered just before use and its gradients reduce-scattered just after
  (Rajbhandari et al. 2020, ZeRO stage 3; Zhao et al. 2023, "PyTorch FSDP"). HSDP = a 2-D
  (replicate, shard) mesh.
"""

from __future__ import annotations

import warnings

import torch
import torch.nn as nn


def apply_ddp(model: nn.Module, dp_mesh, *, find_unused_parameters: bool = False) -> nn.Module:
    """Wrap ``model`` in DistributedDataParallel over the 1-D ``dp_mesh``; returns the wrapper.

    Only without TP and PP (`parallelize` uses `apply_replicate` there), so no parameter is a DTensor.
    ``gradient_as_bucket_view=True``: each ``.grad`` is a view into its all-reduce bucket, so the
    buckets cost no memory beyond the gradients (torch's default, False, keeps a bucket copy of every
    gradient). The buckets exist from construction on and persist across steps, also while
    ``zero_grad(set_to_none=True)`` has set ``.grad`` to None.
    """
    from torch.nn.parallel import DistributedDataParallel as DDP

    dev = next(model.parameters()).device
    ids = [dev.index] if dev.type == "cuda" else None
    with warnings.catch_warnings():      # broadcast_buffers' deprecation notice: we keep buffers rank-local
        warnings.simplefilter("ignore", FutureWarning)
        return DDP(model, device_mesh=dp_mesh, device_ids=ids, find_unused_parameters=find_unused_parameters,
                   broadcast_buffers=False, gradient_as_bucket_view=True)


def apply_fsdp(model: nn.Module, dp_mesh, blocks: list[nn.Module], *, precision: str = "fp32",
               reshard_after_forward: bool = True, cpu_offload: bool = False) -> nn.Module:
    """``fully_shard`` each block, then the root (the root's own parameters, e.g. embeddings).

    Args:
        dp_mesh: 1-D mesh (FSDP) or 2-D (dp_replicate, dp_shard) mesh (HSDP).
        precision: "bf16" computes in bf16 with fp32 master weights and fp32 gradient reduction.
        reshard_after_forward: free gathered block parameters after forward (the root's always stay
            gathered between forward and backward, since backward starts with them).
        cpu_offload: keep sharded parameters, gradients and optimizer state in CPU memory.

    Raises:
        ValueError: cpu_offload without CUDA (there is no device memory to save on a CPU-only run).
    """
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard

    if cpu_offload and not torch.cuda.is_available():
        raise ValueError("cpu_offload=True moves FSDP shards from GPU memory to CPU memory; this run has no "
                         "CUDA device, so there is nothing to offload. Drop --cpu-offload.")
    mp = (MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
          if precision == "bf16" else MixedPrecisionPolicy())
    offload = CPUOffloadPolicy() if cpu_offload else OffloadPolicy()
    for block in blocks:
        fully_shard(block, mesh=dp_mesh, mp_policy=mp, offload_policy=offload,
                    reshard_after_forward=reshard_after_forward)
    fully_shard(model, mesh=dp_mesh, mp_policy=mp, offload_policy=offload, reshard_after_forward=False)
    return model


def apply_replicate(model: nn.Module, dp_mesh, blocks: list[nn.Module], *, precision: str = "fp32") -> nn.Module:
    """DDP semantics (replicated states, gradients averaged over ``dp_mesh``) through FSDP2's
    ``replicate`` (`torch.distributed._composable.replicate_with_fsdp`), per block and then the root.

    Used for pipeline stages and under TP: `torch.distributed.pipelining` runs several micro-batch
    forwards before their backwards and drives the gradient reduction of FSDP-style modules itself,
    which the `DistributedDataParallel` reducer does not support (its bucket rebuild fails with
    "rebuilt parameter indices size is not same as original model parameters size"); and DDP's
    DTensor path replaces TP parameters by plain local tensors after each forward, so the module's
    ``parameters()`` and ``state_dict()`` no longer list them.
    """
    from torch.distributed._composable.replicate_with_fsdp import replicate
    from torch.distributed.fsdp import MixedPrecisionPolicy

    mp = (MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
          if precision == "bf16" else MixedPrecisionPolicy())
    for block in blocks:
        replicate(block, mesh=dp_mesh, mp_policy=mp)
    replicate(model, mesh=dp_mesh, mp_policy=mp)
    return model
