"""Compute contention between local ranks (schema 6): the calibration times kernels with every rank
running them at once and one rank alone (`modelpar.calibrate.contention`); the CPU step model slows
the compute of ranks in lockstep (data / tensor parallel) by the ratio, never a pure pipeline's."""

import dataclasses
import json
import math
import threading
import time

import pytest
import torch

from modelpar.calibrate import contention
from modelpar.models import build_model
from modelpar.plan import ParallelPlan
from modelpar.planner.calibration import SCHEMA_VERSION, Calibration
from modelpar.planner.cost import estimate_step
from modelpar.planner.cpu_shapes import lockstep_contention
from modelpar.planner.hardware import cpu_profile, load_profile, save_profile
from modelpar.planner.memory import Batch
from modelpar.planner.profile import profile_model


def _run_ranks(world, kernels, **kw):
    """`measure_contention` on ``world`` threads (thread CPU time is per thread, as per process)."""
    bar = threading.Barrier(world)
    sums, out = [], [None] * world
    lock = threading.Lock()

    def mean_over_ranks(vals):
        with lock:
            sums.append(vals)
        bar.wait()
        res = [sum(v[i] for v in sums[-world:]) / world for i in range(len(vals))]
        bar.wait()
        return res

    def rank(r):
        out[r] = contention.measure_contention(r, world, bar.wait, mean_over_ranks, kernels=kernels, **kw)
    ts = [threading.Thread(target=rank, args=(r,)) for r in range(world)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    return out


def test_alone_is_alone_and_together_is_together(monkeypatch):
    """A fake per-thread clock that advances by the number of threads inside the kernel: alone every
    call reads 1, together 2 -- so the ratio is exactly 2 only if the alone timings really ran with
    the other rank waiting and the concurrent ones really overlapped (a barrier before each call)."""
    clock, inside, lock = threading.local(), [0], threading.Lock()
    monkeypatch.setattr(contention.time, "thread_time", lambda: getattr(clock, "t", 0.0))

    def build():
        def fn():
            with lock:
                inside[0] += 1
            time.sleep(0.3)                 # long enough for the other rank to enter, when it runs
            clock.t = getattr(clock, "t", 0.0) + inside[0]
            time.sleep(0.05)
            with lock:
                inside[0] -= 1
        return fn
    res = _run_ranks(2, {"k": build}, rounds=2, reps=1)
    assert res[0] == res[1]                 # every rank returns the ranks' mean
    terms, factor, spread = res[0]
    assert terms == {"k": 2.0} and factor == pytest.approx(2.0) and spread == pytest.approx(0.0)


def test_real_kernels_give_positive_ratios_and_bad_input_is_refused():
    small = {"mm": lambda: (lambda a=torch.randn(64, 64): a @ a), "add": lambda: (lambda a=torch.ones(4096): a + a)}
    terms, factor, spread = _run_ranks(2, small, rounds=1, reps=2)[0]
    assert set(terms) == {"mm", "add"} and all(v > 0 for v in terms.values()) and spread == 0.0
    assert factor == pytest.approx(math.sqrt(terms["mm"] * terms["add"]))     # geometric mean, one round
    assert contention.measure_contention(0, 1, None, None, kernels=small) == ({"mm": 1.0, "add": 1.0}, 1.0, 0.0)
    with pytest.raises(ValueError, match="rounds=0"):
        contention.measure_contention(0, 2, None, None, rounds=0)


def test_every_builtin_kernel_builds_and_runs():
    for name, build in contention.CONTENTION_KERNELS.items():
        build()()


def _nano():
    meta = build_model("gpt-nano", device="meta")
    return profile_model(meta, torch.zeros(1, meta.cfg.seq_len, dtype=torch.long, device="meta"))


def test_off_by_default():
    """The factor is recorded but not applied until evidence shows the slowdown (`APPLY_COMPUTE_CONTENTION`)."""
    from modelpar.planner import cpu_shapes
    hw = dataclasses.replace(cpu_profile(2), calibration=Calibration(compute_contention=1.25))
    assert cpu_shapes.APPLY_COMPUTE_CONTENTION is False
    assert lockstep_contention(ParallelPlan(dp_replicate=2), hw) == 1.0


def test_lockstep_ranks_pay_the_factor_a_pipeline_and_old_files_do_not(tmp_path, monkeypatch):
    from modelpar.planner import cpu_shapes
    monkeypatch.setattr(cpu_shapes, "APPLY_COMPUTE_CONTENTION", True)
    base = dataclasses.replace(cpu_profile(2), calibration=Calibration(matmul_flops={64: 1e10, 512: 5e10},
                                                                       attention_flops=1e10, elementwise_bw=2e9))
    slow = dataclasses.replace(base, calibration=dataclasses.replace(base.calibration, compute_contention=1.25))
    prof, batch = _nano(), Batch(8, 4)
    for plan, paid in ((ParallelPlan(dp_replicate=2), True), (ParallelPlan(tp=2), True),
                       (ParallelPlan(pp=2, n_microbatches=2), False), (ParallelPlan(), False)):
        b = batch if plan.dp > 1 else Batch(8, 8)
        assert lockstep_contention(plan, slow) == (1.25 if paid else 1.0) and lockstep_contention(plan, base) == 1.0
        e0, e1 = estimate_step(prof, plan, b, base), estimate_step(prof, plan, b, slow)
        if paid:        # compute slower, by at most the factor (memory-bound terms keep their rate)
            assert e0.compute < e1.compute <= 1.25 * e0.compute * (1 + 1e-12)
            assert (e1.optimizer, e1.dp_comm) == (e0.optimizer, e0.dp_comm)
        else:
            assert e1 == e0
    # schema 6 round trip; a schema-5 file (no field) loads with 1.0 and predicts as before
    slow = dataclasses.replace(slow, calibration=dataclasses.replace(
        slow.calibration, compute_contention_terms={"attention": 1.3, "elementwise": 1.2}))
    out = tmp_path / "v6.json"
    save_profile(slow, out)
    d = json.loads(out.read_text())
    assert d["schema_version"] == SCHEMA_VERSION == 6 and d["calibration"]["compute_contention"] == 1.25
    assert load_profile(out) == slow
    del d["calibration"]["compute_contention"], d["calibration"]["compute_contention_terms"]
    out.write_text(json.dumps({**d, "schema_version": 5}))
    old = load_profile(out)
    assert old.calibration.compute_contention == 1.0 and old.calibration.compute_contention_terms == {}
    plan = ParallelPlan(dp_replicate=2)
    assert estimate_step(prof, plan, batch, old).total == estimate_step(prof, plan, batch, base).total
