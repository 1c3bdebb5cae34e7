"""CPU pricing of the shapes the profile recorded (`BlockProfile.gemm_shapes`), for
`modelpar.planner.cost._load_times`: 2-D matrix products by shape and layout on the calibrated
matmul grid (`Hardware.shape_factor`), causal fused-attention calls by sequence length and head
dimension on the calibrated attention grid (`Hardware.attention_factor`). Both return zeros where
the calibration has no grid, so the FLOPs-only rates price everything as before. And the
framework's fixed cost of a micro-batch (`_framework_seconds`). And compute's slowdown on ranks
that compute at the same moments (`lockstep_contention`)."""

from __future__ import annotations

from modelpar.plan import ParallelPlan
from modelpar.planner.hardware import Hardware
from modelpar.planner.loads import RankLoad
from modelpar.planner.profile_ops import SDPA_LAYOUT


def _shape_seconds(ld: RankLoad, hw: Hardware, b: int, prec: str) -> tuple:
    """((fwd, bwd) seconds, (fwd, bwd) FLOPs, (fwd, bwd) calls) of the rank's 2-D products that the
    calibrated shape grid prices: each product's M x K x N at ``b`` samples (its batch dimension
    scaled), at the square curve's rate for its FLOPs (`Hardware.gemm_flops`) times its shape and
    layout's factor (`Hardware.shape_factor`); zeros where the load has no shapes (TP) or the
    calibration no grid (files before schema 3, GPU presets), so the curve prices it all."""
    cal = hw.calibration
    if not ld.gemm_shapes or cal is None or not cal.matmul_shapes:
        return (0.0, 0.0), (0.0, 0.0), (0, 0)
    sec, fl, calls = [0.0, 0.0], [0.0, 0.0], [0, 0]
    for (ph, lay, m, k, n, dim), c in ld.gemm_shapes:
        if lay == SDPA_LAYOUT:          # attention calls: `_attention_seconds`
            continue
        d = [m, k, n]
        d[dim] *= b
        factor = hw.shape_factor(lay, *d)
        if factor is None:
            continue
        f = 2.0 * d[0] * d[1] * d[2] * c
        sec[ph] += f / (hw.gemm_flops(prec, f / c) * factor)
        fl[ph] += f
        calls[ph] += c
    return tuple(sec), tuple(fl), tuple(calls)


def _attention_seconds(ld: RankLoad, hw: Hardware, b: int, attn_rate: float) -> tuple:
    """((fwd, bwd) seconds, (fwd, bwd) counted FLOPs) of the rank's causal fused-attention calls
    the profile recorded by shape (layout ``"SDPA"``: (B x H, S, D) per sample, B x H scaled to
    ``b`` samples): each at ``attn_rate`` times its shape's factor (`Hardware.attention_factor`);
    FLOPs as `profile_ops` counts them (4 B H S^2 D forward, twice that backward). Zeros without
    the calibrated grid or recorded calls: ``attn_rate`` prices all attention FLOPs then."""
    cal = hw.calibration
    if not ld.gemm_shapes or cal is None or not cal.attention_shapes:
        return (0.0, 0.0), (0.0, 0.0)
    sec, fl = [0.0, 0.0], [0.0, 0.0]
    for (ph, lay, bh, s, d, _), c in ld.gemm_shapes:
        if lay != SDPA_LAYOUT:
            continue
        factor = hw.attention_factor(bh * b, s, d)
        if factor is None:
            continue
        f = 4.0 * bh * b * s * s * d * (2 if ph else 1) * c
        sec[ph] += f / (attn_rate * factor)
        fl[ph] += f
    return tuple(sec), tuple(fl)


def _framework_seconds(ld: RankLoad, hw: Hardware) -> tuple[float, float]:
    """(fwd, bwd) seconds of framework cost per micro-batch (independent of its size): every aten
    call the profile recorded (`RankLoad.calls`, views and matmuls included) at the calibrated cost
    per call of a module-structured model (`Calibration.dispatch_overhead_s`, schema 5); on files
    without it (and loads profiled before the calls were counted), the profiled non-view,
    non-matmul ops at ``hw.op_overhead_s``, as before."""
    cal = hw.calibration
    d = cal.dispatch_overhead_s if cal is not None else None
    if d is None or not ld.calls:
        return ld.fwd_ops * hw.op_overhead_s, (ld.ops - ld.fwd_ops) * hw.op_overhead_s
    return ld.fwd_calls * d, (ld.calls - ld.fwd_calls) * d


# Whether the step model applies `Calibration.compute_contention` (`lockstep_contention`). Off: the
# step does slow beside a second one (`benchmarks/compute_contention.py`, gpt-1m one-process step,
# thread CPU time: together / alone 1.17 / 1.14 median at load 1.6; 1.01-1.04 at load 5-15, where
# "together" hardly overlaps), but the calibrated kernels do not show it (quiet: 1.012 x, matmuls
# 1.00-1.03), so the factor would not price that slowdown; recorded, not applied (docs/planner.md).
APPLY_COMPUTE_CONTENTION = False


def lockstep_contention(plan: ParallelPlan, hw: Hardware) -> float:
    """The factor (>= 1 when measured so) on a rank's compute seconds -- matmuls, attention,
    element-wise operators and the framework's per-call cost; not the memory-bound roofline terms
    or the optimizer, which the all-ranks ``mem_bandwidth`` already prices, nor fresh allocations
    (their own alone / every-rank pair) -- for ``plan`` on ``hw``: ``Calibration.compute_contention``
    (`modelpar.calibrate.contention`: kernels' thread-CPU time with every local rank running them at
    once over one rank alone) where data or tensor parallel peers exist (``dp * tp > 1``): they run
    the same kernels at the same moments and share the last-level cache and the memory bus, as in
    the measurement. 1.0 for a single rank, for a pure pipeline (``dp * tp == 1``: its stages run
    different work, offset by the schedule and idle in its bubbles, the same reason `cost.step_form`
    gives them the one-rank ``mem_bandwidth_alone``; not measured for them), and for files without
    the measurement (schema < 6, GPU presets): today's numbers. 1.0 everywhere while
    `APPLY_COMPUTE_CONTENTION` is off (the default: the kernels do not show the step's slowdown).

    Measured on the 2-core AMD EPYC host kind (private 1 MiB L2 per core, one shared 32 MiB L3),
    loaded: see docs/planner.md's "compute contention" section and `benchmarks/compute_contention.py`
    (gpt-1m's one-process step in thread CPU time alone vs with a second process stepping at the
    same moment)."""
    cal = hw.calibration
    if not APPLY_COMPUTE_CONTENTION or cal is None or plan.dp * plan.tp <= 1:
        return 1.0
    return cal.compute_contention
