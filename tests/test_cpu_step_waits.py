"""Pure checks of `benchmarks/cpu_step_waits.py`'s report (no launch, nothing timed): the per-rank
columns, the all-reduce grouping, and the planner's priced TP count beside them."""

from __future__ import annotations

import pathlib
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

import cpu_step_waits  # noqa: E402


def _rank(wall, thread, process, waits):
    return {"wall": wall, "thread": thread, "process": process, "funcol": waits, "eager_all_reduces": 2}


def test_render_columns_and_grouping():
    two_mib, small = str(2 * 2 ** 20), str(16 * 2 ** 10)
    ranks = [{"gpt-1m/tp": _rank(0.80, 0.52, 0.59, {two_mib: [0.004, 0.005, 0.009], small: [0.002]}),
              "gpt-1m/ddp": _rank(0.33, 0.32, 0.323, {})},
             {"gpt-1m/tp": _rank(0.78, 0.55, 0.63, {two_mib: [0.010], small: []}),
              "gpt-1m/ddp": _rank(0.33, 0.28, 0.284, {})}]
    out = cpu_step_waits.render(ranks, None).splitlines()
    rows = [r.split(" | ") for r in out[2:]]
    assert len(rows) == 4
    tp0 = rows[0]
    assert tp0[0] == "| gpt-1m/tp" and tp0[1] == "0"
    assert tp0[2:6] == ["800.0", "520.0", "590.0", "210.0"]       # wall - process CPU = 210 ms
    # the larger size first, with its count and median / mean wait; a size without waits left out
    assert tp0[6] == "2 MiB: 3, 5.00 / 6.00; 0.0156 MiB: 1, 2.00 / 2.00"
    assert rows[1][6] == "2 MiB: 1, 10.00 / 10.00"
    assert rows[2][6] == "2 eager"                                 # no DTensor collectives: DDP's eager calls
    assert rows[3][5] == "46.0"


def test_priced_count_is_the_cost_models():
    """The priced column is what `StepForm` charges: 2 x the forward's TP all-reduces at the
    in-context seconds of the block output (gpt-1m: 4 blocks x 2 + embedding and head = 10)."""
    from modelpar.planner.hardware import cpu_profile

    hw = cpu_profile()
    case = next(c for c in cpu_step_waits.cases_for("gpt-1m") if c.name == "gpt-1m/tp")
    p = cpu_step_waits.priced(case, hw)
    assert p["count"] == 20
    assert p["bytes"] == 32 * 128 * 128 * 4
    assert p["per_call"] > 0
    ddp = next(c for c in cpu_step_waits.cases_for("gpt-1m") if c.name == "gpt-1m/ddp")
    assert cpu_step_waits.priced(ddp, hw) == {}


def test_steps_must_be_positive():
    with pytest.raises(SystemExit, match="--steps must be >= 1, got 0"):
        cpu_step_waits.main(["--steps", "0"])
