"""The memory model's timeline of a step (no process groups): the profiled in-backward peaks, the
candidate moments `rank_memory` weighs, and that pruning them never changes the answer."""

import dataclasses
import itertools

import torch

from modelpar.models import MLP_PRESETS, build_model
from modelpar.plan import ParallelPlan
from modelpar.planner import memory
from modelpar.planner.memory import Batch, estimate_memory, rank_loads, rank_memory
from modelpar.planner.profile import profile_model


def _profile(name: str, batch: int = 1):
    m = build_model(name, device="meta")
    x = (torch.zeros(batch, MLP_PRESETS[name][0], device="meta") if name in MLP_PRESETS
         else torch.zeros(batch, m.cfg.seq_len, dtype=torch.long, device="meta"))
    return m, profile_model(m, x)


def test_profile_backward_peaks_and_saved_inputs():
    m, p = _profile("gpt-nano")
    d, s, f = m.cfg.d_model, m.cfg.seq_len, m.cfg.ffn
    blk = p.blocks[1]
    # by increasing gradients; the first peak is the MLP interior's gradient (f wide), before any
    # weight gradient of the block is stored; the last has every gradient of the block
    grads = [gs + gq for _, _, gs, gq in blk.bwd_peaks]
    assert grads == sorted(grads) and blk.bwd_peaks[0][2] == 0
    assert blk.bwd_peaks[0][0] >= 4 * s * f and blk.bwd_peaks[-1][2] + blk.bwd_peaks[-1][3] == blk.num_params
    assert blk.bwd_peaks[0][1] == 4 * s * d                     # the gradient w.r.t. its output
    # a block's LayerNorm saves the block input; the embedding saves the token ids
    assert blk.saved_input_bytes == blk.input_bytes == 4 * s * d
    assert p.blocks[0].saved_input_bytes == p.blocks[0].input_bytes == 8 * s
    # linear in the batch (per-sample quantities), gradients not
    _, p2 = _profile("gpt-nano", 2)
    assert [(2 * e, 2 * i, g, q) for e, i, g, q in blk.bwd_peaks] == list(p2.blocks[1].bwd_peaks)
    _, mlp = _profile("mlp-small")
    first = mlp.blocks[0]
    assert first.saved_input_bytes == first.input_bytes        # the first Linear saves the batch


def _brute(ld, plan, b, **kw):
    """`rank_memory`'s total with every moment `_backward_moments` produced, none pruned by mode."""
    rm = ld.__class__(**{f.name: getattr(ld, f.name) for f in dataclasses.fields(ld) if f.name != "projections"})
    saved = memory._projections
    try:
        def all_moments(bwd, rs, mode):
            fsdp, ac, prev, rafw, work, pp, gloo = mode[:7]
            terms = [("backward", memory._bwd_terms(c, mode)) for c in bwd]
            if fsdp and not prev and not pp:
                terms += [("fsdp_reduce", memory._rs_terms(c, mode, coll)) for c in rs for coll in (False, True)]
            return tuple((t[2], t[0] + t[3] + t[4] + t[5], t[1] + t[6], (k, t)) for k, t in terms)
        memory._projections = all_moments
        return rank_memory(rm, plan, micro_batch_size=b, **kw).total
    finally:
        memory._projections = saved


def test_pruned_moments_give_the_same_peak():
    """`_projections` keeps only moments that can win for some b >= 1 and dp_shard >= 1, and
    `_backward_moments` keeps the ends of runs of identical blocks: the peak is unchanged."""
    for name in ("gpt-nano", "mlp-large"):
        _, prof = _profile(name)
        plans = [ParallelPlan(dp_shard=ds, tp=tp, pp=pp, n_microbatches=4, pp_schedule=sch,
                              activation_checkpointing=ac, precision=prec)
                 for ds, tp, pp, sch, ac, prec in itertools.product(
                     (1, 2, 8), (1, 2), (1, 2), ("1f1b", "gpipe"), ("none", "full"), ("fp32", "bf16"))
                 if not (pp == 1 and sch == "gpipe")]
        plans += [ParallelPlan(dp_shard=ds, defer_grad_sync=True, precision=prec) for ds in (2, 8)
                  for prec in ("fp32", "bf16")]
        for plan in plans:
            loads = rank_loads(prof, plan, act_bytes=2 if plan.precision == "bf16" else 4)
            for r, ld in enumerate(loads):
                for b, acc, gloo in ((1, 1, True), (3, 1, False), (64, 2, True), (1024, 1, False)):
                    kw = dict(optimizer="adamw", overhead_bytes=0.0, pp_rank=r, accumulation=acc,
                              global_batch_size=8, gloo=gloo)
                    got = rank_memory(ld, plan, micro_batch_size=b, **kw).total
                    assert abs(got - _brute(ld, plan, b, **kw)) <= 1e-9 * got, (name, plan.describe(), r, b)


def test_identical_block_runs_keep_only_their_ends():
    """Along a run of identical blocks every term changes by the same step, so only the run's ends
    can be largest: breaking the run (blocks made distinct by a negligible amount) keeps every
    block's moments and gives the same peak."""
    _, prof = _profile("gpt-10m")                   # 6 identical blocks: the middle 2 are dropped
    blocks = list(prof.blocks)
    for i in range(1, len(blocks) - 1):
        blocks[i] = dataclasses.replace(blocks[i], saved_bytes=blocks[i].saved_bytes + i)
    distinct = dataclasses.replace(prof, blocks=tuple(blocks))
    for plan in (ParallelPlan(), ParallelPlan(dp_shard=2), ParallelPlan(pp=2, n_microbatches=4)):
        for b in (1, 4, 64):
            batch = Batch(b * plan.dp * (4 if plan.pp > 1 else 1), b * (4 if plan.pp > 1 else 1))
            a = estimate_memory(prof, plan, batch, gloo=True)
            c = estimate_memory(distinct, plan, batch, gloo=True)
            assert abs(a.total - c.total) <= 64 * b * len(blocks)      # the perturbation itself
    assert len(rank_loads(distinct, ParallelPlan(), act_bytes=4)[0].bwd_moments) > \
        len(rank_loads(prof, ParallelPlan(), act_bytes=4)[0].bwd_moments)


def test_pipeline_last_stage_keeps_its_outputs():
    """torch.distributed.pipelining's last stage keeps every micro-batch's output until the next
    step (and merges them when the schedule ends); Megatron-LM's runtime drops them."""
    _, prof = _profile("gpt-nano")
    out = prof.blocks[-1].output_bytes
    est = {}
    for m in (2, 8):
        plan = ParallelPlan(pp=2, n_microbatches=m, pp_schedule="1f1b")
        ld = rank_loads(prof, plan, act_bytes=4)[1]
        kw = dict(micro_batch_size=4, optimizer="adamw", overhead_bytes=0.0, pp_rank=1, global_batch_size=4 * m)
        est[m] = (rank_memory(ld, plan, **kw), rank_memory(ld, plan, recv_per_microbatch=False, **kw))
    # with the runtime's receive buffers (one per micro-batch) and outputs: 6 more of each
    kept, megatron = est[8][0].total - est[2][0].total, est[8][1].total - est[2][1].total
    assert kept - megatron >= 6 * 4 * out


def test_fsdp_moments_follow_fsdp2():
    _, prof = _profile("gpt-nano")
    plan = ParallelPlan(dp_shard=2)
    root = (prof.blocks[0].num_params + prof.blocks[-1].num_params) * 4
    # activations dominate: the loss's backward, before the root's pre-backward gathers any unit
    big = estimate_memory(prof, plan, Batch(64, 32))
    assert big.phase == "loss" and big.fsdp_gathered == root and big.grads == 0
    # mlp-large (one 50M-parameter unit first): its reduce-scatter on gloo holds the reduce-scatter
    # input, gloo's copy of it and the output (the new sharded gradient)
    _, mlp = _profile("mlp-large")
    u = mlp.blocks[0].num_params
    gl = estimate_memory(mlp, plan, Batch(8, 4), gloo=True)
    nccl = estimate_memory(mlp, plan, Batch(8, 4), gloo=False)
    assert gl.phase == "fsdp_reduce" and gl.comm_buffers == 4 * u + 4 * u + 4 * u / 2
    assert gl.params == 4 * sum(b.num_params for b in mlp.blocks) / 2 and gl.fsdp_gathered == 0   # resharded
    assert nccl.total < gl.total


def test_fsdp_accumulation_keeps_gradients_sharded():
    """Issue 14: under gradient accumulation FSDP reduce-scatters every local batch, so the gradients
    held between local batches are the shards (4 B/param / dp_shard); ``defer_grad_sync`` holds the
    unsharded fp32 gradients (4 B/param) instead."""
    _, prof = _profile("gpt-10m")
    P = prof.num_params
    one = estimate_memory(prof, ParallelPlan(dp_shard=8), Batch(8, 1))
    four = estimate_memory(prof, ParallelPlan(dp_shard=8), Batch(32, 1))
    defer = estimate_memory(prof, ParallelPlan(dp_shard=8, defer_grad_sync=True), Batch(32, 1))
    # at most the shards (the single step's backward peak comes before most of its gradients exist)
    assert 0 <= four.total - one.total <= 1.1 * 4 * P / 8
    assert defer.total - four.total >= 0.9 * 4 * P * (1 - 1 / 8)
    assert four.grads <= 4 * P / 8 + 1 and defer.grads >= 4 * P
    # without accumulation the option changes nothing
    assert estimate_memory(prof, ParallelPlan(dp_shard=8, defer_grad_sync=True), Batch(8, 1)).total == one.total


def test_ddp_gradients_are_bucket_views():
    """Issue 14: DDP's buckets are its gradients (gradient_as_bucket_view=True): the 4 B/param of the
    buckets are counted once, as buffers, from the start of the step, and no gradient storage
    beyond them."""
    _, prof = _profile("mlp-large")
    P = prof.num_params
    e = estimate_memory(prof, ParallelPlan(dp_replicate=2), Batch(8, 4))
    assert e.grads == 0 and e.comm_buffers == 4 * P
    assert e.total <= 4 * P + 4 * P + 8 * P + e.activations + 1     # params + buckets + adamw + the rest


def test_replicate_under_tp_or_pp_has_no_ddp_buckets():
    """Issue 13/14: with TP or PP, `parallelize` runs dp_replicate through FSDP2's replicate, which
    has no DDP buckets: beside the fp32 gradients only one group's flat fp32 reduce buffer (the
    largest block or the root) exists. Plain DDP keeps its bucket views; a runtime described with
    torch DDP's bucket copy (Megatron rows) keeps its 4 B/param."""
    _, prof = _profile("gpt-nano")
    for plan in (ParallelPlan(dp_replicate=2, tp=2), ParallelPlan(dp_replicate=2, pp=2, n_microbatches=2)):
        lds = rank_loads(prof, plan, act_bytes=4)
        e = estimate_memory(prof, plan, Batch(8, 4 if plan.pp > 1 else 2))
        ld = lds[e.pp_rank]
        recv = e.comm_buffers - 4 * max(ld.max_unit_params, ld.root_params)
        assert 0 <= recv < 4 * ld.params and (plan.pp > 1 or recv == 0), (plan.describe(), e)
        assert e.grads == 4 * ld.params
        copy = estimate_memory(prof, plan, Batch(8, 4 if plan.pp > 1 else 2), ddp_bucket_copy=True)
        assert copy.comm_buffers - recv == 4 * ld.params
    ddp = estimate_memory(prof, ParallelPlan(dp_replicate=2), Batch(8, 4))
    assert ddp.grads == 0 and ddp.comm_buffers == 4 * prof.num_params
