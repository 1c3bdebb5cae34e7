"""What each rank of a plan holds and computes: `RankLoad` per pipeline rank, from the profile's
per-block terms (prefix sums over blocks, so a load costs O(stages)); the memory and step-time
models (`modelpar.planner.memory.rank_memory`, `modelpar.planner.cost.rank_step`) read them.

Split out of `memory.py` unchanged (the same numbers; the planner's outputs compared to 1e-12 with
`benchmarks/planner_dump.py`).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import NamedTuple

from modelpar.plan import ParallelPlan
from modelpar.planner.memo import PlannerCache
from modelpar.planner.moments import _backward_moments, _scaled_peaks  # noqa: F401  (re-exported)
from modelpar.planner.profile import ModelProfile, tied_copies
from modelpar.planner.profile_ops import SDPA_LAYOUT
from modelpar.planner.records import BlockRecord, BlockTerms, stage_terms
from modelpar.stage_split import V_SCHEDULES, split_blocks, stage_rank


def stage_ranges(profile: ModelProfile, num_stages: int) -> list[tuple[int, int]]:
    """Block index ranges ``[start, end)`` of each pipeline stage: `modelpar.stage_split.split_blocks`,
    the rule the runtime's default split follows too (`modelpar.parallel.pipeline.planned_ranges`).

    Transformers (``profile.arch`` set, blocks ``embed, blocks.*, head``): the layers are split as
    evenly as possible, embed joins the first stage and head the last (Megatron-LM's layout). Other
    models: the split minimising the largest stage's forward + backward FLOPs per sample; a profile
    whose first and last blocks are the ``embed`` / ``head`` rest of the model (`profile.default_blocks`
    of a model with found blocks, e.g. a ResNet) keeps them on the first / last stage.

    Raises:
        ValueError: more stages than splittable blocks.
    """
    bs = max(profile.batch_size, 1)
    costs = tuple(max((b.fwd_flops + b.bwd_flops) / bs, 1.0) for b in profile.blocks)
    return list(_split(costs, num_stages, _has_ends(profile), bool(profile.arch)))


def _has_ends(profile: ModelProfile) -> bool:
    """The profile's first and last blocks are the input / output parts (not runtime blocks)."""
    names = [b.name for b in profile.blocks]
    return len(names) >= 3 and (bool(profile.arch) or (names[0] == "embed" and names[-1] == "head"))


def plan_stage_ranges(profile: ModelProfile, plan: ParallelPlan) -> list[tuple[int, int]]:
    """The stage ranges of ``plan`` over ``profile.blocks``: its ``stage_boundaries`` where given (in
    the runtime's block indices, as `parallelize` reads them: the profile's input part is not a
    block), else the planner's split (`stage_ranges`); one stage: every block.

    Raises:
        ValueError: boundaries that are not strictly increasing inside the blocks, or more stages
            than blocks.
    """
    n = len(profile.blocks)
    if plan.num_stages <= 1:
        return [(0, n)]
    if not plan.stage_boundaries:
        return stage_ranges(profile, plan.num_stages)
    off = 1 if _has_ends(profile) else 0
    blocks = n - 2 * off
    b = tuple(plan.stage_boundaries)
    if len(b) != plan.num_stages - 1 or any(x >= y for x, y in zip((0,) + b, b + (blocks,))):
        raise ValueError(f"stage_boundaries={b} must be {plan.num_stages - 1} strictly increasing block indices "
                         f"in 1..{blocks - 1} (the model has {blocks} blocks)")
    cuts = [0] + [x + off for x in b] + [n]
    return [(cuts[k], cuts[k + 1]) for k in range(plan.num_stages)]


@functools.lru_cache(maxsize=4096)
def _split(costs: tuple, num_stages: int, ends: bool, even: bool) -> tuple:
    return tuple(split_blocks(costs, num_stages, ends=ends, even=even))


@dataclass
class RankLoad:
    """What one pipeline rank holds, per sample where it scales with the batch (all / tp applied
    by the callers). Units: parameters, bytes, FLOPs, ops."""

    params: float = 0.0            # parameters of the rank's stages
    root_params: float = 0.0       # parameters outside the transformer blocks (embed/head): FSDP root
    max_unit_params: float = 0.0   # largest FSDP unit (one block)
    # the parameters that require gradients (`profile.BlockProfile.frozen`): the ones with a gradient,
    # optimizer state and a data-parallel reduction; frozen ones are still held and FSDP-gathered.
    # Equal to the fields above where nothing is frozen (the same floats)
    trainable: float = 0.0         # of ``params``
    root_trainable: float = 0.0    # of ``root_params``
    max_unit_trainable: float = 0.0    # the most of one FSDP unit
    trainable_numels: tuple = ()   # ``numels`` of the trainable tensors (the optimizer's, in order)
    trainable_sizes: tuple = ()    # ``param_sizes`` of the trainable tensors (gradients, DDP's buckets)
    unit_trainable: tuple = ()     # per FSDP unit (``unit_sizes``' order): its trainable elements
    autocast: bool = False         # from the profile's autocast variant (`rank_loads`' ``autocast``)
    saved: float = 0.0             # saved bytes per sample, TP-split applied (a stage's input excluded)
    saved_ac: float = 0.0          # with full checkpointing: block inputs kept per sample (same)
    boundary: float = 0.0          # stage output bytes per sample (p2p send/recv buffers)
    recv: float = 0.0              # bytes per sample received per micro-batch: stage inputs (non-first
                                   # stages) + output gradients (non-last stages), over the rank's stages
    fwd_flops: float = 0.0
    bwd_flops: float = 0.0
    fwd_mem: float = 0.0
    bwd_mem: float = 0.0
    ops: float = 0.0               # fwd+bwd ops per micro-batch (not per sample)
    fwd_ops: float = 0.0
    calls: float = 0.0             # fwd+bwd aten calls per micro-batch, views and matmuls included
    fwd_calls: float = 0.0
    tp_collectives: int = 0        # TP all-reduces in one forward of the rank's blocks
    is_last: bool = False          # holds the model's last block (logits and loss)
    loss_parallel: bool = False    # the last stage's loss runs on vocab-sharded logits (TP)
    num_tensors: int = 0           # parameter tensors (optimizer kernels are launched per tensor on CPU)
    opt_temp: float = -1.0         # elements of the single-tensor AdamW step transient (`_adamw_temp`);
                                   # computed on first use (-1: not yet), from numels
    numels: tuple = ()             # (elements, decayed) per parameter tensor, TP applied
    data: float = 0.0              # bytes per global-batch sample of inputs + targets (held by every rank)
    fwd_gemms: int = 0             # matmul-class calls per micro-batch (forward, backward)
    bwd_gemms: int = 0
    gemm_param_bytes: tuple = (0.0, 0.0)   # (fwd, bwd) bytes of parameters the matmuls touch, per micro-batch
    gemm_act_bytes: tuple = (0.0, 0.0)     # (fwd, bwd) other matmul bytes, per sample
    # 2-D products by shape, per sample: ((pass, layout, M, K, N, batch dim), calls) with the batch
    # dim per sample (`BlockProfile.gemm_shapes`, summed over the rank's blocks); under TP only the
    # causal attention calls (layout ``"SDPA"``: (B x H / t, S, D)): the shards' matmul shapes are
    # not profiled, and the FLOPs-only curve prices every matmul
    gemm_shapes: tuple = ()
    # the backward of one micro-batch here as candidate peak moments (`_backward_moments`, read as `bwd_moments` /
    # `rs_moments`, computed on first read from ``moment_src``: block records, cache): in each block's backward and
    # (FSDP) at each unit's reduce-scatter, that `rank_memory` weighs with the plan's batch, sharding and schedule
    moments: tuple | None = field(default=None, repr=False, compare=False)
    moment_src: tuple = field(default=((), None), repr=False, compare=False)
    out: float = 0.0               # last stage: the model output (logits) bytes per sample
    # `memory._projections` per `records.ProjMode`; a V schedule's chunk k: its moments under ("chunk", k),
    # its projections under (k, mode) (`chunk_moments`, `memory.MemoryForm._chunk_proj`)
    projections: dict = field(default_factory=dict, repr=False, compare=False)
    # elements of each parameter tensor (TP applied) and of each FSDP unit (sum of its tensors, TP
    # applied, unsharded), for the step-time model's fresh-allocation term (CPU allocators hand tensors
    # above the mmap threshold new pages on every allocation; see cost.fresh_bytes)
    param_sizes: tuple = ()
    unit_sizes: tuple = ()
    attn_flops: tuple = (0.0, 0.0)     # (fwd, bwd) FLOPs per sample of fused attention kernels, TP applied
    attn_calls: int = 0                # fused attention calls per forward (as many in backward)
    tp_linears: int = 0                # weight matrices a TP split shards (DTensor Linears per forward)
    # per block of the rank, in order, for the checkpointing modes other than none / full
    # (`modelpar.planner.recompute`): (block's backward record, layer index among the checkpointable
    # blocks or -1 for a transformer's embed / head, attention-core saved bytes per sample, forward
    # FLOPs per sample, fused-attention forward FLOPs per sample), TP applied
    ac_blocks: tuple = ()
    ac_variants: dict = field(default_factory=dict, repr=False, compare=False)
    # per stage of the rank, in stage order (its chunks): (blocks of it in ``ac_blocks``, its output bytes per
    # sample, 0 for the model's last stage); the V schedules' memory prices each chunk's in-flight micro-batches
    chunks: tuple = ()
    # per chunk as ``chunks``: (bytes per sample a split backward keeps from the chunk's ``I`` to its ``W``
    # (`profile.BlockProfile.wgrad_bytes`, summed), bytes per sample of the chunk's input gradient, which a
    # backward sends to the previous stage (0 for the model's first stage)), TP applied
    chunk_io: tuple = ()
    wgrad: float = 0.0                 # `BlockProfile.wgrad_bytes` per sample, TP applied, over the rank
    # bytes per sample of the largest pipeline transfer of the rank: a stage's output (sent forward)
    # or its input (whose gradient is sent back); hidden states, never the logits (0: no pipeline)
    p2p: float = 0.0
    attn_shape: tuple | None = None    # (seq, head dim, causal) of a transformer's attention, for GPU tables
    # (tokens per sample, d_model, ffn, transformer layers of the rank) for the GPU GEMMs' wave
    # quantization (`gpu.layer_wave_seconds`); () for profiles without a transformer arch
    layer_gemm: tuple = ()
    # what this load is within its profile (`rank_loads`: TP degree, sequence parallel, stages, pp,
    # activation scale, pipeline rank; `recompute.ac_load` appends its mode): the memo tables'
    # (`memo.PlannerCache`) key for it
    key: tuple = field(default=(), compare=False)

    @property
    def bwd_moments(self) -> tuple:         # `_backward_moments`' `records.BwdMoment`s of the rank
        return (self.moments or self._moments())[0]

    @property
    def rs_moments(self) -> tuple:          # and its `records.ReduceMoment`s
        return (self.moments or self._moments())[1]

    def _moments(self) -> tuple:            # (only the plans whose memory is estimated read them)
        recs, cache = self.moment_src[:2]
        self.moments = _backward_moments(recs, False, cache) if recs else ((), ())
        return self.moments

    def chunk_moments(self, k: int) -> tuple:
        """`_backward_moments` of the blocks of the rank's ``k``-th stage alone (`chunks`): one micro-batch's
        backward through that chunk (the V schedules backpropagate one chunk at a time). Memoized in
        ``projections`` under ("chunk", k) (`recompute.ac_load`'s variants have their own dict)."""
        hit = self.projections.get(("chunk", k))
        if hit is None:
            recs, cache, *own = self.moment_src
            a = sum(n for n, _ in self.chunks[:k])
            hit = self.projections[("chunk", k)] = _backward_moments(tuple(recs[a:a + self.chunks[k][0]]),
                                                                     bool(own and own[0]), cache)
        return hit


def _adamw_temp(numels: list[tuple[float, bool]]) -> float:
    """Largest transient of torch's single-tensor AdamW step, in elements: for each parameter j it
    builds ``denom = exp_avg_sq.sqrt() / c`` (two temporaries of p_j's size) while the previous
    parameter's ``denom`` is still referenced, so max_j (s_{j-1} + 2 s_j) over the optimizer's order
    (modelpar's `build_optimizer`: matrices first, then vectors)."""
    order = [n for n, mat in numels if mat] + [n for n, mat in numels if not mat]
    best, prev = 0.0, 0.0
    for n in order:
        best = max(best, prev + 2 * n)
        prev = n
    return best


# additive per-block fields of a `RankLoad`, in this order (summed over a stage by prefix sums)
_SUMS = ("params", "root_params", "saved", "saved_ac", "fwd_flops", "bwd_flops", "fwd_mem", "bwd_mem",
         "ops", "fwd_ops", "fwd_gemms", "bwd_gemms", "attn_f", "attn_b", "attn_calls", "tp_linears",
         "gp_f", "gp_b", "ga_f", "ga_b", "tp_collectives", "calls", "fwd_calls", "trainable", "root_trainable",
         "wgrad")
# those that are `RankLoad` fields of the same name; the rest are (forward, backward) pairs
_LOAD_SUMS = tuple(k for k in _SUMS if k not in ("attn_f", "attn_b", "gp_f", "gp_b", "ga_f", "ga_b"))
_PARAMS, _ROOT, _SAVED, _SAVED_AC, _TRAIN, _ROOT_TRAIN, _WGRAD = (_SUMS.index(k) for k in (
    "params", "root_params", "saved", "saved_ac", "trainable", "root_trainable", "wgrad"))


class _BlockArgs(NamedTuple):
    """What `_block_terms`' ``record`` reads of one block (per sample, TP applied)."""

    block: object       # the `profile.BlockProfile`
    saved: float        # saved bytes
    saved_first: float  # saved bytes as its stage's first block (its input not counted)
    ac_in: float        # input bytes (what full checkpointing keeps)
    params: float       # local parameters
    is_end: bool        # a transformer's embed / head
    ex_mul: float       # scale of the profiled backward temporaries
    g_div: float        # scale of the gradient bytes
    shr: float          # local share of the block's parameters
    trainable: float    # local parameters that require gradients


def _block_shapes(bl, t: int, bs: int) -> tuple:
    """A block's (`RankLoad.gemm_shapes` key, calls) per sample (`records.GemmShape`): matmul shapes
    without TP only; attention's (B x H, S, D) under TP too, H / t per rank."""
    out = []
    for g in bl.gemm_shapes:
        if t == 1 or g.layout == SDPA_LAYOUT:
            dims = [g.m, g.k, g.n]
            dims[g.batch_dim] /= bs * (t if g.layout == SDPA_LAYOUT else 1)
            out.append(((g.phase, g.layout, *dims, g.batch_dim), g.calls))
    return tuple(out)


def _tp_part(flops: float, whole: float, bs: int, t: int) -> float:
    """Per sample, one TP rank's FLOPs of ``flops`` (the profiled batch ``bs``), of which the share
    ``whole`` stays whole on every rank (`BlockProfile.tp_whole_flops`) and the rest splits ``t`` ways."""
    return flops / bs / t if not whole else flops / bs * ((1 - whole) / t + whole)


def _trainable_local(bl, t: int) -> float:
    """One TP rank's elements of block ``bl``'s trainable parameters (`profile.BlockProfile.frozen`),
    at TP degree ``t``: the TP-sharded ones divided by ``t``, as the block's ``local`` parameters."""
    tr = [(k, sh) for (k, _, sh), f in zip(bl.param_numels, bl.frozen) if not f]
    sharded = sum(k for k, sh in tr if sh)
    return sum(k for k, _ in tr) - sharded + sharded / t


def _block_terms(profile: ModelProfile, t: int, sp: bool, scale: float, cache: PlannerCache) -> BlockTerms:
    """Per-block contributions to a `RankLoad` for TP degree ``t`` (memoized in ``cache``, which
    serves one profile, per degree, sequence parallel and activation scale: the search builds ~200
    layouts from a few of these); fields in `records.BlockTerms`."""
    key = (t, sp, scale, profile is not cache.profile)     # the base profile or its autocast one
    hit = cache.block_terms.get(key)
    if hit is not None:
        return hit
    bs = profile.batch_size
    n = len(profile.blocks)
    transformer = bool(profile.arch)
    pre = [(0,) * len(_SUMS)]
    first_adj, unit_params, numels, rec_args, gemms, unit_tr, tr_numels = [], [], [], [], [], [], []
    ac_info = []        # per block: (layer index or -1, core saved bytes, fwd FLOPs, attention fwd FLOPs)
    for i, bl in enumerate(profile.blocks):
        is_end = transformer and (i == 0 or i == n - 1)
        local = bl.num_params - bl.tp_sharded_params + bl.tp_sharded_params / t
        rep = bl.saved_bytes - bl.saved_tp_sharded_bytes
        # sequence parallel: every saved byte on sequence or head shards (Korthikanti et al. 2022,
        # Eq. 3, which re-gathers the projections' inputs in backward) but the gathered inputs the
        # runtime keeps whole (`BlockProfile.saved_gathered_bytes`; 0 for Megatron-LM's runtime)
        g = bl.saved_gathered_bytes
        saved = ((bl.saved_bytes - g) / t + g) if sp else (rep + bl.saved_tp_sharded_bytes / t)
        ac_in = bl.input_bytes / (t if sp else 1)
        # a stage's first block saves (or, checkpointed, keeps) its input, which is the batch (first
        # stage: a view of the global batch every rank holds, `RankLoad.data`) or the pipeline's
        # receive buffer (counted with the buffers), not a new storage
        saved_first = saved - bl.saved_input_bytes / (t if sp else 1)
        first_adj.append(((saved_first - saved) * scale / bs, -ac_in * scale / bs))
        unit_params.append(None if is_end else local)
        numels.append([(k / t if sh else k, mat) for k, mat, sh in bl.param_numels])
        # frozen parameters (`BlockProfile.frozen`): no gradient, no optimizer state, no reduction
        tr_numels.append(numels[-1] if not bl.frozen else [x for x, f in zip(numels[-1], bl.frozen) if not f])
        local_tr = local if not bl.frozen else _trainable_local(bl, t)
        unit_tr.append(None if is_end else local_tr)
        gemms.append(_block_shapes(bl, t, bs))
        wf, wa = (w / x if x else 0.0 for w, x in zip(bl.tp_whole_flops, (bl.fwd_flops, bl.fwd_attn_flops)))
        ac_info.append((-1 if is_end else (i - 1 if transformer else i), bl.attn_core_saved_bytes / t * scale / bs,
                        _tp_part(bl.fwd_flops, wf, bs, t), _tp_part(bl.fwd_attn_flops, wa, bs, t)))
        frac = bl.saved_tp_sharded_bytes / bl.saved_bytes if bl.saved_bytes else 0.0
        tp_div = 1.0 / t if sp else (1 - frac) + frac / t   # share of traffic left per rank
        shr = local / bl.num_params if bl.num_params else 1.0
        g_div = (1.0 / t if sp else 1.0) * scale / bs
        rec_args.append(_BlockArgs(block=bl, saved=saved * scale / bs, saved_first=saved_first * scale / bs,
                                   ac_in=ac_in * scale / bs, params=local, is_end=is_end, ex_mul=scale / bs * tp_div,
                                   g_div=g_div, shr=shr, trainable=local_tr))
        # in the order of `_SUMS`
        row = (local, local if is_end else 0.0, saved * scale / bs, ac_in * scale / bs,
               _tp_part(bl.fwd_flops, wf, bs, t), _tp_part(bl.bwd_flops, wf, bs, t),
               bl.fwd_mem_bytes * scale / bs * tp_div, bl.bwd_mem_bytes * scale / bs * tp_div,
               bl.fwd_ops + bl.bwd_ops, bl.fwd_ops, bl.fwd_gemms, bl.bwd_gemms,
               _tp_part(bl.fwd_attn_flops, wa, bs, t), _tp_part(bl.bwd_attn_flops, wa, bs, t), bl.attn_calls,
               sum(1 for _, mat, sh in bl.param_numels if mat and sh) if t > 1 else 0,
               bl.fwd_gemm_param_bytes * scale * shr, bl.bwd_gemm_param_bytes * scale * shr,
               bl.fwd_gemm_act_bytes * scale / bs * tp_div, bl.bwd_gemm_act_bytes * scale / bs * tp_div,
               (bl.tp_rowwise if bl.tp_rowwise >= 0 and transformer and not is_end
                else 2 if (transformer and not is_end) else 1) if t > 1 else 0,
               bl.fwd_calls + bl.bwd_calls, bl.fwd_calls, local_tr, local_tr if is_end else 0.0,
               # the colwise outputs split; the rest kept whole, also under SP (a rowwise matmul's output is
               # its full-length partial sum before the reduce-scatter; the norms' seq shards: counted whole)
               (bl.wgrad_bytes - bl.wgrad_tp_sharded_bytes * (1 - 1 / t)) * scale / bs)
        pre.append(tuple(a + b for a, b in zip(pre[-1], row)))

    @functools.lru_cache(maxsize=None)
    def rec(i: int, first: bool, last: bool) -> BlockRecord:
        """Block i's backward record (see `_backward_moments`) at its place in a stage."""
        a = rec_args[i]
        bl, g_div = a.block, a.g_div
        # the block's backward peaks (profile): its extra temporaries shard like its saved bytes,
        # its gradients like its parameters; the gradient arriving from the block after it is
        # what that block received as input (replicated unless sequence parallel); at a stage's
        # last block that gradient sits in the pipeline's receive buffer (counted there), at the
        # model's last block it is the loss's gradient of the logits (the profile's backward
        # starts from a sum, which makes none)
        peaks = _scaled_peaks(bl.bwd_peaks or ((0, bl.output_bytes, 0, 0),),
                              bl.output_bytes if i == n - 1 else (0.0 if last else None), a.ex_mul, g_div, a.shr,
                              cache)
        return BlockRecord(saved=a.saved_first if first else a.saved, kept=0.0 if first else a.ac_in, peaks=peaks,
                           params=a.params, is_root=a.is_end, in_grad=bl.input_bytes * g_div if i > 0 else 0.0,
                           in_saved=0.0 if first else a.saved - a.saved_first, trainable=a.trainable)

    out = BlockTerms(prefix=pre, first_adj=first_adj, unit_params=unit_params, numels=numels, record=rec,
                     ac_info=ac_info, stages={}, shapes=gemms, unit_trainable=unit_tr, trainable_numels=tr_numels,
                     all_trainable=not any(any(bl.frozen) or any(bl.tied_frozen) for bl in profile.blocks))
    cache.block_terms[key] = out
    return out


def rank_loads(profile: ModelProfile, plan: ParallelPlan, *, act_bytes: float,
               cache: PlannerCache | None = None, autocast: bool = False) -> list[RankLoad]:
    """One `RankLoad` per pipeline rank (``plan.pp`` of them), tensor parallel applied.

    ``act_bytes``: element size the activations will have (2 bf16, 4 fp32), relative to the profile's.
    ``autocast``: the runtime trains under torch.autocast with fp32 parameters (`modelpar.plan.autocasts`):
    the activations, traffic and backward moments come from ``profile.autocast`` where it was profiled.
    A stage's sums come from per-block prefix sums (`_block_terms`), so a load costs O(stages), not
    O(blocks), once the blocks' terms for the TP degree are known. ``cache``: the search's memo
    tables (`memo.PlannerCache`, serving ``profile``); None: a fresh one.

    Raises:
        ValueError: more stages than blocks; a ``cache`` of another profile.
    """
    cache = (cache or PlannerCache()).bind(profile=profile)
    base, profile = profile, (profile.autocast if autocast and profile.autocast is not None else profile)
    scale = act_bytes / (2 if profile.dtype == "bf16" else 4)
    t = plan.tp
    sp = plan.sequence_parallel
    bs = profile.batch_size
    rng = plan_stage_ranges(profile, plan)
    terms = _block_terms(profile, t, sp, scale, cache)
    all_train = terms.all_trainable
    first_adj = terms.first_adj
    bkey = (tuple(plan.stage_boundaries),) if plan.stage_boundaries and plan.num_stages > 1 else ()
    variant = (True,) if profile is not base else ()
    vkey = ("v",) if plan.pp > 1 and plan.pp_schedule in V_SCHEDULES else ()     # V placement: other loads
    loads = [RankLoad(key=(t, sp, plan.num_stages, plan.pp, scale, r) + bkey + variant + vkey, autocast=bool(variant))
             for r in range(plan.pp)]
    sums = [[0] * len(_SUMS) for _ in range(plan.pp)]
    numels: list[list[tuple[float, bool]]] = [[] for _ in range(plan.pp)]
    units: list[list[float]] = [[] for _ in range(plan.pp)]       # FSDP units' parameters, in order
    sizes: list[list[float]] = [[] for _ in range(plan.pp)]       # each tensor's elements (numels' first)
    tr_numels: list[list[tuple[float, bool]]] = [[] for _ in range(plan.pp)]    # the trainable ones'
    tr_units: list[list[float]] = [[] for _ in range(plan.pp)]
    tr_sizes: list[list[float]] = [[] for _ in range(plan.pp)]
    recs: list[list[tuple]] = [[] for _ in range(plan.pp)]
    acb: list[list[tuple]] = [[] for _ in range(plan.pp)]
    shapes: list[dict] = [{} for _ in range(plan.pp)]
    first_in = profile.blocks[0].input_bytes / bs
    data = first_in * (2 if profile.tokens_per_sample > 1 else 1) + (0 if profile.tokens_per_sample > 1 else 8)
    chunks: list[list[tuple]] = [[] for _ in range(plan.pp)]
    io: list[list[tuple]] = [[] for _ in range(plan.pp)]
    for s, (a, b) in enumerate(rng):
        # round-robin, or rank r holds stages r and 2 pp - 1 - r under a V schedule (as the runtime)
        r = stage_rank(s, plan.pp, plan.pp_schedule) if plan.pp > 1 else 0
        ld = loads[r]
        st = terms.stages.get((a, b)) or stage_terms(terms, a, b)
        sums[r] = acc = [x + d for x, d in zip(sums[r], st.diff)]     # the same floats as summing in place
        acc[_SAVED] += first_adj[a][0]
        acc[_SAVED_AC] += first_adj[a][1]
        ld.max_unit_params = max(ld.max_unit_params, st.max_unit)
        ld.max_unit_trainable = max(ld.max_unit_trainable, st.max_unit_trainable)
        numels[r].extend(st.numels)
        sizes[r].extend(st.sizes)
        units[r].extend(st.units)
        if not all_train:
            tr_numels[r].extend(st.trainable_numels)
            tr_sizes[r].extend(st.trainable_sizes)
            tr_units[r].extend(st.unit_trainable)
        recs[r].extend(st.records)
        acb[r].extend(st.ac_blocks)
        sh = shapes[r]
        for key, calls in st.shapes.items():
            sh[key] = sh.get(key, 0) + calls
        ld.boundary = profile.blocks[b - 1].output_bytes * scale / bs / (t if sp else 1)
        chunks[r].append((len(st.ac_blocks), ld.boundary if s < len(rng) - 1 else 0.0))
        io[r].append((st.diff[_WGRAD], profile.blocks[a].input_bytes * scale / bs / (t if sp else 1) if s else 0.0))
        if s > 0:
            ld.recv += profile.blocks[a].input_bytes * scale / bs / (t if sp else 1)
            ld.p2p = max(ld.p2p, profile.blocks[a].input_bytes * scale / bs / (t if sp else 1))
        if s < len(rng) - 1:
            ld.recv += ld.boundary
            ld.p2p = max(ld.p2p, ld.boundary)
        ld.data = data
    for r, extra in enumerate(tied_copies(profile, rng, plan.pp, t, plan.pp_schedule)):    # a tie's copy on a later stage
        for k, mat, end, trainable in extra:
            sums[r][_PARAMS] += k
            sums[r][_ROOT] += k if end else 0.0
            numels[r].append((k, mat))
            sizes[r].append(k)
            if trainable:           # every tie where `all_train` (the lists below are then shared)
                sums[r][_TRAIN] += k
                sums[r][_ROOT_TRAIN] += k if end else 0.0
                if not all_train:
                    tr_numels[r].append((k, mat))
                    tr_sizes[r].append(k)
    for ld, acc in zip(loads, sums):
        tot = dict(zip(_SUMS, acc))
        for k in _LOAD_SUMS:
            setattr(ld, k, tot[k])
        ld.attn_flops = (tot["attn_f"], tot["attn_b"])
        ld.gemm_param_bytes = (tot["gp_f"], tot["gp_b"])
        ld.gemm_act_bytes = (tot["ga_f"], tot["ga_b"])
    for ld, rc, ab, sh in zip(loads, recs, acb, shapes):
        ld.gemm_shapes = tuple(sorted(sh.items()))
        ld.moment_src = (tuple(rc), cache)          # `RankLoad.bwd_moments` computes them when first read
        ld.ac_blocks = tuple(ab)
    for ld, ch, c_io in zip(loads, chunks, io):
        ld.chunks, ld.chunk_io = tuple(ch), tuple(c_io)
    for ld, nl, un, sz, tn, tu, ts in zip(loads, numels, units, sizes, tr_numels, tr_units, tr_sizes):
        ld.numels, ld.num_tensors, ld.unit_sizes, ld.param_sizes = tuple(nl), len(nl), tuple(un), tuple(sz)
        if all_train:                # nothing frozen: the same tuples (the same values)
            ld.trainable_numels, ld.unit_trainable, ld.trainable_sizes = ld.numels, ld.unit_sizes, ld.param_sizes
        else:
            ld.trainable_numels, ld.unit_trainable, ld.trainable_sizes = tuple(tn), tuple(tu), tuple(ts)
    last = loads[stage_rank(len(rng) - 1, plan.pp, plan.pp_schedule) if plan.pp > 1 else 0]
    last.is_last = True
    arch = profile.arch
    if arch.get("n_head") and arch.get("seq_len"):
        for ld in loads:
            ld.attn_shape = (profile.tokens_per_sample, arch["d_model"] // arch["n_head"], True)
    if arch.get("d_model") and len(profile.blocks) >= 3:
        for ld in loads:
            ld.layer_gemm = (profile.tokens_per_sample, arch["d_model"], arch.get("ffn", 4 * arch["d_model"]),
                             sum(1 for a in ld.ac_blocks if a[1] >= 0))
    # the logits (model output) and the loss's saved copy of them (log-softmax output); replicated
    # under TP unless the head is vocab-sharded (sequence parallel turns loss parallel on; a head
    # whose projection the profile marks TP-sharded, `vocab_parallel_profile`, computes the loss
    # on sharded logits: Megatron-LM's parallel cross entropy, torch's loss_parallel)
    head_sharded = profile.blocks[-1].tp_sharded_params > 0 or bool(profile.arch.get("vocab_parallel"))
    last.out = profile.blocks[-1].output_bytes * scale / bs / (t if (sp or head_sharded) else 1)
    last.loss_parallel = t > 1 and (sp or head_sharded)
    return loads
