"""A model split over two devices layer by layer: the classic model parallelism.

The first half of the MLP's blocks lives on the first device, the rest on the second; modelpar moves
the activations between them (one process, no process group). With two GPUs the devices are cuda:0
and cuda:1; on a CPU-only machine both halves are "cpu", which shows the mechanics, not a speed-up.

    python examples/two_device_placement.py [--tiny]
"""

import torch
import torch.nn.functional as F

from _launch import tiny
from modelpar import plan_for_strategy
from modelpar.models import build_mlp
from modelpar.parallel import MeshInfo, parallelize

devices = ("cuda:0", "cuda:1") if torch.cuda.device_count() >= 2 else ("cpu", "cpu")
widths = [64, 48, 32, 16, 10] if tiny() else "mlp-large"
model = build_mlp(widths)
plan = plan_for_strategy("placement", 1, placement_devices=devices)
pm = parallelize(model, plan, MeshInfo(None), loss_fn=F.cross_entropy, device=torch.device(devices[0]))
for dev, (a, b) in pm.layout:
    print(f"blocks {a}..{b - 1} on {dev}")
for i, block in enumerate(model):          # show where each block runs and what flows through it
    block.register_forward_hook(lambda m, x, y, i=i: print(
        f"  block {i}: in {tuple(x[0].shape)} on {x[0].device} -> out {tuple(y.shape)} on {y.device}"))
x = torch.randn(16, model[0][0].in_features)
y = torch.randint(0, 10, (16,))
opt = torch.optim.SGD(model.parameters(), lr=0.05)
print("one forward, traced:")
loss = pm.forward_backward(x, y)
for h in [m._forward_hooks for m in model]:
    h.clear()
opt.step()
opt.zero_grad()
for step in range(1, 4):
    loss = pm.forward_backward(x, y)
    opt.step()
    opt.zero_grad()
    print(f"step {step}: loss {loss.item():.4f}")
print(f"placement over {devices}: every block ran on its own device; the loss went down")
