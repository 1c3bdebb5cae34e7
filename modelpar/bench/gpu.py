"""The GPU check's measurements (`benchmarks/gpu_check.py` prints them on a CUDA machine): training
MFU, the planner's one-device bf16 prediction, timed one-device training steps, and placement parity
(blocks split over two devices against one device). Every function also runs on CPU (``"cpu"``
devices), which is how the test suite checks them."""

from __future__ import annotations

import copy
import statistics
import time

import torch
import torch.nn.functional as F

GOAL_MFU = 0.45
DENSE_BF16_PEAK = 989e12        # H100 / H200 SXM dense bf16 (NVIDIA datasheets)


def lm_loss(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.float().flatten(0, 1), y.flatten())


def hardware_for_device(name: str, total_memory: int = 0):
    """The built-in profile matching a CUDA device name (`modelpar.planner.hardware.hardware_for_device`)."""
    from modelpar.planner.hardware import hardware_for_device as lookup
    return lookup(name, total_memory)


def mfu(model_flops_per_step: float, step_s: float, peak: float) -> float:
    """Model FLOPs utilization (PaLM App. B): FLOPs per step / (seconds per step x peak FLOP/s)."""
    return model_flops_per_step / (step_s * peak)


def predict(model_name: str, micro_batch: int, hw):
    """(profile, predicted MemoryEstimate, predicted StepEstimate) of one-device bf16 training."""
    from modelpar.models import build_model
    from modelpar.plan import ParallelPlan
    from modelpar.planner.cost import estimate_step
    from modelpar.planner.memory import Batch, estimate_memory
    from modelpar.planner.profile import profile_model
    m = build_model(model_name, device="meta")
    prof = profile_model(m, torch.zeros(1, m.cfg.seq_len, dtype=torch.long, device="meta"),
                         dtype=torch.bfloat16, attention="flash")
    plan = ParallelPlan(precision="bf16")
    batch = Batch(micro_batch, micro_batch)
    return (prof, estimate_memory(prof, plan, batch, optimizer="adamw"),
            estimate_step(prof, plan, batch, hw, optimizer="adamw"))


def train_steps(model_name: str, device: str, *, micro_batch: int, steps: int, precision: str = "bf16",
                compile_model: bool = False, seed: int = 0) -> dict:
    """Train ``steps`` steps of one-device training; returns step seconds, step-3 peak bytes (CUDA) and losses."""
    from modelpar.models import build_model
    from modelpar.parallel.compose import parallelize
    from modelpar.parallel.mesh import MeshInfo
    from modelpar.plan import ParallelPlan

    dev = torch.device(device)
    model = build_model(model_name, device="cpu", seed=seed)
    if compile_model:
        for blk in model.blocks:
            blk.compile()
    pm = parallelize(model, ParallelPlan(precision=precision), MeshInfo(None), loss_fn=lm_loss, device=dev)
    from modelpar.train.step import adamw
    opt = adamw(model.parameters(), lr=1e-4)        # fused, as `modelpar train` runs it
    g = torch.Generator().manual_seed(seed)
    seq = model.cfg.seq_len
    x = torch.randint(0, model.cfg.vocab_size, (micro_batch, seq), generator=g).to(dev)
    y = torch.randint(0, model.cfg.vocab_size, (micro_batch, seq), generator=g).to(dev)
    times, losses, peak = [], [], 0
    cuda = dev.type == "cuda"
    for i in range(steps):
        if cuda and i == 2:
            torch.cuda.synchronize(dev)
            torch.cuda.reset_peak_memory_stats(dev)
        if cuda:
            torch.cuda.synchronize(dev)
        t = time.perf_counter()
        loss = pm.forward_backward(x, y)
        opt.step()
        opt.zero_grad(set_to_none=True)
        if cuda:
            torch.cuda.synchronize(dev)
        times.append(time.perf_counter() - t)
        losses.append(float(loss))
        if cuda and i == 2:
            peak = torch.cuda.max_memory_allocated(dev)
    return {"times": times, "median_s": statistics.median(times[2:] or times), "peak_bytes": peak, "losses": losses}


def placement_check(devices=("cpu", "cuda:0"), *, model_name: str = "gpt-3m", steps: int = 3,
                    batch: int = 4, seed: int = 0) -> dict:
    """Train ``model_name`` with its blocks split over ``devices`` and on ``devices[0]`` alone
    (fp32, SGD, same data); returns both loss lists and the largest relative loss difference."""
    from modelpar.models import build_model
    from modelpar.parallel.compose import parallelize
    from modelpar.parallel.mesh import MeshInfo
    from modelpar.plan import ParallelPlan

    if torch.cuda.is_available():
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
    ref_model = build_model(model_name, device="cpu", seed=seed)
    split_model = copy.deepcopy(ref_model)
    ref = parallelize(ref_model, ParallelPlan(), MeshInfo(None), loss_fn=lm_loss, device=torch.device(devices[0]))
    split = parallelize(split_model, ParallelPlan(placement_devices=tuple(devices)), MeshInfo(None),
                        loss_fn=lm_loss, device=torch.device(devices[0]))
    g = torch.Generator().manual_seed(seed + 1)
    seq = ref_model.cfg.seq_len
    out = {}
    for name, pm, mod in (("reference", ref, ref_model), ("placement", split, split_model)):
        opt = torch.optim.SGD(mod.parameters(), lr=0.1)
        g.manual_seed(seed + 1)
        losses = []
        for _ in range(steps):
            x = torch.randint(0, 256, (batch, seq), generator=g)
            y = torch.randint(0, 256, (batch, seq), generator=g)
            losses.append(float(pm.forward_backward(x, y)))
            opt.step()
            opt.zero_grad(set_to_none=True)
        out[name] = losses
    diff = max(abs(a - b) / abs(a) for a, b in zip(out["reference"], out["placement"]))
    return {**out, "max_rel_diff": diff, "devices": list(devices)}
