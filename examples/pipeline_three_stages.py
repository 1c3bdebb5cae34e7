"""A three-stage pipeline: consecutive blocks on three ranks, the batch cut into micro-batches.

Each rank holds one stage; torch.distributed.pipelining's 1F1B schedule runs forward and backward
of the micro-batches so that the stages work at the same time. Runs as 3 local CPU ranks (gloo) or
3 GPUs (NCCL).

    python examples/pipeline_three_stages.py [--tiny]
"""

import sys

from _launch import relaunch, tiny

# the launching process only starts the ranks: torch is imported by the ranks, not by it too
if relaunch(__file__, 3):
    sys.exit(0)

import torch
import torch.distributed as dist
import torch.nn.functional as F

from modelpar import plan_for_strategy
from modelpar.models import build_mlp
from modelpar.parallel import build_mesh, get_device, init_distributed, parallelize
from modelpar.launch import exit_rank

rank, world = init_distributed()
torch.set_num_threads(1)
device = get_device()
widths = [64, 64, 64, 64, 64, 10] if tiny() else "mlp-large"
model = build_mlp(widths, seed=0)                      # same initial weights on every rank
plan = plan_for_strategy("pp", 3, pp_schedule="1f1b", n_microbatches=4)
batch = 16
pm = parallelize(model, plan, build_mesh(plan, device), loss_fn=F.cross_entropy, device=device,
                 example_input=torch.zeros(batch // 4, model[0][0].in_features))
a, b = pm.stage_ranges[pm.stage_indices[0]]
n_params = sum(p.numel() for p in pm.parameters())
print(f"rank {rank}: stage {pm.stage_indices[0]} = blocks {a}..{b - 1}, {n_params:,} parameters, on {device}")
opt = torch.optim.SGD(list(pm.parameters()), lr=0.05)
g = torch.Generator().manual_seed(0)
x = torch.randn(batch, model[0][0].in_features, generator=g)
y = torch.randint(0, 10, (batch,), generator=g)
for step in range(3):
    loss = pm.forward_backward(x, y)                   # 4 micro-batches of 4 samples through 3 stages
    opt.step()
    opt.zero_grad()
    if loss is not None:
        print(f"rank {rank} (last stage): step {step} loss {loss.item():.4f}, micro-batch shape "
              f"{(batch // 4, model[0][0].in_features)} -> logits {(batch // 4, 10)}")
dist.barrier()
if rank == 0:
    print("3-stage pipeline trained: each rank held only its stage's parameters")
# every rank is done: leave through modelpar's exit_rank (barrier, flush, exit without tearing the gloo
# group down, which occasionally aborts a rank at interpreter exit)
exit_rank(0)
