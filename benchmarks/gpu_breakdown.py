"""Where a GPU training step's time goes, by kernel class, beside the planner's inputs for each class.

`benchmarks/gpu_check.py` compares the planner's step time with a measured one; this script says
which of the planner's terms is off. For sweep rows of `modelpar.bench.gpu` (one GPU, bf16 autocast,
fused AdamW, fused attention, as `gpu_check.py` trains them) it records a few steps under
``torch.profiler`` (CUDA kernels only), sorts every kernel by its name into a class, and prints per
step:

- measured device seconds per class: ``gemm`` (cuBLAS / CUTLASS / nvjet), ``attention`` (flash /
  memory-efficient kernels), ``loss`` (softmax / NLL kernels), ``cast`` (copy kernels: autocast's
  casts), ``norm``, ``optimizer`` (fused AdamW / multi-tensor kernels), ``other`` (the remaining
  memory-bound kernels: GELU, adds, embedding, reductions); the device's busy time (their sum) and
  its idle time within the step's wall time (the host's launches when they fall behind);
- the planner's inputs for the class, from the profile it prices (`planner.profile.profile_model`):
  matmul FLOPs (less attention), attention FLOPs, the memory-bound bytes (``fwd_mem_bytes +
  bwd_mem_bytes``, plus `planner.gpu.LOSS_BYTES_PER_LOGIT` for the loss), and the rate the planner
  prices them at (`planner.gpu.GpuPhysics`: MAMF for matmuls, ``hbm_fraction`` x datasheet bandwidth
  for memory-bound kernels, the FlashAttention papers' tables for attention);
- the rate that the measurement implies (FLOPs or bytes / measured seconds), beside the planner's.

Run on a CUDA machine (``--device cpu --tiny``: a dry run of the code, no profile classes):
``PYTHONPATH=. python benchmarks/gpu_breakdown.py [--rows gpt-125m:1024:none,gpt-1b:1024:none]
[--steps 3] [--out DIR]``. Writes ``gpu_breakdown.json`` to ``--out`` (default ``$OUT`` or
``gpu-check-out``). Exit status 0 when every row ran (or ran out of memory), else 1.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch

from modelpar.bench.gpu import (SWEEP_MODELS, TINY_MODELS, _free, _oom_types, _timed_step, hardware_for_device,
                                lm_loss, predict_row, row_profile, row_setup)

# (class, name fragments), first match wins; attention before gemm (flash kernels hold "gemm" parts)
CLASSES = (("attention", ("flash", "fmha", "attention", "attn")),
           ("gemm", ("gemm", "nvjet", "cutlass", "xmma", "cublas", "sm90_", "sm80_", "splitk")),
           ("optimizer", ("adam", "multi_tensor")),
           ("loss", ("softmax", "nll_loss", "cross_entropy")),
           ("cast", ("copy", "cast")),
           ("norm", ("layer_norm", "layernorm", "rms_norm")))
CLASS_NAMES = tuple(c for c, _ in CLASSES) + ("other",)


def kernel_class(name: str) -> str:
    """The class of a CUDA kernel by its (demangled) name: one of `CLASS_NAMES`."""
    n = name.lower()
    for cls, parts in CLASSES:
        if any(p in n for p in parts):
            return cls
    return "other"


def planner_inputs(name: str, seq: int, mb: int, hw) -> dict:
    """The profile's per-step quantities the planner prices, and its rates (bf16, one device)."""
    from modelpar.planner.gpu import LOSS_BYTES_PER_LOGIT, physics_for
    prof = row_profile(name, seq)
    prof = prof.autocast or prof          # one device, bf16: the runtime autocasts (`plan.autocasts`)
    bl = prof.blocks
    af = sum(b.fwd_attn_flops for b in bl) * mb
    ab = sum(b.bwd_attn_flops for b in bl) * mb
    mat = sum(b.fwd_flops + b.bwd_flops for b in bl) * mb - af - ab
    logits = seq * mb * prof.arch.get("vocab_size", 0)
    loss_bytes = sum(LOSS_BYTES_PER_LOGIT) * logits
    mem_bytes = sum(b.fwd_mem_bytes + b.bwd_mem_bytes for b in bl) * mb
    phys = physics_for(hw)
    out = {"matmul_flops": mat, "attention_flops": af + ab, "memory_bound_bytes": mem_bytes,
           "loss_bytes": loss_bytes, "params": prof.num_params}
    if phys is not None:
        hd = prof.arch.get("d_model", 0) // max(prof.arch.get("n_head", 1), 1)
        rf, rb = (phys.attention_flops(d, seq, hd, True) for d in ("fwd", "bwd"))
        out.update(rate_matmul=phys.mamf_bf16, rate_memory=phys.hbm_fraction * hw.mem_bandwidth,
                   attention_s=af * 0.5 / rf + ab * 0.5 * 1.25 / rb)
    return out


def measure_classes(name: str, seq: int, mb: int, ac: str, device: str, steps: int, warmup: int = 2) -> dict:
    """Device seconds per kernel class per step, the wall seconds per step under the profiler, and
    the number of kernels per step, over ``steps`` profiled steps after ``warmup``; on CUDA also one
    more step's allocated-bytes peak per phase (``forward``: up to the loss call; ``backward``: the
    loss and the backward; ``optimizer``: the step), to place the step's peak."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    dev = torch.device(device)
    cuda = dev.type == "cuda"
    phases: dict[str, float] = {}
    marking = [False]

    def loss_fn(logits, y):            # the forward's end: its peak, then the backward's from here
        if marking[0]:
            phases["forward"] = torch.cuda.max_memory_allocated(dev)
            torch.cuda.reset_peak_memory_stats(dev)
        return lm_loss(logits, y)

    pm, opt, x, y = row_setup(name, seq, mb, ac, dev, loss_fn=loss_fn)
    for _ in range(warmup):
        _timed_step(pm, opt, x, y, dev)
    acts = [ProfilerActivity.CUDA] if cuda else [ProfilerActivity.CPU]
    t0 = time.perf_counter()
    with profile(activities=acts) as prof:
        for _ in range(steps):
            _timed_step(pm, opt, x, y, dev)
    wall = (time.perf_counter() - t0) / steps
    per = dict.fromkeys(CLASS_NAMES, 0.0)
    kernels = 0
    for e in prof.events():
        if cuda and e.device_type != DeviceType.CUDA:
            continue
        if not cuda and e.cpu_parent is not None:     # CPU dry run: top-level ops only
            continue
        per[kernel_class(e.name)] += e.time_range.elapsed_us() * 1e-6 / steps
        kernels += 1
    if cuda:
        torch.cuda.synchronize(dev)
        torch.cuda.reset_peak_memory_stats(dev)
        marking[0] = True
        pm.forward_backward(x, y)
        torch.cuda.synchronize(dev)
        phases["backward"] = torch.cuda.max_memory_allocated(dev)
        torch.cuda.reset_peak_memory_stats(dev)
        opt.step()
        torch.cuda.synchronize(dev)
        phases["optimizer"] = torch.cuda.max_memory_allocated(dev)
        opt.zero_grad(set_to_none=True)
    return {"class_s": per, "busy_s": sum(per.values()), "wall_s": wall, "kernels": kernels / steps,
            "phase_peak_bytes": phases}


def report(row: dict) -> list[str]:
    """The printed lines of one row."""
    m, p = row["measured"], row["planner"]
    c = m["class_s"]
    lines = [f"{row['model']} seq {row['seq']} x{row['micro_batch']} ac {row['ac']}: wall {m['wall_s'] * 1e3:.1f} ms "
             f"(profiled), device busy {m['busy_s'] * 1e3:.1f} ms, idle {(m['wall_s'] - m['busy_s']) * 1e3:.1f} ms, "
             f"{m['kernels']:.0f} kernels/step; planner step {row['predicted_step_s'] * 1e3:.1f} ms "
             f"({', '.join(f'{k} {v * 1e3:.1f}' for k, v in row['predicted_parts_s'].items() if v)})"]
    lines.append("    " + "  ".join(f"{k} {v * 1e3:.1f}" for k, v in c.items()) + "  (ms per step, measured)")
    if m.get("phase_peak_bytes"):
        lines.append("    peak GiB by phase: " + ", ".join(f"{k} {v / 2 ** 30:.2f}" for k, v in m["phase_peak_bytes"].items())
                     + f" (planner {row['predicted_peak_bytes'] / 2 ** 30:.2f} at its {row['predicted_phase']})")
    if c["gemm"]:
        lines.append(f"    matmul: {p['matmul_flops'] / 1e12:.2f} TFLOP -> {p['matmul_flops'] / c['gemm'] / 1e12:.0f} "
                     f"TFLOP/s measured, planner {p.get('rate_matmul', 0) / 1e12:.0f}")
    if c["attention"]:
        lines.append(f"    attention: {p['attention_flops'] / 1e12:.2f} TFLOP (profile's count) in "
                     f"{c['attention'] * 1e3:.1f} ms measured, planner {p.get('attention_s', 0) * 1e3:.1f} ms")
    mem_s = c["other"] + c["norm"] + c["cast"]
    if mem_s:
        lines.append(f"    memory-bound (other + norm + cast): {p['memory_bound_bytes'] / 1e9:.2f} GB -> "
                     f"{p['memory_bound_bytes'] / mem_s / 1e12:.2f} TB/s measured, planner "
                     f"{p.get('rate_memory', 0) / 1e12:.2f}")
    if c["loss"]:
        lines.append(f"    loss: {p['loss_bytes'] / 1e9:.2f} GB (planner's bytes) -> "
                     f"{p['loss_bytes'] / c['loss'] / 1e12:.2f} TB/s measured")
    return lines


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    ap.add_argument("--tiny", action="store_true", help="a tiny GPT (a CPU dry run)")
    ap.add_argument("--rows", default=None, help="model:seq:ac,... (micro-batch: 16,384 tokens per step)")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=None, help="tokens per step (default 16,384; --tiny 1,024)")
    ap.add_argument("--out", default=os.environ.get("OUT") or "gpu-check-out")
    a = ap.parse_args(argv)
    if a.device == "cuda" and not torch.cuda.is_available():
        print("gpu_breakdown: no CUDA device; nothing measured (--device cpu --tiny for a dry run)")
        return 0
    spec = a.rows or ("tiny:32:none,tiny:64:full" if a.tiny else
                      "gpt-125m:1024:none,gpt-1b:1024:none,gpt-1b:1024:full,gpt-3b:1024:full")
    models = {**SWEEP_MODELS, **TINY_MODELS}
    dev = "cuda:0" if a.device == "cuda" else "cpu"
    hw = hardware_for_device(torch.cuda.get_device_name(0) if a.device == "cuda" else "H200",
                             torch.cuda.get_device_properties(0).total_memory if a.device == "cuda" else 0)
    rows, ok = [], True
    for item in spec.split(","):
        name, seq, ac = item.split(":")
        seq = int(seq)
        if name not in models:
            print(f"gpu_breakdown: --rows: unknown model {name!r}; known: {', '.join(models)}")
            return 2
        mb = max(1, (a.tokens or (1024 if a.tiny else 16384)) // seq)
        row = {"model": name, "seq": seq, "micro_batch": mb, "ac": ac}
        pred = predict_row(name, seq, mb, ac, hw)
        row.update(predicted_step_s=pred["step_s"], predicted_parts_s=pred["step_parts_s"],
                   predicted_peak_bytes=pred["peak_bytes"], predicted_phase=pred["memory_phase"],
                   planner=planner_inputs(name, seq, mb, hw))
        try:
            row["measured"] = measure_classes(name, seq, mb, ac, dev, a.steps)
        except _oom_types() as e:
            row["status"] = "oom: " + str(e).splitlines()[0][:200]
        except Exception as e:   # noqa: BLE001 -- report and go on
            row["status"] = f"error: {type(e).__name__}: {e}"
            ok = False
        _free(dev)
        rows.append(row)
        print("\n".join(report(row)) if "measured" in row else f"{item}: {row['status']}", flush=True)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "gpu_breakdown.json").write_text(json.dumps({"hardware": hw.name, "rows": rows}, indent=1))
    print(f"written: {out / 'gpu_breakdown.json'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
