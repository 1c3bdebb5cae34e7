"""The framework's per-call cost (schema 5): the calibration measures seconds per aten call of tiny
blocks, the profile counts every call a model dispatches, the CPU step model prices one by the other."""

import dataclasses
import json

import pytest
import torch

from modelpar.calibrate import micro
from modelpar.models import build_model
from modelpar.plan import ParallelPlan
from modelpar.planner.calibration import SCHEMA_VERSION, Calibration
from modelpar.planner.cost import estimate_step
from modelpar.planner.hardware import cpu_profile, load_profile, save_profile
from modelpar.planner.loads import rank_loads
from modelpar.planner.memory import Batch
from modelpar.planner.profile import profile_model


def _nano_profile():
    meta = build_model("gpt-nano", device="meta")
    return profile_model(meta, torch.zeros(1, meta.cfg.seq_len, dtype=torch.long, device="meta"))


def test_profile_counts_the_calls_a_real_step_dispatches():
    """Every aten call of the model's forward + backward (views and matmuls too) lands in a block,
    as many as the same model dispatches for real (counted by the calibration's counter)."""
    prof = _nano_profile()
    torch.manual_seed(0)
    model = build_model("gpt-nano")
    x = torch.randint(0, 256, (1, model.cfg.seq_len))
    grad = torch.ones(1, model.cfg.seq_len, model.cfg.vocab_size)     # the loss's calls are not the model's
    real = micro.count_calls(lambda: model(x).backward(grad))
    assert sum(b.fwd_calls + b.bwd_calls for b in prof.blocks) == real
    for b in prof.blocks:       # calls include the non-view, non-matmul ops and the matmuls
        assert b.fwd_calls >= b.fwd_ops + b.fwd_gemms and b.bwd_calls >= b.bwd_ops + b.bwd_gemms


def test_step_prices_calls_at_the_calibrated_cost_and_old_files_as_before(tmp_path):
    prof = _nano_profile()
    base = dataclasses.replace(cpu_profile(1), op_overhead_s=3e-6,
                               calibration=Calibration(matmul_flops={64: 1e10, 512: 5e10}, attention_flops=1e10))
    new = dataclasses.replace(base, calibration=dataclasses.replace(base.calibration, dispatch_overhead_s=1e-5))
    plan, batch = ParallelPlan(), Batch(4, 4)
    ld = rank_loads(prof, plan, act_bytes=4)[0]
    assert ld.calls > ld.ops > 0
    diff = estimate_step(prof, plan, batch, new).total - estimate_step(prof, plan, batch, base).total
    assert diff == pytest.approx(ld.calls * 1e-5 - ld.ops * 3e-6, rel=1e-9)
    # schema 5 round trip; a schema-4 file (no field) loads with None and predicts as before
    out = tmp_path / "v5.json"
    save_profile(new, out)
    d = json.loads(out.read_text())
    assert d["schema_version"] == SCHEMA_VERSION >= 5 and d["calibration"]["dispatch_overhead_s"] == 1e-5
    assert load_profile(out) == new
    del d["calibration"]["dispatch_overhead_s"]
    out.write_text(json.dumps({**d, "schema_version": 4}))
    old = load_profile(out)
    assert old.calibration.dispatch_overhead_s is None
    assert estimate_step(prof, plan, batch, old).total == estimate_step(prof, plan, batch, base).total


def test_measure_dispatch_overhead_is_seconds_per_counted_call():
    """Timed with a clock that advances 1 s per reading: every timed run reads 1 s, so the result is
    1 / (calls of one run); the calls grow by the same count with every block (the chain's calls
    are the blocks' and one input, sum and backward seed)."""
    def calls(blocks):
        ticks = iter(range(10 ** 6))
        per_call = micro.measure_dispatch_overhead(blocks=blocks, reps=2, timer=lambda: float(next(ticks)))
        n = 1.0 / per_call
        assert n == pytest.approx(round(n), abs=1e-6)
        return round(n)
    one, two, three = calls(1), calls(2), calls(3)
    assert 20 < one < two < three and three - two == two - one
