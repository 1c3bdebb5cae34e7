"""The finalists of `benchmarks/plan_quality.py` (does `--strategy auto`'s pick run as fast as the best
finalist?): the planner's top layouts, the best plan of each basic strategy and the rules baseline's
plan. Pure: a planner search over a model profile, no process started."""

from __future__ import annotations

from modelpar.plan import ParallelPlan

GLOBAL_BATCH = 32           # the benchmark's default batch (global, samples)


def basic_strategy(p: ParallelPlan) -> str | None:
    """"ddp", "fsdp", "tp" or "pp" when the plan uses that parallelism alone, else None."""
    kinds = [k for k, d in (("ddp", p.dp_replicate), ("fsdp", p.dp_shard), ("tp", p.tp), ("pp", p.pp)) if d > 1]
    return kinds[0] if len(kinds) == 1 else None


def finalists(prof, nproc: int, hw, *, global_batch: int = GLOBAL_BATCH, top: int = 5):
    """The plans worth measuring for the model profile ``prof`` on ``nproc`` ranks of ``hw`` at
    ``global_batch`` (fp32): ``([(label, plan, local batch, predicted step seconds)], SearchReport)``.
    Labels: "auto" (the planner's pick, first), "top2".."top<top>" (the next distinct layouts),
    "best-ddp" / "best-fsdp" / "best-tp" / "best-pp" (the best-predicted plan using that
    parallelism alone, when not listed yet) and "rules" (last; left out when the rules baseline
    picks auto's very plan and local batch, which is then measured once)."""
    from modelpar.planner.cost import estimate_step
    from modelpar.planner.memory import Batch
    from modelpar.planner.rules import rule_plan
    from modelpar.planner.search import search_plans
    rep = search_plans(prof, nproc, hw, global_batch_size=global_batch, precision="fp32")
    out, seen = [], set()
    for i, c in enumerate(rep.distinct_layouts(top)):
        out.append(("auto" if i == 0 else f"top{i + 1}", c.plan, c.batch.local_batch_size, c.step.total))
        seen.add(c.plan)
    for kind in ("ddp", "fsdp", "tp", "pp"):
        best = next((c for c in rep.ranked if basic_strategy(c.plan) == kind), None)
        if best is not None and best.plan not in seen:
            out.append((f"best-{kind}", best.plan, best.batch.local_batch_size, best.step.total))
            seen.add(best.plan)
    plan, _ = rule_plan(prof, nproc, hw, global_batch_size=global_batch,
                        task="language" if prof.tokens_per_sample > 1 else "image")
    if plan.pp > 1 and plan.n_microbatches == 1:
        plan = ParallelPlan.from_dict({**plan.to_dict(), "n_microbatches": 2 * plan.pp})
    local = global_batch // plan.dp
    if (plan, local) == (out[0][1], out[0][2]):
        return out, rep                 # rules picks auto's plan: measured once (see the module doc)
    pred = estimate_step(prof, plan, Batch(global_batch, local), hw).total
    out.append(("rules", plan, local, pred))
    return out, rep
