"""Preflight scenarios (cases C1, C2, C9, C12, C15, frozen DDP parameters) run inside a multi-process launch by tests/helpers/ckpt_worker.py."""

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
    if kind == "c12":
        return case_c12(spec["plan"], spec["split_at"], spec.get("check", True), spec.get("find_unused", False))
    if kind == "c15":
        return case_c15(spec["plan"])
    if kind == "frozen_ddp":
        return case_frozen_ddp()
    if kind == "ddp_accum_early_only":
        return case_ddp_accum_early_only()
    if kind == "gathered_bytes":
        return case_gathered_bytes(spec["plan"])
    raise ValueError(f"unknown scenario kind {kind!r}")


class Branchy(nn.Module):
    """Case C12: from the step ``split_at`` on, rank 0's forward uses branch ``a``, the others ``b``
    (same shapes, so a positional reduction pairs them up silently); before it, both."""

    def __init__(self, split_at: int):
        super().__init__()
        torch.manual_seed(0)
        self.inp, self.a, self.b, self.out = nn.Linear(8, 16), nn.Linear(16, 16), nn.Linear(16, 16), nn.Linear(16, 4)
        self.split_at, self.step = split_at, 0

    def forward(self, x):
        h = self.inp(x).relu()
        if self.step >= self.split_at:
            h = (self.a if dist.get_rank() == 0 else self.b)(h)
        else:
            h = self.a(h) + self.b(h)
        return self.out(h.relu())


def _local_slice(n: int = 8):
    r, w = dist.get_rank(), dist.get_world_size()
    return slice(r * n // w, (r + 1) * n // w)


def case_c12(plan_fields: dict, split_at: int, check: bool = True, find_unused: bool = False) -> dict:
    """C12: train 3 steps; with the check on, the step ``split_at`` must raise (the caller compares
    the ranks' messages). With DDP's find_unused_parameters the split is handled: the gradients at the
    split step must be the mean over ranks of each rank's own gradients (zeros where unused)."""
    plan = ParallelPlan(**plan_fields).validate(dist.get_world_size())
    model = Branchy(split_at)
    ref = copy.deepcopy(model)
    pm = parallelize(model, plan, build_mesh(plan, CPU), loss_fn=F.cross_entropy, device=CPU,
                     check_unused_params=check, find_unused_parameters=find_unused)
    opt = torch.optim.SGD(pm.parameters(), lr=0.1)
    ropt = torch.optim.SGD(ref.parameters(), lr=0.1)
    x, y = _batch()
    worst = 0.0
    for s in range(3):
        model.step = ref.step = s
        train_step(pm, opt, x, y, accum_steps=1)
        # the data-parallel reference: this rank's gradient on its slice, averaged over ranks
        F.cross_entropy(ref(x[_local_slice()]), y[_local_slice()]).backward()
        for p in ref.parameters():
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            dist.all_reduce(p.grad)
            p.grad /= dist.get_world_size()
        ropt.step()
        ropt.zero_grad()
        got = dict(pm.named_parameters())
        for n, p in ref.named_parameters():
            g = got[n].full_tensor() if hasattr(got[n], "full_tensor") else got[n]
            worst = max(worst, (g.detach() - p.detach()).abs().max().item())
    return {"steps": 3, "max_param_diff_vs_dp_reference": worst}


class BNNet(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.seq = nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 4))

    def forward(self, x):
        return self.seq(x)


def case_c15(plan_fields: dict) -> dict:
    """C15: BatchNorm under DDP / FSDP: one warning on rank 0 only at parallelize; after one step
    the running mean equals one device's (an average of per-rank exponential averages); after three
    steps every rank holds the same running statistics; sync_batchnorm on CPU is refused."""
    import warnings

    plan = ParallelPlan(**plan_fields).validate(dist.get_world_size())
    model = BNNet()
    ref = copy.deepcopy(model)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        pm = parallelize(model, plan, build_mesh(plan, CPU), loss_fn=F.cross_entropy, device=CPU)
    msgs = [str(w.message) for w in seen if "BatchNorm" in str(w.message)]
    counts = [None] * dist.get_world_size()
    dist.all_gather_object(counts, len(msgs))
    opt = torch.optim.SGD(pm.parameters(), lr=0.1)
    x, y = _batch()
    train_step(pm, opt, x, y, accum_steps=1)
    ref(x)                                             # one device: statistics of the whole batch
    bn, rbn = model.seq[1], ref.seq[1]
    mean_diff = (bn.running_mean - rbn.running_mean).abs().max().item()
    var_diff = (bn.running_var - rbn.running_var).abs().max().item()
    for s in range(2):
        train_step(pm, opt, *_batch(seed=s + 1), accum_steps=1)
    mine = torch.cat([bn.running_mean, bn.running_var])
    every = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(every, mine)
    spread = max((e - every[0]).abs().max().item() for e in every)
    refused = None
    try:
        parallelize(BNNet(), plan, build_mesh(plan, CPU), loss_fn=F.cross_entropy, device=CPU, sync_batchnorm=True)
    except ValueError as e:
        refused = str(e)
    return {"warnings": msgs, "warnings_per_rank": counts, "mean_diff_after_1": mean_diff, "var_diff_after_1": var_diff,
            "rank_spread_after_3": spread, "refused": refused}


def case_frozen_ddp() -> dict:
    """DDP, then the first layer frozen after wrapping: one error naming it on every rank (instead of
    torch's "Expected to have finished reduction" at the next step)."""
    plan = ParallelPlan(dp_replicate=dist.get_world_size())
    model = _mlp()
    pm = parallelize(model, plan, build_mesh(plan, CPU), loss_fn=F.cross_entropy, device=CPU)
    opt = torch.optim.SGD(pm.parameters(), lr=0.1)
    x, y = _batch()
    train_step(pm, opt, x, y, accum_steps=1)
    model[0].weight.requires_grad_(False)
    for _ in range(2):
        train_step(pm, opt, x, y, accum_steps=1)
    return {"trained": True}


class EarlyOnly(nn.Module):
    """Branch ``b`` is used in the first accumulation micro-batch of a step only (on every rank)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b, self.out = nn.Linear(8, 16), nn.Linear(8, 16), nn.Linear(16, 4)
        self.calls = 0

    def forward(self, x):
        self.calls += 1
        h = self.a(x) + (self.b(x) if self.calls % 2 == 1 else 0)
        return self.out(h.relu())


def case_ddp_accum_early_only() -> dict:
    """DDP with 2 accumulation micro-batches, ``b`` used in the first only: DDP reduces in the second's
    backward, where ``b`` gets nothing, so it would fail at the next forward; one error names ``b``."""
    plan = ParallelPlan(dp_replicate=dist.get_world_size())
    pm = parallelize(EarlyOnly(), plan, build_mesh(plan, CPU), loss_fn=F.cross_entropy, device=CPU)
    opt = torch.optim.SGD(pm.parameters(), lr=0.1)
    x, y = _batch()
    for _ in range(2):
        train_step(pm, opt, x, y, accum_steps=2)
    return {"trained": True}


class LongNames(nn.Module):
    """24 layers named as deeply as a Hugging Face model's (``model.layers.N.self_attn.o_proj``)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.names = [f"decoder_layer_{i:03d}_self_attention_output_projection" for i in range(24)]
        for i, n in enumerate(self.names):
            setattr(self, n, nn.Linear(8 if i == 0 else 16, 4 if i == 23 else 16))

    def forward(self, x):
        for n in self.names:
            x = getattr(self, n)(x)
        return x


def case_gathered_bytes(plan_fields: dict) -> dict:
    """A good run's checks gather no parameter names: 3 steps of a model with 48 long-named
    parameters (FSDP or DDP, first-step checks and the per-step check on), recording the pickled size
    of every object `all_gather_object` is given. Then a C1 model (an unused layer), to show the names
    are still gathered and named when there is something to report."""
    import pickle

    sizes = []
    real = dist.all_gather_object

    def counting(out, obj, group=None):
        sizes.append(len(pickle.dumps(obj)))
        return real(out, obj, group=group)

    plan = ParallelPlan(**plan_fields).validate(dist.get_world_size())
    pm = parallelize(LongNames(), plan, build_mesh(plan, CPU), loss_fn=F.cross_entropy, device=CPU)
    opt = torch.optim.AdamW(pm.parameters(), lr=1e-2)
    dist.all_gather_object = counting
    try:
        install_first_step_checks(pm.named_parameters(), opt)
        x, y = _batch()
        for _ in range(3):
            train_step(pm, opt, x, y, accum_steps=1)
        good = list(sizes)
        error = None
        pm1 = parallelize(WithUnused(), plan, build_mesh(plan, CPU), loss_fn=F.cross_entropy, device=CPU)
        try:
            train_step(pm1, torch.optim.AdamW(pm1.parameters(), lr=1e-2), x, y, accum_steps=1)
        except ValueError as e:
            error = str(e)
    finally:
        dist.all_gather_object = real
    names_bytes = len(pickle.dumps([n for n, _ in pm.named_parameters()]))
    return {"good_run_sizes": good, "names_bytes": names_bytes, "c1_error": error,
            "c1_sizes": sizes[len(good):], "params": len(list(pm.named_parameters()))}
