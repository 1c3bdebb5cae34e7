"""One rank's collective times (the alpha-beta forms of `formulas`, the calibrated tables, or the
built-in GPUs' published NCCL figures) and the share of FSDP2's communication that compute does not
hide; used by `cost.rank_step` (sources in the docstrings of `cost` and `gpu`)."""

from __future__ import annotations

from modelpar.plan import ParallelPlan
from modelpar.planner.formulas import alpha_beta_form
from modelpar.planner.gpu import gpu_link, physics_for
from modelpar.planner.hardware import Hardware
from modelpar.planner.memo import PlannerCache
from modelpar.planner.memory import RankLoad

DDP_BUCKET_BYTES = 25 * 2 ** 20


def _axis_link(plan: ParallelPlan, axis: str, hw: Hardware, op: str = "all_reduce") -> tuple[float, float]:
    """Bandwidth and latency of ``op`` on one mesh axis; axes are (pp, dp_replicate, dp_shard, tp),
    tp innermost. Inside one node a calibrated per-operation fit (`Hardware.collective`) is used."""
    if hw.devices_per_node % (plan.tp * plan.dp * plan.pp) == 0:
        return hw.collective(op) or (hw.intra_bw, hw.intra_latency)
    span = {"tp": 1, "dp_shard": plan.tp, "dp_replicate": plan.tp * plan.dp_shard,
            "pp": plan.tp * plan.dp}[axis]
    n = {"tp": plan.tp, "dp_shard": plan.dp_shard, "dp_replicate": plan.dp_replicate, "pp": 2}[axis]
    return hw.link(n, span)


def _coll(plan: ParallelPlan, axis: str, hw: Hardware, op: str, nbytes: float, n: int, ctx: bool = False,
          cache: PlannerCache | None = None) -> float:
    """Seconds of one ``op`` of ``nbytes`` over ``n`` ranks of mesh axis ``axis``: the calibrated
    table (`Hardware.collective_seconds`; ``ctx``: the one of calls issued between compute segments,
    the wait for the slowest rank included) when the job fits one node and ``op`` was measured with
    ``n`` ranks, else the alpha-beta form (Thakur et al. 2005) with the axis' link."""
    return _coll_sum(plan, axis, hw, op, (nbytes,), n, ctx=ctx, cache=cache)


def _coll_sum(plan: ParallelPlan, axis: str, hw: Hardware, op: str, sizes, n: int, scale: float = 1.0,
              ctx: bool = False, cache: PlannerCache | None = None) -> float:
    """`_coll` summed over one ``op`` per entry of ``sizes`` x ``scale`` (bytes); the alpha-beta form
    in closed form (calls x latency steps + total bytes x volume / bandwidth). The search calls this
    ~10^5 times, so the link of (degrees, axis, op) is memoized in ``cache`` (`PlannerCache.links`;
    the cache serves one hardware)."""
    if n <= 1:
        return 0.0
    key = (plan.tp, plan.dp_shard, plan.dp_replicate, plan.pp, axis, op, n, ctx)
    link = cache.links.get(key) if cache is not None else None
    if link is None:
        table = (hw.calibration is not None and hw.devices_per_node % (plan.tp * plan.dp * plan.pp) == 0
                 and hw.collective_seconds(op, 1.0, n, in_context=ctx) is not None)
        bw, lat = _axis_link(plan, axis, hw, op)
        steps, volume = alpha_beta_form(op, n)
        phys = physics_for(hw)
        if phys is not None:            # built-in GPU: published NCCL bus bandwidths (gpu.py)
            span = {"tp": 1, "dp_shard": plan.tp, "dp_replicate": plan.tp * plan.dp_shard,
                    "pp": plan.tp * plan.dp}[axis]
            bw, lat, steps = gpu_link(phys, hw, bw, op, n, steps, min(n, hw.devices_per_node // span))
        link = (table, steps * lat, volume / bw)
        if cache is not None:
            cache.links[key] = link
    if link[0]:
        return sum(hw.collective_seconds(op, x * scale, n, in_context=ctx) for x in sizes if x > 0)
    if len(sizes) == 1:
        k, total = 1, sizes[0]
    else:                       # (calls, bytes) of a rank's unit or bucket list
        k, total = sum(1 for x in sizes if x > 0), sum(sizes)
    return k * link[1] + link[2] * total * scale if k else 0.0


DDP_FIRST_BUCKET_BYTES = 2 ** 20     # torch DDP's first bucket (``_DEFAULT_FIRST_BUCKET_BYTES``)


def _ddp_buckets_cached(sizes: tuple, elem_bytes: float = 4, cache: PlannerCache | None = None) -> list[float]:
    """`ddp_buckets` of gradients of ``elem_bytes`` (fp32 by default), memoized in ``cache`` per
    parameter-size tuple (one per rank load) and element size."""
    if cache is None:
        return ddp_buckets(sizes, elem_bytes)
    key = (sizes, elem_bytes)
    hit = cache.buckets.get(key)
    if hit is None:
        hit = cache.buckets[key] = ddp_buckets(sizes, elem_bytes)
    return hit


def ddp_buckets(sizes, elem_bytes: float, cap: float = DDP_BUCKET_BYTES) -> list[float]:
    """Bucket sizes (bytes) torch DDP forms over parameters of ``sizes`` elements: in reverse
    registration order (the order gradients arrive), the first bucket closing at 1 MiB, the others
    at ``cap`` (25 MiB); a tensor larger than the cap fills a bucket alone."""
    out, cur, lim = [], 0.0, DDP_FIRST_BUCKET_BYTES
    for k in reversed(sizes):
        cur += k * elem_bytes
        if cur >= lim:
            out.append(cur)
            cur, lim = 0.0, cap
    if cur:
        out.append(cur)
    return out


def _comm_terms(ld: RankLoad, plan: ParallelPlan, hw: Hardware, b: int, wb: int, dp_overlap: bool,
                rb: float = 4, sg: bool = False, groups: bool = False, cache: PlannerCache | None = None) -> dict:
    """The collective times of one rank's step that do not depend on the schedule, micro-batch count
    or checkpointing (memoized: the search evaluates many such variants of each layout). ``wb``:
    bytes per gathered parameter (FSDP all-gather), ``rb``: per reduced gradient element; ``sg``:
    pipeline transfers use Megatron-LM's scatter / gather (each TP rank sends 1/tp of the tensor,
    the receivers all-gather it over the TP group; Narayanan et al. SC'21, Sec. 4.1); ``groups``:
    data-parallel all-reduces per FSDP2 replicate group (each block, then the root) instead of DDP
    buckets, ``last`` the first block's and the root's. ``cache``: `PlannerCache.comms`, per rank
    load (its ``key``, the entry used for the same object only) and these arguments.

    Gradient reductions carry the gradients that exist, those of the trainable parameters
    (`loads.RankLoad.trainable`: DDP's buckets hold only parameters that require gradients, FSDP2
    reduce-scatters a unit's parameters with a gradient); FSDP's all-gathers carry every parameter."""
    key = (ld.key, plan.tp, plan.dp_shard, plan.dp_replicate, plan.pp, b, wb, dp_overlap, rb, sg, groups)
    hit = cache.comms.get(key) if cache is not None else None
    if hit is not None and hit[0] is ld:
        return hit[1]
    # without overlap (CPU) every data-parallel collective and pipeline transfer blocks between two
    # compute segments: its calibrated in-context time includes the wait for the slowest rank
    cx = not hw.comm_overlap
    # a stage sends its output forward and its input's gradient back: hidden states, never logits
    # (`RankLoad.p2p`); CPU profiles keep the stage-output size their calibrated accuracy was
    # measured with (the last stage's logits; see docs/planner.md)
    p2p = ld.p2p if (ld.p2p and physics_for(hw) is not None) else ld.boundary
    c = {"p2p": _coll(plan, "pp", hw, "send_recv", p2p * b, 2, cx, cache) if plan.pp > 1 else 0.0}
    if sg and plan.pp > 1 and plan.tp > 1 and not plan.sequence_parallel:
        c["p2p"] = (_coll(plan, "pp", hw, "send_recv", p2p * b / plan.tp, 2, False, cache)
                    + _coll(plan, "tp", hw, "all_gather", p2p * b, plan.tp, False, cache))
    grad_bytes = rb * ld.trainable
    if plan.dp_shard > 1:
        n = plan.dp_shard
        units = ld.unit_sizes or (ld.params - ld.root_params,)
        grad_units = ld.unit_trainable or (ld.trainable - ld.root_trainable,)
        c["ag"] = _coll_sum(plan, "dp_shard", hw, "all_gather", units, n, wb, cx, cache)
        c["ag_root"] = _coll(plan, "dp_shard", hw, "all_gather", wb * ld.root_params, n, cx, cache)
        c["rs"] = (_coll_sum(plan, "dp_shard", hw, "reduce_scatter", grad_units, n, rb, cx, cache)
                   + _coll(plan, "dp_shard", hw, "reduce_scatter", rb * ld.root_trainable, n, cx, cache))
        c["first"] = _coll(plan, "dp_shard", hw, "all_gather", wb * ld.max_unit_params, n, False, cache)
        # the pieces FSDP2 cannot hide (`_fsdp_exposed`): one block's reduce-scatter, the root's
        c["rs_unit"] = _coll(plan, "dp_shard", hw, "reduce_scatter", rb * ld.max_unit_trainable, n, False, cache)
        c["rs_root"] = _coll(plan, "dp_shard", hw, "reduce_scatter", rb * ld.root_trainable, n, False, cache)
        c["rep"] = (_coll(plan, "dp_replicate", hw, "all_reduce", grad_bytes / n, plan.dp_replicate, cx, cache)
                    if plan.dp_replicate > 1 else 0.0)
    elif plan.dp_replicate > 1:
        n = plan.dp_replicate
        sizes = ld.trainable_sizes
        buckets = _ddp_buckets_cached(sizes, rb, cache) if (sizes and dp_overlap) else (grad_bytes,)
        c["t_ar"] = _coll_sum(plan, "dp_replicate", hw, "all_reduce", buckets, n, cache=cache)
        if cx:
            # DDP launches each bucket's all-reduce asynchronously from backward; only the wait for
            # the last one after backward blocks between compute segments
            c["t_ar"] += (_coll(plan, "dp_replicate", hw, "all_reduce", buckets[-1], n, True, cache)
                          - _coll(plan, "dp_replicate", hw, "all_reduce", buckets[-1], n, False, cache))
        c["n_buckets"] = len(buckets)
        c["last"] = _coll(plan, "dp_replicate", hw, "all_reduce", min(DDP_BUCKET_BYTES, grad_bytes), n, False, cache)
        if groups:
            units = (ld.unit_trainable or (ld.trainable - ld.root_trainable,)) + (ld.root_trainable,)
            c["t_ar"] = _coll_sum(plan, "dp_replicate", hw, "all_reduce", units, n, rb, False, cache)
            c["last"] = (_coll(plan, "dp_replicate", hw, "all_reduce", rb * ld.max_unit_trainable, n, False, cache)
                         + _coll(plan, "dp_replicate", hw, "all_reduce", rb * ld.root_trainable, n, False, cache))
    if cache is not None:
        cache.comms[key] = (ld, c)
    return c


def _nccl_share(plan: ParallelPlan, axis: str, hw: Hardware, phys) -> float:
    """NCCL's share of the SMs while a collective of mesh axis ``axis`` runs beside compute
    (`gpu.GpuPhysics.nccl_sm_share`) for groups inside one node, `GpuPhysics.nccl_sm_share_inter`
    (NCCL's channels per NIC) for groups spanning nodes; 0 on devices without built-in physics."""
    if phys is None:
        return 0.0
    span = {"dp_shard": plan.tp * plan.dp_shard, "dp_replicate": plan.tp * plan.dp}[axis]
    return phys.nccl_sm_share if span <= hw.devices_per_node else phys.nccl_sm_share_inter


def _fsdp_exposed(cm: dict, gathers: int, t_fwd: float, t_bwd: float, sm_share: float, *,
                  reduce: bool) -> float:
    """Seconds of FSDP2 communication one micro-batch does not hide, on a device that overlaps
    (``cm``: `_comm_terms`; ``gathers``: 2 with ``reshard_after_forward``; ``t_fwd`` / ``t_bwd``:
    forward and backward compute seconds, the backward's recompute included; ``reduce``: this
    micro-batch reduce-scatters its gradients).

    FSDP2 (`fully_shard` per block, then the root: `parallel.data_parallel`; Zhao et al., VLDB 2023,
    Sec. 3.3-4) issues every all-gather on its own stream once the previous one is done, so block
    i+1's gather runs under block i's compute; in backward the previous block's gather and the
    next block's reduce-scatter run under a block's backward. What it cannot hide:

    - the root's gather (embedding, head) and the first block's gather, issued before any compute
      (the embedding lookup between them is a gather of a few rows);
    - forward gathers beyond the forward's compute, backward gathers + reduce-scatters beyond the
      backward's (the two directions are separate windows: a forward gather cannot wait for backward);
    - the first block's reduce-scatter and the root's, issued after the last compute of the
      backward (the embedding's scatter-add); FSDP2's final callback waits for them;
    - contention: NCCL runs its collectives as kernels, one CTA per channel, each holding an SM for
      the collective's duration, so compute under a hidden collective runs on the other SMs
      (``sm_share`` = NCCL's CTAs / SMs, `gpu.GpuPhysics.nccl_sm_share`): it takes
      ``sm_share`` x (hidden time) longer."""
    ag, ag_u = cm["ag"], min(cm["first"], cm["ag"])
    head = cm["ag_root"] + ag_u
    fwd = ag - ag_u
    bwd = (gathers - 1) * ag
    tail = 0.0
    if reduce:
        rs_u = min(cm["rs_unit"], cm["rs"] - cm["rs_root"])
        bwd += cm["rs"] - cm["rs_root"] - rs_u
        tail = rs_u + cm["rs_root"]
    ex_f, ex_b = max(0.0, fwd - t_fwd), max(0.0, bwd - t_bwd)
    return head + ex_f + ex_b + tail + sm_share * ((fwd - ex_f) + (bwd - ex_b))
