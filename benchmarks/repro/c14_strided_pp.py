"""C14: a 2-stage pipeline whose boundary activation (mode out | slice) or returned gradient (mode in) is
not contiguous; prints the parity line against one process.

usage: torchrun --standalone --nproc-per-node 2 benchmarks/repro/c14_strided_pp.py out|slice|in [SCHEDULE]
"""
import sys
sys.path.insert(0, "tests")
import torch, torch.distributed as dist
from modelpar.parallel.mesh import init_distributed, MeshInfo
from modelpar.plan import ParallelPlan
from modelpar.verify import run_steps, compare
from modelpar.train.task import classification_loss
import parity_cases as pc

init_distributed(30)
torch.set_num_threads(1)
mode = sys.argv[1]
model = pc.StridedNet(mode)
_, batch_fn = pc.mlp_task()
kw = dict(loss_fn=classification_loss, batch_fn=batch_fn, steps=3, global_batch_size=8)
sched = sys.argv[2] if len(sys.argv) > 2 else "1f1b"
got = run_steps(model, ParallelPlan(pp=2, n_microbatches=2, pp_schedule=sched, virtual_stages=1 if sched in ("1f1b", "gpipe") else 2), local_batch_size=8, **kw)
if dist.get_rank() == 0:
    ref = run_steps(model, ParallelPlan(), local_batch_size=8, mesh=MeshInfo(mesh=None), **kw)
    print(compare(f"c14-{mode}", ref, got).line())
from modelpar.launch import exit_rank
exit_rank(0)
