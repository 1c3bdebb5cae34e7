"""Parity cases run inside one multi-process launch per world size (process groups are shared).

Run by `tests/dist_worker.py` under torchrun; results are written as JSON for the pytest side to
assert on. Every case trains the same tiny model from the same initial weights for ``steps`` steps
under a plan and on one process, and compares them with `modelpar.verify.compare` (losses, final
parameters, and the logged global gradient norm of every step, case C3).

Case kinds (``check``):
- ``"parity"``: the foundation's tolerance against one fp32 process;
- ``"bf16"``: bf16 compute with fp32 master weights: every parameter and optimizer state is fp32
  (asserted), and the loss is within 2% of the fp32 reference at every step from 20 to 50.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F

from modelpar.models import build_gpt, build_mlp
from modelpar.plan import ParallelPlan
from modelpar.train.task import classification_loss, lm_loss

STEPS = 10
GLOBAL_BATCH = 8
SEQ = 16


def lm_loss_sum(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Summed next-byte cross entropy (nats over all tokens): the sum-loss variant of case C4."""
    return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten(), reduction="sum")


def gpt_task(n_layer: int = 2):
    model = build_gpt("gpt-nano", seq_len=SEQ, n_layer=n_layer, seed=0)      # 2 heads, width 64

    def batch_fn(step):
        g = torch.Generator().manual_seed(1000 + step)
        w = torch.randint(0, 256, (GLOBAL_BATCH, SEQ + 1), generator=g)
        return w[:, :-1], w[:, 1:]
    return model, batch_fn


def mlp_task(n_layer: int = 2):
    model = build_mlp([32, 64, 64, 32, 10], seed=0)          # 4 Linears: col/row/col/row under TP

    def batch_fn(step):
        g = torch.Generator().manual_seed(2000 + step)
        return torch.randn(GLOBAL_BATCH, 32, generator=g), torch.randint(0, 10, (GLOBAL_BATCH,), generator=g)
    return model, batch_fn


class Case(NamedTuple):
    """One parity case; ``world`` first so ``case[0]`` is the world size (tests/conftest.py)."""

    world: int
    task: str                   # "gpt" | "mlp"
    plan: dict                  # ParallelPlan fields
    optimizer: str = "adamw"
    local: int = 0              # local batch size; 0: global / dp (no accumulation)
    clip: float = 0.0           # global grad-norm clip (0: off)
    n_layer: int = 2            # GPT blocks (4 or 8 for virtual stages)
    loss: str = "mean"          # "mean" | "sum" (case C4)
    check: str = "parity"       # "parity" | "bf16"
    steps: int = STEPS
    lr: float = 0.0             # 0: 1e-3 for adamw, 0.05 for sgd
    loss_parallel: bool | None = None   # shard the GPT head over vocab, loss without full logits


# name -> Case
CASES: dict[str, Case] = {}


def _case(name, world, task, plan, **kw):
    CASES[name] = Case(world, task, plan, **kw)


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

# ---- issue 3: every pipeline schedule on 2 ranks (multi-stage ones: 2 stages per rank = 4 stages,
# on a 4-block GPT; interleaved also with 4 stages per rank = 8 stages on an 8-block GPT)
_V2 = dict(pp=2, virtual_stages=2, n_microbatches=4)
_case("gpt4-pp2-interleaved1f1b", 2, "gpt", dict(_V2, pp_schedule="interleaved1f1b"), n_layer=4)
_case("gpt8-pp2-interleaved1f1b-v4", 2, "gpt", dict(pp=2, virtual_stages=4, n_microbatches=4,
                                                     pp_schedule="interleaved1f1b"), n_layer=8)
_case("gpt4-pp2-loopedbfs", 2, "gpt", dict(_V2, pp_schedule="loopedbfs"), n_layer=4)
_case("gpt4-pp2-interleavedzerobubble", 2, "gpt", dict(_V2, pp_schedule="interleavedzerobubble"), n_layer=4)
_case("gpt4-pp2-zbvzerobubble", 2, "gpt", dict(_V2, pp_schedule="zbvzerobubble"), n_layer=4)
_case("gpt4-pp2-dualpipev", 2, "gpt", dict(_V2, pp_schedule="dualpipev"), n_layer=4)
# C3: one global clip norm over stages; C4: accumulation over schedule steps, mean and sum losses
_case("gpt-pp2-1f1b-clip", 2, "gpt", dict(pp=2, n_microbatches=2), clip=0.05)
_case("gpt4-pp2-zbv-clip", 2, "gpt", dict(_V2, pp_schedule="zbvzerobubble"), n_layer=4, clip=0.05)
_case("gpt-pp2-1f1b-accum2", 2, "gpt", dict(pp=2, n_microbatches=2), local=4)
_case("gpt-pp2-gpipe-accum2-sum", 2, "gpt", dict(pp=2, pp_schedule="gpipe", n_microbatches=2), local=4,
      loss="sum", optimizer="sgd", lr=1e-4)
_case("gpt4-pp2-interleaved-accum2-sum", 2, "gpt", dict(_V2, pp_schedule="interleaved1f1b", n_microbatches=2),
      n_layer=4, local=4, loss="sum", optimizer="sgd", lr=1e-4)
_case("gpt-ddp2-accum2-sum", 2, "gpt", dict(dp_replicate=2), local=2, loss="sum", optimizer="sgd", lr=1e-4)
_case("gpt-fsdp2-accum2-sum", 2, "gpt", dict(dp_shard=2), local=2, loss="sum", optimizer="sgd", lr=1e-4)
# bf16 with fp32 master weights, 50 steps
_case("gpt-fsdp2-bf16", 2, "gpt", dict(dp_shard=2, precision="bf16"), check="bf16", steps=50)
_case("gpt-pp2-bf16", 2, "gpt", dict(pp=2, n_microbatches=2, precision="bf16"), check="bf16", steps=50)

# ---- hybrids on 4 ranks
_case("gpt-hsdp2x2", 4, "gpt", dict(dp_replicate=2, dp_shard=2))
_case("gpt-pp2xddp2", 4, "gpt", dict(pp=2, dp_replicate=2, n_microbatches=2))
_case("gpt-pp2xfsdp2", 4, "gpt", dict(pp=2, dp_shard=2, n_microbatches=2))
_case("gpt-pp2xtp2", 4, "gpt", dict(pp=2, tp=2, n_microbatches=2))
_case("gpt4-pp2xfsdp2-interleaved-clip", 4, "gpt", dict(_V2, dp_shard=2, pp_schedule="interleaved1f1b",
                                                        n_microbatches=2), n_layer=4, clip=0.05)
_case("gpt-pp2xddp2-accum2-clip", 4, "gpt", dict(pp=2, dp_replicate=2, n_microbatches=2), local=2, clip=0.05)

# ---- 3-D on 8 ranks
_case("gpt-pp2xfsdp2xtp2", 8, "gpt", dict(pp=2, dp_shard=2, tp=2, n_microbatches=2))


def run_case(name: str, mesh=None, device=None):
    """Run one case on this rank; returns the ParityReport dict on rank 0, None elsewhere."""
    import torch.distributed as dist

    from modelpar.parallel.mesh import MeshInfo
    from modelpar.verify import compare, compare_low_precision, run_steps

    c = CASES[name]
    model, batch_fn = gpt_task(c.n_layer) if c.task == "gpt" else mlp_task()
    loss_fn = (lm_loss_sum if c.loss == "sum" else lm_loss) if c.task == "gpt" else classification_loss
    plan = ParallelPlan(**c.plan).validate(c.world)
    local = c.local or GLOBAL_BATCH // plan.dp
    lr = c.lr or (1e-3 if c.optimizer == "adamw" else 0.05)
    kw = dict(loss_fn=loss_fn, batch_fn=batch_fn, steps=c.steps, global_batch_size=GLOBAL_BATCH,
              optimizer=c.optimizer, lr=lr, grad_clip=c.clip, loss_reduction=c.loss)
    got = run_steps(model, plan, local_batch_size=local, loss_parallel=c.loss_parallel, **kw)
    if dist.get_rank() != 0:
        return None
    # the reference: one process, fp32, the whole global batch in one forward/backward
    ref = run_steps(model, ParallelPlan(), local_batch_size=GLOBAL_BATCH, mesh=MeshInfo(mesh=None), **kw)
    if c.check == "bf16":
        return compare_low_precision(name, ref, got, first_step=20, loss_rtol=0.02).to_dict()
    return compare(name, ref, got, optimizer=c.optimizer).to_dict()
