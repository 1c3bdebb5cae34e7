"""The search's speed-ups change no number: every ranked candidate equals a standalone estimate.

The search evaluates one `cost.StepForm` and one `memory.MemoryForm` per layout at many candidates,
shares memo tables across layouts and skips work by proven bounds; `estimate_step` /
`rank_step` / `rank_memory` on a fresh cache do none of that. Each candidate's step must be bitwise
equal to a fresh `rank_step` over the ranks the search evaluates (its representative ranks; every
pipeline rank under every-k checkpointing, where the representatives do not bound the others), its
memory estimate to a fresh `rank_memory` of the rank the search reports, and both to the all-rank
`estimate_step` / `estimate_memory`.
"""

import dataclasses

import pytest

from modelpar.planner.cost import _finish, estimate_step, rank_step, step_form, tp_bytes_per_sample
from modelpar.planner.hardware import get_hardware
from modelpar.planner.memory import estimate_memory, rank_loads, rank_memory
from modelpar.planner.search import _representatives, search_plans

CASES = [  # (model, seq_len, devices, global batch, precision, hardware)
    ("gpt-1m", 64, 8, 32, "fp32", "cpu"),
    ("gpt-nano", 16, 4, 8, "fp32", "cpu"),
    ("gpt-1b", 2048, 64, 512, "bf16", "H100-80GB-SXM"),
]


def _profile(model, seq, prec):
    """`profile_for`'s profile (what `modelpar plan` searches); at the preset's own seq_len the shared
    `helpers.profiles.gpt_profile` (2 blocks profiled, the steady one repeated: equal to profiling all
    24 of gpt-1b's blocks, ~6 s of the pure tier each time; the equality is tested in test_planner_core)."""
    import torch

    from helpers.profiles import shared_profile_for as profile_for
    from modelpar.models.gpt import PRESETS

    if seq == PRESETS[model].seq_len:
        from helpers.profiles import gpt_profile
        return gpt_profile(model, torch.bfloat16 if prec == "bf16" else torch.float32)[0]
    return profile_for(model, {}, seq, prec)[0]


@pytest.mark.parametrize("model,seq,n,gb,prec,hw_name", CASES, ids=[f"{c[0]}-n{c[2]}" for c in CASES])
def test_every_ranked_candidate_equals_a_standalone_estimate(model, seq, n, gb, prec, hw_name):
    prof = _profile(model, seq, prec)
    hw = get_hardware(hw_name, local_ranks=n) if hw_name == "cpu" else get_hardware(hw_name)
    rep = search_plans(prof, n, hw, global_batch_size=gb, precision=prec)
    # a memory budget at the candidates' median total: some plans need checkpointing, some are pruned
    totals = sorted(c.memory.total for c in rep.ranked)
    frac = totals[len(totals) // 2] / hw.memory_bytes
    rep = search_plans(prof, n, hw, global_batch_size=gb, precision=prec, memory_fraction=frac)
    assert len(rep.ranked) > 20, rep.summary()
    # the candidates cover what the shared forms vary: checkpointing modes, deferred sync, m, b
    assert {c.plan.activation_checkpointing for c in rep.ranked} >= {"none", "full"}
    assert len({(c.plan.n_microbatches, c.micro_batch_size) for c in rep.ranked}) > 3
    # every candidate of the small searches; every 8th of gpt-1b's ~5,000 (the pure tier's time; the
    # representatives' gap fixed in `search` hit ~1 in 5 of those candidates, so a stride still finds it)
    for c in (rep.ranked if len(rep.ranked) < 1500 else rep.ranked[::8]):
        # a fresh `rank_step` over the ranks the search prices: every rank of a pipeline (their times
        # give its fill and drain, `formulas.fill_drain_seconds`) and of every-k, else the
        # representatives (`search._representatives`)
        loads = rank_loads(prof, c.plan, act_bytes=2 if prec == "bf16" else 4)
        every = c.plan.activation_checkpointing == "every-k" or c.plan.pp > 1
        evaluated = loads if every else [ld for _, ld in _representatives(loads)]
        parts = rank_step(evaluated, c.plan, hw,
                          micro_batch_size=c.micro_batch_size, accumulation=c.batch.accumulation_steps(c.plan),
                          optimizer="adamw", tp_bytes=tp_bytes_per_sample(prof, c.plan))
        assert dataclasses.asdict(_finish(parts, prof, c.plan, gb)) == dataclasses.asdict(c.step), c.plan.describe()
        # the memory of the rank the search reports, from a fresh `rank_memory`
        r = c.memory.pp_rank
        ld = loads[r]
        mem = rank_memory(ld, c.plan, micro_batch_size=c.micro_batch_size, optimizer="adamw",
                          overhead_bytes=hw.framework_overhead_bytes, pp_rank=r,
                          accumulation=c.batch.accumulation_steps(c.plan), global_batch_size=gb,
                          foreach=hw.kind != "cpu", gloo=hw.kind == "cpu")
        assert dataclasses.asdict(mem) == dataclasses.asdict(c.memory), c.plan.describe()
        assert mem.total <= hw.memory_bytes * frac
        # and the all-rank estimates agree: the ranks the search skips are never slower or fuller
        full_step = estimate_step(prof, c.plan, c.batch, hw, optimizer="adamw")
        full_mem = estimate_memory(prof, c.plan, c.batch, optimizer="adamw",
                                   overhead_bytes=hw.framework_overhead_bytes, foreach=hw.kind != "cpu",
                                   gloo=hw.kind == "cpu")
        assert full_step.total == pytest.approx(c.step.total, rel=1e-12), c.plan.describe()
        assert full_mem.total == pytest.approx(c.memory.total, rel=1e-12), c.plan.describe()


def test_one_step_form_serves_a_layout_as_fresh_rank_steps_do():
    """A form built from one plan of a layout, evaluated at its other plans (micro-batch count,
    checkpointing, deferred sync) and micro-batch sizes, equals a fresh `rank_step` for each."""
    from modelpar.plan import ParallelPlan

    prof = _profile("gpt-1b", 2048, "bf16")
    hw = get_hardware("H100-80GB-SXM")
    for base in (ParallelPlan(dp_shard=4, tp=2, precision="bf16"),
                 ParallelPlan(dp_replicate=2, dp_shard=2, pp=2, pp_schedule="interleaved1f1b", virtual_stages=2,
                              n_microbatches=4, precision="bf16"),
                 ParallelPlan(dp_replicate=4, pp=2, precision="bf16", n_microbatches=2)):
        loads = rank_loads(prof, base, act_bytes=2)
        tpb = tp_bytes_per_sample(prof, base)
        form = step_form(loads, base, hw, optimizer="adamw", tp_bytes=tpb)
        seen = 0
        for m in ((1,) if base.pp == 1 else (2, 4, 8)):
            for ac, k in (("none", 1), ("selective", 1), ("every-k", 4), ("full", 1)):
                for defer in ((False, True) if base.dp_shard > 1 and base.pp == 1 else (False,)):
                    plan = dataclasses.replace(base, n_microbatches=m, activation_checkpointing=ac, ac_every=k,
                                               defer_grad_sync=defer)
                    for b, acc in ((1, 4), (2, 1), (4, 2)):
                        want = rank_step(loads, plan, hw, micro_batch_size=b, accumulation=acc,
                                         optimizer="adamw", tp_bytes=tpb)
                        assert form.at(plan, b, acc) == want, (plan.describe(), b, acc)
                        seen += 1
        assert seen >= 24


def test_rank_selection_equals_a_scan_of_every_rank():
    """`grid.plan_memory` evaluates ranks of identical content once per stretch of micro-batches in
    flight (`grid._selection`); its result (estimate and total) must equal a scan of every pipeline
    rank with fresh `rank_memory` calls (the fullest, the earliest on ties), for interleaved and
    every-k plans at several micro-batch sizes, counts and accumulation steps, and it must evaluate
    fewer ranks than there are."""
    from modelpar.plan import ParallelPlan
    from modelpar.planner.grid import plan_memory
    from modelpar.planner.memo import PlannerCache
    from modelpar.planner.memory import in_flight

    prof = _profile("gpt-1b", 2048, "bf16")
    hw = get_hardware("H100-80GB-SXM")
    gb, skipped = 512, 0
    for base in (ParallelPlan(dp_shard=2, tp=2, pp=4, pp_schedule="interleaved1f1b", virtual_stages=2,
                              precision="bf16"),
                 ParallelPlan(dp_replicate=2, pp=6, pp_schedule="interleavedzerobubble", virtual_stages=2,
                              precision="bf16"),
                 ParallelPlan(dp_replicate=2, pp=8, pp_schedule="1f1b", precision="bf16",
                              activation_checkpointing="every-k", ac_every=2),
                 ParallelPlan(dp_shard=4, pp=4, pp_schedule="gpipe", precision="bf16",
                              activation_checkpointing="every-k", ac_every=4)):
        cache = PlannerCache(prof, hw)
        kw = dict(optimizer="adamw", global_batch_size=gb, foreach=True, recv_per_microbatch=True, gloo=False,
                  cache=cache)
        loads = rank_loads(prof, base, act_bytes=2, cache=cache)
        ranks = list(enumerate(loads))
        memo, forms, flights = {}, {}, {}
        for m in (base.pp, 2 * base.pp, 4 * base.pp):
            plan = dataclasses.replace(base, n_microbatches=m)
            for b in (1, 2, 4):
                acc = gb // (b * m * plan.dp)
                est, total = plan_memory(plan, ranks, b, acc, flights, kw, float("inf"), memo, forms,
                                         hw.framework_overhead_bytes)
                scan = [rank_memory(ld, plan, micro_batch_size=b, optimizer="adamw",
                                    overhead_bytes=hw.framework_overhead_bytes, pp_rank=r, accumulation=acc,
                                    global_batch_size=gb, foreach=True) for r, ld in ranks]
                want = max(scan, key=lambda e: e.total)       # the first of the largest
                assert dataclasses.asdict(est) == dataclasses.asdict(want), (plan.describe(), b)
                assert total == want.total
                assert [in_flight(plan, r) for r, _ in ranks] == flights[m]
                skipped += len(ranks) - len(flights[("sel", m, plan.activation_checkpointing, plan.ac_every)])
    assert skipped > 0


@pytest.mark.slow
def test_search_time_benchmark_has_a_command_line():
    """`benchmarks/planner_search_time.py --help` prints its flags (it parsed "--help" as a run and crashed
    before), and a malformed run is refused naming it, before any profiling (a subprocess each: tests
    import no benchmark script)."""
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).resolve().parent.parent / "benchmarks" / "planner_search_time.py"
    r = subprocess.run([sys.executable, str(script), "--help"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    assert all(s in r.stdout for s in ("N:BATCH", "--repeat", "--top", "Time the planner's full search")), r.stdout
    r = subprocess.run([sys.executable, str(script), "3072:x", "--repeat", "2"], capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 2 and "'3072:x' is not N:BATCH" in r.stderr and "profile" not in r.stdout, r


def test_v_schedule_candidates_do_not_share_round_robin_step_times():
    """A V schedule's layout places other stages on each rank (`stage_split.rank_stages`) than an
    interleaved layout of the same (tp, pp, v = 2), so the step forms must not share their per-rank
    time tables (`layouts._share_times`): each ZB-V candidate's step equals a fresh `rank_step` of its
    own loads, whichever layout of the (tp, pp, v) the search timed first (interleaved, here)."""
    prof = _profile("gpt-1b", 2048, "bf16")
    hw = get_hardware("H100-80GB-SXM")
    rep = search_plans(prof, 64, hw, global_batch_size=512, precision="bf16",
                       schedules=("interleaved1f1b", "zbvzerobubble"))
    zbv = [c for c in rep.ranked if c.plan.pp_schedule == "zbvzerobubble"]
    assert len(zbv) > 20 and any(c.plan.pp_schedule == "interleaved1f1b" and c.plan.virtual_stages == 2
                                 for c in rep.ranked)
    for c in zbv[::max(1, len(zbv) // 60)]:
        loads = rank_loads(prof, c.plan, act_bytes=2)
        parts = rank_step(loads, c.plan, hw, micro_batch_size=c.micro_batch_size,
                          accumulation=c.batch.accumulation_steps(c.plan), optimizer="adamw",
                          tp_bytes=tp_bytes_per_sample(prof, c.plan))
        assert dataclasses.asdict(_finish(parts, prof, c.plan, 512)) == dataclasses.asdict(c.step), c.plan.describe()
