"""Thin products whose weight is far beyond the cache (`Calibration.matmul_thin`, schema 4): the
planner prices shapes beyond the calibrated grid by the measured factor on the grid's edge; files
without the table keep the edge clamp."""

from __future__ import annotations

import dataclasses
import json

import pytest

from modelpar.calibrate.thin import measure_thin_matmuls, thin_dims
from modelpar.planner.calibration import SCHEMA_VERSION, Calibration
from modelpar.planner.hardware import cpu_profile, load_profile, save_profile

DIMS = (16, 256, 1024)
MIB = 2 ** 20


def _grid(rate=2e10):
    return {lay: {(m, k, n): rate for m in DIMS for k in DIMS for n in DIMS} for lay in ("NT", "NN", "TN")}


# per layout {(rows, weight bytes): FLOP/s}: 16 rows fall from 20 to 10 GFLOP/s between the 4 MiB
# (grid edge) and the 64 MiB weight; 256 rows do not fall
THIN = {lay: {(16, 4 * MIB): 2e10, (16, 16 * MIB): 1.4e10, (16, 64 * MIB): 1e10,
              (256, 4 * MIB): 4e10, (256, 16 * MIB): 4e10, (256, 64 * MIB): 4e10} for lay in ("NT", "NN", "TN")}


def _hw(**kw):
    return dataclasses.replace(cpu_profile(1), calibration=Calibration(matmul_flops={1024: 6e10},
                                                                        matmul_shapes=_grid(), **kw))


def test_beyond_grid_thin_products_are_priced_below_the_edge():
    old, new = _hw(), _hw(matmul_thin=THIN)
    edge = old.shape_flops("fp32", "NT", 16, 1024, 1024)
    # mlp-large's first layer: 16 rows x a 10,000 x 5,000 weight (200 MB, past the table's 64 MiB:
    # flat there) -> the 64 MiB factor 0.5
    assert old.shape_flops("fp32", "NT", 16, 10000, 5000) == pytest.approx(edge)
    assert new.shape_flops("fp32", "NT", 16, 10000, 5000) == pytest.approx(0.5 * edge)
    # between table points: log-log in bytes (16 MiB weight = 2048 x 2048 -> 1.4 / 2)
    assert new.shape_flops("fp32", "NN", 16, 2048, 2048) == pytest.approx(0.7 * edge)
    # the weight gradient's thin dimension is K; its weight-sized result is M x N
    assert new.shape_flops("fp32", "TN", 2048, 16, 2048) == pytest.approx(0.7 * edge)
    # inside the grid, or not thin (256 rows: no fall measured; 2048 rows: beyond the table's rows)
    assert new.shape_flops("fp32", "NT", 16, 1024, 1024) == pytest.approx(edge)
    assert new.shape_flops("fp32", "NT", 256, 10000, 5000) == pytest.approx(old.shape_flops("fp32", "NT", 256, 10000, 5000))
    assert new.shape_flops("fp32", "NT", 2048, 4096, 4096) == pytest.approx(old.shape_flops("fp32", "NT", 2048, 4096, 4096))
    # the shape factor the cost model reads falls with it
    assert new.shape_factor("NT", 16, 10000, 5000) == pytest.approx(0.5 * old.shape_factor("NT", 16, 10000, 5000))
    # a noisy table (beyond-cache rate above the edge's) never speeds a product up
    fast = {lay: {(16, 4 * MIB): 1e10, (16, 64 * MIB): 2e10} for lay in ("NT", "NN", "TN")}
    assert _hw(matmul_thin=fast).shape_flops("fp32", "NT", 16, 10000, 5000) == pytest.approx(edge)


def test_schema_round_trip_and_old_files(tmp_path):
    assert SCHEMA_VERSION >= 5         # 4 added matmul_thin; 5 dispatch_overhead_s; 6 compute_contention
    out = tmp_path / "hw.json"
    save_profile(_hw(matmul_thin=THIN), out)
    d = json.loads(out.read_text())
    assert d["schema_version"] == SCHEMA_VERSION
    assert d["calibration"]["matmul_thin"]["NT"][f"16x{64 * MIB}"] == 1e10
    assert load_profile(out).calibration.matmul_thin == THIN
    # a schema-3 file (no table) loads with an empty one and prices at the edge, as before
    d["schema_version"] = 3
    del d["calibration"]["matmul_thin"]
    out.write_text(json.dumps(d))
    old = load_profile(out)
    assert old.calibration.matmul_thin == {}
    assert old.shape_flops("fp32", "NT", 16, 10000, 5000) == pytest.approx(old.shape_flops("fp32", "NT", 16, 1024, 1024))


def test_measure_thin_matmuls_small():
    rates, spread = measure_thin_matmuls(rows=(4,), weight_mib=(0.25,), passes=1, pool_bytes=2 * MIB)
    side = 256
    assert set(rates) == {"NT", "NN", "TN"}
    assert all(set(g) == {(4, 4 * side * side)} and min(g.values()) > 0 for g in rates.values())
    assert spread == 0.0                                    # one pass
    assert thin_dims("TN", 4, side) == (side, 4, side) and thin_dims("NT", 4, side) == (4, side, side)
    with pytest.raises(ValueError, match="passes 0"):
        measure_thin_matmuls(passes=0)
