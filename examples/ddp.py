"""Data parallel (DDP): every rank holds the whole model and trains on its own slice of the batch;
gradients are all-reduced so the replicas stay identical.

    python examples/ddp.py [--tiny]
"""

import sys

from _launch import relaunch, tiny

# the launching process only starts the ranks: torch is imported by the ranks, not by it too
if relaunch(__file__, 2):
    sys.exit(0)

import torch
import torch.distributed as dist

from modelpar import plan_for_strategy
from modelpar.models import build_gpt
from modelpar.parallel import build_mesh, get_device, init_distributed, parallelize
from modelpar.launch import exit_rank
from modelpar.train.task import lm_loss

rank, world = init_distributed()
torch.set_num_threads(1)
device = get_device()
model = build_gpt("gpt-nano" if tiny() else "gpt-3m", seed=0)
plan = plan_for_strategy("ddp", world)
pm = parallelize(model, plan, build_mesh(plan, device), loss_fn=lm_loss, device=device)
opt = torch.optim.AdamW(list(pm.parameters()), lr=1e-3)
seq, global_batch = model.cfg.seq_len, 8
g = torch.Generator().manual_seed(0)
tokens = torch.randint(0, 256, (global_batch, seq + 1), generator=g)        # the same global batch everywhere
local = tokens[rank * global_batch // world:(rank + 1) * global_batch // world]  # this rank's slice
for step in range(3):
    loss = pm.forward_backward(local[:, :-1], local[:, 1:])
    opt.step()
    opt.zero_grad()
    print(f"rank {rank}: step {step}, local batch {tuple(local[:, :-1].shape)}, local loss {loss.item():.4f}")
flat = torch.cat([p.detach().flatten() for p in pm.parameters()])
spread = flat.clone()
dist.all_reduce(spread, op=dist.ReduceOp.MAX)
drift = (spread - flat).abs().max().item()
if rank == 0:
    print(f"DDP on {world} ranks: {flat.numel():,} parameters per replica; replicas differ by at most {drift:.1e}")
# every rank is done: leave through modelpar's exit_rank (barrier, flush, exit without tearing the gloo
# group down, which occasionally aborts a rank at interpreter exit)
exit_rank(0)
