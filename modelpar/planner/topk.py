"""The search's exact top-k mode (`search.search_plans(..., top_k=K)`): the first K candidates of
the full ranking, in its order and with its numbers, without evaluating every candidate.

Every (layout, micro-batch size b, micro-batch count m) group gets a lower bound on the step time of
each candidate it can produce (any checkpointing mode, deferred sync or not: `step_lower_bound`);
groups are evaluated exactly (`layouts.evaluate_group`: memory, then step time of the fitting
candidates) in increasing order of that bound, and the walk stops once K fitting candidates are known
and the K-th of them (in the full ranking's order: step total, then memory total, then enumeration
order) is strictly faster than the next group's bound: every candidate not evaluated is then strictly
slower than the K-th, so it ranks after it in the full ranking too.
"""

from __future__ import annotations

from bisect import insort
from heapq import heapify, heappop, heapreplace

from modelpar.planner.formulas import bubble_fraction, fill_drain_from_sums
from modelpar.planner.grid import plan_memory as _plan_memory
from modelpar.planner.layouts import Layout, Search, can_defer, evaluate_group, group_pruned

# relative slack taken off every bound: the bound and the exact total are different float sums of
# the same non-negative terms (tens of additions and products, each rounded by at most 2^-53
# relative), so the bound computed in floats can exceed its exact value by ~1e-14 relative at most;
# 1e-9 keeps it below every exact total it bounds
_SLACK = 1e-9


def step_lower_bound(S: Search, L: Layout, b: int, m: int, acc: int) -> float:
    """A lower bound (seconds) on `StepEstimate.total` of every candidate of group (b, m) of ``L``.

    Proof. ``total`` = compute + recompute + tp_comm + pp_comm + dp_comm + bubble + optimizer
    (`cost.StepForm.at`, `step_estimate._finish`), for the slowest rank ``i`` of the candidate's
    form (`StepForm._slowest`: the largest work = t_f + t_b + t_rc + t_tp). With ``mbs`` = accumulation
    x m (pipelines; else accumulation), the same for every candidate of the group:
    - compute + recompute + tp_comm = mbs x work_i + t_acc >= mbs x W, where W is the slowest rank's
      work without checkpointing (`_slowest` of the group's plan with "none": the same memoized
      per-b times every candidate reads; every-k's form is over every rank, as the pipeline form
      is, and for pp = 1 both forms hold the one rank): each rank's work under any checkpointing
      exceeds its work without by t_rc >= 0 and the replayed all-reduces (rc_share x collectives x
      all-reduce seconds >= 0), so the largest work does too; t_acc = (mbs - 1) x 12 params /
      bandwidth >= 0.
    - bubble = accumulation x bub: for the fraction schedules (interleaved, zero-bubble, ZB-V)
      bub = `bubble_fraction` (p, m, v) x m x work_i >= that x W; for GPipe (every rank's times:
      `formulas.fill_drain_from_sums`) bub = the sum of the other stages' work >= (sum of every
      stage's work without checkpointing) - W = U + D of the "none" sums; for 1F1B bub >= 0 (its
      terms are sums of seconds and max(0, .)); without a pipeline 0.
    - optimizer = the slowest rank's optimizer seconds >= the smallest of the form's (``opt``).
    - pp_comm (2 v x p2p seconds per micro-batch) and dp_comm (exposed collectives and copies, each
      a max(0, .) or a sum of seconds; the deferred sync's part is `comms._fsdp_exposed` with the
      reduce-scatter minus without, >= 0 as it is non-decreasing in the backward's collectives)
      are >= 0 and dropped.
    The sum of these is taken in floats and lowered by `_SLACK` relative, which exceeds the rounding of
    both sums, so the returned bound is <= the float total of every candidate of the group."""
    form = L.sform
    _, _, t_f, t_b, t_rc, t_tp, fill = form._slowest(L.plan(S, m, "none", 1, False), b)
    w = t_f + t_b + t_rc + t_tp
    p = L.pp
    mbs = acc * (m if p > 1 else 1)
    bub = 0.0
    if p > 1:
        if L.sched == "gpipe" and fill is not None:
            bub = acc * (fill[0] + fill[1])
        elif L.sched != "1f1b":
            bub = acc * bubble_fraction(L.sched, p, m, L.v) * m * w
    return (mbs * w + bub + min(form.opt)) * (1.0 - _SLACK)


def mode_lower_bound(S: Search, L: Layout, b: int, m: int, acc: int, ac: str, k: int) -> float:
    """A lower bound (seconds) on the step total of the group's candidates under checkpointing
    (``ac``, ``k``), deferred sync or not: `cost.StepForm.at`'s parts less the ones dropped.

    Proof. From the form's slowest rank ``i`` under this checkpointing (`StepForm._slowest`, the same
    memoized entry `at` reads, so the same floats): compute + recompute + tp_comm = mbs x work_i +
    t_acc with work_i = t_f + t_b + t_rc + t_tp, and t_acc >= 0 (see `step_lower_bound`); bubble =
    accumulation x (`formulas.fill_drain_from_sums` of the slowest rank's sums for GPipe / 1F1B, else
    `bubble_fraction` x m x work_i): computed here exactly as `at` does; optimizer = the slowest
    rank's, exactly. Dropped: t_acc, pp_comm and dp_comm (>= 0, see `step_lower_bound`); the deferred
    sync changes only those. Lowered by `_SLACK` for the float sums."""
    form = L.sform_k if ac == "every-k" else L.sform
    if form is None:
        form = L.form(S, L.plan(S, m, ac, k, False), ac == "every-k")
    plan = L.plan(S, m, ac, k, False)
    i, _, t_f, t_b, t_rc, t_tp, fill = form._slowest(plan, b)
    p = L.pp
    mm = m if p > 1 else 1
    work = t_f + t_b + t_tp + t_rc
    if fill is not None:
        bub = fill_drain_from_sums(L.sched, *fill, mm)
    else:
        bub = bubble_fraction(L.sched, p, mm, L.v) * mm * work
    return (acc * mm * work + acc * bub + form.opt[i]) * (1.0 - _SLACK)


def _refined(S: Search, L: Layout, b: int, m: int, acc: int, batch) -> float:
    """The group's bound once it is known whether its plan without checkpointing fits: where it fits,
    every other mode is dominated (`layouts.evaluate_group`), so only that mode's candidates remain;
    where it does not, only the recomputing modes' (the smallest of their `mode_lower_bound`s)."""
    opts = S.ac_opts
    if ("none", 1) in opts:
        plan = L.plan(S, m, "none", 1, False)
        _, total = _plan_memory(plan, L.reps, b, acc, L.flights, *L.mem_args)     # memoized: evaluate_group reads it
        if total <= S.budget:
            return mode_lower_bound(S, L, b, m, acc, "none", 1)
        opts = [o for o in opts if o[0] != "none"]
    return min(mode_lower_bound(S, L, b, m, acc, ac, k) for ac, k in opts)


def top_candidates(S: Search, layouts, k: int) -> tuple[list, list, dict]:
    """The first ``k`` candidates of the full ranking (fewer where fewer fit) and their
    (step total, memory total) keys, best first; and counts of the work done (groups bounded,
    refined and evaluated, candidates found fitting).

    Each group enters a heap at `step_lower_bound`; popped the first time, its bound is refined
    (`_refined`: needs the memory of its plan without checkpointing) and it re-enters the heap; popped
    again, it is evaluated. A group is evaluated only when no other's bound is lower, and the walk
    stops when the K-th best known candidate's total is below the lowest bound left."""
    heap = []
    n_ac = S.n_ac
    rep = S.rep
    for L in layouts:
        L.form(S, L.plan(S, L.groups[0][1], "none", 1, False), False)
        for gi, (b, m, acc, batch) in enumerate(L.groups):
            if group_pruned(S, L, m):
                continue
            if can_defer(S, L, acc):
                rep.considered += n_ac
            heap.append((step_lower_bound(S, L, b, m, acc), L.order, gi, 0, L, b, m, acc, batch))
    heapify(heap)
    n_groups = len(heap)
    best: list[tuple] = []              # (total, memory total, layout order, group, index, candidate)
    refined = evaluated = found = 0
    while heap:
        lb, order, gi, stage, L, b, m, acc, batch = heap[0]
        if len(best) >= k and best[k - 1][0] < lb:
            break
        if stage == 0:
            refined += 1
            heapreplace(heap, (max(lb, _refined(S, L, b, m, acc, batch)), order, gi, 1, L, b, m, acc, batch))
            continue
        heappop(heap)
        ranked, keys = [], []
        evaluate_group(S, L, b, m, acc, batch, ranked, keys)
        evaluated += 1
        found += len(ranked)
        for j, (c, (t, mt)) in enumerate(zip(ranked, keys)):
            if len(best) < k or (t, mt, order, gi, j) < best[k - 1][:5]:
                insort(best, (t, mt, order, gi, j, c))
                del best[k:]
    stats = {"groups": n_groups, "refined": refined, "evaluated": evaluated, "fitting": found}
    return [e[5] for e in best], [e[:2] for e in best], stats
