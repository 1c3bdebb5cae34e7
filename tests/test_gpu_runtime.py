"""The runtime paths that differ on CUDA, on ONE GPU (marked ``gpu``: skipped without CUDA, tests/conftest.py).

Each test builds a world-size-1 process group in-process (NCCL on CUDA, through a FileStore in the
test's temporary folder), a one-rank DeviceMesh where a wrapper needs one, and compares against a
plain one-device reference:

- NCCL collectives on one rank (all-reduce AVG, all-gather, reduce-scatter, broadcast);
- DDP (`data_parallel.apply_ddp`), FSDP2's ``replicate`` (`apply_replicate`): fp32 parity;
- FSDP2 with its bf16 ``MixedPrecisionPolicy`` (`apply_fsdp(precision="bf16")`): bf16 compute,
  fp32 sharded parameters and gradients, losses near an autocast-bf16 reference;
- autocast bf16 (`ParallelModel` with ``precision="bf16"``): bf16 matmul outputs, fp32 parameters;
- activation checkpointing (full / selective / every-k): the same gradients, less peak memory (full);
  a zero-bubble weight pass in one ``GraphExecGroup``: the same gradients, a lower peak than torch's replays;
- ``torch.compile`` of each block (skipped without Triton): eager's loss and gradients;
- fused AdamW on CUDA (`train.step.adamw`): fused kernel chosen, same update as the single-tensor loop;
- `ParallelModel` + `train_step` end to end (accumulation, clipping; no wrapper and FSDP on one
  rank) against a plain CUDA fp32 loop (README's parity bar);
- checkpoint save and resume on CUDA (DCP over NCCL): the resumed run continues the saved one;
- ``meta_init`` of a built-in GPT under FSDP (shards materialised on the device) and the end-of-run
  gather of its weights (`DTensor.full_tensor` over NCCL, host copies);
- placement ``cpu`` + ``cuda:0`` against one device.

fp32 comparisons turn TF32 off. Tolerances are stated where used.

Without pytest (the GPU machine may lack it): ``PYTHONPATH=. python tests/test_gpu_runtime.py [-k SUBSTR]``
runs the same functions with a small runner and prints ``N passed, N failed, N skipped``; exit status 1
if any failed. ``--device cpu`` runs them on the CPU with gloo (a dry run of the test code itself;
the CUDA-only assertions are skipped); ``MODELPAR_GPU_TEST_DEVICE=cpu pytest tests/test_gpu_runtime.py``
does the same under pytest.
"""

from __future__ import annotations

import contextlib
import copy
import inspect
import os
import sys
import tempfile
import time
import traceback
import uuid
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.nn.functional as F

try:
    import pytest
except ImportError:                  # the fallback runner below needs no pytest
    pytest = None

DEVICE_ENV = "MODELPAR_GPU_TEST_DEVICE"      # "cpu": the runner's dry run; default cuda:0


class _Skip(Exception):
    pass


def _skip(reason: str):
    if pytest is not None:
        pytest.skip(reason)
    raise _Skip(reason)


def _mark(f):
    """``gpu``-marked, except in a CPU dry run under pytest (``MODELPAR_GPU_TEST_DEVICE=cpu pytest ...``:
    the same tests on gloo, with the suite's guards on leaked process groups, threads and processes)."""
    if pytest is not None and not os.environ.get(DEVICE_ENV, "cuda").startswith("cpu"):
        return pytest.mark.gpu(f)
    return f


def _dev() -> torch.device:
    return torch.device(os.environ.get(DEVICE_ENV, "cuda:0"))


def _cuda() -> bool:
    return _dev().type == "cuda"


@contextlib.contextmanager
def world1(tmp):
    """A world-size-1 default process group (NCCL on CUDA, gloo on CPU) through a FileStore in ``tmp``;
    collectives time out after 120 s (not NCCL's default 10 minutes), so a hang fails the test."""
    dev = _dev()
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    dist.init_process_group("nccl" if dev.type == "cuda" else "gloo",
                            init_method=f"file://{os.path.join(str(tmp), 'pg-' + uuid.uuid4().hex)}",
                            rank=0, world_size=1, timeout=timedelta(seconds=120))
    try:
        yield
    finally:
        dist.destroy_process_group()


def mesh1(name: str):
    from torch.distributed.device_mesh import init_device_mesh
    return init_device_mesh(_dev().type, (1,), mesh_dim_names=(name,))


@contextlib.contextmanager
def exact_fp32():
    """TF32 off for fp32 parity (restored after)."""
    saved = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved


def lm_loss(logits, y):
    return F.cross_entropy(logits.float().flatten(0, 1), y.flatten())


def tiny(seed: int = 0, name: str = "gpt-nano"):
    from modelpar.models import build_model
    return build_model(name, device="cpu", seed=seed)


def data(n: int, seq: int, seed: int = 1, vocab: int = 256):
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(0, vocab, (n, seq), generator=g)
    return x.to(_dev()), torch.randint(0, vocab, (n, seq), generator=g).to(_dev())


def local(t):
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def params_of(model) -> dict:
    return {n: local(p.detach()).float().cpu().clone() for n, p in model.named_parameters()}


def assert_params_close(a: dict, b: dict, atol: float = 1e-4, rtol: float = 1e-4, rel_norm: float = 1e-5):
    """README's bar (`modelpar.verify.compare`'s): |delta| <= atol + rtol |theta| per element, and
    ||delta|| / ||theta|| <= rel_norm over all parameters together. Not per parameter: a parameter whose
    gradient is analytically zero (a key bias: softmax ignores a per-row constant) stays at its initial
    zeros plus ~1e-12 of round-off, which a per-parameter ratio reads as a 65% difference (H100, cuBLAS)."""
    assert a.keys() == b.keys(), sorted(set(a) ^ set(b))
    dsq = tsq = 0.0
    for n in a:
        d = (a[n] - b[n]).abs()
        assert bool((d <= atol + rtol * b[n].abs()).all()), f"{n}: max |delta| {d.max():.3e}"
        dsq, tsq = dsq + float(d.square().sum()), tsq + float(b[n].square().sum())
    assert dsq ** 0.5 <= rel_norm * tsq ** 0.5, f"||delta|| / ||theta|| = {(dsq / tsq) ** 0.5:.3e} > {rel_norm:.0e}"


def sgd_losses(fwd, params, x, y, steps: int = 3, lr: float = 0.1) -> list[float]:
    opt = torch.optim.SGD(params, lr=lr)
    out = []
    for _ in range(steps):
        loss = lm_loss(fwd(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        out.append(float(loss.detach()))
    return out


def rel(a: float, b: float) -> float:
    return abs(a - b) / abs(b)


# ---- tests -------------------------------------------------------------------------------------

@_mark
def test_nccl_world1_collectives(tmp_path):
    with world1(tmp_path):
        dev = _dev()
        assert dist.get_backend() == ("nccl" if _cuda() else "gloo")
        t = torch.arange(6, dtype=torch.float32, device=dev) + 1
        s = t.clone()
        dist.all_reduce(s, op=dist.ReduceOp.AVG if _cuda() else dist.ReduceOp.SUM)   # gloo has no AVG
        assert torch.equal(s, t)
        g = torch.empty(6, device=dev)
        dist.all_gather_into_tensor(g, t)
        assert torch.equal(g, t)
        r = torch.empty(6, device=dev)
        dist.reduce_scatter_tensor(r, t)
        assert torch.equal(r, t)
        b = t.clone() if dist.get_rank() == 0 else torch.zeros_like(t)
        dist.broadcast(b, src=0)
        assert torch.equal(b, t) and b.device == dev
        if _cuda():
            torch.cuda.synchronize()


@_mark
def test_ddp_matches_one_device(tmp_path):
    from modelpar.parallel.data_parallel import apply_ddp

    with world1(tmp_path), exact_fp32():
        ref = tiny().to(_dev())
        wrapped = apply_ddp(copy.deepcopy(ref), mesh1("dp_replicate"))
        x, y = data(4, ref.cfg.seq_len)
        a = sgd_losses(ref, ref.parameters(), x, y)
        b = sgd_losses(wrapped, wrapped.parameters(), x, y)
        assert max(rel(p, q) for p, q in zip(b, a)) <= 1e-5, (a, b)
        assert_params_close(params_of(wrapped.module), params_of(ref))
        assert a[-1] < a[0]          # it trained


@_mark
def test_replicate_matches_one_device(tmp_path):
    from modelpar.parallel.data_parallel import apply_replicate

    with world1(tmp_path), exact_fp32():
        ref = tiny().to(_dev())
        rep = copy.deepcopy(ref)
        apply_replicate(rep, mesh1("dp_replicate"), list(rep.blocks))
        x, y = data(4, ref.cfg.seq_len)
        a = sgd_losses(ref, ref.parameters(), x, y)
        b = sgd_losses(rep, rep.parameters(), x, y)
        assert max(rel(p, q) for p, q in zip(b, a)) <= 1e-5, (a, b)
        assert_params_close(params_of(rep), params_of(ref))


@_mark
def test_fsdp_bf16_mixed_precision(tmp_path):
    """FSDP2's MixedPrecisionPolicy(bf16 params, fp32 reduce): blocks compute in bf16, the sharded
    parameters and their gradients stay fp32; losses within 2e-2 relative of autocast bf16 (the two
    round differently: FSDP casts LayerNorm weights too)."""
    from modelpar.parallel.data_parallel import apply_fsdp
    from modelpar.train.step import adamw

    with world1(tmp_path):
        ref = tiny().to(_dev())
        sh = copy.deepcopy(ref)
        apply_fsdp(sh, mesh1("dp_shard"), list(sh.blocks), precision="bf16")
        seen = []
        sh.blocks[0].attn.q.register_forward_hook(lambda m, i, o: seen.append((m.weight.dtype, o.dtype)))
        x, y = data(4, ref.cfg.seq_len)
        o_ref, o_sh = adamw(ref.parameters(), lr=1e-3), adamw(sh.parameters(), lr=1e-3)
        a, b = [], []
        for _ in range(3):
            with torch.autocast(_dev().type, dtype=torch.bfloat16):
                la = lm_loss(ref(x), y)
            la.backward()
            lb = lm_loss(sh(x), y)
            lb.backward()
            for n, p in sh.named_parameters():
                assert p.dtype == torch.float32 and p.grad is not None and p.grad.dtype == torch.float32, n
                assert hasattr(p, "device_mesh"), f"{n} is not an FSDP2 DTensor shard"
            o_ref.step(), o_sh.step()
            o_ref.zero_grad(set_to_none=True), o_sh.zero_grad(set_to_none=True)
            a.append(float(la)), b.append(float(lb))
        assert seen and all(w == torch.bfloat16 and o == torch.bfloat16 for w, o in seen), seen
        assert max(rel(p, q) for p, q in zip(b, a)) <= 2e-2, (a, b)
        assert b[-1] < b[0], b


@_mark
def test_autocast_bf16_parallel_model():
    from modelpar.parallel.compose import parallelize
    from modelpar.parallel.mesh import MeshInfo
    from modelpar.plan import ParallelPlan

    ref = tiny().to(_dev())
    m = copy.deepcopy(ref)
    pm = parallelize(m, ParallelPlan(precision="bf16"), MeshInfo(None), loss_fn=lm_loss, device=_dev())
    seen = []
    m.blocks[0].mlp.up.register_forward_hook(lambda mod, i, o: seen.append(o.dtype))
    x, y = data(4, ref.cfg.seq_len)
    loss = pm.forward_backward(x, y)
    with exact_fp32():
        lf = lm_loss(ref(x), y)
    assert seen == [torch.bfloat16], seen
    assert all(p.dtype == torch.float32 and p.grad.dtype == torch.float32 for p in m.parameters())
    assert rel(float(loss), float(lf)) <= 2e-2, (float(loss), float(lf))


def _grads_and_peak(model, x, y) -> tuple[dict, int]:
    dev = _dev()
    if dev.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    lm_loss(model(x), y).backward()
    peak = torch.cuda.max_memory_allocated() - base if dev.type == "cuda" else 0
    return {n: p.grad.detach().float().cpu() for n, p in model.named_parameters()}, peak


@_mark
def test_activation_checkpointing_modes():
    """full / selective / every-k: gradients equal to no checkpointing (|delta| <= 1e-6 + 1e-5 |g|,
    fp32, TF32 off); full checkpointing's peak activation memory below 60% of none's (CUDA)."""
    from modelpar.parallel.checkpointing import apply_ac

    with exact_fp32():
        base = tiny(name="gpt-3m").to(_dev())
        x, y = data(16, base.cfg.seq_len)
        ref, peak_none = _grads_and_peak(base, x, y)
        for mode, every in (("full", 1), ("selective", 1), ("every-k", 2)):
            m = copy.deepcopy(base)
            for p in m.parameters():
                p.grad = None
            n = apply_ac(list(m.blocks), mode=mode, every=every)
            assert n == {"full": 4, "selective": 4, "every-k": 2}[mode], (mode, n)
            g, peak = _grads_and_peak(m, x, y)
            for k in ref:
                d = (g[k] - ref[k]).abs()
                assert bool((d <= 1e-6 + 1e-5 * ref[k].abs()).all()), f"{mode} {k}: max |delta| {d.max():.3e}"
            if mode == "full" and _cuda():
                assert peak < 0.6 * peak_none, f"full checkpointing peak {peak} B vs none {peak_none} B"


@_mark
def test_split_backward_weight_pass_in_one_group():
    """A zero-bubble weight pass (torch's ``stage_backward_weight`` after ``stage_backward_input``) over
    fully checkpointed gpt-3m blocks: in one ``GraphExecGroup`` (`pipeline.group_weight_pass`) the same
    gradients as without checkpointing (|delta| <= 1e-6 + 1e-5 |g|, fp32, TF32 off) and, on CUDA, a lower
    peak inside ``W`` than torch's per-parameter-group replays give (measured on CPU: 9.8 vs 42.9 MiB
    for two gpt-1m blocks)."""
    from torch.distributed.pipelining._backward import stage_backward_input, stage_backward_weight

    from modelpar.parallel.checkpointing import apply_ac
    from modelpar.parallel.pipeline import group_weight_pass

    class Stage:
        def __init__(self, params, groups):
            self.params, self.groups = params, groups

        def backward_weight_one_chunk(self, chunk_id, last_backward=False):
            stage_backward_weight(iter(self.params), self.groups)

    def run(ac: bool, grouped: bool):
        blocks = copy.deepcopy(base_blocks)
        if ac:
            apply_ac(list(blocks), mode="full")
        h = x.clone().requires_grad_(True)
        out = h
        for b in blocks:
            out = b(out)
        params = list(blocks.parameters())
        _, groups = stage_backward_input([out], [torch.ones_like(out)], [h], iter(params))
        del out
        stage = Stage(params, groups)
        if grouped:
            group_weight_pass(stage)
        if _cuda():
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        base_mem = torch.cuda.memory_allocated() if _cuda() else 0
        stage.backward_weight_one_chunk(0)
        peak = torch.cuda.max_memory_allocated() - base_mem if _cuda() else 0
        return [p.grad.detach().float().cpu() for p in params], peak

    with exact_fp32():
        model = tiny(name="gpt-3m").to(_dev())
        base_blocks = torch.nn.ModuleList(list(model.blocks)[:2])
        g = torch.Generator().manual_seed(3)
        x = torch.randn(8, model.cfg.seq_len, model.cfg.d_model, generator=g).to(_dev())
        ref, _ = run(False, False)
        grouped, peak_grouped = run(True, True)
        _, peak_torch = run(True, False)
        for a, r in zip(grouped, ref):
            d = (a - r).abs()
            assert bool((d <= 1e-6 + 1e-5 * r.abs()).all()), f"max |delta| {d.max():.3e}"
        if _cuda():
            assert peak_grouped < peak_torch, (peak_grouped, peak_torch)
            print(f"W peak: grouped {peak_grouped / 2**20:.1f} MiB, per-group replays {peak_torch / 2**20:.1f} MiB")


@_mark
def test_compile_block_matches_eager():
    """``torch.compile`` of each block (inductor, in-process: compile_threads=1): loss within 1e-5 and
    gradients within 1e-4 relative norm of eager (fp32, TF32 off). Skipped without Triton."""
    if not _cuda():
        _skip("compile is checked on CUDA only (inductor on CPU needs a C++ toolchain)")
    from torch.utils._triton import has_triton
    if not has_triton():
        _skip("no Triton: torch.compile's inductor cannot generate CUDA kernels here")
    import torch._inductor.config as icfg
    from modelpar.parallel.compiling import apply_compile

    saved = icfg.compile_threads
    icfg.compile_threads = 1
    try:
        with exact_fp32():
            ref = tiny().to(_dev())
            m = copy.deepcopy(ref)
            assert apply_compile(list(m.blocks)) == len(m.blocks)
            x, y = data(4, ref.cfg.seq_len)
            lr_, lc = lm_loss(ref(x), y), lm_loss(m(x), y)
            lr_.backward(), lc.backward()
            assert rel(float(lc), float(lr_)) <= 1e-5
            for (n, p), q in zip(m.named_parameters(), ref.parameters()):
                assert float((p.grad - q.grad).norm()) <= 1e-4 * float(q.grad.norm()) + 1e-8, n
    finally:
        icfg.compile_threads = saved
        torch._dynamo.reset()


if pytest is not None:               # compiling may start compiler workers: the suite's rule marks it slow
    test_compile_block_matches_eager = pytest.mark.slow(test_compile_block_matches_eager)


@contextlib.contextmanager
def no_device_sync():
    """On CUDA, any host-device synchronisation inside raises (`torch.cuda.set_sync_debug_mode`);
    on the CPU dry run nothing to check."""
    if not _cuda():
        yield
        return
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode("default")


@_mark
def test_clipping_and_stop_agreement_queue_without_a_host_sync(tmp_path):
    """What the train loop adds to every step on a GPU queues work without waiting for it: clipping
    FSDP's DTensor gradients (the factor stays on the device) and issuing the ranks' stop agreement
    (a fill, an async all-reduce, a pinned copy and an event; `StopRequest`, a 2-rank world faked on
    the 1-rank group so it takes the multi-rank path). The agreement's value is read one call later."""
    import signal

    from modelpar.parallel.data_parallel import apply_fsdp
    from modelpar.train.grads import clip_grad_norm_
    from modelpar.train.stop import StopRequest

    with world1(tmp_path):
        m = tiny().to(_dev())
        apply_fsdp(m, mesh1("dp_shard"), list(m.blocks))
        x, y = data(2, m.cfg.seq_len)
        lm_loss(m(x), y).backward()
        ps = list(m.parameters())
        assert any(hasattr(p.grad, "device_mesh") for p in ps)
        with no_device_sync():
            norm = clip_grad_norm_(ps, 1e-3)
        assert float(norm) > 1e-3
        g = torch.cat([local(p.grad).flatten() for p in ps])
        assert abs(float(g.norm()) - 1e-3) < 1e-6
        real_world = dist.get_world_size
        dist.get_world_size = lambda group=None: 2
        stop = StopRequest(True, _dev())
        try:
            with no_device_sync():
                assert stop.agreed() == 0           # issues step 1's agreement only
            stop.signum = signal.SIGTERM            # as the handler notes it
            assert stop.agreed() == 0               # reads step 1's (0), issues step 2's
            assert stop.agreed() == signal.SIGTERM  # reads step 2's
        finally:
            stop.close()
            dist.get_world_size = real_world


@_mark
def test_fused_adamw():
    """`train.step.adamw` picks torch's fused kernel on CUDA, and its 3 steps match the single-tensor
    loop within 1e-6 absolute."""
    from modelpar.train.step import adamw, make_optimizer

    torch.manual_seed(0)
    ps = [torch.randn(64, 32, device=_dev(), requires_grad=True), torch.randn(32, device=_dev(), requires_grad=True)]
    qs = [p.detach().clone().requires_grad_(True) for p in ps]
    fused = adamw(ps, lr=1e-2, weight_decay=0.1)
    plain = torch.optim.AdamW(qs, lr=1e-2, weight_decay=0.1, foreach=False)
    assert fused.defaults["fused"] is True, fused.defaults
    for i in range(3):
        g = [torch.randn_like(p) for p in ps]
        for p, q, gi in zip(ps, qs, g):
            p.grad, q.grad = gi.clone(), gi.clone()
        fused.step(), plain.step()
    for p, q in zip(ps, qs):
        assert float((p - q).abs().max()) <= 1e-6
    opt = make_optimizer(tiny().to(_dev()).parameters(), lr=1e-3, weight_decay=0.1)
    assert all(g["fused"] for g in opt.param_groups) and [g["weight_decay"] for g in opt.param_groups] == [0.1, 0.0]


def _reference_run(model, batches, accum: int, clip: float, lr: float = 0.1) -> list[float]:
    """Plain torch: SGD, mean loss over ``accum`` chunks, norm clipping. (SGD, not AdamW: Adam
    normalises gradients that are zero up to rounding, such as the key biases' (softmax is invariant
    to them), into full-size steps, so two correct runs drift apart there; AdamW is checked by
    `test_fused_adamw`.)"""
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    losses = []
    for xg, yg in batches:
        tot = 0.0
        for xs, ys in zip(xg.chunk(accum), yg.chunk(accum)):
            loss = lm_loss(model(xs), ys)
            (loss / accum).backward()
            tot += float(loss)
        torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(tot / accum)
    return losses


@_mark
def test_parallel_model_end_to_end_matches_reference(tmp_path):
    """`ParallelModel` + `train_step` (2 accumulation steps, clipping at 0.5, SGD, full
    checkpointing) for 4 steps, with no wrapper and with FSDP2 on a one-rank mesh, against a plain
    CUDA fp32 loop: losses within 1e-5 relative, parameters within README's bar."""
    from modelpar.parallel.compose import ParallelModel, parallelize
    from modelpar.parallel.data_parallel import apply_fsdp
    from modelpar.parallel.mesh import MeshInfo
    from modelpar.plan import ParallelPlan
    from modelpar.train.step import make_optimizer, train_step

    with world1(tmp_path), exact_fp32():
        base = tiny()
        batches = [data(8, base.cfg.seq_len, seed=s) for s in range(4)]
        ref = copy.deepcopy(base).to(_dev())
        want = _reference_run(ref, batches, accum=2, clip=0.5)
        for kind in ("plain", "fsdp"):
            m = copy.deepcopy(base)
            plan = ParallelPlan(activation_checkpointing="full")
            if kind == "plain":
                pm = parallelize(m, plan, MeshInfo(None), loss_fn=lm_loss, device=_dev())
            else:
                m.to(_dev())
                apply_fsdp(m, mesh1("dp_shard"), list(m.blocks))
                pm = ParallelModel(plan, MeshInfo(None), [m], m, lm_loss, _dev())
            opt = make_optimizer(pm.parameters(), "sgd", lr=0.1)
            got = []
            for xg, yg in batches:
                s, n, _ = train_step(pm, opt, xg, yg, accum_steps=2, grad_clip=0.5)
                got.append(float(s) / n)
            assert max(rel(p, q) for p, q in zip(got, want)) <= 1e-5, (kind, got, want)
            assert_params_close(params_of(m), params_of(ref))


def _checkpoint_round_trip(tmp_path, fsdp: bool) -> None:
    """Train 2 steps, save (DCP), train 2 more; a fresh model with other weights loads the save: the
    same parameters, and its 2 steps give the saving run's losses (within 1e-6 relative)."""
    from modelpar.parallel.data_parallel import apply_fsdp
    from modelpar.train.checkpoint import Checkpointer, checkpoint_module, load_checkpoint
    from modelpar.train.step import make_optimizer

    def build(seed):
        m = tiny(seed=seed).to(_dev())
        if fsdp:
            apply_fsdp(m, mesh1("dp_shard"), list(m.blocks))
        return m, make_optimizer(m.parameters(), lr=1e-3)

    def steps(m, opt, n):
        out = []
        for i in range(n):
            x, y = data(4, m.cfg.seq_len, seed=10 + i)
            loss = lm_loss(m(x), y)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            out.append(float(loss.detach()))
        return out

    with exact_fp32():
        m, opt = build(0)
        assert all(g["fused"] for g in opt.param_groups)
        steps(m, opt, 2)
        path = Checkpointer(tmp_path / "ckpt").save(checkpoint_module([m]), opt, 2)
        saved = params_of(m)
        cont = steps(m, opt, 2)
        m2, opt2 = build(1)
        assert any(not torch.equal(saved[k], v) for k, v in params_of(m2).items())     # other weights before
        meta = load_checkpoint(checkpoint_module([m2]), opt2, path)
        assert meta["step"] == 2
        for k, v in params_of(m2).items():
            assert torch.equal(v, saved[k]), k
        resumed = steps(m2, opt2, 2)
        assert max(rel(p, q) for p, q in zip(resumed, cont)) <= 1e-6, (resumed, cont)


@_mark
def test_checkpoint_save_and_resume(tmp_path):
    """One process without a process group (DCP's no_dist path): a plain CUDA model, fused AdamW."""
    _checkpoint_round_trip(tmp_path, fsdp=False)


@_mark
def test_checkpoint_save_and_resume_fsdp_nccl(tmp_path):
    """FSDP2 on a one-rank NCCL mesh: DCP's collectives (its save plan is gathered as pickled
    objects, which torch.distributed turns into bytes through numpy: without numpy this path cannot
    run, so the test is skipped with that reason)."""
    import importlib.util
    if importlib.util.find_spec("numpy") is None:
        _skip("numpy is not installed: torch.distributed's object collectives (gather_object, used by "
              "DCP's save plan under a process group) need it")
    with world1(tmp_path):
        _checkpoint_round_trip(tmp_path, fsdp=True)


@_mark
def test_meta_init_fsdp_and_the_end_of_run_gather(tmp_path):
    """A built-in GPT with ``meta_init``: built on meta, FSDP-sharded over a one-rank mesh, each shard
    materialised on the device (`train.materialise`), equal to the same materialisation on one process
    without FSDP; then the end-of-run gather (`train.gather.gather_full_state_dict`: `DTensor.full_tensor`
    over NCCL, host copies) returns exactly the device's parameters, every name, on the host."""
    import types

    from modelpar.parallel.data_parallel import apply_fsdp
    from modelpar.parallel.mesh import MeshInfo
    from modelpar.train.config import TrainConfig
    from modelpar.train.gather import gather_full_state_dict
    from modelpar.train.materialise import materialise
    from modelpar.train.task import build_task

    cfg = TrainConfig(model="gpt-nano", model_config={"tie_embeddings": True}, meta_init=True, seq_len=16)
    with world1(tmp_path):
        ref = build_task(cfg, load_data=False).model
        materialise([ref], cfg, _dev())
        sh = build_task(cfg, load_data=False).model
        assert all(p.is_meta for p in sh.parameters())
        mesh = mesh1("dp_shard")
        apply_fsdp(sh, mesh, list(sh.blocks), precision="fp32")
        materialise([sh], cfg, _dev(), ties=[("embed.tok.weight", "head.out.weight")])
        assert all(local(p).device == _dev() for p in sh.parameters())
        assert_params_close(params_of(sh), params_of(ref), atol=0, rtol=0, rel_norm=0)
        pm = types.SimpleNamespace(mesh=MeshInfo(mesh=mesh), modules=[sh], device=_dev())
        got = gather_full_state_dict(pm)
        want = {k: local(v.detach()).cpu() for k, v in sh.state_dict().items()}
        assert got.keys() == want.keys() and all(v.device.type == "cpu" for v in got.values())
        assert all(torch.equal(got[k], want[k]) for k in want)
        x, y = data(2, 16)
        assert torch.isfinite(lm_loss(sh(x), y))


@_mark
def test_placement_cpu_and_cuda_matches_one_device():
    """gpt-3m split over cpu and cuda:0 (fp32, TF32 off) against one device: losses within 1e-4 relative."""
    from modelpar.bench.gpu import placement_check

    devices = ("cpu", "cuda:0") if _cuda() else ("cpu", "cpu")
    pc = placement_check(devices, model_name="gpt-3m" if _cuda() else "gpt-nano", steps=3)
    assert len(pc["placement"]) == 3 and pc["max_rel_diff"] <= 1e-4, pc


# ---- the runner without pytest ---------------------------------------------------------------------

def _run(argv: list[str]) -> int:
    import argparse

    ap = argparse.ArgumentParser(description="run this module's tests without pytest")
    ap.add_argument("-k", default="", help="only tests whose name contains this")
    ap.add_argument("--device", default="cuda:0", help="cuda:0, or cpu for a dry run of the test code (gloo)")
    args = ap.parse_args(argv)
    os.environ[DEVICE_ENV] = args.device
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        print("no CUDA device (torch.cuda.is_available() is False): 0 passed, 0 failed, "
              f"{sum(1 for n in globals() if n.startswith('test_'))} skipped")
        return 0
    tests = [(n, f) for n, f in globals().items() if n.startswith("test_") and callable(f) and args.k in n]
    counts = {"passed": 0, "failed": 0, "skipped": 0}
    for name, fn in tests:
        t0 = time.perf_counter()
        kw = {}
        if "tmp_path" in inspect.signature(fn).parameters:
            from pathlib import Path
            kw["tmp_path"] = Path(tempfile.mkdtemp(prefix=f"{name}-"))
        try:
            fn(**kw)
            status = "PASSED"
        except _Skip as e:
            status = f"SKIPPED ({e})"
        except BaseException as e:          # noqa: BLE001 -- pytest's Skipped is a BaseException
            if type(e).__name__ == "Skipped":
                status = f"SKIPPED ({e})"
            elif isinstance(e, KeyboardInterrupt):
                raise
            else:
                status = "FAILED"
                traceback.print_exc()
        finally:
            if dist.is_available() and dist.is_initialized():
                dist.destroy_process_group()
        key = status.split()[0].lower()
        counts[key] += 1
        print(f"{name}: {status} ({time.perf_counter() - t0:.1f} s)", flush=True)
    print(f"{counts['passed']} passed, {counts['failed']} failed, {counts['skipped']} skipped")
    return 1 if counts["failed"] else 0


if __name__ == "__main__":
    sys.exit(_run(sys.argv[1:]))
