"""2-rank scenarios (``kind: "call"`` in `helpers.ckpt_worker`) of the end-of-run weight gather
(`modelpar.train.gather.gather_full_state_dict`) on an MLP of 16 x Linear(1024, 1024) (67 MB fp32, 4 MB a weight):
the state rank 0 gets equals the model's, and each rank's peak host memory during the gather (Linux
``VmHWM``, reset just before it through ``/proc/self/clear_refs``) above its resident memory before it.
On CPU the device is the host, so the peak counts the whole tensors a rank makes as well as the copies
it keeps. glibc's malloc is told to serve every block of 128 KiB or more by mmap (``mallopt``; it
otherwise raises that threshold to the largest block freed and keeps freed blocks resident, so the
peak would count its retention, not the tensors alive at once)."""

from __future__ import annotations

import gc

import torch
import torch.nn as nn

WIDTHS = [1024] * 17


def _status_kb(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"/proc/self/status has no {field}")


def _mmap_large_blocks() -> None:
    import ctypes

    if ctypes.CDLL("libc.so.6").mallopt(-3, 128 * 1024) != 1:       # M_MMAP_THRESHOLD
        raise RuntimeError("mallopt(M_MMAP_THRESHOLD) failed: the peak would count the allocator's retention")


def gather(spec: dict) -> dict:
    """spec["plan"]: `ParallelPlan` fields. Returns every rank's {"rank", "keys", "peak_mb"} and, from
    rank 0, whether its state equals the model's ("equal", "missing") and the model's MB."""
    import torch.distributed as dist

    from modelpar.models.mlp import build_mlp
    from modelpar.parallel.compose import parallelize
    from modelpar.parallel.mesh import build_mesh
    from modelpar.plan import ParallelPlan
    from modelpar.train.gather import gather_full_state_dict

    _mmap_large_blocks()
    plan = ParallelPlan(**spec["plan"])
    cpu = torch.device("cpu")
    model = build_mlp(WIDTHS, seed=0)
    ref = {k: v.clone() for k, v in model.state_dict().items()} if dist.get_rank() == 0 else {}
    model_mb = sum(v.numel() * v.element_size() for v in model.state_dict().values()) / 2**20
    pm = parallelize(model, plan, build_mesh(plan, cpu), loss_fn=nn.functional.cross_entropy, device=cpu,
                     example_input=torch.randn(2, WIDTHS[0]))
    del model
    gc.collect()
    dist.barrier()
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")                 # VmHWM := VmRSS
    before = _status_kb("VmRSS")
    sd = gather_full_state_dict(pm)
    peak_mb = (_status_kb("VmHWM") - before) / 1024
    mine = {"rank": dist.get_rank(), "keys": len(sd), "peak_mb": round(peak_mb, 1)}
    ranks = [None] * dist.get_world_size()
    dist.all_gather_object(ranks, mine)
    out = {"ranks": ranks, "model_mb": model_mb}
    if dist.get_rank() == 0:
        out["missing"] = sorted(set(ref) - set(sd))
        out["equal"] = all(k in sd and torch.equal(sd[k], v) for k, v in ref.items())
    return out


def shapes(spec: dict) -> dict:
    """The parameter list a run's checkpoints record (`param_shapes` of `TrainCheckpoints`' holder) under
    spec["plan"]: every rank's count of ``all_gather_object`` calls and the size of the group of each,
    and whether its list is the whole model's with global shapes."""
    import types

    import torch.distributed as dist

    from modelpar.models.mlp import build_mlp
    from modelpar.parallel.compose import parallelize
    from modelpar.parallel.mesh import build_mesh
    from modelpar.plan import ParallelPlan
    from modelpar.train.checkpoint import state
    from modelpar.train.checkpoint.resume import TrainCheckpoints

    plan = ParallelPlan(**spec["plan"])
    cpu = torch.device("cpu")
    model = build_mlp(WIDTHS, seed=0)
    want = {n: list(p.shape) for n, p in model.named_parameters()}
    pm = parallelize(model, plan, build_mesh(plan, cpu), loss_fn=nn.functional.cross_entropy, device=cpu,
                     example_input=torch.randn(2 * plan.n_microbatches, WIDTHS[0]))
    cfg = types.SimpleNamespace(ckpt_every=0, ckpt_dir=spec["work"], out_dir=spec["work"], resume="")
    holder = TrainCheckpoints(cfg, pm, None, say=lambda *a: None).holder
    calls = []
    real = dist.all_gather_object

    def counting(out, obj, group=None):
        calls.append(dist.get_world_size(group))
        return real(out, obj, group=group)

    state.dist.all_gather_object = counting
    try:
        got = state.param_shapes(holder)
    finally:
        state.dist.all_gather_object = real
    mine = {"rank": dist.get_rank(), "group_sizes": calls, "whole": got == want}
    ranks = [None] * dist.get_world_size()
    dist.all_gather_object(ranks, mine)
    return {"ranks": ranks}
