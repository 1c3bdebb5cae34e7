"""Pure-CPU checks of the accuracy tooling: calibrate's fits and default path, the FLOP/s curve,
fused-attention profiling, the GPU check's logic (`modelpar.bench.gpu`: placement parity on cpu + cpu,
MFU and the prediction path; `benchmarks/gpu_check.py`'s CUDA-less exit) and plan_quality's
finalists (`modelpar.bench.plan_quality`)."""

from __future__ import annotations

import json
import math
import os
import pathlib
import subprocess
import sys

import pytest
import torch

from modelpar.models import build_model
from modelpar.calibrate import default_calibration_path
from modelpar.calibrate.micro import fit_alpha_beta
from modelpar.cli.calibrate import main as calibrate_main
from modelpar.planner.calibration import Calibration
from modelpar.planner.hardware import cpu_profile, load_profile
from modelpar.planner.profile import profile_model

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_fit_alpha_beta_recovers_constants():
    alpha, beta = 50e-6, 2e9
    times = {b: 2 * alpha + 1.0 * b / beta for b in (4096, 2 ** 20, 2 ** 24)}     # all-reduce, n = 2
    a, bw = fit_alpha_beta(times, steps=2, volume=1.0)
    assert math.isclose(a, alpha, rel_tol=1e-6) and math.isclose(bw, beta, rel_tol=1e-6)


# what `micro.measure_compute` returns, made up: the tests below check what calibrate does with a
# measurement (paths, scaling, reuse); the real micro-benchmarks run in the slow
# tests/test_planner_commands.py::test_calibrate_smoke (a whole `modelpar calibrate --nproc 2`)
FAKE_COMPUTE = {"matmul_flops": {256: 1e11, 512: 1.2e11}, "matmul_peak": 1.3e11, "op_overhead_s": 2e-6, "dispatch_overhead_s": 3e-6,
                "mem_bandwidth": 2e10, "attention_flops": 7e10, "fresh": {2 ** 25: 3e-10},
                "elementwise_bw": 2e10, "zero_bubble_backward_factor": 1.1}


class _Calls(list):
    """`measure_compute`'s calls (the ``sizes`` passed) and, in ``rounds`` / ``quick``, the ``rounds`` /
    ``quick`` passed."""

    def __init__(self):
        super().__init__()
        self.rounds, self.quick = [], []


@pytest.fixture
def fake_compute(monkeypatch):
    from modelpar.calibrate import micro

    calls = _Calls()

    def measure(sizes=None, rounds=None, quick=False):
        calls.append(sizes)
        calls.rounds.append(rounds)
        calls.quick.append(quick)
        return {**FAKE_COMPUTE, "matmul_flops": dict(FAKE_COMPUTE["matmul_flops"])}
    monkeypatch.setattr(micro, "measure_compute", measure)
    return calls


def test_calibrate_writes_default_path(tmp_path, monkeypatch, capsys, fake_compute):
    target = tmp_path / "sub" / "calibration.json"
    monkeypatch.setenv("MODELPAR_CALIBRATION", str(target))
    assert default_calibration_path() == target
    assert calibrate_main(["--no-collectives", "--nproc", "1"]) == 0
    assert len(fake_compute) == 1
    hw = load_profile(target)
    assert hw.calibration.matmul_flops == FAKE_COMPUTE["matmul_flops"]
    assert hw.op_overhead_s == FAKE_COMPUTE["op_overhead_s"]
    assert hw.calibration.dispatch_overhead_s == FAKE_COMPUTE["dispatch_overhead_s"]
    assert hw.source == "calibrated by modelpar calibrate"


def test_calibrate_rounds_reach_the_measurement(tmp_path, fake_compute):
    """``--rounds`` is passed to the compute micro-benchmarks (default `micro.ROUNDS`, the CLI's
    default too); fewer than one round is one clear error before anything is measured."""
    from modelpar.calibrate import micro
    from modelpar.cli.calibrate import CalibrateOptions

    assert CalibrateOptions().rounds == micro.ROUNDS
    assert calibrate_main(["--no-collectives", "--nproc", "1", "--out", str(tmp_path / "a.json")]) == 0
    assert calibrate_main(["--no-collectives", "--nproc", "1", "--rounds", "1", "--out", str(tmp_path / "b.json")]) == 0
    assert fake_compute.rounds == [micro.ROUNDS, 1]
    with pytest.raises(ValueError, match=r"--rounds must be >= 1, got 0"):
        calibrate_main(["--no-collectives", "--nproc", "1", "--rounds", "0", "--out", str(tmp_path / "c.json")])
    assert len(fake_compute) == 2 and not (tmp_path / "c.json").exists()


def test_calibrate_quick_reaches_the_measurement_and_the_file_says_so(tmp_path, fake_compute):
    """``--quick`` (the suite's smoke run, smaller grids) is passed to the compute micro-benchmarks, and
    the profile it writes says it is a smoke run; without it neither happens."""
    assert calibrate_main(["--no-collectives", "--nproc", "1", "--out", str(tmp_path / "a.json")]) == 0
    assert calibrate_main(["--no-collectives", "--nproc", "1", "--quick", "--out", str(tmp_path / "q.json")]) == 0
    assert fake_compute.quick == [False, True]
    assert load_profile(tmp_path / "a.json").source == "calibrated by modelpar calibrate"
    assert load_profile(tmp_path / "q.json").source.startswith("calibrated by modelpar calibrate --quick")


def test_auto_calibrates_once_and_uses_it(tmp_path, monkeypatch, capsys, fake_compute):
    """An uncalibrated CPU machine is measured on the first `--strategy auto` (one local rank here:
    no collective launch) and the file is reused; ``MODELPAR_AUTO_CALIBRATE=0`` turns it off."""
    from modelpar.train import auto
    from modelpar.train.config import TrainConfig
    target = tmp_path / "calib.json"
    monkeypatch.setenv("MODELPAR_CALIBRATION", str(target))
    monkeypatch.setenv("MODELPAR_AUTO_CALIBRATE", "0")
    assert auto.ensure_calibration(1) is None and not target.exists()
    assert auto.hardware_for(TrainConfig(model="gpt-nano"), 1).source.startswith("estimate")
    monkeypatch.setenv("MODELPAR_AUTO_CALIBRATE", "1")
    assert auto.ensure_calibration(1) == target and target.is_file()
    assert "measuring it once" in capsys.readouterr().out
    mtime = target.stat().st_mtime_ns
    hw = auto.hardware_for(TrainConfig(model="gpt-nano"), 1)
    assert hw.source == "calibrated by modelpar calibrate" and target.stat().st_mtime_ns == mtime
    assert len(fake_compute) == 1                   # measured once, then read back
    assert hw.calibration.matmul_flops == FAKE_COMPUTE["matmul_flops"]
    assert hw.calibration.attention_flops == FAKE_COMPUTE["attention_flops"]


def test_auto_remeasures_a_calibration_from_an_older_schema(tmp_path, monkeypatch, capsys, fake_compute):
    """`train --strategy auto` measures again a calibration file an older modelpar wrote (schema below
    SCHEMA_VERSION: the per-shape tables missing; a schema-2 file predicted the main job 57% fast), and
    leaves a current one and ``MODELPAR_AUTO_CALIBRATE=0`` alone."""
    import json

    from modelpar.planner.calibration import SCHEMA_VERSION
    from modelpar.train import auto
    from modelpar.train.config import TrainConfig
    target = tmp_path / "calib.json"
    monkeypatch.setenv("MODELPAR_CALIBRATION", str(target))
    monkeypatch.setenv("MODELPAR_AUTO_CALIBRATE", "1")
    assert auto.ensure_calibration(1) == target and len(fake_compute) == 1
    assert auto.calibration_schema(target) == SCHEMA_VERSION
    assert not auto.remeasure_stale_calibration(1) and len(fake_compute) == 1      # current: kept
    old = json.loads(target.read_text())
    old["schema_version"] = SCHEMA_VERSION - 1
    target.write_text(json.dumps(old))
    monkeypatch.setenv("MODELPAR_AUTO_CALIBRATE", "0")
    auto.hardware_for(TrainConfig(model="gpt-nano"), 1)
    assert len(fake_compute) == 1 and auto.calibration_schema(target) == SCHEMA_VERSION - 1
    monkeypatch.setenv("MODELPAR_AUTO_CALIBRATE", "1")
    auto.hardware_for(TrainConfig(model="gpt-nano"), 1, measure_if_missing=False)    # plan/estimate: never
    assert len(fake_compute) == 1
    capsys.readouterr()
    hw = auto.hardware_for(TrainConfig(model="gpt-nano"), 1)
    assert len(fake_compute) == 2 and auto.calibration_schema(target) == SCHEMA_VERSION
    assert f"is from an older modelpar (schema {SCHEMA_VERSION - 1}, now {SCHEMA_VERSION})" in capsys.readouterr().out
    assert hw.source == "calibrated by modelpar calibrate"


def test_calibrate_scales_compute_when_ranks_outnumber_cores(tmp_path, monkeypatch, fake_compute):
    """More local ranks than cores: every rate calibrate timed in one process is scaled by the
    ranks' share of the cores (4 ranks on this 2-core machine computed 2x slower than predicted)."""
    import os

    fake = FAKE_COMPUTE
    ranks = 4 * (os.cpu_count() or 1)
    out = tmp_path / "hw.json"
    assert calibrate_main(["--no-collectives", "--nproc", str(ranks), "--out", str(out)]) == 0
    hw = load_profile(out)
    share = (os.cpu_count() or 1) / ranks
    assert math.isclose(hw.calibration.core_share, share)
    assert math.isclose(hw.calibration.matmul_flops[512], 1.2e11 * share)
    assert math.isclose(hw.peak_flops["fp32"], 1.3e11 * share)
    assert math.isclose(hw.calibration.attention_flops, 7e10 * share)
    assert math.isclose(hw.op_overhead_s, 2e-6 / share)


def test_gemm_flops_curve_interpolates_and_clamps():
    import dataclasses
    hw = dataclasses.replace(cpu_profile(1), calibration=Calibration(matmul_flops={64: 1e10, 256: 4e10}))
    assert hw.gemm_flops("fp32", 2 * 32 ** 3) == 1e10                 # below the sweep: clamped
    assert hw.gemm_flops("fp32", 2 * 1024 ** 3) == 4e10               # above: clamped
    mid = hw.gemm_flops("fp32", 2 * 128 ** 3)                         # halfway in log size
    assert math.isclose(mid, 2e10, rel_tol=1e-9)
    assert cpu_profile(1).gemm_flops("fp32", 1e9) == cpu_profile(1).achievable_flops("fp32")


def test_in_context_collective_table_and_fallback():
    """`collective_seconds(in_context=True)` reads the table of calls between compute segments and
    falls back to the back-to-back one; log-log between sizes, linear in bytes past the largest."""
    import dataclasses
    extra = {"collective_ranks": 2, "all_reduce_t_1024": 1e-4, "all_reduce_t_4096": 4e-4,
             "all_reduce_ctx_1024": 2e-3, "all_reduce_ctx_4096": 8e-3, "all_gather_t_1024": 3e-4}
    hw = dataclasses.replace(cpu_profile(2), calibration=Calibration.from_legacy_extra(extra))   # schema-1 keys
    assert hw.collective_seconds("all_reduce", 1024, 2) == 1e-4
    assert hw.collective_seconds("all_reduce", 1024, 2, in_context=True) == 2e-3
    assert math.isclose(hw.collective_seconds("all_reduce", 2048, 2, in_context=True), 4e-3, rel_tol=1e-9)
    assert math.isclose(hw.collective_seconds("all_reduce", 8192, 2, in_context=True), 16e-3, rel_tol=1e-9)
    assert hw.collective_seconds("all_gather", 1024, 2, in_context=True) == 3e-4     # no ctx table
    assert hw.collective_seconds("all_reduce", 1024, 4, in_context=True) is None     # other rank count
    assert hw.collective_seconds("all_reduce", 0, 2, in_context=True) == 0.0


def test_flash_profile_saves_linear_in_seq():
    m = build_model("gpt-1m", device="meta")
    saved = {}
    for att in ("flash", "math"):
        for s in (64, 128):
            x = torch.zeros(1, s, dtype=torch.long, device="meta")
            saved[att, s] = profile_model(m, x, attention=att).blocks[1].saved_bytes
    assert saved["flash", 128] == 2 * saved["flash", 64]               # O(seq)
    assert saved["math", 128] > 2 * saved["math", 64]                  # superlinear: (seq, seq) scores
    assert saved["flash", 128] < saved["math", 128]
    with pytest.raises(ValueError, match="attention"):
        profile_model(m, torch.zeros(1, 8, dtype=torch.long, device="meta"), attention="sparse")


def test_flash_flops_equal_math_flops():
    m = build_model("gpt-nano", device="meta")
    x = torch.zeros(2, 64, dtype=torch.long, device="meta")
    f, g = profile_model(m, x, attention="flash"), profile_model(m, x, attention="math")
    assert [b.fwd_flops for b in f.blocks] == [b.fwd_flops for b in g.blocks]
    assert [b.bwd_flops for b in f.blocks] == [b.bwd_flops for b in g.blocks]


@pytest.mark.slow
def test_gpu_check_without_cuda_exits_cleanly():
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    p = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "gpu_check.py")], capture_output=True,
                       text=True, timeout=120, env=env)
    assert p.returncode == 0, p.stderr[-2000:]
    assert "no CUDA device" in p.stdout


def test_gpu_check_logic_on_cpu():
    from modelpar.bench import gpu as gc

    pc = gc.placement_check(("cpu", "cpu"), model_name="gpt-nano", steps=2, batch=2)
    assert pc["max_rel_diff"] <= 1e-6 and len(pc["placement"]) == 2
    assert gc.hardware_for_device("NVIDIA H200").name == "H200"
    assert gc.hardware_for_device("NVIDIA A100-SXM4-80GB").name == "A100-80GB"
    assert math.isclose(gc.mfu(989e12 * 0.5, 1.0, 989e12), 0.5)
    prof, mem, step = gc.predict("gpt-nano", 2, gc.hardware_for_device("NVIDIA H100 80GB HBM3"))
    assert mem.total > 0 and step.total > 0 and prof.dtype == "bf16"
    run = gc.train_steps("gpt-nano", "cpu", micro_batch=2, steps=3, precision="fp32")
    assert len(run["times"]) == 3 and run["peak_bytes"] == 0 and all(math.isfinite(x) for x in run["losses"])


def test_plan_quality_finalists_cover_basic_strategies():
    from modelpar.bench import plan_quality as pq

    m = build_model("gpt-nano", device="meta")
    prof = profile_model(m, torch.zeros(1, m.cfg.seq_len, dtype=torch.long, device="meta"))
    fin, rep = pq.finalists(prof, 2, cpu_profile(2))
    labels = [f[0] for f in fin]
    assert labels[0] == "auto" and labels.count("rules") <= 1
    if "rules" not in labels:           # rules picked auto's very plan: it is measured once
        from modelpar.planner.rules import rule_plan
        plan, _ = rule_plan(prof, 2, cpu_profile(2), global_batch_size=pq.GLOBAL_BATCH,
                            task="language")
        assert (plan, pq.GLOBAL_BATCH // plan.dp) == (fin[0][1], fin[0][2])
    else:
        assert labels[-1] == "rules"
    kinds = {pq.basic_strategy(p) for _, p, _, _ in fin}
    assert {"ddp", "fsdp", "tp", "pp"} <= kinds
    assert json.dumps([p.to_dict() for _, p, _, _ in fin])


def test_robust_keeps_the_median_and_reports_the_range():
    """`micro.robust`: one outlying round is rejected whichever way it lies; the spread is the full
    range over the median."""
    from modelpar.calibrate.micro import robust
    assert robust([10.0, 11.0, 30.0]) == (11.0, 20.0 / 11.0)
    assert robust([1.0, 10.0, 11.0])[0] == 10.0
    assert robust([5.0]) == (5.0, 0.0)
    assert robust([0.0, 0.0, 0.0]) == (0.0, 0.0)
    assert robust([-1.0, 0.0, 1.0]) == (0.0, float("inf"))


def test_calibrate_records_and_prints_each_terms_spread(tmp_path, monkeypatch, capsys, fake_compute):
    """The spreads `measure_compute` reports land in the file (schema 3) and every term's line shows
    its spread; a spread above `NOISY_SPREAD` adds one note that the machine was busy."""
    from modelpar.calibrate import NOISY_SPREAD, micro

    def measure(sizes=None, rounds=None, quick=False):
        return {**FAKE_COMPUTE, "rounds": 3, "spread": {"matmul_flops[256]": 0.031, "attention_flops": 0.5}}
    monkeypatch.setattr(micro, "measure_compute", measure)
    out = tmp_path / "hw.json"
    assert calibrate_main(["--no-collectives", "--nproc", "1", "--out", str(out)]) == 0
    c = load_profile(out).calibration
    assert c.rounds == 3 and c.spread == {"matmul_flops[256]": 0.031, "attention_flops": 0.5}
    text = capsys.readouterr().out
    line = next(ln for ln in text.splitlines() if "matmul   256^3" in ln)
    assert "100.0 GFLOP/s" in line and "spread   3.1%" in line
    assert "attention" in text and "spread  50.0%" in text
    assert 0.5 > NOISY_SPREAD and text.count("this machine was busy") == 1


def test_calibrate_does_not_call_the_hosts_own_jitter_busy(tmp_path, monkeypatch, capsys, fake_compute):
    """Spreads of the jitter terms (`JITTER_TERMS`: the in-context collectives, the TP / FSDP2
    differences, the memory bandwidth sampled across the run) are printed but never make the
    busy-machine note; a compute term's does."""
    from modelpar.calibrate import JITTER_TERMS, micro
    jitter = {"all_reduce.in_context[small]": 1.2, "tp_linear_overhead_s": 3.0, "mem_bandwidth": 0.6,
              "fsdp_unit_overhead_s": 0.9}
    assert all(any(j in k for j in JITTER_TERMS) for k in jitter)

    def measure(sizes=None, rounds=None, quick=False):
        return {**FAKE_COMPUTE, "rounds": 3, "spread": {"attention_flops": 0.02, **jitter}}
    monkeypatch.setattr(micro, "measure_compute", measure)
    assert calibrate_main(["--no-collectives", "--nproc", "1", "--out", str(tmp_path / "a.json")]) == 0
    assert "this machine was busy" not in capsys.readouterr().out
    monkeypatch.setattr(micro, "measure_compute", lambda sizes=None, rounds=None, quick=False: {
        **FAKE_COMPUTE, "rounds": 3, "spread": {"attention_flops": 0.3, **jitter}})
    assert calibrate_main(["--no-collectives", "--nproc", "1", "--out", str(tmp_path / "b.json")]) == 0
    assert "largest spread over 3 rounds is attention_flops 30%" in capsys.readouterr().out
