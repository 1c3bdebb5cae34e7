"""No tax over plain torch: what `train_step` and the run loop do per step, counted (not timed).

A plain torch loop does forward, backward, ``optimizer.step()``. Per optimizer step modelpar adds
only the gradient-use check (one small all-reduce, case C12; off with check_unused_params=False);
it reads no loss (``Tensor.item``), computes no global gradient norm unless clipping or a log step
asks for it, and reduces the losses of several steps in one all-reduce (tier 1: no processes; the
collectives are counted on a patched ``torch.distributed``).
"""

from __future__ import annotations

import collections
import contextlib
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

import modelpar.parallel.grad_use as grad_use
import modelpar.train.grads as grads
from modelpar.models import build_gpt
from modelpar.parallel.compose import parallelize
from modelpar.parallel.grad_use import GradUseCheck
from modelpar.parallel.mesh import build_mesh
from modelpar.plan import ParallelPlan
from modelpar.train.step import make_optimizer, train_step
from modelpar.train.task import lm_loss


@contextlib.contextmanager
def counting():
    """Count host reads of tensors and global-norm computations while inside (own patches, undone
    on exit; the caller's stay)."""
    n = collections.Counter()
    with pytest.MonkeyPatch.context() as mp:
        for name in ("item", "tolist"):
            orig = getattr(torch.Tensor, name)

            def wrapped(self, *a, _orig=orig, _name=name, **k):
                n[f"Tensor.{_name}"] += 1
                return _orig(self, *a, **k)
            mp.setattr(torch.Tensor, name, wrapped)
        orig_norm = grads.global_grad_norm

        def norm(*a, **k):
            n["global_grad_norm"] += 1
            return orig_norm(*a, **k)
        mp.setattr(grads, "global_grad_norm", norm)
        yield n


def _one_process_run():
    plan = ParallelPlan()
    pm = parallelize(build_gpt("gpt-nano", seq_len=16, seed=0), plan, build_mesh(plan, torch.device("cpu")),
                     loss_fn=lm_loss, device=torch.device("cpu"))
    opt = make_optimizer(pm.parameters(), "adamw", lr=1e-3, weight_decay=0.1)
    g = torch.Generator().manual_seed(0)
    w = torch.randint(0, 256, (4, 17), generator=g)
    return pm, opt, w[:, :-1], w[:, 1:]


def test_train_step_reads_nothing_and_computes_no_norm_unless_asked(monkeypatch):
    pm, opt, x, y = _one_process_run()
    train_step(pm, opt, x, y, accum_steps=2)                 # optimizer state built outside the count
    with counting() as n:
        out = [train_step(pm, opt, x, y, accum_steps=2) for _ in range(3)]
    assert n == {}, f"per-step work nobody asked for: {dict(n)}"
    assert all(g is None and c == 2 and s.dtype == torch.float64 for s, c, g in out)
    with counting() as n:
        _, _, g1 = train_step(pm, opt, x, y, accum_steps=2, need_norm=True)    # a log step
        _, _, g2 = train_step(pm, opt, x, y, accum_steps=2, grad_clip=1.0)     # clipping needs it
    assert n == {"global_grad_norm": 2} and float(g1) > 0 and float(g2) > 0


def test_train_step_loss_sum_is_the_float64_sum_of_the_local_losses():
    """The loss sum is the same float64 additions as summing ``loss.item()`` values (bitwise)."""
    pm, opt, x, y = _one_process_run()
    seen = []
    orig = pm.forward_backward

    def fb(*a, **k):
        loss = orig(*a, **k)
        seen.append(loss.item())
        return loss
    pm.forward_backward = fb
    s, c, _ = train_step(pm, opt, x, y, accum_steps=4)
    assert c == 4 and s.item() == 0.0 + seen[0] + seen[1] + seen[2] + seen[3]


class _FakeDist:
    """torch.distributed for a 2-rank world seen from rank 0: rank 1 sends ``peer`` (a callable of the
    local tensor) in every all-gather; collectives are counted."""

    def __init__(self, monkeypatch, peer=lambda t: t.clone()):
        self.calls = collections.Counter()
        self.peer = peer
        monkeypatch.setattr(dist, "is_initialized", lambda: True)
        monkeypatch.setattr(dist, "get_world_size", lambda group=None: 2)
        monkeypatch.setattr(dist, "get_backend", lambda group=None: "gloo")
        monkeypatch.setattr(dist, "all_gather_object", self.all_gather_object)
        monkeypatch.setattr(dist, "all_gather", self.all_gather)
        monkeypatch.setattr(dist, "all_reduce", self.all_reduce)

    def all_gather_object(self, out, obj, group=None):
        self.calls["all_gather_object"] += 1
        out[:] = [obj, obj]

    def all_gather(self, out, t, group=None):
        self.calls["all_gather"] += 1
        out[0].copy_(t)
        out[1].copy_(self.peer(t))

    def all_reduce(self, t, op=None, group=None):
        self.calls["all_reduce"] += 1
        if op == dist.ReduceOp.MAX:
            torch.maximum(t, self.peer(t), out=t)
        else:
            t.mul_(2)           # rank 1 holds the same values


def test_grad_use_check_one_small_all_reduce_per_step_and_no_diagnosis_when_clean(monkeypatch):
    lin = torch.nn.Linear(3, 2)
    check = GradUseCheck(lin.named_parameters(), (0, 0))
    fake = _FakeDist(monkeypatch)
    diagnosed = collections.Counter()
    orig = grad_use._diagnose

    def diagnose(*a, **k):
        diagnosed["_diagnose"] += 1
        return orig(*a, **k)
    monkeypatch.setattr(grad_use, "_diagnose", diagnose)
    lin(torch.ones(1, 3)).sum().backward()
    # the first check learns the groups: an all-gather of a few int64 per rank and one all-reduce of
    # the pattern of a clean step; no names (all_gather_object) and no diagnosis
    check()
    assert fake.calls == {"all_gather": 1, "all_reduce": 2} and diagnosed == {}
    # then one all-reduce of the packed marks per step; the one host read per step is the reduced
    # words (a few int64s), not a read per parameter
    with counting() as n:
        for _ in range(2):
            check()
    assert fake.calls == {"all_gather": 1, "all_reduce": 4} and diagnosed == {}
    assert n == {"Tensor.tolist": 2}
    # rank 1 used no bias: its reduced words differ, so the marks are gathered and the bias is named
    weight_only = grad_use._pack([1, 0], 1)

    def peer(t):
        if t.dtype == torch.uint8:                      # the gathered marks
            return torch.tensor([1, 0], dtype=torch.uint8)
        return torch.tensor(weight_only + [-w for w in weight_only], dtype=torch.int64)
    fake.peer = peer
    with pytest.raises(ValueError, match=r"rank-divergent parameter use at step 3 .*bias"):
        check()
    assert diagnosed == {"_diagnose": 1} and fake.calls == {"all_gather": 2, "all_reduce": 5, "all_gather_object": 1}


def test_grad_use_check_gathers_the_names_when_a_group_disagrees_on_its_parameters(monkeypatch):
    """The ranks of one data-parallel group whose parameter digests differ (names or trainable flags):
    the clean pattern comes from the gathered names (`GradUseCheck._learn_groups`), and a clean step
    still passes with one all-reduce."""
    lin = torch.nn.Linear(3, 2)
    check = GradUseCheck(lin.named_parameters(), (0, 0))

    def peer(t):
        return t.clone() if t.dtype != torch.int64 or t.numel() != 4 else t + torch.tensor([0, 0, 0, 1])
    fake = _FakeDist(monkeypatch, peer=peer)
    lin(torch.ones(1, 3)).sum().backward()
    check()
    assert fake.calls == {"all_gather": 1, "all_gather_object": 1, "all_reduce": 1}
    check()
    assert fake.calls == {"all_gather": 1, "all_gather_object": 1, "all_reduce": 2}


def test_grad_use_check_under_ddp_is_local_after_the_first_step(monkeypatch):
    """DDP: the first step is checked collectively, later ones on the rank alone (DDP's buckets
    need every parameter's gradient on every rank, so a rank's own marks decide; `grad_use`)."""
    lin = torch.nn.Linear(3, 2)
    check = GradUseCheck(lin.named_parameters(), (0, 0), ddp=True)
    fake = _FakeDist(monkeypatch)
    monkeypatch.setattr(dist, "get_rank", lambda group=None: 0)
    for _ in range(3):
        check.reset_seen()
        lin(torch.ones(1, 3)).sum().backward()
        check()
    assert fake.calls == {"all_gather": 1, "all_reduce": 2}      # the first step only
    check.reset_seen()
    (lin.weight.sum() * 1.0).backward()                                  # the bias gets nothing
    with pytest.raises(ValueError, match=r"1 trainable parameter\(s\) got no gradient on rank 0 at step 3: bias\. "
                                         r".*rank-divergent use, case C12.*find_unused_parameters=True"):
        check()
    lin.bias.requires_grad_(False)
    with pytest.raises(ValueError, match=r"1 parameter\(s\) changed requires_grad after DDP wrapped the model: "
                                         r"bias \(trainable -> frozen\)"):
        check()
    assert fake.calls == {"all_gather": 1, "all_reduce": 2}


def test_grad_use_reduced_words_equal_the_gathered_marks_exactly():
    """The one-all-reduce test of `GradUseCheck` against the gathered marks: for random marks of 3
    groups x 2 ranks (parameter counts across a word boundary), the reduced words say "all ranks of
    every group sent the same marks" exactly when they did, and then hold those marks."""
    import random

    rng = random.Random(0)
    for width in (1, 30, 31, 32, 70):
        nw = -(-2 * width // grad_use._WORD_BITS)
        for _ in range(50):
            groups = [[rng.choice([0, 1, 1, 1, 2, 3]) for _ in range(width)] for _ in range(3)]
            ranks = []
            for g, m in enumerate(groups):
                other = list(m)
                if rng.random() < 0.5:
                    i = rng.randrange(width)
                    other[i] = rng.choice([v for v in range(4) if v != m[i]])
                ranks += [(g, m), (g, other)]
            bufs = []
            for g, m in ranks:
                flat = [grad_use._EMPTY] * (2 * nw * 3)
                w = grad_use._pack(m, nw)
                flat[2 * nw * g:2 * nw * (g + 1)] = w + [-x for x in w]
                bufs.append(torch.tensor(flat, dtype=torch.int64))
            red = torch.stack(bufs).amax(0).tolist()
            same = all(ranks[2 * g][1] == ranks[2 * g + 1][1] for g in range(3))
            agree = all(red[2 * nw * g + j] == -red[2 * nw * g + nw + j] for g in range(3) for j in range(nw))
            assert agree == same
            if same:
                assert [red[2 * nw * g:2 * nw * g + nw] for g in range(3)] == [grad_use._pack(m, nw) for m in groups]


def test_losses_of_several_steps_reduced_in_one_all_reduce(monkeypatch):
    from modelpar.train.loop import reduce_loss, reduce_losses

    fake = _FakeDist(monkeypatch)
    pm = SimpleNamespace(has_last_stage=True, mesh=SimpleNamespace(tp_rank=0, mesh=object()))
    pending = [(torch.tensor(2.5, dtype=torch.float64), 2), (torch.tensor(1.0 / 3, dtype=torch.float64), 1),
               (0.75, 1)]
    got = reduce_losses(pm, pending)
    assert fake.calls == {"all_reduce": 1}
    assert got == [(2 * 2.5) / 4, (2 * (1.0 / 3)) / 2, 1.5 / 2]
    assert reduce_loss(pm, torch.tensor(3.0, dtype=torch.float64), 2) == 1.5 and fake.calls["all_reduce"] == 2


def test_run_reads_losses_at_log_steps_only_and_keeps_every_step(tmp_path):
    """``log_every 3``: metrics rows at steps 1, 4, 7 (and the last), the summary still has every
    step's loss, bitwise equal to a run that logs every step."""
    import json

    from modelpar.train.config import TrainConfig
    from modelpar.train.runner import train

    kw = dict(model="gpt-nano", strategy="single", nproc=1, steps=7, global_batch_size=4, seq_len=16,
              eval_every=0, eval_samples=8, sample_bytes=0, track_memory=False, threads=1, warmup_steps=2)
    every = train(TrainConfig(log_every=1, **kw), run_dir=tmp_path / "a", quiet=True)
    sparse = train(TrainConfig(log_every=3, **kw), run_dir=tmp_path / "b", quiet=True)
    assert len(sparse["losses"]) == 7 and sparse["losses"] == every["losses"]
    rows = [json.loads(line) for line in (tmp_path / "b" / "metrics.jsonl").read_text().splitlines()]
    logged = [r for r in rows if "loss" in r]
    assert [r["step"] for r in logged] == [1, 4, 7]
    assert [r["loss"] for r in logged] == [every["losses"][i] for i in (0, 3, 6)]
    assert all(r["grad_norm"] > 0 for r in logged)


class _FakeFSDPModule(torch.nn.Module):
    """Counts FSDP2's sync setters (each walks every submodule in torch)."""

    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(3, 2)
        self.calls: list[tuple[str, bool]] = []

    def forward(self, x):
        return self.lin(x)

    def set_requires_gradient_sync(self, v):
        self.calls.append(("sync", v))

    def set_requires_all_reduce(self, v):
        self.calls.append(("all_reduce", v))


def _pm_of(plan, mod, schedule=None, loss_fn=lambda out, y: (out - y).mean()):
    from modelpar.parallel.compose import ParallelModel
    from modelpar.parallel.mesh import MeshInfo

    return ParallelModel(plan, MeshInfo(None), [mod], mod, loss_fn,
                         torch.device("cpu"), schedule=schedule)


def _old_flags(plan, enabled):
    """What the setters were called with on every `_grad_sync` before they were cached."""
    from modelpar.plan import runtime_layout

    if runtime_layout(plan).sharded_grad_accumulation:
        return [("sync", True)] + ([("all_reduce", enabled)] if plan.hsdp_enabled else [])
    return [("sync", enabled)]


@pytest.mark.parametrize("plan_kw, per_step", [
    (dict(dp_shard=2), [True]),                                   # fsdp, no accumulation
    (dict(dp_shard=2), [True, True]),                             # sharded accumulation
    (dict(dp_shard=2, defer_grad_sync=True), [False, True]),      # deferred: the flag alternates
    (dict(dp_replicate=2, dp_shard=2), [False, True]),            # hsdp: all-reduce on the last only
])
def test_fsdp_sync_flags_are_set_when_they_change_not_every_step(plan_kw, per_step):
    """FSDP2's setters run only where a flag changes (once in a run without accumulation); the flags
    in force at every backward are those the old code set on every call."""
    plan = ParallelPlan(**plan_kw)
    mod = _FakeFSDPModule()
    pm = _pm_of(plan, mod)
    state: dict = {}
    calls_old = 0
    for step in range(3):
        for enabled in per_step:
            with pm._grad_sync(enabled):
                pass
            for k, v in mod.calls:
                state[k] = v
            mod.calls.clear()
            old = _old_flags(plan, enabled)
            calls_old += len(old)
            assert state == dict(old), (step, enabled, state)    # the flags this backward runs with
    # under a pipeline the schedule sets the flags itself: modelpar sets them on every call, as before
    sched = _FakeFSDPModule()
    pp = _pm_of(plan, sched, schedule=object())
    for _ in range(3):
        for enabled in per_step:
            with pp._grad_sync(enabled):
                pass
    assert len(sched.calls) == calls_old


def test_fsdp_sync_flags_set_once_without_accumulation():
    mod = _FakeFSDPModule()
    pm = _pm_of(ParallelPlan(dp_shard=2), mod)
    for _ in range(5):
        with pm._grad_sync(True):
            pass
    assert mod.calls == [("sync", True)]


def test_loss_scale_one_adds_no_multiply_and_the_same_gradients():
    """``loss_scale=1.0`` (no accumulation) backpropagates the loss itself: no ``mul`` op and no
    MulBackward node, gradients bitwise those of ``(loss * 1.0).backward()``; other scales multiply."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Count(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.n = collections.Counter()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.n[func.overloadpacket.__name__] += 1
            return func(*args, **(kwargs or {}))

    torch.manual_seed(0)
    x, y = torch.randn(4, 3), torch.randn(4, 2)
    for scale in (1.0, 0.5):
        mod = _FakeFSDPModule()
        pm = _pm_of(ParallelPlan(), mod)
        ref = _FakeFSDPModule()
        ref.load_state_dict(mod.state_dict())
        with Count() as c:
            pm.forward_backward(x, y, loss_scale=scale)
        assert ("mul" in c.n) == (scale != 1.0), dict(c.n)
        ((ref(x) - y).mean() * scale).backward()     # (a loss whose own backward has no mul)
        for p, q in zip(mod.parameters(), ref.parameters()):
            assert torch.equal(p.grad, q.grad)


def test_clipping_dtensor_gradients_reads_no_device_value():
    """FSDP / TP gradients are DTensors: the clip factor scales their local shards as a tensor. Read
    on the host (``.item()``, as before), it made every clipped step wait on a GPU for the backward to
    end before the optimizer's kernels were queued (fake 2-rank group: shapes and placements only)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    try:
        mesh = init_device_mesh("cpu", (2,))
        torch.manual_seed(0)
        ps = [torch.nn.Parameter(distribute_tensor(torch.randn(4, 3), mesh, [Shard(0)])) for _ in range(2)]
        for p in ps:
            p.grad = distribute_tensor(torch.randn(4, 3) * 10, mesh, [Shard(0)])
        before = [p.grad.to_local().clone() for p in ps]
        with counting() as n:
            norm = grads.clip_grad_norm_(ps, 1.0)
        assert n == {"global_grad_norm": 1}, dict(n)
        coef = min(1.0, 1.0 / (float(norm) + 1e-6))
        assert coef < 1.0
        for p, g in zip(ps, before):
            torch.testing.assert_close(p.grad.to_local(), g * coef, rtol=1e-6, atol=0)
    finally:
        dist.destroy_process_group()
