"""The search's memory evaluation of one candidate over a layout's pipeline ranks (`plan_memory`),
with ranks of identical content evaluated once per stretch of micro-batches in flight.

Interleaved schedules and every-k checkpointing evaluate every pipeline rank (`search.search_plans`),
but a layout's ranks come in few kinds: the middle stages of an interleaved pipeline hold the same
blocks, so their `memory.MemoryForm`s agree in every number `MemoryForm.parts` reads, and differ
only in the micro-batches in flight ``W`` (`memory.in_flight`: non-increasing in the rank). Which of
them can be the fullest rank, and why the result is the one a scan of every rank gives, is proved in
`_selection`; `plan_memory` is that scan on the selected ranks, and falls back to every rank of a
kind wherever the proof's margins do not hold (tests/test_planner_search_speed.py compares both).
"""

from __future__ import annotations

from modelpar.planner.memory import MemoryEstimate, in_flight, memory_form
from modelpar.planner.records import MemoryParts
from modelpar.planner.recompute import is_checkpointed
from modelpar.planner.vshape import w_moments
from modelpar.stage_split import V_SCHEDULES

# the phases of `MemoryForm.parts` that do not depend on the micro-batches in flight
_FLAT_PHASES = ("optimizer", "pipeline_end")
# relative margin of the fall-back checks: far above the rounding of `MemoryForm.parts`' sums
# (~30 additions and products of non-negative terms: at most ~1e-14 relative)
_MARGIN = 1e-9
# every field of a rank load that `memory.memory_form` and `MemoryForm.parts` read (after
# `recompute.ac_load`): loads equal in all of them give equal forms under one plan
_MEM_FIELDS = ("params", "data", "saved", "saved_ac", "is_last", "out", "max_unit_params", "root_params", "numels",
               "recv", "boundary", "bwd_moments", "rs_moments", "trainable", "root_trainable", "max_unit_trainable",
               "trainable_numels")


def memory_class(ld, cache) -> int:
    """A number per distinct memory content of a rank load (`_MEM_FIELDS`) within one search
    (``cache``: its `memo.PlannerCache`): loads with equal numbers have equal `memory.MemoryForm`s
    under any one plan."""
    hit = cache.mem_classes.get(ld.key)
    if hit is not None and hit[0] is ld:
        return hit[1]
    content = tuple(getattr(ld, f) for f in _MEM_FIELDS)
    cid = cache.mem_class_ids.setdefault(content, len(cache.mem_class_ids))
    cache.mem_classes[ld.key] = (ld, cid)
    return cid


def _ac_class(ld, plan, cache) -> int:
    """`memory_class` of `recompute.ac_load` (ld, plan) without building it: ac_load keeps every
    field of ``ld`` but the saved bytes and the backward moments, which it computes from each block's
    record and, under every-k, whether the block is checkpointed, under selective its attention-core
    bytes; equal loads with equal such lists give equal variants."""
    mode = plan.activation_checkpointing
    if mode == "every-k":
        sig = tuple((rec, is_checkpointed(layer, plan)) for rec, layer, *_ in ld.ac_blocks)
    elif mode == "selective":
        sig = tuple((rec, core) for rec, _, core, _, _ in ld.ac_blocks)
    else:
        return memory_class(ld, cache)
    content = (memory_class(ld, cache), mode, sig)
    return cache.mem_class_ids.setdefault(content, len(cache.mem_class_ids))


def _form(forms: dict, plan, v: int, r: int, ld, kw: dict):
    """The `memory.MemoryForm` of rank ``r`` under ``plan``'s checkpointing and sync (one per layout)."""
    fkey = (v, r, plan.activation_checkpointing, plan.ac_every, plan.defer_grad_sync, plan.reshard_after_forward)
    form = forms.get(fkey)
    if form is None:
        form = forms[fkey] = memory_form(ld, plan, **kw)
    return form


def _selection(plan, ranks: list, ws: list, cache) -> list:
    """The ranks of ``ranks`` (``ws``: their micro-batches in flight) that `plan_memory` evaluates, in
    rank order, as (rank, load, W, others): ``others`` None, or the rest of the rank's stretch that
    `plan_memory`'s checks may have to evaluate too. Depends on the loads, ``ws`` and ``plan``'s
    checkpointing only (shared by the layouts of one (tp, pp, v) and schedule).

    Proof that the fullest rank (the largest total, the earliest rank on ties, as a scan of every rank
    finds it) is among them. Group the ranks by `_ac_class` (their load under the plan's
    checkpointing; equal classes: equal forms, equal parts at equal W) and each group into the ranks
    holding all ``m`` micro-batches (W = m) and the others (W < m):
    - W = m: equal parts, equal totals: the group's first rank is the earliest of them.
    - W < m: in `MemoryForm.parts` W enters only the held bytes ``(F - 1) x per_other + F' x per_out``
      with F = W in both variants and F' = W or a constant, all factors >= 0; IEEE rounding is
      monotone, so every computed moment, the largest of them and the branch taken (optimizer /
      pipeline end, which do not depend on W, or the largest moment) are non-decreasing in W. W is
      non-increasing in the rank (checked here: otherwise every rank is evaluated), so the stretch's
      first rank has the largest W. If it takes a flat branch (`_FLAT_PHASES`), so do all later ranks
      of the stretch (their largest moment is no larger), with the same parts: its total is theirs
      and it is earlier. Otherwise its total exceeds each later rank's: in exact arithmetic every
      moment grows with W at a slope of at least ``per_other`` (one micro-batch's saved bytes), so it
      exceeds a later rank's best moment by at least ``per_other x (W - W_next)``, and a later rank in
      a flat branch by its total's margin over that branch's (the stretch's last rank, which takes a
      flat branch if any rank does); `plan_memory` checks both margins against `_MARGIN` (far above
      the sums' rounding) and evaluates the whole stretch where either is smaller.
    So the earliest rank with the largest total is selected, and the scan over the selected ranks in
    rank order, keeping the earliest on ties, finds it."""
    m = plan.n_microbatches
    mode = plan.activation_checkpointing
    # the ranks' classes under this checkpointing: per rank list and mode, for every schedule and m
    ikey = ("ids", ranks[0][1].key, len(ranks), mode, plan.ac_every if mode == "every-k" else 0)
    hit = cache.mem_classes.get(ikey)
    if hit is not None and hit[0] is ranks[0][1] and hit[1] is ranks[-1][1]:
        ids = hit[2]
    else:
        ids = [_ac_class(ld, plan, cache) for _, ld in ranks]
        cache.mem_classes[ikey] = (ranks[0][1], ranks[-1][1], ids)
    groups: dict[int, tuple[list, list]] = {}
    prev = float("inf")
    for (r, ld), w, cid in zip(ranks, ws, ids):
        if type(w) is tuple or w > prev:     # W not non-increasing (or with I -> W gradients): every rank
            return [(r2, ld2, w2, None) for (r2, ld2), w2 in zip(ranks, ws)]
        prev = w
        full, part = groups.setdefault(cid, ([], []))
        (full if w >= m else part).append((r, ld, w))
    out = []
    for full, part in groups.values():
        if full:
            out.append((*full[0], None))
        if part:
            out.append((*part[0], part if len(part) > 1 else None))
    out.sort(key=lambda e: e[0])
    return out


def _estimate_of(parts: MemoryParts, overhead_bytes: float, pp_rank: int) -> MemoryEstimate:
    """The `MemoryEstimate` of `memory.MemoryForm.parts` output on pipeline rank ``pp_rank``."""
    return MemoryEstimate(*parts[:6], overhead_bytes, pp_rank, parts.phase)   # the same field order


def _parts_total(parts: MemoryParts, overhead_bytes: float) -> float:
    """`MemoryEstimate.total` of `_estimate_of` (parts, overhead_bytes, ...): the same sum in the
    same order, so bitwise the same float."""
    params, grads, optimizer, activations, fsdp_gathered, comm_buffers, _phase = parts     # field order
    return params + grads + optimizer + activations + fsdp_gathered + comm_buffers + overhead_bytes


def plan_memory(plan, reps, b: int, acc: int, flights: dict, kw: dict, budget: float, memo: dict,
                forms: dict, overhead: float):
    """(estimate, total) of the most loaded rank of ``reps`` ((rank, load) pairs); the earliest rank
    on ties. Stops at the first rank over ``budget`` (the total is then a lower bound, enough to
    prune, and the estimate None). A rank's memory depends on the schedule only through the
    micro-batches it holds in flight, so schedules that agree on that share the estimate (``memo``,
    one per layout: its loads differ only by the virtual stages), and on (b, m, accumulation, in
    flight) only through `memory.MemoryForm.parts`: one form per rank and checkpointing / sync
    variant (``forms``, one per layout), the same numbers as `memory.rank_memory`. ``flights``:
    `memory.in_flight` of each rank of ``reps`` per micro-batch count (one table per (tp, pp, v),
    schedule and rank list: in flight depends on nothing else). Ranks of identical content are
    evaluated as `_selection` proves enough."""
    v, m, ac, k, defer = (plan.virtual_stages, plan.n_microbatches, plan.activation_checkpointing, plan.ac_every,
                          plan.defer_grad_sync)
    vshape = plan.pp_schedule in V_SCHEDULES
    if vshape:      # V placement: loads (and their forms, estimates) apart from the round-robin ones of this v
        v = (v, "v")
    rf = plan.reshard_after_forward      # per schedule (`plan.fsdp_keeps_gathered`): in every key below
    pp = plan.pp > 1
    # a V schedule's moments differ where W replays checkpointed blocks (`vshape.v_states`' ``w_moments``)
    fkey = (m, "w") if vshape and w_moments(plan) else m
    ws = flights.get(fkey)
    if ws is None:
        ws = flights[fkey] = [in_flight(plan, r, kw["gloo"]) for r, _ in reps]
    skey = ("sel", m, ac, k)
    sel = flights.get(skey)
    if sel is None:
        # (a V schedule's in flight is a table of moments per rank, `memory.in_flight`: every rank)
        sel = flights[skey] = (_selection(plan, reps, ws, kw["cache"]) if len(reps) > 2 and not vshape
                               else [(r, ld, w, None) for (r, ld), w in zip(reps, ws)])
    best, best_total, best_r = None, 0.0, 0
    extra = []
    pm = m if pp else 1
    for r, ld, w, others in sel:
        mkey = (v, r, b, acc, m, ac, k, defer, w, rf)
        hit = memo.get(mkey)
        if hit is None:
            form = _form(forms, plan, v, r, ld, kw)
            parts = form.parts(b, pm, acc, w if pp else 1.0)
            hit = memo[mkey] = (_parts_total(parts, overhead), parts)
        e_total = hit[0]
        if e_total > budget:
            return None, e_total
        if best is None or e_total > best_total:        # rank order: the earliest on ties
            best, best_total, best_r = hit[1], e_total, r
        if others is not None and hit[1].phase not in _FLAT_PHASES:
            # `_selection`'s margins: a later rank's best moment (slope) and a flat branch (last rank)
            form = _form(forms, plan, v, r, ld, kw)
            per_other = b * form.S + (b * form.loss_out if form.last else 0.0)
            ok = per_other * (w - others[1][2]) > _MARGIN * e_total
            if ok:
                lr, lld, lw = others[-1]
                lkey = (v, lr, b, acc, m, ac, k, defer, lw, rf)
                last = memo.get(lkey)
                if last is None:
                    parts = _form(forms, plan, v, lr, lld, kw).parts(b, pm, acc, lw)
                    last = memo[lkey] = (_parts_total(parts, overhead), parts)
                ok = last[1].phase not in _FLAT_PHASES or e_total > last[0] * (1 + _MARGIN)
            if not ok:
                extra.extend(others[1:])
    for r, ld, w in extra:       # later than their stretch's first rank, not in rank order
        mkey = (v, r, b, acc, m, ac, k, defer, w, rf)
        hit = memo.get(mkey)
        if hit is None:
            parts = _form(forms, plan, v, r, ld, kw).parts(b, pm, acc, w if pp else 1.0)
            hit = memo[mkey] = (_parts_total(parts, overhead), parts)
        e_total = hit[0]
        if e_total > budget:
            return None, e_total
        if e_total > best_total or (e_total == best_total and r < best_r):
            best, best_total, best_r = hit[1], e_total, r
    # the estimate of the fullest rank only (the others' totals are all the search compares)
    return _estimate_of(best, overhead, best_r), best_total
