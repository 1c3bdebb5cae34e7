"""The candidate peak moments of one micro-batch's backward on a rank (`_backward_moments`, from the
blocks' `records.BlockRecord`s) and what each holds beyond a step's base bytes under a plan's mode
(`_bwd_terms`, `_rs_terms`, pruned by `_projections`): the in-backward part of the memory model
(`memory.MemoryForm.parts` weighs them with the plan's batch, sharding and schedule).

Split out of `loads.py` and `memory.py` unchanged but for frozen parameters: the gradient bytes of a
moment (stored and pending gradients, FSDP's reduce-scatter buffers) count trainable parameters, its
gathered bytes every parameter.
"""

from __future__ import annotations

from modelpar.planner.memo import PlannerCache
from modelpar.planner.records import BwdMoment, MomentTerms, ProjMode, ReduceMoment, fast_new

_terms = fast_new(MomentTerms)      # (values in field order)

def _scaled_peaks(peaks: tuple, in_grad, ex_mul: float, g_mul: float, shr: float,
                  cache: PlannerCache | None = None) -> tuple:
    """`BlockProfile.bwd_peaks` per sample with TP applied (``in_grad``: incoming gradient bytes that
    replace the profiled ones, None to keep them); memoized in ``cache``, since a model's blocks repeat."""
    if cache is not None:
        key = (peaks, in_grad, ex_mul, g_mul, shr)
        hit = cache.peaks.get(key)
        if hit is None:
            hit = cache.peaks[key] = _scaled_peaks(peaks, in_grad, ex_mul, g_mul, shr)
        return hit
    return tuple((ex * ex_mul, (gi if in_grad is None else in_grad) * g_mul, gs * shr, gq * shr)
                 for ex, gi, gs, gq in peaks)


def _backward_moments(recs: tuple, own: bool = False, cache: PlannerCache | None = None) -> tuple[tuple, tuple]:
    """Candidate peak moments of one micro-batch's backward on a rank, from its blocks in forward
    order. ``recs``: a `records.BlockRecord` per block.

    Backward runs the blocks in reverse. Inside block k's backward (`BlockProfile.bwd_peaks`) the
    live activations of the micro-batch are the saved bytes of blocks <= k (later blocks' were freed
    by autograd as their backward ran), the block's gradient temporaries and the gradient flowing in.
    Parameters of later blocks have their gradients; under FSDP2 (Zhao et al. 2023, Sec. 3.3;
    torch's ``FSDPParamGroup``) unit k is gathered, the unit before it is being all-gathered into a
    flat buffer by the backward prefetch, and the reduce-scatter input of the unit after it is
    retained until unit k's own reduce (``reduce_scatter_max_input_buffers=1``). At unit k's
    reduce-scatter (FSDP2 ``post_backward``: reshard, then reduce) its gathered parameters are freed
    and the unsharded gradient is copied into the reduce-scatter input.

    Returns ``(block moments, reduce moments)``: tuples of `records.BwdMoment` and
    `records.ReduceMoment`.

    Only moments that can be the largest are kept: in a run of identical blocks every quantity
    changes by the same step from one block to the next, so the total is linear along the run's
    interior and only its two ends (and the run's first and last blocks, whose neighbours differ)
    can be the maximum; within a block, a later peak (fewer activations, more gradients) is dropped
    when an earlier one beats it even with the heaviest gradient weight (4 bytes per element) and
    the smallest micro-batch (1 sample). `_projections` prunes further for each plan mode.

    ``own``: the second column's block record is what the block keeps (`modelpar.planner.recompute`),
    so inside block k's backward it holds blocks < k's and block k's whole saved bytes (restored by
    its recompute, or never freed); False (full checkpointing): the input of blocks <= k and block
    k's recomputed saved bytes less the input among them (``in_saved``: the recompute saves the kept
    input itself, not a copy).

    ``cache``: memoized there per (``recs``, ``own``) (`memo.PlannerCache.moments`).
    """
    _bwd, _rs = _NEW_BWD, _NEW_RS
    if cache is not None:
        hit = cache.moments.get((recs, own))
        if hit is None:
            hit = cache.moments[(recs, own)] = _backward_moments(recs, own)
        return hit
    nb = len(recs)
    cum, cum_ac, done_u, done_r = [0.0] * (nb + 1), [0.0] * (nb + 1), [0.0] * (nb + 1), [0.0] * (nb + 1)
    done_ut = [0.0] * (nb + 1)                # trainable parameters of completed units (their gradients)
    prev_u, upto = [0.0] * nb, [0.0] * nb
    last_u, tot_u = 0.0, 0.0
    for k, (saved, kept, _peaks, params, is_root, _in_grad, _in_saved, _tr) in enumerate(recs):   # `BlockRecord`s
        cum[k + 1], cum_ac[k + 1] = cum[k] + saved, cum_ac[k] + kept
        prev_u[k] = last_u
        if not is_root:
            last_u, tot_u = params, tot_u + params
        upto[k] = tot_u
    next_u, nxt = [0.0] * nb, 0.0             # the next unit's trainable parameters (its gradient)
    for k in range(nb - 1, -1, -1):           # parameters of units / root blocks after k
        next_u[k] = nxt
        after = recs[k + 1] if k + 1 < nb else None
        done_u[k] = done_u[k + 1] + (after.params if after is not None and not after.is_root else 0.0)
        done_ut[k] = done_ut[k + 1] + (after.trainable if after is not None and not after.is_root else 0.0)
        done_r[k] = done_r[k + 1] + (after.trainable if after is not None and after.is_root else 0.0)
        if not recs[k].is_root:
            nxt = recs[k].trainable
    keep = set()
    k = 0
    while k < nb:                             # runs of identical blocks: their ends, and one inside
        e = k
        while e + 1 < nb and recs[e + 1] == recs[k]:
            e += 1
        keep.update(x for x in (k, k + 1, e - 1, e) if k <= x <= e)
        k = e + 1
    bwd, rs = [], []
    for k in sorted(keep, reverse=True):
        rk = recs[k]
        sv, pk, root, gin_in, pt = rk.saved, rk.params, rk.is_root, rk.in_grad, rk.trainable
        sv_ac = sv if own else sv - rk.in_saved     # full: the kept input is the input it saves
        kept: list[tuple] = []
        for ex, gi, gs, gq in rk.peaks:
            for a, g in kept:       # an earlier peak beats this one (a loop: no generator per peak)
                if a - (ex + gi) >= 4 * (gs + gq - g):
                    break
            else:
                kept.append((ex + gi, gs + gq))
                # (act, act_ac, done_units, done_root, stored, unit, prev_unit, next_unit, units_upto, pending,
                # done_units_trainable)
                bwd.append(_bwd((cum[k + 1] + ex + gi, cum_ac[k + (0 if own else 1)] + sv_ac + ex + gi, done_u[k],
                                 done_r[k], gs, 0.0 if root else pk, prev_u[k], next_u[k], upto[k], gq, done_ut[k])))
        if not root:
            # (act, act_ac, done_units, done_root, unit, prev_unit, units_before, unit_trainable)
            rs.append(_rs((cum[k] + gin_in, cum_ac[k] + gin_in, done_ut[k], done_r[k], pk, prev_u[k], upto[k] - pk,
                           pt)))
    return tuple(dict.fromkeys(bwd)), tuple(dict.fromkeys(rs))


_NEW_BWD, _NEW_RS = fast_new(BwdMoment), fast_new(ReduceMoment)


def _bwd_terms(c: BwdMoment, mode: ProjMode) -> MomentTerms:
    """A block moment (`_backward_moments`) beyond what every backward moment of the step
    holds, as `records.MomentTerms` (linear forms in the micro-batch b and ws = 1 / dp_shard)."""
    # (unpacked in field order: ~10^5 calls per search, where attribute reads cost)
    act, act_ac, done_u, done_r, gs, u, u_prev, u_next, _units_upto, gq, done_ut = c
    fsdp, ac, prev, rafw, work, pp, _gloo, held = mode   # held: earlier local batches' sharded gradients (base)
    A = act_ac if ac else act
    # weight gradients a matmul computed and AccumulateGrad has not stored yet are temporaries; with
    # gradients from earlier micro-batches the stored ones were added in place. Gradients: of the
    # trainable parameters (``done_ut``, ``done_r``, ``u_next``); gathered parameters: all (``done_u``, ``u``)
    if not fsdp:
        if prev:        # pp == 2: the weight copies' gradients wait for the stage's backward to end (ProjMode)
            return _terms((0.0, 0.0, A, 4 * gq + (2 * (done_ut + done_r) if pp == 2 else 0.0), 0.0, 0.0, 0.0))
        return _terms((4 * (done_ut + done_r + gs), 0.0, A, 4 * gq, 0.0, 0.0, 0.0))
    pre = work * u_prev if rafw else 0.0    # the prefetched unit's flat all-gather output
    if prev:
        # gradient sync off (accumulation; every backward of a pipeline, whose runtime calls
        # set_requires_gradient_sync(False)): unsharded gradients accumulate (in the base); the
        # pipeline also keeps units gathered after their backward (set_reshard_after_backward(False),
        # in the base)
        return _terms((0.0, 0.0, A, work * gq, (work * u if (rafw and not pp) else 0.0), pre, 0.0))
    if pp:
        # a pipeline's first backward: completed units keep their unsharded gradients (accumulated
        # in fp32) and stay gathered; nothing is reduce-scattered until the schedule ends
        return _terms((4 * (done_ut + done_r), 0.0, A, work * (gs + gq), (work * (u + done_u) if rafw else 0.0),
                       pre, 0.0))
    # reduce-scattered (sharded) gradients of completed units; the root's and unit k's unsharded
    # gradients so far; unit k gathered; the retained fp32 reduce-scatter input of the unit after k
    # (accumulating into sharded gradients held in the base: completed units add nothing)
    return _terms((0.0, 0.0 if held else 4 * done_ut, A, work * (done_r + gs + gq), (work * u if rafw else 0.0),
                   pre + 4 * u_next, 0.0))


def _rs_terms(c: ReduceMoment, mode: ProjMode, collective: bool) -> MomentTerms:
    """FSDP unit k's reduce-scatter beyond the base, as `_bwd_terms`: on its copy-in (the unsharded
    gradient, in the parameters' dtype, copied into the fp32 reduce-scatter input) or during the
    collective (the unsharded gradient freed; input and output, which becomes the sharded gradient;
    gloo (``mode.gloo``) first copies the input into a flat buffer of its own, ProcessGroupGloo's
    reduce_scatter, where NCCL reduces in place). Unit k itself is resharded. With sharded gradients
    of earlier local batches held (``mode.sharded_acc``, in the base) the output is a temporary that FSDP2
    adds into them (``foreach_reduce``), and completed units add nothing. FSDP2 reduces the gradients
    that exist: the buffers and gradients count the unit's trainable parameters (``ut``), the resharded
    unit all of them (``u``)."""
    act, act_ac, done_ut, done_r, u, u_prev, _units_before, ut = c      # `ReduceMoment`, in field order
    _fsdp, ac, _prev, rafw, work, _pp, gloo, held = mode                # `ProjMode`, in field order
    A = act_ac if ac else act
    gath = 0.0 if rafw else -work * u
    buf = 4 * ut + (work * u_prev if rafw else 0.0)
    done = 0.0 if held else 4 * done_ut
    if not collective:
        return _terms((0.0, done, A, work * (done_r + ut), gath, buf, 0.0))
    return _terms((0.0, done, A, work * done_r, gath, buf + (4 * ut if gloo else 0.0), 4 * ut))


def _projections(bwd_moments: tuple, rs_moments: tuple, mode: ProjMode) -> tuple:
    """A rank's block and reduce moments (`RankLoad.bwd_moments`, ``rs_moments``) for one ``mode``
    as (A, K, G, (kind, `records.MomentTerms`)), total = A b + K + G / dp_shard beyond the
    base, keeping only those that can be the largest for some b >= 1 and dp_shard >= 1: none that
    another bounds in A, K and G, and, where G is zero throughout, only the upper convex hull of
    (A, K) over slopes b >= 1."""
    terms = [("backward", _bwd_terms(c, mode)) for c in bwd_moments]
    if mode.fsdp and not mode.prev and not mode.pp:
        for c in rs_moments:
            terms.append(("fsdp_reduce", _rs_terms(c, mode, False)))
            terms.append(("fsdp_reduce", _rs_terms(c, mode, True)))
    # (A, K, G) of `MomentTerms` (grads_k, grads_g, acts_a, acts_k, gathered_k, buffers_k, buffers_g)
    cands = sorted(((t[2], t[0] + t[3] + t[4] + t[5], t[1] + t[6], (kind, t)) for kind, t in terms),
                   key=lambda x: (-x[0], -x[1], -x[2]))
    if len(cands) < 2:
        return tuple(cands)
    if any(x[2] for x in cands):
        keep: list[tuple] = []
        for x in cands:         # by decreasing A: a candidate bounding x in all three comes first
            k1, g1 = x[1], x[2]
            for y in keep:      # (a loop: no generator per candidate)
                if y[1] >= k1 and y[2] >= g1:
                    break
            else:
                keep.append(x)
        return tuple(keep)
    # max over points of A b + K for b >= 1: the upper hull, from the largest A down to the vertex
    # past which the hull's slope dK/dA is below -1 (b = 1)
    hull: list[tuple] = []
    for x in cands:
        while len(hull) >= 2:
            (a1, k1), (a2, k2) = hull[-2][:2], hull[-1][:2]
            if (k2 - k1) * (a1 - x[0]) <= (x[1] - k1) * (a1 - a2):
                hull.pop()
            else:
                break
        hull.append(x)
    out = [hull[0]]
    for x in hull[1:]:
        if x[1] - out[-1][1] > out[-1][0] - x[0]:     # beats the previous vertex for some b >= 1
            out.append(x)
        else:
            break
    return tuple(out)

