"""The whole model's weights on rank 0 at the end of a run (the run folder's ``model.safetensors``,
``modelpar verify``'s parity check), gathered one tensor at a time so that it is safe at any scale.

What the plain ways cost on a cluster (why this module exists):
- ``get_model_state_dict(m, options=StateDictOptions(full_state_dict=True))`` makes every tensor whole
  on every rank's device at once: a 70B model's 280 GB of fp32 weights on each GPU, at the very end of
  a run. With ``cpu_offload=True`` torch keeps the tensors on global rank 0 only, which holds none of
  the other pipeline stages'.
- ``dist.gather_object`` of the stages' state dicts pickles them into one byte tensor per rank on the
  device, and rank 0 allocates the largest of them once per rank of the group.

Here every rank walks its own stages' state dicts (`get_model_state_dict`: original names, FSDP /
TP shards as DTensors) in the same order as the other ranks of its stage; each DTensor is made whole
by `DTensor.full_tensor` (an all-gather over the tensor's own mesh, the stage's data- and
tensor-parallel ranks), copied to the host by the one rank that keeps it and dropped. The keeping
rank of a stage is its first data- and tensor-parallel rank: the ranks of global rank 0's pipeline
group. Under a pipeline they send their tensors to rank 0 one at a time (`dist.send` / `dist.recv` on
that group, after a `dist.gather_object` of names, shapes and dtypes only). So a rank's device holds
at most one whole tensor beyond its own shards (plus one in flight), no rank but 0 keeps a host copy,
and rank 0 holds the whole model once, in host memory, as the file it writes needs.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def gather_full_state_dict(pm) -> dict[str, torch.Tensor]:
    """The whole model's state dict (CPU tensors, original names, every stage) on rank 0; ``{}`` on
    the other ranks. Every rank of the run must call it (it runs collectives within each stage and,
    under a pipeline, point-to-point sends from each stage's first rank to rank 0).

    ``pm``: a `modelpar.parallel.compose.ParallelModel` (one process: its modules' own state dicts).
    Memory: see the module docstring (one whole tensor at a time on each device; host copies on rank
    0 only).
    """
    if pm.mesh.mesh is None:            # one process (single device or layer placement)
        return {k: v.detach().to("cpu", copy=True) for m in pm.modules for k, v in m.state_dict().items()}
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    names = pm.mesh.mesh.mesh_dim_names or ()
    keep = pm.mesh.dp_rank == 0 and pm.mesh.tp_rank == 0       # this stage's first rank
    group = pm.mesh.group("pp") if "pp" in names and keep else None
    parts = [get_model_state_dict(m) for m in pm.modules]       # shards (DTensors) under the original names
    rank = dist.get_rank()
    out: dict[str, torch.Tensor] = {}

    def copy(k, t):
        out[k] = t.to("cpu", copy=True)

    if group is None:                   # no pipeline (rank 0 keeps), or a rank that only takes part
        _each_whole(parts, copy if keep else lambda k, t: None)
        return out
    # a pipeline's keeping ranks: rank 0 learns the other stages' names, shapes and dtypes, then
    # receives their tensors, stage by stage, in that order
    meta = [(k, tuple(v.shape), v.dtype) for p in parts for k, v in p.items()]
    metas = [None] * dist.get_world_size(group) if rank == 0 else None
    dist.gather_object(meta, metas, dst=0, group=group)
    if rank != 0:
        _each_whole(parts, lambda k, t: _send(t, pm.device, group))
        return {}
    _each_whole(parts, copy)
    for src, meta in zip(dist.get_process_group_ranks(group)[1:], metas[1:]):
        for k, shape, dtype in meta:
            out[k] = _recv(shape, dtype, src, pm.device, group)
    return out


def _each_whole(parts: list[dict], use) -> None:
    """``use(name, whole tensor)`` for each entry of ``parts``, in order, one tensor alive at a time
    (``use`` must not keep it): a DTensor is made whole by `DTensor.full_tensor` (a collective over
    its mesh), after moving shards held on the host (FSDP's CPU offload) to the mesh's device type."""
    from torch.distributed.tensor import DTensor

    for p in parts:
        for k in list(p):
            v = p[k].detach()
            if isinstance(v, DTensor):
                if v.device.type != v.device_mesh.device_type:
                    v = v.to(v.device_mesh.device_type)
                v = v.full_tensor()
            use(k, v)
            del v


def _send(t: torch.Tensor, device: torch.device, group) -> None:
    """Send ``t``'s bytes to rank 0 and wait until they have left this rank's device (so one tensor
    at most is in flight)."""
    if t.numel() == 0:
        return
    buf = t.contiguous().reshape(-1).view(torch.uint8).to(device)
    dist.send(buf, dst=0, group=group)
    if buf.is_cuda:
        torch.cuda.synchronize(buf.device)


def _recv(shape: tuple, dtype: torch.dtype, src: int, device: torch.device, group) -> torch.Tensor:
    """The tensor of ``shape`` and ``dtype`` that rank ``src`` sends with `_send`, on the host."""
    n = 1
    for d in shape:
        n *= d
    if n == 0:
        return torch.empty(shape, dtype=dtype)
    buf = torch.empty(n * dtype.itemsize, dtype=torch.uint8, device=device)
    dist.recv(buf, src=src, group=group)
    return buf.cpu().view(dtype).reshape(shape)
