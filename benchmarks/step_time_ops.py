"""Where a model's step time goes, by operator category, against the planner's terms (one process).

For each model (the step-time benchmark's HF configs `planner_accuracy_time.HF_TIME_MODELS`, and
``gpt``: modelpar's GPT of hf-gpt2's shape with a tied head), one training step (forward, loss,
backward, fused AdamW) at ``--batch`` samples on one thread is timed with ``time.thread_time()``
(this thread's CPU time: other processes on a shared machine do not add to it, though they still
share caches and memory bandwidth) in two ways:

1. every aten call, under a dispatch mode, summed by category (matmul, fused attention,
   memory-bound, views, optimizer), next to the planner's term for that category
   (`modelpar.planner.cost._load_times`' pieces: FLOPs over the calibrated GEMM curve at the mean
   call size, attention FLOPs over the calibrated attention rate, profiled bytes over the calibrated
   elementwise rate, profiled ops x the per-op overhead); the step's CPU time outside every aten
   call is the Python of the model's forward (module calls, transformers' mask / rotary / output
   code) plus the timer's own overhead;
2. every matmul-class call replayed alone with its own shapes and strides (min of 5), next to the
   calibrated N x N x N curve at its FLOPs and the calibrated shape grid at its M x K x N and layout
   (`Hardware.shape_flops`; schema-3 files) and the curve times the grid's shape factor
   (`Hardware.shape_factor`, what the planner uses): the rate of a product depends on its shape and layout,
   which the curve (a function of FLOPs only) does not see; totals: replayed, the curve per call,
   the planner before (the curve at the mean call), curve x factor per call, and the planner's shape
   pricing of the profiled shapes (`cost._shape_seconds` plus the rest on the curve);
3. the step at 1 sample x 4 tokens (kernels negligible: the step's fixed cost of dispatch, autograd,
   module calls and the model's own Python), lower quartile of 30, next to the planner's only
   per-step fixed term (profiled non-view ops x the calibrated per-op overhead).

Run: ``python benchmarks/step_time_ops.py [--models hf-llama,hf-gpt2,gpt] [--batch 16] [--hardware cal.json]
[--cpu-time-rates [--save-hardware FILE]]`` (re-measures the compute terms on CPU time, for a shared machine)
(1 thread; the hardware file from ``modelpar calibrate``). Diagnostic only: nothing here is fitted.
"""

from __future__ import annotations

import argparse
import collections
import sys
import time

import torch
from torch.utils._python_dispatch import TorchDispatchMode

GPT = dict(d_model=256, n_layer=4, n_head=8, vocab_size=512, seq_len=128, tie_embeddings=True)
GEMM = ("mm", "addmm", "bmm", "baddbmm")
GPT_PRESETS = ("gpt-1m", "gpt-3m", "gpt-10m")


class _Timer(TorchDispatchMode):
    """Thread CPU seconds and calls per aten op; optionally the matmul calls' shapes and strides."""

    def __init__(self, record: bool = False):
        super().__init__()
        self.t: dict[str, float] = collections.defaultdict(float)
        self.n: collections.Counter = collections.Counter()
        self.record = record
        self.calls: list[tuple] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        t0 = time.thread_time()
        out = func(*args, **(kwargs or {}))
        dt = time.thread_time() - t0
        name = func.overloadpacket.__name__
        self.t[name] += dt
        self.n[name] += 1
        if self.record and name in GEMM:
            self.calls.append((func, tuple((tuple(a.shape), tuple(a.stride()), a.storage_offset())
                                           for a in args if isinstance(a, torch.Tensor)),
                               tuple(a for a in args if not isinstance(a, torch.Tensor))))
        return out


def _category(name: str) -> str:
    from modelpar.planner.profile_ops import _FLOP_OPS, _VIEW_OPS
    if "scaled_dot_product" in name:
        return "attention"
    if name in _FLOP_OPS:
        return "matmul"
    if name in _VIEW_OPS:
        return "view"
    if "adam" in name:
        return "optimizer"
    return "memory-bound"


def _model(name: str):
    """(module, sequence length, profile at batch 1)."""
    from planner_accuracy_time import HF_TIME_MODELS

    from modelpar.measure.memory import profile_for
    from modelpar.models import build_model
    from modelpar.models.hf import build_hf
    from modelpar.planner.profile import profile_model
    if name in HF_TIME_MODELS:
        spec, cfg, seq = HF_TIME_MODELS[name]
        return build_hf(spec, cfg, dropout=0.0, seed=0), seq, profile_for(spec, cfg, seq)
    if name in GPT_PRESETS:         # the built-in presets of the benchmark (gpt-1m, gpt-3m, gpt-10m)
        meta = build_model(name, device="meta")
        return build_model(name), meta.cfg.seq_len, profile_for(name)
    if name != "gpt":
        raise SystemExit(f"--models: {name!r} is unknown; valid: gpt, {', '.join((*GPT_PRESETS, *HF_TIME_MODELS))}")
    meta = build_model("gpt-1m", device="meta", **GPT)
    prof = profile_model(meta, torch.zeros(1, GPT["seq_len"], dtype=torch.long, device="meta"))
    return build_model("gpt-1m", **GPT), GPT["seq_len"], prof


def _flops(name: str, shapes) -> float:
    s = [x[0] for x in shapes]
    if name == "mm":
        return 2.0 * s[0][0] * s[0][1] * s[1][1]
    if name == "addmm":
        return 2.0 * s[1][0] * s[1][1] * s[2][1]
    if name in ("bmm", "baddbmm"):
        a, b = s[-2], s[-1]
        return 2.0 * a[0] * a[1] * a[2] * b[2]
    return 0.0


def _grid_rate(hw, op: str, shapes) -> tuple[float, float] | None:
    """(the calibrated shape grid's FLOP/s, its shape factor `Hardware.shape_factor`) for a replayed
    mm / addmm (None: other ops, or no grid)."""
    from modelpar.planner.profile_ops import _layout_char
    if op not in ("mm", "addmm"):
        return None
    (sa, ta, _), (sb, tb, _) = shapes[-2:]
    lay = ""
    for shape, stride in ((sa, ta), (sb, tb)):
        t = torch.empty_strided(shape, stride, device="meta")
        c = _layout_char(t)
        if c is None:
            return None
        lay += c
    r = hw.shape_flops("fp32", lay, sa[0], sa[1], sb[1])
    return None if r is None else (r, hw.shape_factor(lay, sa[0], sa[1], sb[1]))


def cpu_time_rates(hw):
    """``hw`` with its compute terms re-measured here on this thread's CPU time: the square curve
    and shape grid (`micro._linear_matmul_rate`, `micro.measure_shapes`), the attention rate and
    grid, the element-wise rate, the streaming bandwidth and the per-op overhead (`micro`'s own
    functions with ``timer=time.thread_time``): on a shared machine, wall-clock rates carry the
    neighbours' load, CPU-time rates much less. Collectives and allocator terms stay as loaded."""
    import dataclasses

    from modelpar.calibrate import micro
    tt = time.thread_time
    curve = {n: micro._linear_matmul_rate(n, timer=tt) for n in micro.MATMUL_SIZES}
    grid, _ = micro.measure_shapes(passes=3, timer=tt)
    attn_grid, _ = micro.measure_attention_shapes(timer=tt)
    a, b = torch.ones(32 * 2 ** 20), torch.ones(32 * 2 ** 20)
    c = torch.empty_like(a)
    bw = 3 * a.numel() * 4 / micro._time(lambda: torch.add(a, b, out=c), 5, timer=tt)
    del a, b, c
    op = micro._time(micro._op_chain, 30, best=True, timer=tt) / (2 * micro._CHAIN)
    cal = dataclasses.replace(hw.calibration, matmul_flops=curve, matmul_shapes=grid, attention_shapes=attn_grid,
                              dispatch_overhead_s=micro.measure_dispatch_overhead(timer=tt),
                              attention_flops=micro.measure_attention(timer=tt),
                              elementwise_bw=micro.measure_elementwise(reps=4, timer=tt),
                              mem_bandwidth_alone=bw)
    return dataclasses.replace(hw, calibration=cal, mem_bandwidth=bw, op_overhead_s=op)


def _alone(func, shapes, rest) -> float:
    """Min of 5 thread-CPU seconds of one call on fresh tensors of the same shapes and strides."""
    ts = []
    for shape, stride, off in shapes:
        need = off + sum((d - 1) * st for d, st in zip(shape, stride)) + 1
        ts.append(torch.as_strided(torch.randn(need), shape, stride, off))
    for _ in range(2):
        func(*ts, *rest)
    best = float("inf")
    for _ in range(5):
        t0 = time.thread_time()
        func(*ts, *rest)
        best = min(best, time.thread_time() - t0)
    return best


def report(name: str, batch: int, hw) -> None:
    from modelpar.plan import ParallelPlan
    from modelpar.planner.loads import rank_loads
    from modelpar.train.task import lm_loss

    model, seq, prof = _model(name)
    x = torch.randint(0, 256, (batch, seq))
    y = torch.randint(0, 256, (batch, seq))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)

    def step():
        lm_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    for _ in range(2):
        step()
    plain = float("inf")
    for _ in range(3):
        t0 = time.thread_time()
        step()
        plain = min(plain, time.thread_time() - t0)
    best = None
    for i in range(3):
        tm = _Timer(record=i == 0)
        t0 = time.thread_time()
        with tm:
            step()
        tot = time.thread_time() - t0
        if best is None or tot < best[0]:
            best = (tot, tm)
        if i == 0:
            calls = tm.calls
    tot, tm = best
    by: dict[str, float] = collections.defaultdict(float)
    n: collections.Counter = collections.Counter()
    for k, v in tm.t.items():
        by[_category(k)] += v
        n[_category(k)] += tm.n[k]
    ld = rank_loads(prof, ParallelPlan(), act_bytes=4)[0]
    cal = hw.calibration
    ew_s = min(hw.mem_bandwidth, cal.elementwise_bw or hw.mem_bandwidth)
    af, ab = ld.attn_flops
    mf, mb = ld.fwd_flops - af, ld.bwd_flops - ab
    nf, nb = max(ld.fwd_gemms - ld.attn_calls, 1), max(ld.bwd_gemms - ld.attn_calls, 1)
    pred = {"matmul": mf * batch / hw.gemm_flops("fp32", mf * batch / nf)
            + mb * batch / hw.gemm_flops("fp32", mb * batch / nb),
            "attention": (af + ab) * batch / cal.attention_flops if cal.attention_flops else 0.0,
            "memory-bound": (ld.fwd_mem + ld.bwd_mem) * batch / ew_s}
    inside = sum(by.values())
    print(f"== {name}, batch {batch} x {seq} tokens: step {plain * 1e3:.1f} ms CPU ({tot * 1e3:.1f} ms under the "
          f"timer): in aten calls {inside * 1e3:.1f} ms, outside them {(tot - inside) * 1e3:.1f} ms; "
          f"{sum(n.values())} aten calls ({sum(v for k, v in n.items() if k != 'view')} not views); "
          f"planner: {ld.ops:.0f} profiled ops x {hw.op_overhead_s * 1e6:.1f} us = {ld.ops * hw.op_overhead_s * 1e3:.1f} ms")
    for k in ("matmul", "attention", "memory-bound", "view", "optimizer"):
        p = f"planner {pred[k] * 1e3:8.1f} ms" if k in pred else ""
        print(f"   {k:<13} {by[k] * 1e3:8.1f} ms in {n[k]:4d} calls   {p}")
    sig: collections.Counter = collections.Counter()
    info = {}
    for func, shapes, rest in calls:
        key = (func.overloadpacket.__name__, shapes, rest)
        sig[key] += 1
        info[key] = func
    rows, t_alone, t_curve, t_grid, fl_all, k_all = [], 0.0, 0.0, 0.0, 0.0, 0
    for (op, shapes, rest), cnt in sig.items():
        fl = _flops(op, shapes)
        t = _alone(info[(op, shapes, rest)], shapes, rest)
        rate = hw.gemm_flops("fp32", fl)
        grid, factor = _grid_rate(hw, op, shapes) or (rate, 1.0)
        t_alone, t_curve, fl_all, k_all = t_alone + t * cnt, t_curve + fl / rate * cnt, fl_all + fl * cnt, k_all + cnt
        t_grid += fl / (rate * factor) * cnt
        rows.append((t * cnt, op, [s[0] for s in shapes], cnt, fl / t / 1e9, rate / 1e9, grid / 1e9, rate * factor / 1e9))
    mean = fl_all / hw.gemm_flops("fp32", fl_all / max(k_all, 1))
    from modelpar.planner.cost import _shape_seconds
    (s_f, s_b), (f_f, f_b), (k_f, k_b) = _shape_seconds(ld, hw, batch, "fp32")
    rest = max(mf * batch + mb * batch - f_f - f_b, 0.0)
    n_rest = max(ld.fwd_gemms + ld.bwd_gemms - 2 * ld.attn_calls - k_f - k_b, 1)
    new = s_f + s_b + (rest / hw.gemm_flops("fp32", rest / n_rest) if rest else 0.0)
    print(f"   matmuls alone: {k_all} calls, {fl_all / 1e9:.1f} GFLOP, {t_alone * 1e3:.1f} ms; the curve per call "
          f"{t_curve * 1e3:.1f} ms, at the mean call (the planner before) {mean * 1e3:.1f} ms; curve x shape factor "
          f"per call {t_grid * 1e3:.1f} ms, the planner's shape pricing (profiled shapes) {new * 1e3:.1f} ms")
    for t, op, sh, cnt, g, gp, gg, gs in sorted(rows, reverse=True)[:12]:
        print(f"      {op:<6} {str(sh):<44} x{cnt:<3} {t * 1e3:7.1f} ms  {g:6.1f} GFLOP/s (curve {gp:6.1f}, grid "
              f"{gg:6.1f}, curve x factor {gs:6.1f})")
    x, y = x[:1, :4], y[:1, :4]
    for _ in range(5):
        step()
    ts = []
    for _ in range(30):
        t0 = time.thread_time()
        step()
        ts.append(time.thread_time() - t0)
    from modelpar.planner.cost import _framework_seconds
    print(f"   fixed cost (1 x 4 tokens): {sorted(ts)[len(ts) // 4] * 1e3:.1f} ms CPU per step; the planner's per-op "
          f"term {ld.ops * hw.op_overhead_s * 1e3:.1f} ms ({ld.ops:.0f} ops), its framework term "
          f"{sum(_framework_seconds(ld, hw)) * 1e3:.1f} ms ({ld.calls:.0f} calls x "
          f"{(cal.dispatch_overhead_s or 0) * 1e6:.1f} us; `cost._framework_seconds`)")


def main(argv: list[str]) -> int:
    import os
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from planner_accuracy_time import load_hardware
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="hf-llama,hf-gpt2,gpt")
    ap.add_argument("--batch", type=int, default=16, help="samples (16: a DDP rank's local batch of the benchmark)")
    ap.add_argument("--hardware", help="calibration file (default: `modelpar calibrate`'s)")
    ap.add_argument("--cpu-time-rates", action="store_true",
                    help="re-measure the compute terms here on this thread's CPU time (`cpu_time_rates`)")
    ap.add_argument("--save-hardware", default=None,
                    help="with --cpu-time-rates: write the re-measured profile here (for other diagnostics)")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    hw = load_hardware(args.hardware)
    if args.cpu_time_rates:
        hw = cpu_time_rates(hw)
        if args.save_hardware:
            from modelpar.planner.hardware import save_profile
            save_profile(hw, args.save_hardware)
    for m in args.models.split(","):
        report(m, args.batch, hw)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
