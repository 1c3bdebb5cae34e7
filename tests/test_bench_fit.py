"""Fit table and memory formulas (no processes)."""

import pytest

from modelpar.bench import fit

GIB = 2 ** 30


def test_zero_formulas():
    p = 1e9
    assert fit.zero_model_state_bytes(p) == 16e9
    assert fit.zero_model_state_bytes(p, dp=8, zero_stage=1) == pytest.approx(4e9 + 12e9 / 8)
    assert fit.zero_model_state_bytes(p, dp=8, zero_stage=2) == pytest.approx(2e9 + 14e9 / 8)
    assert fit.zero_model_state_bytes(p, dp=8, zero_stage=3) == pytest.approx(2e9)
    assert fit.zero_model_state_bytes(p, model_parallel=4) == 4e9
    with pytest.raises(ValueError, match="zero_stage"):
        fit.zero_model_state_bytes(p, zero_stage=4)


def test_candidate_plans_are_valid():
    for n in fit.FIT_DEVICES:
        for name, plan in fit.candidate_plans(n, n_layer=24, n_head=16):
            plan.validate(n, num_blocks=24)
    names = [n for n, _ in fit.candidate_plans(64, n_layer=88, n_head=64)]
    assert "tp" not in names and "fsdp" in names and "pp8 x tp8" in names   # TP stays inside a node


def test_fallback_fit_table(monkeypatch):
    monkeypatch.setattr(fit, "planner_memory_model", lambda: None)
    mm = fit.MemoryModel(overhead_bytes=GIB)
    assert "fallback" in mm.source
    cells = fit.fit_table(mm, sizes=("gpt-100m", "gpt-70b"), devices=(1, 64), memories={"80 GB": 80 * GIB})
    by = {(c.size, c.devices): c for c in cells}
    assert by[("gpt-100m", 1)].fits == ["single"]
    assert by[("gpt-70b", 1)].fits == []                         # 16 B/param x 71e9 params >> 80 GB
    assert "fsdp" in by[("gpt-70b", 64)].fits and "ddp" not in by[("gpt-70b", 64)].fits
    md = fit.fit_markdown(cells, devices=(1, 64))
    assert md.splitlines()[0].startswith("| model | device memory | 1 device | 64 devices |")
    assert "| gpt-70b | 80 GB | - |" in md


def test_shared_memory_splits_between_ranks(monkeypatch):
    monkeypatch.setattr(fit, "planner_memory_model", lambda: None)
    mm = fit.MemoryModel(seq_len=256, overhead_bytes=0)
    need = mm.bytes("gpt-500m", fit.candidate_plans(1, n_layer=24, n_head=16, precision="fp32")[0][1])
    cells = fit.fit_table(mm, sizes=("gpt-500m",), devices=(1, 2), memories={"ram": need * 1.05},
                          precision="fp32", ranks_share_memory=True)
    one, two = cells
    assert one.fits == ["single"]
    assert "ddp" not in two.fits                                # two full replicas do not fit in the same RAM
