"""The calibration record: typed, versioned, and files from before the schema still read the same."""

import dataclasses
import json

import pytest

from modelpar.planner.calibration import SCHEMA_VERSION, Calibration, CollectiveTable
from modelpar.planner.hardware import cpu_profile, load_profile, save_profile

LEGACY_EXTRA = {  # the string-keyed form a schema-1 file held in "extra"
    "matmul_flops_256": 2e10, "matmul_flops_1024": 5e10, "attention_flops": 1e10, "elementwise_bw": 3e9,
    "core_share": 1.0, "zero_bubble_backward_factor": 1.2, "mem_bandwidth_alone": 9e9,
    "fresh_alloc_s_per_byte_alone": 1e-9, "tp_linear_overhead_s": 4e-5, "tp_linear_overhead_s_per_byte": 1e-10,
    "fsdp_unit_overhead_s": 1e-4, "fsdp_tensor_overhead_s": 2e-5, "all_reduce_latency": 5e-5,
    "all_reduce_bw": 2e9, "all_reduce_t_4096": 1e-4, "all_reduce_t_1048576": 9e-4, "all_reduce_ctx_4096": 3e-4,
    "send_recv_latency": 4e-5, "send_recv_bw": 3e9, "send_recv_t_4096": 6e-5, "fresh_alloc_s_per_byte": 2e-9,
    "fresh_alloc_min_bytes": 33554432, "collective_ranks": 2,
}


def _legacy_file(tmp_path, extra=LEGACY_EXTRA):
    d = {k: v for k, v in dataclasses.asdict(cpu_profile(2)).items() if k != "calibration"}
    d["extra"] = extra
    path = tmp_path / "v1.json"
    path.write_text(json.dumps(d))
    return path


def test_schema_1_file_reads_as_typed_calibration(tmp_path):
    hw = load_profile(_legacy_file(tmp_path))
    c = hw.calibration
    assert c.matmul_flops == {256: 2e10, 1024: 5e10} and c.collective_ranks == 2
    assert c.collectives["all_reduce"] == CollectiveTable(5e-5, 2e9, {4096: 1e-4, 1048576: 9e-4}, {4096: 3e-4})
    assert c.collectives["send_recv"].in_context == {} and c.fsdp_tensor_overhead_s == 2e-5
    assert hw.collective("all_reduce") == (2e9, 5e-5) and hw.collective("all_gather") is None
    assert hw.collective_seconds("all_reduce", 4096, 2, in_context=True) == 3e-4
    assert hw.collective_seconds("send_recv", 4096, 2, in_context=True) == 6e-5      # back-to-back fallback
    # saved again: schema 2, the same profile after a round trip
    out = tmp_path / "v2.json"
    save_profile(hw, out)
    saved = json.loads(out.read_text())
    assert saved["schema_version"] == SCHEMA_VERSION and "extra" not in saved
    assert saved["calibration"]["collectives"]["all_reduce"]["seconds"] == {"4096": 1e-4, "1048576": 9e-4}
    assert load_profile(out) == hw


def test_unknown_entries_and_newer_schema_are_refused(tmp_path):
    with pytest.raises(ValueError, match="unknown entry 'all_reduce_p99_4096'"):
        load_profile(_legacy_file(tmp_path, {**LEGACY_EXTRA, "all_reduce_p99_4096": 1.0}))
    out = tmp_path / "v2.json"
    save_profile(dataclasses.replace(cpu_profile(1), calibration=Calibration(matmul_flops={64: 1e9})), out)
    d = json.loads(out.read_text())
    out.write_text(json.dumps({**d, "schema_version": SCHEMA_VERSION + 1}))
    with pytest.raises(ValueError, match="newer than this modelpar reads"):
        load_profile(out)
    d["calibration"]["matmul_gflops"] = 1
    out.write_text(json.dumps(d))
    with pytest.raises(ValueError, match=r"unknown fields \['matmul_gflops'\]"):
        load_profile(out)


def test_uncalibrated_profiles_have_no_calibration(tmp_path):
    hw = cpu_profile(2)
    assert hw.calibration is None and hw.matmul_curve() == [] and hw.collective_seconds("all_reduce", 1e6, 2) is None
    out = tmp_path / "cpu.json"
    save_profile(hw, out)
    assert load_profile(out) == hw and json.loads(out.read_text())["calibration"] is None


def test_schema_3_keeps_rounds_and_spread_and_schema_2_files_still_load(tmp_path):
    """Schema 3 records each term's spread over the calibration's rounds (an infinite spread, a median
    of 0 with a range, survives as null); a schema-2 file (no rounds, no spread) loads with one round
    and no spreads, and predicts exactly as before (the spread is read by nothing in the cost model)."""
    from modelpar.planner.cost import estimate_step
    from modelpar.planner.memory import Batch
    from modelpar.plan import ParallelPlan
    from helpers.profiles import shared_profile_for as profile_for

    cal = Calibration(matmul_flops={64: 1e10, 512: 5e10}, attention_flops=1e10, rounds=3,
                      spread={"matmul_flops[64]": 0.04, "tp_linear_overhead_s": float("inf")})
    hw = dataclasses.replace(cpu_profile(2), calibration=cal)
    out = tmp_path / "v3.json"
    save_profile(hw, out)
    saved = json.loads(out.read_text())
    assert saved["schema_version"] == SCHEMA_VERSION == 6      # 4: matmul_thin; 5: dispatch_overhead_s; 6: compute_contention
    assert saved["calibration"]["rounds"] == 3
    assert saved["calibration"]["spread"] == {"matmul_flops[64]": 0.04, "tp_linear_overhead_s": None}
    assert load_profile(out) == hw
    # the same file as schema 2 wrote it: no rounds, no spread
    del saved["calibration"]["rounds"], saved["calibration"]["spread"]
    old = tmp_path / "v2.json"
    old.write_text(json.dumps({**saved, "schema_version": 2}))
    hw2 = load_profile(old)
    assert hw2.calibration.rounds == 1 and hw2.calibration.spread == {}
    assert hw2.calibration.matmul_flops == cal.matmul_flops
    prof, _ = profile_for("gpt-nano", {}, 16, "fp32")
    plan, batch = ParallelPlan(dp_replicate=2), Batch(8, 4)
    assert estimate_step(prof, plan, batch, hw2).total == estimate_step(prof, plan, batch, hw).total

