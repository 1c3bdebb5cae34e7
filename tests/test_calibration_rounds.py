"""Calibration robustness (issue 14 item 6): `measure_compute` adds rounds, after a pause, while a
term's median stands on disagreeing rounds (`median_settled`), and keeps the median over all of them.
The measurements are replaced by scripted values: what is checked is the rounds logic."""

from __future__ import annotations

import itertools

import pytest

from modelpar.calibrate import micro
from modelpar.calibrate.micro import EXTRA_ROUNDS, SETTLED, median_settled


@pytest.mark.parametrize("values, settled", [
    ([5.0], True),                                  # one round: nothing to compare
    ([1.0, 1.05, 1.02], True),
    ([1.0, 1.05, 1.5], False),                      # three rounds: all of them are the middle
    ([0.6, 1.0, 1.05, 1.02, 1.5], True),            # outliers either side, the middle three agree
    ([0.6, 0.8, 1.0, 1.02, 1.05, 1.5], False),      # even count: the middle four, 0.8 among them
    ([0.5, 0.6, 1.0, 1.01, 1.02, 1.03, 1.4], True),
    ([0.0, 0.0, 0.0], False),                       # a median of 0 is never a rate to keep
])
def test_median_settled(values, settled):
    assert median_settled(values) is settled


def test_median_settled_tolerance_is_relative():
    assert median_settled([100.0, 100.0 * (1 + SETTLED * 0.9), 100.0])
    assert not median_settled([100.0, 100.0 * (1 + SETTLED * 1.1), 100.0])


@pytest.fixture
def scripted(monkeypatch):
    """`measure_compute` with every measurement replaced: attention's rate per round from the list
    the test sets (``rates``), everything else constant; no pause between rounds."""
    state = {"rates": [], "calls": 0}

    def attention():
        v = state["rates"][state["calls"]]
        state["calls"] += 1
        return v
    monkeypatch.setattr(micro, "ROUND_PAUSE_S", 0.0)
    monkeypatch.setattr(micro, "_fresh_alloc_costs", lambda: {2 ** 25: 1e-10})
    monkeypatch.setattr(micro, "_time", lambda fn, reps, best=False: 1e-3)
    monkeypatch.setattr(micro, "_linear_matmul_rate", lambda n, passes=1: 5e10)
    monkeypatch.setattr(micro, "measure_dispatch_overhead", lambda: 8e-6)
    monkeypatch.setattr(micro, "measure_attention", attention)
    monkeypatch.setattr(micro, "measure_elementwise", lambda reps=4: 1e10)
    monkeypatch.setattr(micro, "measure_zero_bubble_backward", lambda with_spread=True, **kw: (1.05, 0.01))
    monkeypatch.setattr(micro, "measure_shapes", lambda **kw: ({}, {}))
    monkeypatch.setattr(micro, "measure_attention_shapes", lambda rounds=3: ({(32, 256, 64): 4e10}, 0.0))
    from modelpar.calibrate import thin
    monkeypatch.setattr(thin, "measure_thin_matmuls", lambda **kw: ({}, 0.0))
    monkeypatch.setattr(micro.torch, "ones", lambda n: micro.torch.empty(8))
    return state


def test_a_disturbed_start_gets_more_rounds_and_the_median_rejects_it(scripted):
    """Three rounds inside a burst (attention at 60-80% of its rate, 25% apart), then quiet ones:
    rounds are added until the middle ones agree, and the kept rate is the quiet one, where three
    rounds alone would have kept the burst's 0.7."""
    scripted["rates"] = [0.6, 0.8, 0.7] + [1.0, 1.01, 0.99, 1.0]
    c = micro.measure_compute(sizes=(128, 256), rounds=3)
    assert c["rounds"] == 7 and scripted["calls"] == 7
    assert c["attention_flops"] == pytest.approx(0.99)
    assert c["spread"]["attention_flops"] == pytest.approx((1.01 - 0.6) / 0.99)


def test_agreeing_rounds_get_no_extra_round(scripted):
    scripted["rates"] = [1.0, 1.02, 0.99]
    c = micro.measure_compute(sizes=(128,), rounds=3)
    assert c["rounds"] == 3 and c["attention_flops"] == pytest.approx(1.0)


def test_extra_rounds_are_capped_and_one_round_stays_one(scripted):
    scripted["rates"] = list(itertools.islice(itertools.cycle([0.5, 1.0, 1.5]), 3 + EXTRA_ROUNDS))
    assert micro.measure_compute(sizes=(128,), rounds=3)["rounds"] == 3 + EXTRA_ROUNDS
    scripted["calls"], scripted["rates"] = 0, [0.5]
    assert micro.measure_compute(sizes=(128,), rounds=1)["rounds"] == 1     # --rounds 1: as asked


def _spread_main():
    import importlib.util
    import pathlib
    path = pathlib.Path(__file__).resolve().parents[1] / "benchmarks" / "calibration_spread.py"
    spec = importlib.util.spec_from_file_location("calibration_spread", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.main


def test_calibration_spread_reports_whether_the_auto_pick_moves(tmp_path, capsys):
    """`benchmarks/calibration_spread.py --check-picks` (section 4): the same file twice picks the
    same plan (exit 0); a file whose in-context all-reduce costs 100x more moves gpt-1m off ddp2
    (DIFFERS, exit 1)."""
    import json
    import pathlib
    pinned = pathlib.Path(__file__).resolve().parent / "data" / "cal_pinned.json"
    main = _spread_main()
    assert main([str(pinned), str(pinned), "--models", "gpt-1m", "--check-picks"]) == 0
    out = capsys.readouterr().out
    assert "== 4." in out and "gpt-1m     SAME" in out and "ddp2" in out.split("== 4.")[1]
    d = json.loads(pinned.read_text())
    ar = d["calibration"]["collectives"]["all_reduce"]
    ar["in_context"] = {k: v * 100 for k, v in ar["in_context"].items()}
    ar["seconds"] = {k: v * 100 for k, v in ar["seconds"].items()}
    slow = tmp_path / "slow_all_reduce.json"
    slow.write_text(json.dumps(d))
    assert main([str(pinned), str(slow), "--models", "gpt-1m", "--check-picks"]) == 1
    assert "gpt-1m     DIFFERS" in capsys.readouterr().out


def test_in_context_tables_settle_on_their_own_looser_tolerance():
    """`collectives.tables_unsettled`: any (op, size) whose middle rounds disagree by more than
    `IN_CONTEXT_SETTLED` asks for another round; a rank's all-zero entries (no part in send/recv)
    never do."""
    from modelpar.calibrate.collectives import IN_CONTEXT_SETTLED, tables_unsettled

    def rounds(*small):
        return [{"all_reduce": {4096: v, 2 ** 26: 0.05}, "send_recv": {4096: 0.0, 2 ** 26: 0.0}} for v in small]
    assert IN_CONTEXT_SETTLED > SETTLED
    assert not tables_unsettled(rounds(1e-3, 1.2e-3, 1.1e-3))           # 20% apart: settled here
    assert tables_unsettled(rounds(1e-3, 2e-3, 1.1e-3))                 # a 2x round among three
    assert not tables_unsettled(rounds(1e-3, 2e-3, 1.1e-3, 1.05e-3, 0.2e-3))   # outliers either side


def test_ranks_beyond_the_cores_get_their_share_of_a_core(monkeypatch, tmp_path):
    """A fresh user's trial: `plan --nproc 4` on 2 cores priced every rank at the calibration's full core
    (its 2 ranks had one each), 12x faster than measured, without a word. This machine's profile now
    scales the compute rates by the share and says so; a named file (another machine's) is as measured."""
    import os
    import shutil
    from pathlib import Path

    import modelpar.calibrate as cal_mod
    from modelpar.calibrate import machine_hardware, with_core_share
    from modelpar.planner.hardware import get_hardware

    pinned = Path(__file__).parent / "data" / "cal_pinned.json"
    shutil.copy(pinned, tmp_path / "c.json")
    monkeypatch.setenv("MODELPAR_CALIBRATION", str(tmp_path / "c.json"))
    monkeypatch.setattr(os, "cpu_count", lambda: 2)
    base = get_hardware(str(pinned), local_ranks=4)
    assert base.calibration.core_share == 1.0
    hw, note = machine_hardware(4)
    assert "4 local ranks share 2 cores: compute rates x 0.50" in note and "modelpar calibrate --nproc 4" in note
    c, b = hw.calibration, base.calibration
    assert c.core_share == 0.5 and hw.peak_flops["fp32"] == 0.5 * base.peak_flops["fp32"]
    assert c.attention_flops == 0.5 * b.attention_flops and hw.op_overhead_s == 2 * base.op_overhead_s
    assert all(c.matmul_flops[n] == 0.5 * v for n, v in b.matmul_flops.items())
    assert (c.dispatch_overhead_s is None if b.dispatch_overhead_s is None
            else c.dispatch_overhead_s == 2 * b.dispatch_overhead_s)
    assert hw.mem_bandwidth == base.mem_bandwidth         # the bus is measured with every rank streaming
    hw2, note2 = machine_hardware(2)          # a core each, as measured: unchanged
    assert "share" not in note2 and hw2.peak_flops == base.peak_flops
    assert with_core_share(hw, 1.0).peak_flops == base.peak_flops       # and back
    assert cal_mod.default_calibration_path() == tmp_path / "c.json"
