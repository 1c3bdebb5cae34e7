"""Memory and step-time terms of the checkpointing modes beyond none / full.

What the runtime does (`modelpar.parallel.checkpointing`):

- ``"every-k"``: blocks 0, k, 2k, ... of the model (a transformer's layers; the embedding and the
  head are never checkpointed) keep only their input and recompute their forward in backward; the
  other blocks keep their saved activations. Recompute: the forward of the checkpointed blocks,
  FLOPs-weighted share of the rank's forward.
- ``"selective"``: each layer's attention core (softmax(QK^T)V with dropout, Korthikanti et al. 2022,
  Sec. 5) is recomputed; the block keeps everything else. The bytes it frees are *profiled*
  (`BlockProfile.attn_core_saved_bytes`: what the core saves beyond its inputs q, k, v). With a fused
  attention kernel (the profile's default, ``attention="flash"``; FlashAttention, Dao et al. 2022,
  Sec. 3.1) that is only its (batch, heads, seq) log-sum-exp (its output is the same storage the
  output projection saves): the (seq x seq) terms of Korthikanti's Eq. 1 (5 a s / h per element) are
  already absent, so selective checkpointing saves almost nothing there and costs the attention
  forward again. With the unfused math path
  (``attention="math"``) it frees the scores, probabilities and dropout mask as in the paper.
  Recompute: the fused attention forward of every layer (`RankLoad.ac_blocks`).

In backward, a block's own saved bytes are back while its backward runs (recomputed, or never
freed), which `loads._backward_moments` places with ``own=True``.
"""

from __future__ import annotations

import dataclasses

from modelpar.plan import SPLIT_BACKWARD_SCHEDULES, ParallelPlan
from modelpar.planner.records import BlockRecord, fast_new

_record = fast_new(BlockRecord)     # (values in field order)


def is_checkpointed(layer: int, plan: ParallelPlan) -> bool:
    """Whether the block with ``layer`` index (-1: a transformer's embedding or head) is fully
    recomputed under ``plan``."""
    mode = plan.activation_checkpointing
    if layer < 0:
        return False
    return mode == "full" or (mode == "every-k" and layer % plan.ac_every == 0)


def ac_load(ld, plan: ParallelPlan, cache=None):
    """``ld`` (a `loads.RankLoad`) as ``plan``'s checkpointing mode leaves it: ``saved_ac`` = bytes
    per sample one micro-batch keeps, and the backward moments for it; cached on ``ld`` per mode
    (``cache``: the search's `memo.PlannerCache`, for the moments). none / full: ``ld`` itself (its
    ``saved`` / ``saved_ac`` columns)."""
    mode = plan.activation_checkpointing
    if mode not in ("selective", "every-k"):
        return ld
    key = (mode, plan.ac_every if mode == "every-k" else 0)
    hit = ld.ac_variants.get(key)
    if hit is not None:
        return hit
    from modelpar.planner.loads import _backward_moments

    recs, kept_total = [], 0.0
    for rec, layer, core, _, _ in ld.ac_blocks:
        kept = kept_bytes(rec, layer, core, plan)
        recs.append(_record((rec.saved, kept, rec.peaks, rec.params, rec.is_root, rec.in_grad, rec.in_saved,
                             rec.trainable)))     # kept replaced
        kept_total += kept
    bwd, rs = _backward_moments(tuple(recs), True, cache)
    out = dataclasses.replace(ld, saved_ac=kept_total, moments=(bwd, rs), projections={},
                              ac_variants={}, key=ld.key + key, moment_src=(tuple(recs), cache, True))
    ld.ac_variants[key] = out
    return out


def kept_bytes(rec, layer: int, core: float, plan: ParallelPlan) -> float:
    """Bytes per sample one micro-batch keeps of a block (``rec``: its `records.BlockRecord`; ``layer``,
    ``core``: its `loads.RankLoad.ac_blocks` entry) under ``plan``'s checkpointing: its saved bytes
    (none), its input (full; every-k on a checkpointed block: ``rec.kept``), its saved bytes less the
    attention core's (selective)."""
    mode = plan.activation_checkpointing
    if mode == "none":
        return rec.saved
    if mode == "selective":
        return max(rec.saved - core, 0.0)
    return rec.kept if (mode == "full" or is_checkpointed(layer, plan)) else rec.saved


def chunk_kept(ld, plan: ParallelPlan) -> tuple[float, ...]:
    """Bytes per sample one micro-batch keeps in each stage (chunk) of rank load ``ld`` (`kept_bytes` of
    its blocks, `loads.RankLoad.chunks`) under ``plan``'s checkpointing: their sum is ``ld.saved`` (none) or
    ``ac_load(ld, plan).saved_ac`` (the other modes), up to rounding."""
    key = ("chunks", plan.activation_checkpointing, plan.ac_every)
    hit = ld.ac_variants.get(key)
    if hit is None:
        out, a = [], 0
        for n, _ in ld.chunks:
            out.append(sum(kept_bytes(rec, layer, core, plan) for rec, layer, core, _, _ in ld.ac_blocks[a:a + n]))
            a += n
        hit = ld.ac_variants[key] = tuple(out)
    return hit


def cast_copies(ld, plan: ParallelPlan) -> tuple[float, float]:
    """Bytes of autocast's compute-dtype weight copies on a rank training ``ld`` (a `loads.RankLoad` of
    the autocast profile) under ``plan``: (held from the loss's backward on, held besides until autocast
    exits). torch.autocast casts each parameter a matmul reads once and caches the copy until the
    outermost autocast region exits; the matmuls also save it for their backward. The runtime
    (`modelpar.parallel.compose`) runs forward and loss inside autocast and backward after it, except
    under a pipeline, whose schedule runs entirely inside it: there every copy lives through the step
    (a recompute finds it cached). Without a pipeline a recomputed block (full, every-k) saved no
    copy, so its copies are freed when autocast exits; its recompute in backward makes its own, held
    while that block's backward runs (the largest such block's, counted throughout). The copies are
    the forward matmuls' parameter bytes (`RankLoad.gemm_param_bytes`: neither the embedding tables
    nor the norms); a recomputed block's, 2 B per parameter (its few norm parameters included).
    Measured on CPU (`modelpar.measure.memory.autocast_cases`)."""
    g = ld.gemm_param_bytes[0]
    mode = plan.activation_checkpointing
    if plan.pp > 1 or mode not in ("full", "every-k"):
        return g, 0.0
    key = ("cast", mode, plan.ac_every)
    hit = ld.ac_variants.get(key)
    if hit is None:
        ck = [rec.params for rec, layer, *_ in ld.ac_blocks if is_checkpointed(layer, plan)]
        keep = min(g, g - min(g, 2 * sum(ck)) + 2 * max(ck, default=0.0))
        hit = ld.ac_variants[key] = (keep, g - keep)
    return hit


def recompute_share(ld, plan: ParallelPlan) -> tuple[float, float]:
    """(share of the rank's forward recomputed, fused-attention forward FLOPs per sample recomputed)
    under ``plan``: full and every-k: the checkpointed blocks' share of forward FLOPs (full: every
    block, never a transformer's embedding, head or loss, as `parallel.checkpointing`, Megatron-LM's
    ``recompute_granularity="full"`` and llm-foundry's block wrapping run it; 1 without block
    records); selective (0, the attention forward FLOPs); none (0, 0)."""
    mode = plan.activation_checkpointing
    key = ("share", mode, plan.ac_every)
    hit = ld.ac_variants.get(key)
    if hit is not None:
        return hit
    out = (0.0, 0.0)
    if mode == "selective":
        out = (0.0, sum(a for *_, a in ld.ac_blocks))
    elif mode in ("every-k", "full"):
        tot = sum(f for *_, f, _ in ld.ac_blocks)
        ck = sum(f for _, layer, _, f, _ in ld.ac_blocks if is_checkpointed(layer, plan))
        out = ((ck / tot if tot else float(mode == "full")), 0.0)
    ld.ac_variants[key] = out
    return out


def recompute_layers(ld, plan: ParallelPlan) -> int:
    """Transformer layers of ``ld`` (a `loads.RankLoad`) whose whole forward is replayed under
    ``plan`` (full: all, every-k: the checkpointed ones; selective replays only the attention
    cores, none nothing), for the terms priced per layer (`gpu.layer_wave_seconds`)."""
    mode = plan.activation_checkpointing
    if mode not in ("full", "every-k"):
        return 0
    key = ("layers", mode, plan.ac_every)
    hit = ld.ac_variants.get(key)
    if hit is None:
        hit = ld.ac_variants[key] = sum(1 for _, layer, *_ in ld.ac_blocks if is_checkpointed(layer, plan))
    return hit


def recompute_flops_per_sample(profile, plan: ParallelPlan, cache=None) -> float:
    """Forward FLOPs per sample recomputed in backward (for HFU, PaLM App. B): the checkpointed
    blocks' (full: every block, a transformer's embedding and head excluded; every-k), the attention
    cores' (selective), 0 (none); twice the blocks' under a split backward (zero bubble), which replays a
    checkpointed block at ``I`` and at ``W`` (`modelpar.parallel.pipeline.group_weight_pass`). ``cache``: a
    `memo.PlannerCache` of ``profile`` to memoize in (None: computed)."""
    mode = plan.activation_checkpointing
    if mode == "none":
        return 0.0
    twice = 2.0 if mode != "selective" and plan.pp > 1 and plan.pp_schedule in SPLIT_BACKWARD_SCHEDULES else 1.0
    if cache is None:
        return twice * _recompute_flops(profile, plan)
    cache.bind(profile=profile)
    key = (mode, plan.ac_every)
    val = cache.recompute_flops.get(key)
    if val is None:
        val = cache.recompute_flops[key] = _recompute_flops(profile, plan)
    return twice * val


def _recompute_flops(profile, plan: ParallelPlan) -> float:
    mode = plan.activation_checkpointing
    bs = profile.batch_size
    if mode == "selective":
        return sum(b.fwd_attn_flops for b in profile.blocks) / bs
    n = len(profile.blocks)
    transformer = bool(profile.arch) and n >= 3
    total = 0.0
    for i, b in enumerate(profile.blocks):
        layer = (-1 if i in (0, n - 1) else i - 1) if transformer else i
        if is_checkpointed(layer, plan):
            total += b.fwd_flops
    return total / bs
