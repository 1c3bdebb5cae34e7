"""Tier 2: every strategy trains like one process (loss per step, final parameters), on CPU/gloo."""

import pytest

from helpers.parity_cases import CASES
from helpers.parity_report import record_parity

PARITY = [n for n, c in CASES.items() if c.check not in ("error", "ckpt")]   # error: test_pipeline_boundaries.py,
# ckpt: tests/test_hf_tp.py


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(PARITY, key=lambda n: (CASES[n][0], n)))
def test_parity(name, dist_results):
    world = CASES[name][0]
    res = dist_results(world).get(name)
    assert res is not None, f"case {name} produced no result (the launch died before it)"
    assert "error" not in res, res.get("trace", res.get("error"))
    record_parity(res)
    assert res["passed"], "\n".join(res["failures"])
    assert len(res["loss_diffs"]) == CASES[name].steps
