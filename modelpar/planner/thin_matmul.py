"""Thin matrix products beyond the calibrated shape grid: how much slower than its edge they run.

The rule (`beyond_grid_factor`): a product ``M x K @ K x N`` is thin in its smallest dimension
``t = min(M, K, N)``; its large operand is the one matrix without that dimension (the weight in a
Linear's forward and input gradient, the weight-sized result of its weight gradient), of
``4 M K N / t`` fp32 bytes. Each block of ``t`` rows streams that whole operand from memory, so
once it is far past the last-level cache the rate follows its bytes (and the rows that reuse each
byte), not the FLOPs: the shape grid (`Hardware.shape_flops`), whose largest operand is
``4 x 1024 x 1024`` bytes, clamps to its edge and prices mlp-large's 200 MB layer at 16 rows at
25.6 GFLOP/s where it runs at 14.4 (1 thread, measured on the 2-core CPU host the tests run on).

``Calibration.matmul_thin`` (`modelpar.calibrate.thin`) holds, per layout, the rates at a few row
counts and operand sizes, the smallest at the grid's edge operand. The factor is the table's rate at
(t, bytes) over its rate at (t, the grid's edge bytes): a ratio of two rates of one run, so the
table's method and moment cancel and the grid keeps setting the level. Interpolated log-log in
both coordinates; rows and bytes clamped to the table's range (past its largest operand, already
far beyond the cache, the streaming rate stays flat); never above 1 (the edge is measured from
memory too, so a ratio above 1 is noise). 1 where the operand fits the grid, where ``t`` exceeds the
table's largest row count (enough rows reuse each streamed byte: not thin), or without the table
(files before schema 4: the edge clamp, as before).
"""

from __future__ import annotations

import math


def _interp(points: list[tuple[float, float]], x: float) -> float:
    """Log-log interpolation in sorted ``(x, y)`` points, ``x`` clamped to their range."""
    x = min(max(x, points[0][0]), points[-1][0])
    for (x0, y0), (x1, y1) in zip(points, points[1:]):
        if x <= x1:
            w = (math.log(x) - math.log(x0)) / (math.log(x1) - math.log(x0)) if x1 > x0 else 0.0
            return math.exp((1 - w) * math.log(y0) + w * math.log(y1))
    return points[-1][1]


def _table_rate(table: dict[tuple[int, int], float], rows: float, nbytes: float) -> float | None:
    """Rate at (``rows``, ``nbytes``) from ``{(rows, bytes): FLOP/s}``: log-log in bytes at each
    measured row count, then in rows; None where a row count lacks a positive rate."""
    by_rows: dict[int, list[tuple[float, float]]] = {}
    for (r, b), f in table.items():
        if f <= 0:
            return None
        by_rows.setdefault(r, []).append((float(b), f))
    if not by_rows:
        return None
    per_row = [(float(r), _interp(sorted(pts), nbytes)) for r, pts in sorted(by_rows.items())]
    return _interp(per_row, rows)


def beyond_grid_factor(cal, layout: str, m: float, k: float, n: float) -> float:
    """The factor (<= 1) on the shape grid's clamped rate of an ``m x k @ k x n`` fp32 product of
    ``layout`` whose large operand exceeds the grid's (``4 G^2`` bytes, G the grid's largest
    dimension): the module's rule. ``cal``: a `Calibration` (or None); 1.0 without its
    ``matmul_thin`` table or shape grid for ``layout``."""
    table = cal.matmul_thin.get(layout) if cal is not None else None
    grid = cal.matmul_shapes.get(layout) if table else None
    if not grid:
        return 1.0
    grid_max = max(max(p) for p in grid)
    t = min(m, k, n)
    nbytes, edge = 4.0 * m * k * n / t, 4.0 * grid_max * grid_max
    if nbytes <= edge or t > max(r for r, _ in table):    # fits the grid, or not thin (reuse)
        return 1.0
    at, ref = _table_rate(table, t, nbytes), _table_rate(table, t, edge)
    return 1.0 if at is None or ref is None else min(1.0, at / ref)
