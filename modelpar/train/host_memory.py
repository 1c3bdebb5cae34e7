"""Host memory before a launch on this host: one clear refusal instead of a host that runs out of memory
minutes into the start-up (or kills other jobs' processes).

Two lower bounds, in bytes, against Linux's ``MemAvailable`` (`host_memory_available`):

- the builds: without ``meta_init`` every local rank builds the whole model on the host (fp32, 4 bytes a
  parameter) before it is sharded or cut, all ranks at once: ``ranks x 4 P``;
- the training state, where the device is the host (CPU ranks): every data-parallel replica holds each
  parameter once at least, with its gradient and the optimizer's moments (4 + 4 + 8 bytes for AdamW,
  `planner.memory.OPTIMIZER_BYTES`), however FSDP, TP and the pipeline split them: ``dp_replicate x P x
  (8 + optimizer bytes)`` (activations and buffers come on top: a plan can still fail that passes); a
  frozen parameter (``requires_grad=False``) has no gradient or optimizer state, 4 bytes.
"""

from __future__ import annotations

import torch.nn as nn


def host_memory_available() -> int | None:
    """Bytes of host memory available to new allocations (Linux ``MemAvailable``, /proc/meminfo); None
    where the kernel does not say."""
    from modelpar.planner.hardware import meminfo_bytes

    return meminfo_bytes("MemAvailable")


def check_host_memory(cfg, plan, model: nn.Module, local_ranks: int, available: int | None, *,
                      on_cpu: bool) -> None:
    """Refuse a launch of ``local_ranks`` processes on this host (all of ``plan``'s ranks) whose builds or,
    with ``on_cpu`` (CPU ranks: the device is the host), whose training state exceed ``available`` bytes
    (the module docstring's bounds). ``model``: the model as built on the meta device (its parameter
    count); ``available``: `host_memory_available` (None: nothing checked).

    Raises:
        ValueError: naming the bound, its numbers in GB, the memory available and the way out
            (``--meta-init`` only where the model and the layout take it).
    """
    if available is None:
        return
    from modelpar.planner.memory import OPTIMIZER_BYTES
    from modelpar.train.materialise import meta_buildable

    n = sum(p.numel() for p in model.parameters())      # `parameters()` yields a tied tensor once
    gb = lambda b: f"{b / 1e9:.1f} GB"      # noqa: E731
    if not cfg.meta_init and local_ranks * n * 4 > available:
        sharded = plan.fsdp_enabled or plan.tp > 1 or plan.pp > 1
        if local_ranks > 1 and sharded and not plan.is_placement and meta_buildable(cfg.model):
            way = ("add --meta-init (the model is built on the meta device and each rank allocates only its own "
                   "shards and stages)")
        elif local_ranks > 1 and meta_buildable(cfg.model):
            way = ("--meta-init needs a layout that shards the parameters (--strategy fsdp, hsdp, tp, pp or their "
                   "products, with --meta-init); or launch fewer ranks on this host (--nproc)")
        elif local_ranks > 1:
            way = "launch fewer ranks on this host (--nproc), or train a smaller model"
        else:
            way = "train a smaller model, or on hosts with more memory"
        what = (f"each of the {local_ranks} rank(s) on this host builds the whole model ({n / 1e9:.2f}B parameters, "
                f"{gb(n * 4)} in fp32) before sharding it: {gb(local_ranks * n * 4)} at once" if local_ranks > 1 else
                f"the one process builds the whole model ({n / 1e9:.2f}B parameters, {gb(n * 4)} in fp32)")
        raise ValueError(f"{what}, but this host has {gb(available)} available; {way}")
    per = 8 + OPTIMIZER_BYTES.get(cfg.optimizer, 8)
    # a frozen parameter (requires_grad=False) has neither gradient nor optimizer state: 4 bytes
    frozen = sum(p.numel() for p in model.parameters() if not p.requires_grad)
    need = plan.dp_replicate * (n * per - frozen * (per - 4))
    if on_cpu and need > available:
        of = f"{n / 1e9:.2f}B parameters" + (f" ({frozen / 1e9:.2f}B of them frozen: 4 bytes)" if frozen else "")
        raise ValueError(f"CPU ranks keep the training state in host memory: each parameter with its gradient and "
                         f"{cfg.optimizer} state ({per} bytes) x {of} x {plan.dp_replicate} "
                         f"data-parallel replica(s) = {gb(need)} at least, but this host has {gb(available)} "
                         f"available; " + ("shard instead of replicating (--strategy fsdp), " if plan.dp_replicate > 1
                                             else "") + "train a smaller model, or on GPUs or more hosts")
