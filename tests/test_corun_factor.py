"""`Calibration.corun_matmul_factor`: the CPU matmul rate beside computing ranks (pure, fast)."""

import dataclasses
import json

import pytest

from modelpar.plan import ParallelPlan
from modelpar.planner.calibration import Calibration
from modelpar.cli.common import profile_for
from modelpar.planner.cost import estimate_step
from modelpar.planner.hardware import cpu_profile, get_hardware, load_profile, save_profile
from modelpar.planner.memory import Batch


def _hw(factor=None):
    kw = {} if factor is None else {"corun_matmul_factor": factor}
    cal = Calibration(matmul_flops={64: 1e10, 512: 5e10}, attention_flops=1e10, **kw)
    return dataclasses.replace(cpu_profile(2), calibration=cal)


def test_field_round_trips_and_defaults_to_one(tmp_path):
    out = tmp_path / "cal.json"
    save_profile(_hw(1.25), out)
    assert json.loads(out.read_text())["calibration"]["corun_matmul_factor"] == 1.25
    assert load_profile(out).calibration.corun_matmul_factor == 1.25
    saved = json.loads(out.read_text())
    del saved["calibration"]["corun_matmul_factor"]      # a file from before the field
    old = tmp_path / "old.json"
    old.write_text(json.dumps(saved))
    assert load_profile(old).calibration.corun_matmul_factor == 1.0


@pytest.mark.parametrize("bad", [0.0, -1.0, 50.0, "1.2", None])
def test_bad_factor_is_one_clear_error(bad):
    d = Calibration().to_json()
    d["corun_matmul_factor"] = bad
    with pytest.raises(ValueError, match="corun_matmul_factor"):
        Calibration.from_json(d)


def test_factor_scales_multi_rank_matmuls_only():
    prof, _ = profile_for("gpt-nano", {}, 16, "fp32")
    batch = Batch(8, 4)
    base, slow = _hw(), _hw(1.5)
    for plan in (ParallelPlan(dp_replicate=2), ParallelPlan(tp=2), ParallelPlan(pp=2, n_microbatches=2)):
        a, b = estimate_step(prof, plan, batch, base), estimate_step(prof, plan, batch, slow)
        # compute grows, but by less than the factor: element-wise ops and per-op overheads are not matmuls
        assert a.compute < b.compute < 1.5 * a.compute, plan
        assert b.total > a.total
    one = ParallelPlan()
    assert estimate_step(prof, one, Batch(4, 4), slow).total == estimate_step(prof, one, Batch(4, 4), base).total
    # a factor of 1.0 prices exactly as a file without the field
    explicit = _hw(1.0)
    plan = ParallelPlan(dp_replicate=2)
    assert estimate_step(prof, plan, batch, explicit).total == estimate_step(prof, plan, batch, base).total


def test_gpu_pricing_ignores_the_cpu_factor():
    gpu = get_hardware("H100-80GB-SXM")
    hw = dataclasses.replace(gpu, calibration=Calibration())
    slow = dataclasses.replace(gpu, calibration=Calibration(corun_matmul_factor=2.0))
    prof, _ = profile_for("gpt-nano", {}, 16, "bf16")
    plan = ParallelPlan(dp_replicate=2, precision="bf16")
    assert estimate_step(prof, plan, Batch(8, 4), slow).total == estimate_step(prof, plan, Batch(8, 4), hw).total
