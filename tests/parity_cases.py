"""Parity cases run inside one multi-process launch per world size (process groups are shared).

Run by `tests/dist_worker.py` under torchrun; results are written as JSON for the pytest side to
assert on. Every case trains the same tiny model from the same initial weights for STEPS steps under
a plan and on one process, and compares them with `modelpar.verify.compare`.
"""

from __future__ import annotations

import torch

from modelpar.models import build_gpt, build_mlp
from modelpar.plan import ParallelPlan
from modelpar.train.task import classification_loss, lm_loss

STEPS = 10
GLOBAL_BATCH = 8
SEQ = 16


def gpt_task():
    model = build_gpt("gpt-nano", seq_len=SEQ, seed=0)      # 2 blocks, 2 heads, width 64
    model4 = build_gpt("gpt-nano", seq_len=SEQ, n_layer=4, seed=0)

    def batch_fn(step):
        g = torch.Generator().manual_seed(1000 + step)
        w = torch.randint(0, 256, (GLOBAL_BATCH, SEQ + 1), generator=g)
        return w[:, :-1], w[:, 1:]
    return model, model4, lm_loss, batch_fn


def mlp_task():
    model = build_mlp([32, 64, 64, 32, 10], seed=0)          # 4 Linears: col/row/col/row under TP

    def batch_fn(step):
        g = torch.Generator().manual_seed(2000 + step)
        return torch.randn(GLOBAL_BATCH, 32, generator=g), torch.randint(0, 10, (GLOBAL_BATCH,), generator=g)
    return model, model, classification_loss, batch_fn


# name -> (world size, task, plan fields, optimizer, local batch size or 0 for global / dp, grad clip)
CASES: dict[str, tuple] = {}


def _case(name, world, task, plan, optimizer="adamw", local=0, clip=0.0, blocks4=False):
    CASES[name] = (world, task, plan, optimizer, local, clip, blocks4)


for task in ("gpt", "mlp"):
    _case(f"{task}-ddp2", 2, task, dict(dp_replicate=2))
    _case(f"{task}-fsdp2", 2, task, dict(dp_shard=2))
    _case(f"{task}-tp2", 2, task, dict(tp=2))
    _case(f"{task}-pp2-gpipe", 2, task, dict(pp=2, pp_schedule="gpipe", n_microbatches=2))
    _case(f"{task}-pp2-1f1b", 2, task, dict(pp=2, pp_schedule="1f1b", n_microbatches=4))
    _case(f"{task}-fsdp2-ac", 2, task, dict(dp_shard=2, activation_checkpointing="full"))
    _case(f"{task}-ddp2xtp2", 4, task, dict(dp_replicate=2, tp=2))
    _case(f"{task}-fsdp2xtp2", 4, task, dict(dp_shard=2, tp=2))
_case("mlp-ddp2-sgd", 2, "mlp", dict(dp_replicate=2), optimizer="sgd")
_case("mlp-tp2-sgd", 2, "mlp", dict(tp=2), optimizer="sgd")
_case("gpt-ddp2-accum2-clip", 2, "gpt", dict(dp_replicate=2), local=2, clip=0.05)
_case("gpt-fsdp2-accum2-clip", 2, "gpt", dict(dp_shard=2), local=2, clip=0.05)
_case("gpt-tp2-clip", 2, "gpt", dict(tp=2), clip=0.05)


def run_case(name: str, mesh=None, device=None):
    """Run one case on this rank; returns the ParityReport dict on rank 0, None elsewhere."""
    import torch.distributed as dist

    from modelpar.parallel.mesh import MeshInfo
    from modelpar.verify import compare, run_steps

    world, task, plan_fields, optimizer, local, clip, blocks4 = CASES[name]
    model, model4, loss_fn, batch_fn = gpt_task() if task == "gpt" else mlp_task()
    plan = ParallelPlan(**plan_fields).validate(world)
    local = local or GLOBAL_BATCH // plan.dp
    kw = dict(loss_fn=loss_fn, batch_fn=batch_fn, steps=STEPS, global_batch_size=GLOBAL_BATCH,
              optimizer=optimizer, lr=1e-3 if optimizer == "adamw" else 0.05, grad_clip=clip)
    got = run_steps(model, plan, local_batch_size=local, **kw)
    if dist.get_rank() != 0:
        return None
    # the reference: one process, the whole global batch in one forward/backward
    ref = run_steps(model, ParallelPlan(), local_batch_size=GLOBAL_BATCH, mesh=MeshInfo(mesh=None), **kw)
    return compare(name, ref, got, optimizer=optimizer).to_dict()
