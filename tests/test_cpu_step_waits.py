"""Pure checks of `modelpar.bench.step_waits` (the logic of `benchmarks/cpu_step_waits.py`; no launch,
nothing timed): pairing DTensor all-reduces with their waits, the report's columns and grouping, and the
planner's priced TP count."""

from __future__ import annotations

from types import SimpleNamespace

from modelpar.bench.step_waits import FUNCOL_ALL_REDUCE, WAIT, group_waits, priced, render
from modelpar.measure import Case
from modelpar.plan import ParallelPlan
from modelpar.planner.hardware import cpu_profile


def _ev(name, start, us=0.0, shapes=()):
    return SimpleNamespace(name=name, time_range=SimpleNamespace(start=start), cpu_time_total=us,
                           input_shapes=list(shapes))


def test_group_waits_pairs_each_all_reduce_with_the_next_wait_in_issue_order():
    evs = [_ev(WAIT, 3, 7000.0), _ev(FUNCOL_ALL_REDUCE, 1, shapes=[[32, 128, 128]]),
           _ev(FUNCOL_ALL_REDUCE, 2, shapes=[[4096, 1]]), _ev(WAIT, 4, 2000.0),
           _ev(WAIT, 0, 9.0e6),                                  # a wait before any all-reduce: not counted
           _ev(FUNCOL_ALL_REDUCE, 5, shapes=[[32, 128, 128]])]   # issued, never waited on
    assert group_waits(evs) == {str(2 * 2 ** 20): [0.007], str(16 * 2 ** 10): [0.002]}


def _rank(wall, thread, process, waits):
    return {"wall": wall, "thread": thread, "process": process, "funcol": waits, "eager_all_reduces": 2}


def test_render_columns_and_grouping():
    two_mib, small = str(2 * 2 ** 20), str(16 * 2 ** 10)
    ranks = [{"gpt-1m/tp": _rank(0.80, 0.52, 0.59, {two_mib: [0.004, 0.005, 0.009], small: [0.002]}),
              "gpt-1m/ddp": _rank(0.33, 0.32, 0.323, {})},
             {"gpt-1m/tp": _rank(0.78, 0.55, 0.63, {two_mib: [0.010], small: []}),
              "gpt-1m/ddp": _rank(0.33, 0.28, 0.284, {})}]
    prices = {"gpt-1m/tp": {"count": 20, "bytes": 2 * 2 ** 20, "per_call": 0.00475}}
    rows = [r.split(" | ") for r in render(ranks, prices).splitlines()[2:]]
    assert len(rows) == 4
    tp0 = rows[0]
    assert tp0[0] == "| gpt-1m/tp" and tp0[1] == "0"
    assert tp0[2:6] == ["800.0", "520.0", "590.0", "210.0"]       # wall - process CPU = 210 ms
    # the larger size first, with its count and median / mean wait; a size without waits left out
    assert tp0[6] == "2 MiB: 3, 5.00 / 6.00; 0.0156 MiB: 1, 2.00 / 2.00"
    assert tp0[7] == "20 x 2 MiB at 4.75 ms |"
    assert rows[1][6] == "2 MiB: 1, 10.00 / 10.00"
    assert rows[2][6] == "2 eager" and rows[2][7].strip() == "|"         # DDP: eager calls, nothing priced
    assert rows[3][5] == "46.0"


def test_priced_count_is_the_cost_models():
    """What `StepForm` charges: 2 x the forward's TP all-reduces (gpt-1m: 4 blocks x 2 + embedding
    and head = 10) of the block output at the local batch (32 x 128 x 128 fp32), none without TP."""
    hw = cpu_profile()
    tp = Case("gpt-1m/tp", "gpt-1m", ParallelPlan(tp=2).to_dict(), 32, 32)
    p = priced(tp, hw)
    assert p["count"] == 20
    assert p["bytes"] == 32 * 128 * 128 * 4
    assert p["per_call"] > 0
    assert priced(Case("gpt-1m/ddp", "gpt-1m", ParallelPlan(dp_replicate=2).to_dict(), 32, 16), hw) == {}
