"""Thin matrix products whose large operand is far beyond the last-level cache (`modelpar calibrate`).

The shape grid (`modelpar.calibrate.micro.measure_shapes`) stops at 1,024 (a 4 MiB fp32 weight). A
product with few rows and a much larger weight (mlp-large's 10,000 x 5,000 = 200 MB layer at 16 rows)
runs well below the grid's edge (1 thread, this host kind: 14.4 GFLOP/s vs 25.6 at 16 x 1024 x
1024), because each row block streams the whole weight from memory. This module times that: per
layout, a few row counts x a few weight sizes, the rate `modelpar.planner.thin_matmul` reads.
"""

from __future__ import annotations

import math
import time

import torch

from modelpar.calibrate.micro import time_products

THIN_ROWS = (8, 16, 64, 256)                       # the thin dimension (a micro-batch's rows)
THIN_WEIGHT_MIB = (4, 16, 64)                      # fp32 square weights 1024^2, 2048^2, 4096^2
THIN_LAYOUTS = ("NT", "NN", "TN")
QUICK_THIN_ROWS = (16,)                            # `--quick`: a smoke run, not for planning
QUICK_THIN_WEIGHT_MIB = (4, 16)


def thin_dims(layout: str, rows: int, side: int) -> tuple[int, int, int]:
    """(M, K, N) of a product of ``layout`` with ``rows`` thin rows and a ``side x side`` weight, as
    the shape grid names them: ``"NT"`` (forward ``x @ W.T``) and ``"NN"`` (input gradient
    ``dy @ W``) are ``(rows, side, side)``; ``"TN"`` (weight gradient ``dy.T @ x``, the weight-sized
    result) is ``(side, rows, side)``."""
    return (side, rows, side) if layout == "TN" else (rows, side, side)


def measure_thin_matmuls(rows=THIN_ROWS, weight_mib=THIN_WEIGHT_MIB, layouts=THIN_LAYOUTS, passes: int = 2,
                         pool_bytes: int = 32 * 2 ** 20, timer=time.perf_counter
                         ) -> tuple[dict[str, dict[tuple[int, int], float]], float]:
    """FLOP/s of fp32 products with ``rows`` thin rows and a square weight of ``weight_mib`` MiB, per
    layout (`thin_dims`), operands from memory: each call takes the next of as many operand sets as
    fill ``pool_bytes`` (as the shape grid does, so its 4 MiB point is the grid edge's method; one set
    at and above the pool). The median of ``passes`` passes after a
    warm-up. Returns ({layout: {(rows, weight bytes): FLOP/s}}, the largest relative spread over the
    passes, `robust`). About 8 s on one loaded core of this host kind; `--quick`: 16 rows, 4 and 16 MiB.

    Raises:
        ValueError: ``passes`` < 1, or a row count / weight size that is not positive.
    """
    if passes < 1 or min(rows) < 1 or min(weight_mib) <= 0:
        raise ValueError(f"measure_thin_matmuls: passes {passes}, rows {rows}, weight_mib {weight_mib} must be positive")
    out: dict[str, dict[tuple[int, int], float]] = {lay: {} for lay in layouts}
    worst = 0.0
    for mib in weight_mib:
        side = int(round(math.sqrt(mib * 2 ** 20 / 4)))
        w_src = torch.randn(side, side)
        sets = max(1, pool_bytes // (4 * side * side))
        weights = [w_src.clone() for _ in range(sets)]
        for lay in layouts:
            for r in rows:
                m, k, n = thin_dims(lay, r, side)
                if lay == "TN":           # dy.T (side x rows, transposed view) @ x (rows x side) -> side x side
                    ops = [(torch.randn(r, side).t(), torch.randn(r, side), w) for w in weights]
                else:                     # x (rows x side) @ W.T or W -> rows x side
                    ops = [(torch.randn(r, side), w.t() if lay == "NT" else w, torch.empty(r, side)) for w in weights]

                med, sp = time_products(ops, passes, timer)
                out[lay][(r, 4 * side * side)] = 2.0 * m * k * n / med
                worst = max(worst, sp)
        del weights, w_src
    return out, worst
