"""C13: a GPT whose head shares the embedding weight under pp=2 (1f1b, or zbvzerobubble on 4 blocks), 5 steps;
prints the largest difference between the tied copies and the parity line against one process.

usage: torchrun --standalone --nproc-per-node 2 benchmarks/repro/c13_tied_pp.py [1f1b|zbvzerobubble]
"""
import sys
sys.path.insert(0, "tests")
import torch, torch.distributed as dist
from modelpar.parallel.mesh import init_distributed
from modelpar.plan import ParallelPlan
from modelpar.parallel.mesh import MeshInfo
from modelpar.verify import run_steps, compare
from modelpar.train.task import lm_loss
import parity_cases as pc

init_distributed(90)
torch.set_num_threads(1)
model, batch_fn = pc.gpt_task(4 if len(sys.argv) > 1 and sys.argv[1] == "zbvzerobubble" else 2)
model.head.out.weight = model.embed.tok.weight
kw = dict(loss_fn=lm_loss, batch_fn=batch_fn, steps=5, global_batch_size=8, optimizer="adamw", lr=1e-3)
plan = ParallelPlan(pp=2, pp_schedule=sys.argv[1] if len(sys.argv) > 1 else "1f1b", n_microbatches=4,
                    virtual_stages=2 if len(sys.argv) > 1 and sys.argv[1] == "zbvzerobubble" else 1)
got = run_steps(model, plan, local_batch_size=8, **kw)
if dist.get_rank() == 0:
    ref = run_steps(model, ParallelPlan(), local_batch_size=8, mesh=MeshInfo(mesh=None), **kw)
    d = (got.state["embed.tok.weight"] - got.state["head.out.weight"]).abs().max().item()
    print(f"pp=2 {plan.pp_schedule}: max |embed.tok.weight - head.out.weight| after 5 steps = {d:.3g}")
    print("reference: tied copies identical:", torch.equal(ref.state["embed.tok.weight"], ref.state["head.out.weight"]))
    print(compare("tied-pp2", ref, got).line())
    for f in compare("tied-pp2", ref, got).failures[:4]:
        print("  ", f)
dist.barrier()
from modelpar.launch import exit_rank
exit_rank(0)
