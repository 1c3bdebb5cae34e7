"""Preflight scenarios (cases C1, C2, C9) run inside a multi-process launch by tests/ckpt_worker.py."""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from modelpar.parallel.compose import parallelize
from modelpar.parallel.mesh import build_mesh
from modelpar.plan import ParallelPlan
from modelpar.train.preflight_checks import check_optimizer_params, check_same_steps, install_first_step_checks
from modelpar.train.step import train_step

CPU = torch.device("cpu")


class WithUnused(nn.Module):
    """Case C1: ``unused`` is never called by forward."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Linear(8, 16)
        self.blocks = nn.ModuleList([nn.Linear(16, 16), nn.Linear(16, 16)])
        self.head = nn.Linear(16, 4)
        self.unused = nn.Linear(16, 4)

    def forward(self, x):
        x = self.embed(x)
        for b in self.blocks:
            x = torch.relu(b(x))
        return self.head(x)


def _batch(n=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, 8, generator=g), torch.randint(0, 4, (n,), generator=g)


def _mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 4))


def case_c1(plan_fields: dict) -> dict:
    """DDP/FSDP with an unused layer: the first step must raise one error naming it on every rank."""
    torch.manual_seed(0)
    plan = ParallelPlan(**plan_fields).validate(dist.get_world_size())
    pm = parallelize(WithUnused(), plan, build_mesh(plan, CPU), loss_fn=F.cross_entropy, device=CPU)
    opt = torch.optim.AdamW(pm.parameters(), lr=1e-2)
    install_first_step_checks(pm.named_parameters(), opt)
    x, y = _batch()
    for _ in range(2):
        train_step(pm, opt, x, y, accum_steps=1)
    return {"trained": True}


def case_c9() -> dict:
    """FSDP: (a) a no-grad forward after wrapping and before the optimizer is built; one step must
    update the parameters exactly as on one process. (b) an optimizer built before wrapping is refused."""
    plan = ParallelPlan(dp_shard=dist.get_world_size())
    model = _mlp()
    ref = copy.deepcopy(model)
    pm = parallelize(model, plan, build_mesh(plan, CPU), loss_fn=F.cross_entropy, device=CPU)
    x, y = _batch()
    with torch.no_grad():
        pm.evaluate(x[:2], y[:2])                       # the sanity check that made stale tensors
    opt = torch.optim.SGD(pm.parameters(), lr=0.1)
    check_optimizer_params(pm.named_parameters(), opt)
    install_first_step_checks(pm.named_parameters(), opt)
    train_step(pm, opt, x, y, accum_steps=1)
    ropt = torch.optim.SGD(ref.parameters(), lr=0.1)
    F.cross_entropy(ref(x), y).backward()
    ropt.step()
    got = {n: p.full_tensor() for n, p in pm.named_parameters()}
    diff = max((got[n] - p.detach()).abs().max().item() for n, p in ref.named_parameters())
    moved = min((got[n] - p0).abs().max().item() for (n, p0) in _mlp().named_parameters())
    stale_error = None
    m2 = _mlp()
    opt2 = torch.optim.SGD(m2.parameters(), lr=0.1)     # built before wrapping
    pm2 = parallelize(m2, plan, build_mesh(plan, CPU), loss_fn=F.cross_entropy, device=CPU)
    try:
        check_optimizer_params(pm2.named_parameters(), opt2)
    except ValueError as e:
        stale_error = str(e)
    return {"max_param_diff_vs_reference": diff, "min_param_change": moved, "stale_error": stale_error}


def case_c2(num_steps_by_rank: bool) -> dict:
    """C2: (a) ranks asked for different step counts -> one error on every rank; (b) evaluation of 10
    samples on 4 ranks, local batch 2, no dropping: each sample counted once (equals one process)."""
    from modelpar.train.loop import Batches, evaluate
    from modelpar.train.task import Task

    rank, world = dist.get_rank(), dist.get_world_size()
    if num_steps_by_rank:
        check_same_steps(10 + (rank == world - 1))
        return {}
    plan = ParallelPlan(dp_shard=world)
    model = _mlp()
    ref = copy.deepcopy(model)
    pm = parallelize(model, plan, build_mesh(plan, CPU), loss_fn=F.cross_entropy, device=CPU)
    x, y = _batch(10, seed=3)
    task = Task("mlp", "classify", model, None, (x, y), F.cross_entropy, 1, {})
    got = evaluate(pm, task, Batches(8, 2, 1, 2))
    with torch.no_grad():
        want = F.cross_entropy(ref(x), y).item()
    check_same_steps(10)
    return {"eval": got, "reference": want}


def run(spec: dict) -> dict:
    kind = spec["kind"]
    if kind == "c1":
        return case_c1(spec["plan"])
    if kind == "c9":
        return case_c9()
    if kind == "c2":
        return case_c2(spec.get("steps_differ", False))
    raise ValueError(f"unknown scenario kind {kind!r}")
