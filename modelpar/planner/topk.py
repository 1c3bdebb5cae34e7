"""The search's exact top-k mode (`search.search_plans(..., top_k=K)`): the first K candidates of
the full ranking, in its order and with its numbers, without evaluating every candidate.

A best-first walk (`top_candidates`) over a heap of lower bounds that tighten in stages: every
(layout, micro-batch size b, micro-batch count m) group enters at `step_lower_bound` (any
checkpointing mode, deferred sync or not); popped the first time it re-enters at `group_floor`
(every rank's exposed collectives added) where that is higher; popped, the memory of its plan without checkpointing
splits it into the modes that can still produce candidates, each at `mode_lower_bound`; a mode
popped gets its exact step total (per variant: deferred sync or not), and only a variant popped at
its exact total has its memory checked (`layouts.fitting_variants`, the full ranking's own test).
The walk stops once K fitting candidates are known and the K-th of them (in the full ranking's
order: step total, then memory total, then enumeration order) is strictly faster than the lowest
key left: every candidate not found is then strictly slower than the K-th, so it ranks after it in
the full ranking too.
"""

from __future__ import annotations

from bisect import insort
from heapq import heapify, heappop, heappush

from modelpar.planner.formulas import bubble_fraction, fill_drain_from_sums
from modelpar.planner.grid import plan_memory as _plan_memory
from modelpar.planner.cost import _finish
from modelpar.planner.layouts import Layout, Search, can_defer, fitting_variants, group_refusal, step_parts

# relative slack taken off every bound: the bound and the exact total are different float sums of
# the same non-negative terms (tens of additions and products, each rounded by at most 2^-53
# relative), so the bound computed in floats can exceed its exact value by ~1e-14 relative at most;
# 1e-9 keeps it below every exact total it bounds
_SLACK = 1e-9


def _copy_terms(form, plan, ld) -> tuple[float, float]:
    """FSDP2's copies on the compute stream on a rank holding ``ld`` (`cost.StepForm.at`, the same
    floats): (per micro-batch: each gather's copy-out, per step at least once: the reduce-scatter's
    copy-in); (0, 0) where the form has none (no dp_shard, no overlap, or FSDP1's copies)."""
    if plan.dp_shard == 1 or not form.overlap or not form.fsdp_stream_copies:
        return 0.0, 0.0
    wb, mem_s, root = form.wb, form.mem_s, ld.root_params
    gathers = 2 if plan.reshard_after_forward else 1
    return (2 * wb * (gathers * (ld.params - root) + root) / mem_s,
            (form.wb + form.reduce_bytes) * ld.trainable / mem_s)


def _exposed_terms(form, plan, i: int, ld, b: int) -> tuple[float, float]:
    """What `cost.StepForm.at` exposes of rank ``i``'s data-parallel collectives at least, on a device
    that overlaps (else (0, 0)): (per micro-batch, per step). Its collective times are `at`'s own
    memo entry (``form.comms``, the same floats; their data-parallel parts do not depend on ``b``).

    FSDP (`comms._fsdp_exposed`, every micro-batch): at least ``head`` (the root's and the first
    unit's gathers, before any compute), whatever the compute times; with a reduce-scatter also
    ``tail`` (the first unit's and the root's, after the last compute), which a deferred sync adds
    once (its extra exposure, `_fsdp_exposed` with the reduce-scatter less without, is at least
    ``tail``: the rest is non-decreasing in the backward's collectives); under a pipeline the whole
    reduce-scatter once (``rs``); HSDP adds its replicas' all-reduce (``rep``) once. DDP / replicate:
    ``max(t_ar - t_b, last) + share x min(t_ar, t_b)`` >= ``last``; replicate under a pipeline
    ``t_ar`` + its copies >= ``t_ar``. Memoized per rank in ``form.floors`` (it does not depend on
    the micro-batch size, the count or the checkpointing)."""
    hit = form.floors.get(i)
    if hit is not None:
        return hit
    out = 0.0, 0.0
    if form.overlap and (plan.dp_shard > 1 or plan.dp_replicate > 1):
        cm = form.comms_at(plan, i, ld, b)
        if plan.dp_shard > 1:
            head = cm["ag_root"] + min(cm["first"], cm["ag"])
            tail = cm["rs"] if form.p > 1 else min(cm["rs_unit"], cm["rs"] - cm["rs_root"]) + cm["rs_root"]
            out = head, tail + cm["rep"]
        else:
            out = 0.0, (cm["t_ar"] if (form.rep_rt and form.p > 1) else cm["last"])
    form.floors[i] = out
    return out


def _copy_floor(form, plan) -> tuple[float, float]:
    """The smallest of `_copy_terms` over the form's ranks, each part apart (memoized in
    ``form.floors`` under -2: it reads the layout's degrees and FSDP options only)."""
    if plan.dp_shard == 1 or not form.overlap or not form.fsdp_stream_copies:
        return 0.0, 0.0                  # `_copy_terms` of every rank
    hit = form.floors.get(-2)
    if hit is None:
        terms = [_copy_terms(form, plan, ld) for ld in form.loads]
        hit = form.floors[-2] = min(t[0] for t in terms), min(t[1] for t in terms)
    return hit


def _exposed_floor(form, plan, b: int) -> tuple[float, float]:
    """The smallest of `_exposed_terms` over the form's ranks, each part apart (memoized in
    ``form.floors`` under -1: like them it does not depend on ``b``, the count or the checkpointing)."""
    hit = form.floors.get(-1)
    if hit is None:
        # per distinct content of what `comms._comm_terms` reads of a load for these terms (a pipeline's
        # interior ranks of equal blocks hold equal loads; layouts that differ by the schedule only
        # share them), with the degrees and the form's options they read (`cost.StepForm.comms_at`)
        by_load, contents, terms = form.cache.exposed if form.cache is not None else ({}, {}, {})
        opts = (plan.dp_replicate, plan.dp_shard, plan.tp, plan.pp, form.wb, form.dp_overlap, form.reduce_bytes,
                form.rep_rt, form.overlap)
        e_mb = e_once = float("inf")
        for i, ld in enumerate(form.loads):
            num = by_load.get(id(ld))          # the load's content, numbered once per load object
            if num is None or num[0] is not ld:
                content = (ld.params, ld.root_params, ld.max_unit_params, ld.unit_sizes, ld.param_sizes, ld.trainable,
                           ld.root_trainable, ld.max_unit_trainable, ld.unit_trainable, ld.trainable_sizes)
                num = by_load[id(ld)] = (ld, contents.setdefault(content, len(contents)))
            key = (num[1], opts)
            t = terms.get(key)
            if t is None:
                t = terms[key] = _exposed_terms(form, plan, i, ld, b)
            e_mb, e_once = min(e_mb, t[0]), min(e_once, t[1])
        hit = form.floors[-1] = e_mb, e_once
    return hit


def group_floor(S: Search, L: Layout, b: int, m: int, acc: int) -> float:
    """`step_lower_bound` plus the exposed data-parallel collectives every rank has at least
    (`_exposed_floor`), a lower bound (seconds) on the step total of every candidate of the group
    under any checkpointing, deferred sync or not. Proof: `step_lower_bound`'s, with dp_comm >= the
    slowest rank's copies + its `_exposed_terms` (`mode_lower_bound`), each at least the smallest
    over the ranks (the form's loads: every rank under a pipeline, the one rank without; the every-k
    form has the same ranks and collectives). Computed only for groups the walk pops (stage 0): over
    all ~10^4 groups of every layout, the collectives of every pipeline rank cost more than they prune."""
    return _floor_sum(S, L, b, m, acc, exposed=True) * (1.0 - _SLACK)


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
      stage's work without checkpointing) - W = U + D of the "none" sums; for 1F1B see `_work_floor`
      (half the fill and drain of equal stages at least); without a pipeline 0.
    - optimizer = the slowest rank's optimizer seconds >= the smallest of the form's (``opt``).
    - dp_comm = the exposed collectives and copies: each a max(0, .) or a sum of seconds (the deferred
      sync's part is `comms._fsdp_exposed` with the reduce-scatter minus without, >= 0 as it is
      non-decreasing in the backward's collectives), plus, where FSDP2 copies on the compute stream
      (`_copy_terms`: dp_shard > 1, overlap), mbs x each gather's copy-out and the reduce-scatter's
      copy-in, every micro-batch (FSDP without a pipeline, not deferred) or once (deferred, or
      under a pipeline): >= mbs x the smallest copy-out + the smallest copy-in over the ranks
      (`_copy_floor`); the rest is >= 0 and dropped (`mode_lower_bound` adds a floor of the exposed
      collectives, `_exposed_terms`, on one rank: over every rank it costs more than it prunes
      here), as is pp_comm (2 v x p2p seconds per micro-batch).
    The sum of these is taken in floats and lowered by `_SLACK` relative, which exceeds the rounding of
    both sums, so the returned bound is <= the float total of every candidate of the group."""
    return _floor_sum(S, L, b, m, acc, exposed=False) * (1.0 - _SLACK)


def _floor_sum(S: Search, L: Layout, b: int, m: int, acc: int, *, exposed: bool) -> float:
    """`step_lower_bound`'s sum before `_SLACK` (``exposed``: with `group_floor`'s collectives)."""
    form = L.sform
    plan = L.plan(S, m, "none", 1, False)
    _, _, t_f, t_b, t_rc, t_tp, fill = form._slowest(plan, b)
    mbs = acc * (m if L.pp > 1 else 1)
    c_mb, c_once = _copy_floor(form, plan)
    if exposed:
        e_mb, e_once = _exposed_floor(form, plan, b)
        c_mb, c_once = c_mb + e_mb, c_once + e_once
    return _work_floor(L, m, acc, t_f + t_b + t_rc + t_tp, fill) + min(form.opt) + mbs * c_mb + c_once


def _work_floor(L: Layout, m: int, acc: int, w: float, fill) -> float:
    """compute + recompute + tp_comm + bubble of every candidate of a group of ``L``, at least
    (seconds), from the slowest rank's work ``w`` and `StepForm._slowest`'s ``fill`` without
    checkpointing (`step_lower_bound`'s proof; the caller lowers the float sum by `_SLACK`).

    1F1B (`formulas.fill_drain_from_sums`, one stage per rank). Under any checkpointing let j be the
    slowest rank, w_j its work (forward f + backward b_), U and D the work of the stages before and
    after it, h = p - j - 1 and S = U + w_j + D. With m >= h + 1 the step's part is
    m w_j + U + max(0, D - h f) + max(0, D - h b_) >= m w_j + U + max(0, 2 D - h w_j), which is
    >= (m - 1 - h / 2) w_j + S both where 2 D >= h w_j (it is then (m - 1 - h) w_j + S + D) and where
    not (m w_j + S - w_j - D with D < h w_j / 2); with m < h + 1 it is m w_j + U + D = (m - 1) w_j + S.
    So it is >= max(0, m - 1 - (p - 1) / 2) w_j + S, and >= m w_j (the bubble's terms are >= 0);
    w_j >= W and S >= the same sum without checkpointing (each rank's work only grows), so both hold
    with the "none" values: for equal stages of work w, (m + (p - 1) / 2) w, half of the fill and
    drain of (m + p - 1) w."""
    p = L.pp
    if p == 1:
        return acc * w
    sched = L.sched
    if sched == "1f1b":
        if fill is None:
            return acc * m * w
        total = fill[0] + fill[1] + fill[2] + fill[3]      # U + D + the slowest stage's F + B
        return acc * max(m * w, max(0.0, m - 1 - (p - 1) / 2) * w + total)
    if sched == "gpipe":
        return acc * m * w + (acc * (fill[0] + fill[1]) if fill is not None else 0.0)
    return acc * m * w + acc * bubble_fraction(sched, p, m, L.v) * m * w


def _family_floors(S: Search, L: Layout) -> tuple:
    """The groups of ``L`` that its schedule accepts, each as (group index, `_work_floor`, mbs = its
    micro-batches per step), and how many it refuses per reason (`layouts.group_pruned`'s counts) and
    tries deferred (accumulation > 1): the same for every layout whose step form shares ``L``'s
    per-micro-batch-size tables (`layouts._share_times`: the same slowest rank's times) and has its
    schedule, virtual stages and groups (a (tp, pp) fixes dp, so the groups), so computed once for
    them (memoized in ``S.families``, keyed by the tables' identity, which the search keeps alive)."""
    form = L.sform
    key = (id(form.slowest), L.sched, L.v, L.per_dp, len(L.groups))
    hit = S.families.get(key)
    if hit is not None and hit[0] is form.slowest:
        return hit[1]
    p = L.pp
    per_b: dict[int, tuple] = {}
    out, refused, deferrable = [], {}, 0
    for gi, (b, m, acc, batch) in enumerate(L.groups):
        why = group_refusal(L, m)
        if why is not None:
            refused[why] = refused.get(why, 0) + 1
            continue
        deferrable += acc > 1
        hit = per_b.get(b)
        if hit is None:
            _, _, t_f, t_b, t_rc, t_tp, fill = form._slowest(L.plan(S, m, "none", 1, False), b)
            hit = per_b[b] = (t_f + t_b + t_rc + t_tp, fill)
        out.append((gi, _work_floor(L, m, acc, hit[0], hit[1]), acc * (m if p > 1 else 1)))
    fam = (out, tuple(refused.items()), deferrable)
    S.families[key] = (form.slowest, fam)
    return fam


def _count_groups(S: Search, L: Layout, fam: tuple) -> None:
    """Count what `_family_floors` found of ``L``'s groups in ``S.rep``, as the full ranking does:
    the schedule's refusals (`layouts.group_pruned`) and the deferred-sync variants considered."""
    _, refused, deferrable = fam
    for reason, n in refused:
        S.rep.pruned[reason] += n * S.n_ac
    if S.defer_grad_sync and L.ds > 1 and L.pp == 1:          # `layouts.can_defer` less acc > 1
        S.rep.considered += deferrable * S.n_ac


def _layout_entries(S: Search, L: Layout, heap: list, lb: float) -> None:
    """Push stage-0 heap entries of every group of ``L`` that its schedule accepts, each at
    `step_lower_bound` (the same floats, the work part from `_family_floors`), at least ``lb``."""
    form = L.sform
    opt = min(form.opt)
    c_mb, c_once = _copy_floor(form, L.plan(S, L.groups[0][1], "none", 1, False))
    order, groups = L.order, L.groups
    for gi, wf, mbs in _family_floors(S, L)[0]:
        b, m, acc, batch = groups[gi]
        heappush(heap, (max(lb, (wf + opt + mbs * c_mb + c_once) * (1.0 - _SLACK)), order, gi, -1, 0, 0, L, b, m, acc,
                        batch, None))


def mode_lower_bound(S: Search, L: Layout, b: int, m: int, acc: int, ac: str, k: int) -> float:
    """A lower bound (seconds) on the step total of the group's candidates under checkpointing
    (``ac``, ``k``), deferred sync or not: `cost.StepForm.at`'s parts less the ones dropped.

    Proof. From the form's slowest rank ``i`` under this checkpointing (`StepForm._slowest`, the same
    memoized entry `at` reads, so the same floats): compute + recompute + tp_comm = mbs x work_i +
    t_acc with work_i = t_f + t_b + t_rc + t_tp, and t_acc >= 0 (see `step_lower_bound`); bubble =
    accumulation x (`formulas.fill_drain_from_sums` of the slowest rank's sums for GPipe / 1F1B, else
    `bubble_fraction` x m x work_i): computed here exactly as `at` does; optimizer = the slowest
    rank's, exactly; dp_comm >= FSDP2's copies of rank i (`_copy_terms`: mbs x the copy-out + the
    copy-in, see `step_lower_bound`) + its exposed collectives' floor (`_exposed_terms`: mbs x per
    micro-batch + per step). Dropped: t_acc, pp_comm and the rest of dp_comm (>= 0, see
    `step_lower_bound`); the deferred sync changes only those. Lowered by `_SLACK` for the float sums."""
    form = L.sform_k if ac == "every-k" else L.sform
    if form is None:
        form = L.form(S, L.plan(S, m, ac, k, False), ac == "every-k")
    plan = L.plan(S, m, ac, k, False)
    i, ld, t_f, t_b, t_rc, t_tp, fill = form._slowest(plan, b)
    p = L.pp
    mm = m if p > 1 else 1
    work = t_f + t_b + t_tp + t_rc
    if fill is not None:
        bub = fill_drain_from_sums(L.sched, *fill, mm)
    else:
        bub = bubble_fraction(L.sched, p, mm, L.v) * mm * work
    c_mb, c_once = _copy_terms(form, plan, ld)
    e_mb, e_once = _exposed_terms(form, plan, i, ld, b)
    c_mb, c_once = c_mb + e_mb, c_once + e_once
    return (acc * mm * work + acc * bub + form.opt[i] + acc * mm * c_mb + c_once) * (1.0 - _SLACK)


def _mode_entries(S: Search, L: Layout, b: int, m: int, acc: int) -> list[tuple[float, int]]:
    """(bound, mode index) of each checkpointing mode the group can still produce candidates in,
    once it is known whether its plan without checkpointing fits: where it fits, every other mode is
    dominated (`layouts.fitting_variants`), so only that mode remains; where it does not, every
    recomputing mode that `layouts.fitting_variants` does not rule out by the same test, each at its
    `mode_lower_bound`."""
    opts = S.ac_opts
    if opts[0] == ("none", 1):
        plan = L.plan(S, m, "none", 1, False)
        _, total = _plan_memory(plan, L.reps, b, acc, L.flights, *L.mem_args)     # memoized: fitting_variants reads it
        if total <= S.budget:
            return [(mode_lower_bound(S, L, b, m, acc, "none", 1), 0)]
        # `fitting_variants`' own test: selective cannot fit where "none" exceeds the budget by more
        # than the attention cores it frees
        sel_out = total - S.budget > m * b * L.bounds[0]
        return [(mode_lower_bound(S, L, b, m, acc, ac, k), j) for j, (ac, k) in enumerate(opts)
                if j and not (sel_out and ac == "selective")]
    return [(mode_lower_bound(S, L, b, m, acc, ac, k), j) for j, (ac, k) in enumerate(opts)]


def top_candidates(S: Search, layouts, k: int) -> tuple[list, list, dict]:
    """The first ``k`` candidates of the full ranking (fewer where fewer fit) and their
    (step total, memory total) keys, best first; and counts of the work done (groups bounded,
    groups split into modes (``split``), groups with a candidate's memory estimated (``evaluated``), candidates step-timed (``timed``), candidates
    found fitting).

    A best-first walk over a heap of lower bounds, in stages (each entry's key is a lower bound on
    the step total of every candidate it stands for, and never below its parent's):
    0. each (layout, b, m) group at `step_lower_bound`; popped the first time, it re-enters at
       `group_floor` where that is above the key (no memory estimated yet);
    1. popped, the group's memory without checkpointing decides which modes remain (`_mode_entries`),
       each re-entering at its `mode_lower_bound`;
    2. a (group, mode) popped: the step parts of its plan (and of the deferred-sync plan where the
       group tries one) are computed, each variant re-entering at its exact step total;
    3. a (group, mode, variant) popped: its memory decides whether it is a candidate of the full
       ranking (`layouts.fitting_variants`, the full ranking's own test); if so it enters the best
       list at its key (step total, memory total, layout order, group, mode, variant), the full
       ranking's order: within a group `evaluate_group` appends candidates by mode, then variant.
    The walk stops when the K-th best known candidate's total is below the lowest key left: every
    candidate not yet found is then strictly slower than the K-th."""
    families: dict[int, tuple] = {}         # id of `_family_floors`' tuple -> (it, its layouts)
    for L in layouts:
        L.form(S, L.plan(S, L.groups[0][1], "none", 1, False), False)
        fam = _family_floors(S, L)
        _count_groups(S, L, fam)
        families.setdefault(id(fam), (fam, []))[1].append(L)
    # stage -1: a family's layouts enter together at the least work floor of its groups (each of their
    # stage-0 bounds adds non-negative terms to a group's work floor, rounded up to the same float at least)
    heap: list[tuple] = [(min(wf for _, wf, _ in fam[0]) * (1.0 - _SLACK), Ls[0].order, -1, -1, 0, -1, Ls, 0, 0, 0,
                          None, None) for fam, Ls in families.values() if fam[0]]
    heapify(heap)
    n_groups = sum(len(fam[0]) * len(Ls) for fam, Ls in families.values())
    best: list[tuple] = []   # (total, memory total, layout order, group, mode, variant, plan, memory, parts, batch)
    fits: dict[tuple, list] = {}        # (layout order, group, mode) -> its fitting variants
    evaluated, split, timed, found = set(), 0, 0, 0
    gbs, flops, profile, cache, candidate = S.global_batch_size, S.flops, S.profile, S.cache, S.candidate
    while heap:
        lb, order, gi, j, var, stage, L, b, m, acc, batch, extra = heap[0]
        if len(best) >= k and best[k - 1][0] < lb:
            break
        if stage == -1:
            heappop(heap)
            for L2 in L:                # ``L`` holds the family's layouts
                _layout_entries(S, L2, heap, lb)
            continue
        if stage == 0:
            heappop(heap)
            if not var:     # first pop: re-enter at the tighter `group_floor` where it is above the key
                gf = group_floor(S, L, b, m, acc)
                if gf > lb:
                    heappush(heap, (gf, order, gi, -1, 1, 0, L, b, m, acc, batch, None))
                    continue
            split += 1
            for mlb, mj in _mode_entries(S, L, b, m, acc):
                heappush(heap, (max(lb, mlb), order, gi, mj, 0, 1, L, b, m, acc, batch, None))
            continue
        if stage == 1:
            heappop(heap)
            ac, kk = S.ac_opts[j]
            for v in ((0, 1) if can_defer(S, L, acc) else (0,)):
                plan = L.plan(S, m, ac, kk, v == 1)
                parts, total = step_parts(S, L, plan, b, acc)
                timed += 1
                heappush(heap, (max(lb, total), order, gi, j, v, 2, L, b, m, acc, batch, (plan, parts, total)))
            continue
        heappop(heap)
        gkey = (order, gi, j)
        variants = fits.get(gkey)
        if variants is None:
            variants = fits[gkey] = [e for e in fitting_variants(S, L, b, m, acc, stop=j, count_from=j) if e[0] == j]
            evaluated.add((order, gi))
        plan, parts, total = extra
        for _, v, pl, mem, mt in variants:
            if v != var:
                continue
            assert pl is plan
            found += 1
            if len(best) < k or (total, mt, order, gi, j, var) < best[k - 1][:6]:
                insort(best, (total, mt, order, gi, j, var, pl, mem, parts, batch))
                del best[k:]
    out = []
    for total, mt, *_, pl, mem, parts, batch in best:
        st = _finish(parts, profile, pl, gbs, flops, cache)
        assert st.total == total
        out.append(candidate(pl, batch, mem, st))
    stats = {"groups": n_groups, "split": split, "evaluated": len(evaluated), "timed": timed, "fitting": found}
    return out, [e[:2] for e in best], stats
