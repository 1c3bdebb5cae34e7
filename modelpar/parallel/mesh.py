"""Process groups and the N-D DeviceMesh of a plan."""

from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from modelpar.plan import ParallelPlan


def get_device() -> torch.device:
    """``cuda:LOCAL_RANK`` where CUDA exists, else ``cpu``."""
    if torch.cuda.is_available():
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)) % torch.cuda.device_count())
    return torch.device("cpu")


def init_distributed(timeout_s: float = 60.0) -> tuple[int, int]:
    """Initialise the default process group from torchrun's environment (NCCL on CUDA, gloo on CPU).

    Returns ``(rank, world_size)``; ``(0, 1)`` without a launcher (no process group is made).
    """
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world == 1 and "RANK" not in os.environ:
        return 0, 1
    if not dist.is_initialized():
        dev = get_device()
        backend = "nccl" if dev.type == "cuda" else "gloo"
        if dev.type == "cuda":
            torch.cuda.set_device(dev)
        store = _attempt_store(timeout_s)
        if store is not None:       # case C11: a store of this restart attempt only
            dist.init_process_group(backend=backend, store=store, rank=int(os.environ["RANK"]),
                                    world_size=world, timeout=timedelta(seconds=timeout_s))
        else:
            dist.init_process_group(backend=backend, timeout=timedelta(seconds=timeout_s))
    return dist.get_rank(), dist.get_world_size()


def _attempt_store(timeout_s: float):
    """Under torchrun's agent store: a `PrefixStore` on it named by ``TORCHELASTIC_RESTART_COUNT``.

    Case C11: the launcher's store outlives a restart, so a restarted attempt that rendezvouses on it
    unprefixed can read the first attempt's peer addresses (gloo: 'connectFullMesh failed ...
    Connection refused', or a hang). Keys of attempt ``n`` live under ``modelpar/attempt{n}/``.
    None outside torchrun's agent store (plain ``env://`` is used then).
    """
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() != "true" or "MASTER_PORT" not in os.environ:
        return None
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    base = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                         timeout=timedelta(seconds=timeout_s))
    return dist.PrefixStore(f"modelpar/attempt{attempt}/pg", base)


@dataclass
class MeshInfo:
    """The mesh of a plan, and this rank's coordinates on it (all 0 / None on one process)."""

    mesh: object | None
    dp_rank: int = 0            # index of this rank's slice of the batch, in [0, dp)
    tp_rank: int = 0
    pp_rank: int = 0

    def sub(self, *names: str):
        """Sub-mesh over the named axes that exist (None if none of them do)."""
        if self.mesh is None:
            return None
        have = [n for n in names if n in (self.mesh.mesh_dim_names or ())]
        if not have:
            return None
        return self.mesh[tuple(have)] if len(have) > 1 else self.mesh[have[0]]

    def group(self, name: str):
        m = self.sub(name)
        return m.get_group() if m is not None else None


def build_mesh(plan: ParallelPlan, device: torch.device) -> MeshInfo:
    """`init_device_mesh` over the plan's named axes (``pp, dp_replicate, dp_shard, tp``)."""
    axes = plan.mesh_axes()
    if not axes or not dist.is_initialized():
        return MeshInfo(mesh=None)
    from torch.distributed.device_mesh import init_device_mesh

    names, sizes = zip(*axes)
    mesh = init_device_mesh(device.type, tuple(sizes), mesh_dim_names=tuple(names))
    coord = {n: mesh.get_local_rank(n) for n in names}
    dp_rank = coord.get("dp_replicate", 0) * plan.dp_shard + coord.get("dp_shard", 0)
    return MeshInfo(mesh=mesh, dp_rank=dp_rank, tp_rank=coord.get("tp", 0), pp_rank=coord.get("pp", 0))

