"""A 100-layer model trained with activation checkpointing: each layer's activations are recomputed in
backward instead of stored. The script measures the peak tensor memory of a training step with and
without checkpointing, checks that both give the same loss and gradients, then trains a few steps.

Each of the 100 layers is a feed-forward block Linear(d, 4d) -> ReLU -> Linear(4d, d): without
checkpointing every block keeps its 4d-wide interior for backward; with it, only the block's input.

    python examples/activation_checkpointing.py [--tiny]
"""

import torch
import torch.nn as nn
import torch.nn.functional as F

from _launch import tiny
from modelpar import plan_for_strategy
from modelpar.parallel import MeshInfo, parallelize
from modelpar.train.metrics import PeakTensorMemory

torch.set_num_threads(1)
# MODELPAR_TINY (the test): 20 layers; the CPU peak tracker re-walks every live tensor per op, so
# its cost grows with layers squared (100 layers: ~20 s CPU of MemTracker alone, 20 layers: ~1 s)
d, batch, layers = (32, 512, 20) if tiny() else (128, 1024, 100)
device = torch.device("cpu")


def build(seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    blocks = [nn.Sequential(nn.Linear(d, 4 * d), nn.ReLU(), nn.Linear(4 * d, d)) for _ in range(layers)]
    return nn.Sequential(*blocks, nn.Linear(d, 10))


def setup(mode: str):
    model = build()
    plan = plan_for_strategy("ddp", 1, dp_replicate=1, activation_checkpointing=mode)   # one process
    return model, parallelize(model, plan, MeshInfo(None), loss_fn=F.cross_entropy, device=device)


g = torch.Generator().manual_seed(0)
x, y = torch.randn(batch, d, generator=g), torch.randint(0, 10, (batch,), generator=g)
results = {}
for mode in ("none", "full"):
    model, pm = setup(mode)
    with PeakTensorMemory(device) as mem:
        loss = pm.forward_backward(x, y)
    results[mode] = (loss.item(), torch.cat([p.grad.flatten() for p in model.parameters()]), mem.peak)
(loss_a, grad_a, peak_a), (loss_b, grad_b, peak_b) = results["none"], results["full"]
mib = 2 ** 20
n_params = sum(p.numel() for p in build().parameters())
print(f"{layers} layers of width {d} (+ output layer), {n_params:,} parameters, batch {tuple(x.shape)}")
print(f"peak tensor memory of one step, no checkpointing:   {peak_a / mib:8.2f} MiB")
print(f"peak tensor memory of one step, with checkpointing: {peak_b / mib:8.2f} MiB")
print(f"saved {(peak_a - peak_b) / mib:.2f} MiB ({1 - peak_b / peak_a:.0%}) for one extra forward per layer in backward")
print(f"same result: loss {loss_a:.6f} vs {loss_b:.6f}, largest gradient difference "
      f"{(grad_a - grad_b).abs().max().item():.1e}")
model, pm = setup("full")
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
for step in range(3):
    loss = pm.forward_backward(x, y)
    opt.step()
    opt.zero_grad()
    print(f"training with checkpointing, step {step}: loss {loss.item():.4f}")
