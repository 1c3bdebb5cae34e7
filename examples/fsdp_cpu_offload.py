"""FSDP (ZeRO-3): parameters, gradients and optimizer state sharded over the ranks; with CUDA the
shards are offloaded to CPU memory between uses.

CPU offload only means something where the shards would otherwise live in GPU memory: without CUDA
the example says why it skips offloading and runs plain FSDP.

    python examples/fsdp_cpu_offload.py [--tiny]
"""

import sys

from _launch import relaunch, tiny

# the launching process only starts the ranks: torch is imported by the ranks, not by it too
if relaunch(__file__, 2):
    sys.exit(0)

import torch

from modelpar import plan_for_strategy
from modelpar.models import build_gpt
from modelpar.parallel import build_mesh, get_device, init_distributed, parallelize
from modelpar.launch import exit_rank
from modelpar.train.task import lm_loss

rank, world = init_distributed()
torch.set_num_threads(1)
device = get_device()
offload = device.type == "cuda"
if rank == 0 and not offload:
    print("CPU offload skipped: this machine has no CUDA device, so the FSDP shards already live in CPU "
          "memory and there is no GPU memory to save; running FSDP without offload")
model = build_gpt("gpt-nano" if tiny() else "gpt-3m", seed=0)
full = sum(p.numel() for p in model.parameters())
plan = plan_for_strategy("fsdp", world, cpu_offload=offload)
pm = parallelize(model, plan, build_mesh(plan, device), loss_fn=lm_loss, device=device)
shard = sum(p.to_local().numel() if hasattr(p, "to_local") else p.numel() for p in pm.parameters())
where = {str(p.to_local().device if hasattr(p, "to_local") else p.device) for p in pm.parameters()}
print(f"rank {rank}: holds {shard:,} of {full:,} parameters ({shard / full:.0%}), shards on {sorted(where)}")
opt = torch.optim.AdamW(list(pm.parameters()), lr=1e-3)
seq = model.cfg.seq_len
g = torch.Generator().manual_seed(0)
tokens = torch.randint(0, 256, (8, seq + 1), generator=g)
local = tokens[rank * 4:(rank + 1) * 4]
for step in range(3):
    loss = pm.forward_backward(local[:, :-1].to(device), local[:, 1:].to(device))
    opt.step()
    opt.zero_grad()
    if rank == 0:
        print(f"step {step}: loss on rank 0 {loss.item():.4f}")
if rank == 0:
    print(f"FSDP on {world} ranks, cpu_offload={offload}")
# every rank is done: leave through modelpar's exit_rank (barrier, flush, exit without tearing the gloo
# group down, which occasionally aborts a rank at interpreter exit)
exit_rank(0)
