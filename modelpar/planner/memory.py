"""Per-rank peak memory of a plan, part by part.

Sources:
- Model states: Rajbhandari et al., "ZeRO" (SC'20), Sec. 3.1 and 5 (bytes per parameter; stage 3
  divides parameters, gradients and optimizer state by the sharding degree N).
- Activations: Korthikanti et al., "Reducing Activation Recomputation in Large Transformer Models"
  (2022), Sec. 4 (Eq. 1-2: per-layer bytes; TP shards the attention/MLP interior, sequence parallel the
  rest; full recompute keeps the layer input only) and Sec. 4.2.3 (pipeline: the first stage holds
  p micro-batches under 1F1B, m under GPipe, interleaving multiplies by 1 + (p - 1)/(p v)).
  The per-layer bytes themselves are *measured* by `profile_model`, not taken from Eq. 1.
- When the peak happens (`rank_memory`): the moments of a step and what the runtime holds at each,
  read from the code modelpar runs and checked against torch's MemTracker part by part
  (`benchmarks/planner_accuracy_memory.py`): autograd frees a block's saved tensors as its backward
  runs and holds a weight gradient as a temporary until AccumulateGrad stores it (the in-backward
  bytes are profiled per block, `BlockProfile.bwd_peaks`); FSDP2 (Zhao et al., "PyTorch FSDP",
  VLDB 2023, Sec. 3.3, and torch's ``_fsdp_param_group`` / ``_fsdp_collectives``) prefetches the
  next unit's all-gather into a flat buffer, retains one reduce-scatter input, reshards a unit
  before reducing its gradient; torch.distributed.pipelining keeps a receive buffer per micro-batch
  and the last stage's outputs until the next step; gloo's reduce-scatter copies its input.

Bytes per parameter, as modelpar runs them (``precision="bf16"`` keeps fp32 master weights, fp32
gradients and fp32 reductions, computing in bf16, see `ParallelPlan`):
    params 4, grads 4, optimizer 0 (sgd) / 4 (sgd_momentum) / 8 (adamw), plus a bf16 working copy of
    2 bytes: FSDP's gathered units, or autocast's weight cache without FSDP.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field, fields

from modelpar.plan import ParallelPlan
from modelpar.planner.profile import ModelProfile

OPTIMIZER_BYTES = {"sgd": 0, "sgd_momentum": 4, "adamw": 8}   # fp32 state bytes per parameter
MIB = 2 ** 20


@dataclass(frozen=True)
class Batch:
    """Batch sizes of one optimizer step (DESIGN.md "Batch terms"). Units: samples.

    ``local_batch_size`` = samples per data-parallel rank per forward/backward (split into the plan's
    ``n_microbatches`` under PP). Gradient accumulation = global / (local x dp).
    """

    global_batch_size: int
    local_batch_size: int

    def micro_batch_size(self, plan: ParallelPlan) -> int:
        m = plan.n_microbatches if plan.pp > 1 else 1
        if self.local_batch_size % m:
            raise ValueError(f"local_batch_size={self.local_batch_size} is not divisible by "
                             f"n_microbatches={m}")
        return self.local_batch_size // m

    def accumulation_steps(self, plan: ParallelPlan) -> int:
        per = self.local_batch_size * plan.dp
        if self.global_batch_size % per:
            raise ValueError(f"global_batch_size={self.global_batch_size} is not divisible by "
                             f"local_batch_size x dp = {self.local_batch_size} x {plan.dp} = {per}")
        return self.global_batch_size // per


@dataclass(slots=True)
class MemoryEstimate:
    """Peak bytes of the most loaded rank, by part, and which pipeline rank that is."""

    params: float
    grads: float
    optimizer: float
    activations: float
    fsdp_gathered: float
    comm_buffers: float
    overhead: float
    pp_rank: int = 0
    phase: str = "backward"        # when: "backward" (start), "fsdp_backward" (largest unit), "optimizer"

    @property
    def total(self) -> float:
        return (self.params + self.grads + self.optimizer + self.activations + self.fsdp_gathered
                + self.comm_buffers + self.overhead)

    def parts(self) -> dict[str, float]:
        return {f.name: getattr(self, f.name) for f in fields(self) if f.name not in ("pp_rank", "phase")}


# ---- stages ----------------------------------------------------------------------------------
def stage_ranges(profile: ModelProfile, num_stages: int) -> list[tuple[int, int]]:
    """Block index ranges ``[start, end)`` of each pipeline stage.

    Transformers (profile.arch set, blocks ``embed, blocks.*, head``): the layers are split as evenly
    as possible, embed joins the first stage and head the last (Megatron-LM's layout). Other models:
    their blocks split as evenly as possible.

    Raises:
        ValueError: more stages than splittable blocks.
    """
    n = len(profile.blocks)
    ends = bool(profile.arch) and n >= 3
    lo, hi = (1, n - 1) if ends else (0, n)
    layers = hi - lo
    if num_stages > layers:
        raise ValueError(f"{num_stages} pipeline stages but the model has only {layers} blocks")
    cuts = [lo + (k * layers) // num_stages for k in range(num_stages + 1)]
    rng = [(cuts[k], cuts[k + 1]) for k in range(num_stages)]
    if ends:
        rng[0] = (0, rng[0][1])
        rng[-1] = (rng[-1][0], n)
    return rng


@dataclass
class RankLoad:
    """What one pipeline rank holds, per sample where it scales with the batch (all / tp applied
    by the callers). Units: parameters, bytes, FLOPs, ops."""

    params: float = 0.0            # parameters of the rank's stages
    root_params: float = 0.0       # parameters outside the transformer blocks (embed/head): FSDP root
    max_unit_params: float = 0.0   # largest FSDP unit (one block)
    saved: float = 0.0             # saved bytes per sample, TP-split applied (a stage's input excluded)
    saved_ac: float = 0.0          # with full checkpointing: block inputs kept per sample (same)
    max_block_saved: float = 0.0   # recompute transient per sample (one block's saved bytes)
    logits: float = 0.0            # last-stage output bytes per sample (logits + their gradient)
    boundary: float = 0.0          # stage output bytes per sample (p2p send/recv buffers)
    recv: float = 0.0              # bytes per sample received per micro-batch: stage inputs (non-first
                                   # stages) + output gradients (non-last stages), over the rank's stages
    fwd_flops: float = 0.0
    bwd_flops: float = 0.0
    fwd_mem: float = 0.0
    bwd_mem: float = 0.0
    ops: float = 0.0               # fwd+bwd ops per micro-batch (not per sample)
    fwd_ops: float = 0.0
    tp_collectives: int = 0        # TP all-reduces in one forward of the rank's blocks
    is_last: bool = False          # holds the model's last block (logits and loss)
    max_param: float = 0.0         # largest parameter tensor (elements, TP applied)
    num_tensors: int = 0           # parameter tensors (optimizer kernels are launched per tensor on CPU)
    opt_temp: float = -1.0         # elements of the single-tensor AdamW step transient (`_adamw_temp`);
                                   # computed on first use (-1: not yet), from numels
    numels: tuple = ()             # (elements, decayed) per parameter tensor, TP applied
    data: float = 0.0              # bytes per global-batch sample of inputs + targets (held by every rank)
    fwd_gemms: int = 0             # matmul-class calls per micro-batch (forward, backward)
    bwd_gemms: int = 0
    gemm_param_bytes: tuple = (0.0, 0.0)   # (fwd, bwd) bytes of parameters the matmuls touch, per micro-batch
    gemm_act_bytes: tuple = (0.0, 0.0)     # (fwd, bwd) other matmul bytes, per sample
    # FSDP's busiest backward moment as an earlier model placed it (see `_fsdp_unit_peak`; kept for
    # callers, `rank_memory` now uses bwd_moments / rs_moments): unit i's parameters, the unit after
    # it, activations still saved per sample, parameters whose gradients are already reduce-scattered
    fsdp_unit: float = 0.0
    fsdp_next: float = 0.0
    fsdp_saved: float = 0.0
    fsdp_done: float = 0.0
    # the backward of one micro-batch on this rank, as candidate peak moments (`_backward_moments`):
    # inside each block's backward, and (FSDP) at each unit's reduce-scatter; component tuples that
    # `rank_memory` weighs with the plan's batch, sharding and schedule
    bwd_moments: tuple = ()
    rs_moments: tuple = ()
    out: float = 0.0               # last stage: the model output (logits) bytes per sample
    projections: dict = field(default_factory=dict, repr=False, compare=False)   # `_projections` cache
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
    # bytes per sample of the largest pipeline transfer of the rank: a stage's output (sent forward)
    # or its input (whose gradient is sent back); hidden states, never the logits (0: no pipeline)
    p2p: float = 0.0
    attn_shape: tuple | None = None    # (seq, head dim, causal) of a transformer's attention, for GPU tables


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


def _fsdp_unit_peak(ld: RankLoad, units: list[tuple[float, float]]) -> None:
    """Locate FSDP's busiest backward moment on a rank: while unit i runs its backward, its gathered
    parameters and unsharded gradient are live together with unit i+1's (gathered parameters,
    unsharded gradient and the reduce-scatter input), per FSDP2's backward prefetch and asynchronous
    reduce-scatter (Zhao et al. 2023, Sec. 3.3). ``units``: (parameters, saved bytes per sample) of
    each FSDP unit in forward order. The unit maximising 8 U_i + 12 U_{i+1} (fp32 bytes) is kept."""
    best = -1.0
    for i, (u, _) in enumerate(units):
        nxt = units[i + 1][0] if i + 1 < len(units) else 0.0
        if 8 * u + 12 * nxt > best:
            best = 8 * u + 12 * nxt
            ld.fsdp_unit, ld.fsdp_next = u, nxt
            ld.fsdp_saved = sum(sv for _, sv in units[:i + 1])
            ld.fsdp_done = sum(p for p, _ in units[i + 1:])


@functools.lru_cache(maxsize=4096)
def _scaled_peaks(peaks: tuple, in_grad, ex_mul: float, g_mul: float, shr: float) -> tuple:
    """`BlockProfile.bwd_peaks` per sample with TP applied (``in_grad``: incoming gradient bytes that
    replace the profiled ones, None to keep them); cached, since a model's blocks repeat."""
    return tuple((ex * ex_mul, (gi if in_grad is None else in_grad) * g_mul, gs * shr, gq * shr)
                 for ex, gi, gs, gq in peaks)


@functools.lru_cache(maxsize=4096)
def _backward_moments(recs: tuple, own: bool = False) -> tuple[tuple, tuple]:
    """Candidate peak moments of one micro-batch's backward on a rank, from its blocks in forward
    order. ``recs``: per block (saved bytes and full-checkpointing input bytes per sample; its
    in-backward peaks as (extra bytes, incoming gradient bytes per sample, parameters whose gradient
    is stored, parameters whose gradient is computed but not yet stored); parameters; is an FSDP root
    block (embed/head); gradient w.r.t. the block's input per sample).

    Backward runs the blocks in reverse. Inside block k's backward (`BlockProfile.bwd_peaks`) the
    live activations of the micro-batch are the saved bytes of blocks <= k (later blocks' were freed
    by autograd as their backward ran), the block's gradient temporaries and the gradient flowing in.
    Parameters of later blocks have their gradients; under FSDP2 (Zhao et al. 2023, Sec. 3.3;
    torch's ``FSDPParamGroup``) unit k is gathered, the unit before it is being all-gathered into a
    flat buffer by the backward prefetch, and the reduce-scatter input of the unit after it is
    retained until unit k's own reduce (``reduce_scatter_max_input_buffers=1``). At unit k's
    reduce-scatter (FSDP2 ``post_backward``: reshard, then reduce) its gathered parameters are freed
    and the unsharded gradient is copied into the reduce-scatter input.

    Returns ``(block moments, reduce moments)``; a block moment is (activations per sample, the same
    under full checkpointing, completed unit parameters, completed root parameters, parameters of
    block k with a stored gradient, unit k's parameters, the previous unit's, the next unit's, units
    up to k, parameters of block k with a gradient not yet stored); a reduce moment is (activations
    per sample, with checkpointing, completed unit parameters, completed root parameters, unit k's
    parameters, the previous unit's, units before k).

    Only moments that can be the largest are kept: in a run of identical blocks every quantity
    changes by the same step from one block to the next, so the total is linear along the run's
    interior and only its two ends (and the run's first and last blocks, whose neighbours differ)
    can be the maximum; within a block, a later peak (fewer activations, more gradients) is dropped
    when an earlier one beats it even with the heaviest gradient weight (4 bytes per element) and
    the smallest micro-batch (1 sample). `_projections` prunes further for each plan mode.

    ``own``: the second column's block record is what the block keeps (`modelpar.planner.recompute`),
    so inside block k's backward it holds blocks < k's and block k's whole saved bytes (restored by
    its recompute, or never freed); False (full checkpointing): the input of blocks <= k and block
    k's recomputed saved bytes.
    """
    nb = len(recs)
    cum, cum_ac, done_u, done_r = [0.0] * (nb + 1), [0.0] * (nb + 1), [0.0] * (nb + 1), [0.0] * (nb + 1)
    prev_u, upto = [0.0] * nb, [0.0] * nb
    last_u, tot_u = 0.0, 0.0
    for k, r in enumerate(recs):
        cum[k + 1], cum_ac[k + 1] = cum[k] + r[0], cum_ac[k] + r[1]
        prev_u[k] = last_u
        if not r[4]:
            last_u, tot_u = r[3], tot_u + r[3]
        upto[k] = tot_u
    next_u, nxt = [0.0] * nb, 0.0
    for k in range(nb - 1, -1, -1):           # parameters of units / root blocks after k
        next_u[k] = nxt
        done_u[k] = done_u[k + 1] + (recs[k + 1][3] if k + 1 < nb and not recs[k + 1][4] else 0.0)
        done_r[k] = done_r[k + 1] + (recs[k + 1][3] if k + 1 < nb and recs[k + 1][4] else 0.0)
        if not recs[k][4]:
            nxt = recs[k][3]
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
        sv, _, peaks, pk, root, gin_in = recs[k]
        kept: list[tuple] = []
        for ex, gi, gs, gq in peaks:
            if any(a - (ex + gi) >= 4 * (gs + gq - g) for a, g in kept):
                continue
            kept.append((ex + gi, gs + gq))
            bwd.append((cum[k + 1] + ex + gi, cum_ac[k + (0 if own else 1)] + sv + ex + gi, done_u[k], done_r[k], gs,
                        0.0 if root else pk, prev_u[k], next_u[k], upto[k], gq))
        if not root:
            rs.append((cum[k] + gin_in, cum_ac[k] + gin_in, done_u[k], done_r[k], pk, prev_u[k],
                       upto[k] - pk))
    return tuple(dict.fromkeys(bwd)), tuple(dict.fromkeys(rs))


_BLOCK_TERMS: dict[tuple, tuple] = {}
# additive per-block fields of a `RankLoad`, in this order (summed over a stage by prefix sums)
_SUMS = ("params", "root_params", "saved", "saved_ac", "fwd_flops", "bwd_flops", "fwd_mem", "bwd_mem",
         "ops", "fwd_ops", "fwd_gemms", "bwd_gemms", "attn_f", "attn_b", "attn_calls", "tp_linears",
         "gp_f", "gp_b", "ga_f", "ga_b", "tp_collectives")


def _block_terms(profile: ModelProfile, t: int, sp: bool, scale: float):
    """Per-block contributions to a `RankLoad` for TP degree ``t`` (memoized per profile, degree,
    sequence parallel and activation scale: the search builds ~200 layouts from a few of these).

    Returns (prefix sums of the additive fields `_SUMS` over blocks, per block: (saved, saved_ac)
    corrections when the block is its stage's first, max-block saved bytes, FSDP-unit parameters
    (None for the root's embed / head), parameter numels, (generic, as a stage's first) unit
    entries, and a function giving the block's backward record for its position in the stage)."""
    key = (id(profile), t, sp, scale)
    hit = _BLOCK_TERMS.get(key)
    if hit is not None and hit[0] is profile:
        return hit[1]
    bs = profile.batch_size
    n = len(profile.blocks)
    transformer = bool(profile.arch)
    pre = [(0,) * len(_SUMS)]
    first_adj, mbs, unit_params, numels, unit_gen, unit_first, rec_args = [], [], [], [], [], [], []
    ac_info = []        # per block: (layer index or -1, core saved bytes, fwd FLOPs, attention fwd FLOPs)
    for i, bl in enumerate(profile.blocks):
        is_end = transformer and (i == 0 or i == n - 1)
        local = bl.num_params - bl.tp_sharded_params + bl.tp_sharded_params / t
        rep = bl.saved_bytes - bl.saved_tp_sharded_bytes
        saved = (bl.saved_bytes / t) if sp else (rep + bl.saved_tp_sharded_bytes / t)
        mbs.append(saved * scale / bs)
        ac_in = bl.input_bytes / (t if sp else 1)
        # a stage's first block saves (or, checkpointed, keeps) its input, which is the batch (first
        # stage: a view of the global batch every rank holds, `RankLoad.data`) or the pipeline's
        # receive buffer (counted with the buffers), not a new storage
        saved_first = saved - bl.saved_input_bytes / (t if sp else 1)
        first_adj.append(((saved_first - saved) * scale / bs, -ac_in * scale / bs))
        unit_params.append(None if is_end else local)
        unit_gen.append(None if is_end else (local, saved * scale / bs))
        unit_first.append(None if is_end else (local, saved_first * scale / bs))
        numels.append([(k / t if sh else k, mat) for k, mat, sh in bl.param_numels])
        ac_info.append((-1 if is_end else (i - 1 if transformer else i), bl.attn_core_saved_bytes / t * scale / bs,
                        bl.fwd_flops / bs / t, bl.fwd_attn_flops / bs / t))
        frac = bl.saved_tp_sharded_bytes / bl.saved_bytes if bl.saved_bytes else 0.0
        tp_div = 1.0 / t if sp else (1 - frac) + frac / t   # share of traffic left per rank
        shr = local / bl.num_params if bl.num_params else 1.0
        g_div = (1.0 / t if sp else 1.0) * scale / bs
        rec_args.append((bl, i, saved * scale / bs, saved_first * scale / bs, ac_in * scale / bs, local, is_end,
                         scale / bs * tp_div, g_div, shr))
        row = (local, local if is_end else 0.0, saved * scale / bs, ac_in * scale / bs,
               bl.fwd_flops / bs / t, bl.bwd_flops / bs / t,
               bl.fwd_mem_bytes * scale / bs * tp_div, bl.bwd_mem_bytes * scale / bs * tp_div,
               bl.fwd_ops + bl.bwd_ops, bl.fwd_ops, bl.fwd_gemms, bl.bwd_gemms,
               bl.fwd_attn_flops / bs / t, bl.bwd_attn_flops / bs / t, bl.attn_calls,
               sum(1 for _, mat, sh in bl.param_numels if mat and sh) if t > 1 else 0,
               bl.fwd_gemm_param_bytes * scale * shr, bl.bwd_gemm_param_bytes * scale * shr,
               bl.fwd_gemm_act_bytes * scale / bs * tp_div, bl.bwd_gemm_act_bytes * scale / bs * tp_div,
               (2 if (transformer and not is_end) else 1) if t > 1 else 0)
        pre.append(tuple(a + b for a, b in zip(pre[-1], row)))

    @functools.lru_cache(maxsize=None)
    def rec(i: int, first: bool, last: bool) -> tuple:
        """Block i's backward record (see `_backward_moments`) at its place in a stage."""
        bl, _, sv, sv_first, ac_in, local, is_end, ex_mul, g_div, shr = rec_args[i]
        # the block's backward peaks (profile): its extra temporaries shard like its saved bytes,
        # its gradients like its parameters; the gradient arriving from the block after it is
        # what that block received as input (replicated unless sequence parallel); at a stage's
        # last block that gradient sits in the pipeline's receive buffer (counted there), at the
        # model's last block it is the loss's gradient of the logits (the profile's backward
        # starts from a sum, which makes none)
        peaks = _scaled_peaks(bl.bwd_peaks or ((0, bl.output_bytes, 0, 0),),
                              bl.output_bytes if i == n - 1 else (0.0 if last else None), ex_mul, g_div, shr)
        return (sv_first if first else sv, 0.0 if first else ac_in, peaks, local, is_end,
                bl.input_bytes * g_div if i > 0 else 0.0)

    out = (pre, first_adj, mbs, unit_params, numels, unit_gen, unit_first, rec, ac_info)
    if len(_BLOCK_TERMS) > 256:
        _BLOCK_TERMS.clear()
    _BLOCK_TERMS[key] = (profile, out)
    return out


def rank_loads(profile: ModelProfile, plan: ParallelPlan, *, act_bytes: float) -> list[RankLoad]:
    """One `RankLoad` per pipeline rank (``plan.pp`` of them), tensor parallel applied.

    ``act_bytes``: element size the activations will have (2 bf16, 4 fp32), relative to the profile's.
    A stage's sums come from per-block prefix sums (`_block_terms`), so a load costs O(stages), not
    O(blocks), once the blocks' terms for the TP degree are known.
    """
    scale = act_bytes / (2 if profile.dtype == "bf16" else 4)
    t = plan.tp
    sp = plan.sequence_parallel
    bs = profile.batch_size
    rng = stage_ranges(profile, plan.num_stages) if plan.num_stages > 1 else [(0, len(profile.blocks))]
    pre, first_adj, mbs, unit_params, numels_b, unit_gen, unit_first, rec, ac_info = _block_terms(profile, t, sp, scale)
    loads = [RankLoad() for _ in range(plan.pp)]
    sums = [[0] * len(_SUMS) for _ in range(plan.pp)]
    numels: list[list[tuple[float, bool]]] = [[] for _ in range(plan.pp)]
    units: list[list[tuple[float, float]]] = [[] for _ in range(plan.pp)]
    recs: list[list[tuple]] = [[] for _ in range(plan.pp)]
    acb: list[list[tuple]] = [[] for _ in range(plan.pp)]
    first_in = profile.blocks[0].input_bytes / bs
    data = first_in * (2 if profile.tokens_per_sample > 1 else 1) + (0 if profile.tokens_per_sample > 1 else 8)
    for s, (a, b) in enumerate(rng):
        r = s % plan.pp
        ld = loads[r]
        acc = sums[r]
        hi, lo = pre[b], pre[a]
        for j in range(len(acc)):
            acc[j] += hi[j] - lo[j]
        acc[2] += first_adj[a][0]
        acc[3] += first_adj[a][1]
        ld.max_block_saved = max(ld.max_block_saved, max(mbs[a:b]))
        ld.max_unit_params = max([ld.max_unit_params] + [u for u in unit_params[a:b] if u is not None])
        for i in range(a, b):
            numels[r].extend(numels_b[i])
            u = unit_first[i] if i == a else unit_gen[i]
            if u is not None:
                units[r].append(u)
            recs[r].append(rec(i, i == a, i == b - 1))
            acb[r].append((recs[r][-1],) + ac_info[i])
        ld.boundary = profile.blocks[b - 1].output_bytes * scale / bs / (t if sp else 1)
        if s > 0:
            ld.recv += profile.blocks[a].input_bytes * scale / bs / (t if sp else 1)
            ld.p2p = max(ld.p2p, profile.blocks[a].input_bytes * scale / bs / (t if sp else 1))
        if s < len(rng) - 1:
            ld.recv += ld.boundary
            ld.p2p = max(ld.p2p, ld.boundary)
        ld.data = data
    for ld, acc in zip(loads, sums):
        (ld.params, ld.root_params, ld.saved, ld.saved_ac, ld.fwd_flops, ld.bwd_flops, ld.fwd_mem, ld.bwd_mem,
         ld.ops, ld.fwd_ops, ld.fwd_gemms, ld.bwd_gemms, af, ab, ld.attn_calls, ld.tp_linears,
         gpf, gpb, gaf, gab, ld.tp_collectives) = acc
        ld.attn_flops, ld.gemm_param_bytes, ld.gemm_act_bytes = (af, ab), (gpf, gpb), (gaf, gab)
    for ld, rc, ab in zip(loads, recs, acb):
        ld.bwd_moments, ld.rs_moments = _backward_moments(tuple(rc))
        ld.ac_blocks = tuple(ab)
    for ld, nl, un in zip(loads, numels, units):
        sizes = [k for k, _ in nl]
        ld.max_param = max(sizes, default=0.0)
        ld.numels = tuple(nl)
        ld.num_tensors = len(nl)
        ld.param_sizes = tuple(sizes)
        ld.unit_sizes = tuple([u for u, _ in un])
        _fsdp_unit_peak(ld, un)
    last = loads[(len(rng) - 1) % plan.pp]
    last.is_last = True
    arch = profile.arch
    if arch.get("n_head") and arch.get("seq_len"):
        for ld in loads:
            ld.attn_shape = (profile.tokens_per_sample, arch["d_model"] // arch["n_head"], True)
    # the logits (model output) and the loss's saved copy of them (log-softmax output); replicated
    # under TP unless the head is vocab-sharded (sequence parallel turns loss parallel on; a head
    # whose projection the profile marks TP-sharded, `vocab_parallel_profile`, computes the loss
    # on sharded logits: Megatron-LM's parallel cross entropy, torch's loss_parallel)
    head_sharded = profile.blocks[-1].tp_sharded_params > 0 or bool(profile.arch.get("vocab_parallel"))
    last.logits = 2 * profile.blocks[-1].output_bytes * scale / bs / (t if (sp or head_sharded) else 1)
    last.out = last.logits / 2
    return loads


def _bwd_terms(c: tuple, mode: tuple) -> tuple:
    """A block moment (`_backward_moments`) beyond what every backward moment of the step holds, as
    linear forms in the micro-batch b and ws = 1 / dp_shard: (gradients K, gradients G, activations
    A, activations K, gathered parameters K, buffers K, buffers G), i.e. gradients = K + G ws,
    activations = A b + K. ``mode`` = (FSDP, full checkpointing, gradients from earlier
    micro-batches, reshard_after_forward, bytes of a gathered parameter, pipeline)."""
    act, act_ac, done_u, done_r, gs, u, u_prev, u_next, _, gq = c
    fsdp, ac, prev, rafw, work, pp = mode[:6]
    held = len(mode) > 7 and mode[7]         # sharded gradients of earlier local batches (in the base)
    A = act_ac if ac else act
    # weight gradients a matmul computed and AccumulateGrad has not stored yet are temporaries; with
    # gradients from earlier micro-batches the stored ones were added in place
    if not fsdp:
        if prev:
            return 0.0, 0.0, A, 4 * gq, 0.0, 0.0, 0.0
        return 4 * (done_u + done_r + gs), 0.0, A, 4 * gq, 0.0, 0.0, 0.0
    pre = work * u_prev if rafw else 0.0    # the prefetched unit's flat all-gather output
    if prev:
        # gradient sync off (accumulation; every backward of a pipeline, whose runtime calls
        # set_requires_gradient_sync(False)): unsharded gradients accumulate (in the base); the
        # pipeline also keeps units gathered after their backward (set_reshard_after_backward(False),
        # in the base)
        return 0.0, 0.0, A, work * gq, (work * u if (rafw and not pp) else 0.0), pre, 0.0
    if pp:
        # a pipeline's first backward: completed units keep their unsharded gradients (accumulated
        # in fp32) and stay gathered; nothing is reduce-scattered until the schedule ends
        return (4 * (done_u + done_r), 0.0, A, work * (gs + gq), (work * (u + done_u) if rafw else 0.0),
                pre, 0.0)
    # reduce-scattered (sharded) gradients of completed units; the root's and unit k's unsharded
    # gradients so far; unit k gathered; the retained fp32 reduce-scatter input of the unit after k
    # (accumulating into sharded gradients held in the base: completed units add nothing)
    return (0.0, 0.0 if held else 4 * done_u, A, work * (done_r + gs + gq), (work * u if rafw else 0.0),
            pre + 4 * u_next, 0.0)


def _rs_terms(c: tuple, mode: tuple, collective: bool) -> tuple:
    """FSDP unit k's reduce-scatter beyond the base, as `_bwd_terms`: on its copy-in (the unsharded
    gradient, in the parameters' dtype, copied into the fp32 reduce-scatter input) or during the
    collective (the unsharded gradient freed; input and output, which becomes the sharded gradient;
    gloo (``mode[6]``) first copies the input into a flat buffer of its own, ProcessGroupGloo's
    reduce_scatter, where NCCL reduces in place). Unit k itself is resharded. With sharded gradients
    of earlier local batches held (``mode[7]``, in the base) the output is a temporary that FSDP2
    adds into them (``foreach_reduce``), and completed units add nothing."""
    act, act_ac, done_u, done_r, u, u_prev, _ = c
    fsdp, ac, prev, rafw, work, pp, gloo = mode[:7]
    held = len(mode) > 7 and mode[7]
    A = act_ac if ac else act
    gath = 0.0 if rafw else -work * u
    buf = 4 * u + (work * u_prev if rafw else 0.0)
    done = 0.0 if held else 4 * done_u
    if not collective:
        return 0.0, done, A, work * (done_r + u), gath, buf, 0.0
    return 0.0, done, A, work * done_r, gath, buf + (4 * u if gloo else 0.0), 4 * u


@functools.lru_cache(maxsize=4096)
def _projections(bwd_moments: tuple, rs_moments: tuple, mode: tuple) -> tuple:
    """A rank's block and reduce moments (`RankLoad.bwd_moments`, ``rs_moments``) for one ``mode``
    (`_bwd_terms`, plus gloo) as (A, K, G, (kind, terms)), total = A b + K + G / dp_shard beyond the
    base, keeping only those that can be the largest for some b >= 1 and dp_shard >= 1: none that
    another bounds in A, K and G, and, where G is zero throughout, only the upper convex hull of
    (A, K) over slopes b >= 1."""
    fsdp, ac, prev, rafw, work, pp, gloo = mode[:7]
    terms = [("backward", _bwd_terms(c, mode)) for c in bwd_moments]
    if fsdp and not prev and not pp:
        for c in rs_moments:
            terms.append(("fsdp_reduce", _rs_terms(c, mode, False)))
            terms.append(("fsdp_reduce", _rs_terms(c, mode, True)))
    cands = sorted(((t[2], t[0] + t[3] + t[4] + t[5], t[1] + t[6], (kind, t)) for kind, t in terms),
                   key=lambda x: (-x[0], -x[1], -x[2]))
    if len(cands) < 2:
        return tuple(cands)
    if any(x[2] for x in cands):
        keep: list[tuple] = []
        for x in cands:         # by decreasing A: a candidate bounding x in all three comes first
            if not any(y[1] >= x[1] and y[2] >= x[2] for y in keep):
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


def in_flight(plan: ParallelPlan, pp_rank: int) -> float:
    """Micro-batches whose activations a pipeline rank holds at its peak (Korthikanti Sec. 4.2.3).

    GPipe / looped BFS: m. 1F1B and zero-bubble variants: min(p - rank, m). Interleaved:
    p x (1 + (p - 1)/(p v)) on the first rank, at most m x 1 of every chunk.
    """
    p, m, v = plan.pp, plan.n_microbatches, plan.virtual_stages
    if p == 1:
        return 1.0
    if plan.pp_schedule in ("gpipe", "loopedbfs"):
        return float(m)
    if v > 1 and plan.pp_schedule in ("interleaved1f1b", "interleavedzerobubble"):
        return min(float(m), (p - pp_rank) * (1 + (p - 1) / (p * v)))
    return float(min(p - pp_rank, m))


def rank_memory(ld: RankLoad, plan: ParallelPlan, *, micro_batch_size: int, optimizer: str,
                overhead_bytes: float, pp_rank: int, accumulation: int = 1, global_batch_size: int = 0,
                foreach: bool = False, recv_per_microbatch: bool = True, fused: bool = True,
                gloo: bool = False, fused_tp_optimizer: bool = False,
                ddp_bucket_copy: bool | None = None) -> MemoryEstimate:
    """Peak memory of one pipeline rank, with its parts at the moment of the peak.

    The largest of these moments of a training step (steady state: optimizer state exists;
    gradients are freed after each step, ``zero_grad(set_to_none=True)``):

    - the loss's backward (last stage): the micro-batch's saved activations, its logits, the loss's
      saved log-softmax and the gradients of both; FSDP has gathered only its root for backward;
    - inside each block's backward (`_backward_moments`): saved activations of the blocks not yet
      backpropagated, the block's gradient temporaries and incoming gradient (profiled,
      `BlockProfile.bwd_peaks`), gradients completed so far (reduce-scattered under FSDP), FSDP's
      gathered unit, the next unit's all-gather buffer and the previous unit's retained
      reduce-scatter input;
    - FSDP's reduce-scatter of each unit (`_rs_terms`);
    - the end of a pipeline step (the last stage merges the outputs it kept);
    - the optimizer step: parameters, gradients, optimizer state plus the step's transient
      (none for torch's fused AdamW, modelpar's default (`modelpar.train.step.adamw`), nor for SGD's
      in-place update; ``fused=False``: single-tensor AdamW `_adamw_temp`, foreach AdamW one copy of
      the local parameters), communication buffers that persist (DDP buckets, pipeline receive
      buffers).

    Backward moments are taken for the step's first backward on the rank (no gradients yet unless
    gradient accumulation made them) and, in a pipeline, for a later one with all gradients
    present. Other micro-batches in flight add their saved activations (and the pipeline runtime
    keeps their stage outputs), and every rank holds the global batch (inputs and targets).
    ``gloo``: collectives run on gloo (CPU), whose reduce-scatter copies its input first.
    ``ddp_bucket_copy``: None (modelpar's runtime): DDP's gradients are views into its buckets
    (4 B/param, counted as buffers, no gradient storage beside them); True: torch DDP's default,
    the buckets a copy beside the gradients; False for a runtime that reduces the gradients in place
    (Megatron-LM's DDP: one contiguous gradient buffer).
    """
    if plan.activation_checkpointing in ("selective", "every-k"):
        from modelpar.planner.recompute import ac_load
        ld = ac_load(ld, plan)
    shard = plan.dp_shard
    fsdp = shard > 1
    ws = 1.0 / shard
    b = micro_batch_size
    P = ld.params
    params = 4 * P * ws
    grads = params
    opt = OPTIMIZER_BYTES[optimizer] * P * ws
    data = ld.data * global_batch_size
    bf16 = plan.precision == "bf16"
    work = 2 if bf16 else 4                  # bytes of a gathered / working parameter (and its gradient)
    # checkpointing: the ``saved_ac`` column holds what the mode keeps (full: block inputs;
    # selective / every-k: `modelpar.planner.recompute.ac_load`)
    ac = plan.activation_checkpointing != "none"
    S = ld.saved_ac if ac else ld.saved      # one micro-batch's saved bytes per sample
    pp = plan.pp > 1
    m = plan.n_microbatches if pp else 1
    last = ld.is_last
    out = ld.out
    rafw = plan.reshard_after_forward
    # buffers that live through the whole step: torch.distributed.pipelining's receive buffers, one
    # per micro-batch and stage (activations on non-first stages, gradients on non-last stages;
    # Megatron-LM reuses 2), and DDP's gradient buckets (below)
    comm_persist = ((m if recv_per_microbatch else 2) * ld.recv * b) if pp else 0.0
    # DDP's buckets (4 B/param, from construction on). modelpar's runtime (``ddp_bucket_copy=None``):
    # `apply_ddp` makes the gradients views into them (gradient_as_bucket_view=True), so no gradient
    # storage beside them. Under PP or TP it runs FSDP2's replicate instead
    # (`parallel.compose.parallelize`, `data_parallel.apply_replicate`): no buckets; each block's
    # (and last the root's) unsharded gradients are copied into one flat fp32 buffer
    # (reduce_dtype=float32), all-reduced and written into the replicated fp32 gradients, the
    # unsharded ones then freed, so beside the gradients (4 B/param) one group's buffer exists at a
    # time; counted as a buffer of the largest group through the step (at most a block's worth
    # more than at the optimizer step). True: torch DDP's default, the buckets a copy beside the
    # gradients; False: gradients reduced in place (Megatron-LM's contiguous gradient buffer).
    ddp = plan.dp_replicate > 1 and not fsdp
    replicate = ddp and ddp_bucket_copy is None and (pp or plan.tp > 1)
    ddp_view = ddp and ddp_bucket_copy is None and not replicate
    if replicate:
        comm_persist += 4 * max(ld.max_unit_params, ld.root_params)
    elif ddp and ddp_bucket_copy is not False:
        comm_persist += 4 * P
    if ddp_view:
        grads = 0.0
    # FSDP without a pipeline accumulates sharded gradients (reduce-scatter every local batch) unless
    # the plan defers the sync (`ParallelPlan.defer_grad_sync`: unsharded gradients accumulate)
    sharded_acc = fsdp and not pp and not plan.defer_grad_sync and accumulation > 1
    # autocast keeps a bf16 copy of every weight it cast, from forward to the end of backward
    cast_cache = 2 * P if (bf16 and not fsdp) else 0.0
    # FSDP's root parameters (embed/head) stay gathered from forward to the end of backward
    # (reshard_after_forward=False on the root); with reshard_after_forward=False every unit does
    root_g = work * (ld.root_params + (0.0 if rafw else P - ld.root_params)) if fsdp else 0.0
    fixed = params + opt + comm_persist + data + cast_cache
    key0 = fsdp + 2 * ac + 8 * rafw + 16 * pp + 32 * gloo + 64 * bf16     # `_projections` cache key

    # variants: the step's first backward on this rank (no gradients yet, unless an earlier local
    # batch of gradient accumulation made them; W micro-batches in flight), and, in a pipeline, a
    # later one with every gradient present: 1F1B keeps W in flight while forwards remain (W < m),
    # GPipe has finished one backward (m - 1 left)
    # torch.distributed.pipelining's last stage keeps each micro-batch's output (below); Megatron-LM
    # (``recv_per_microbatch=False``) drops it after the loss
    keep = pp and recv_per_microbatch
    if pp:
        W = in_flight(plan, pp_rank)
        variants = ((W, W if keep else 1.0, accumulation > 1),)
        if m > 1:
            variants += ((W if W < m else m - 1.0, float(m) if keep else 1.0, True),)
    else:
        # DDP's stored gradients are bucket views (always there); sharded FSDP accumulation: the
        # earlier local batches' sharded gradients (in `grads`), the moments of a first backward
        variants = ((1.0, 1.0, (accumulation > 1 or ddp_view) and not sharded_acc),)
    bS = b * S
    bout = b * out
    # other micro-batches in flight keep their saved bytes and, on the last stage, the loss's saved
    # log-softmax; the last stage keeps every micro-batch's output it has computed (the schedule
    # returns them merged: ``PipelineStage.output_chunks``), a non-last stage each in-flight
    # micro-batch's stage output (``fwd_cache``, until its backward); without a pipeline the caller
    # holds the model output through backward
    per_other, per_out = (bS + bout, bout) if last else (bS, b * ld.boundary if pp else 0.0)
    best_total, best = -1.0, None
    for F, n_out, prev in variants:
        held = (F - 1) * per_other + (n_out if last else F) * per_out
        # gradients of earlier micro-batches: sharded, or (FSDP without gradient sync) unsharded
        g0 = (4 * P if fsdp else grads) if prev else (grads if sharded_acc else 0.0)
        # a pipeline under FSDP keeps every unit gathered after its first backward
        gath0 = root_g + work * (P - ld.root_params) if (fsdp and pp and prev and rafw) else root_g
        base = fixed + held + g0 + gath0
        if last:
            # the loss's backward: logits, log-softmax output (saved), and the gradients of both;
            # FSDP has gathered nothing for backward yet (the root's pre-backward hook, which starts
            # the first unit's all-gather, fires when the logits' gradient is complete)
            tot = base + bS + 3 * bout
            if tot > best_total:
                best_total, best = tot, (held, g0, gath0, prev, None)
        # the block / reduce moments, as totals b * A + K + G / dp_shard (see `_projections`)
        key = key0 + 4 * prev + 128 * sharded_acc
        proj = ld.projections.get(key)
        if proj is None:
            proj = ld.projections[key] = _projections(ld.bwd_moments, ld.rs_moments,
                                                      (fsdp, ac, prev, rafw, work, pp, gloo, sharded_acc))
        for A, K, G, c in proj:
            tot = base + b * A + K + ws * G
            if tot > best_total:
                best_total, best = tot, (held, g0, gath0, prev, c)
    # the last stage's outputs stay referenced until the next step starts
    # (``clear_runtime_states``); when the schedule ends it also merges them into one batch
    held_end = m * out * b if (keep and last) else 0.0
    end_total = params + grads + opt + data + comm_persist + 2 * held_end
    # modelpar's TP leaves some parameters plain tensors, and torch's fused kernel refuses mixed
    # lists, so tensor-parallel plans step with the single-tensor loop (`modelpar.train.step.adamw`)
    if optimizer == "adamw" and not (fused and (plan.tp == 1 or fused_tp_optimizer)):
        if not foreach and ld.opt_temp < 0:
            ld.opt_temp = _adamw_temp(list(ld.numels))
        step_tmp = (ld.params if foreach else ld.opt_temp) * 4 / shard
    else:
        step_tmp = 0.0     # fused AdamW and in-place SGD; the gradient norm copies nothing either
    opt_total = params + grads + opt + step_tmp + data + held_end + comm_persist
    if opt_total >= best_total and opt_total >= end_total:
        return MemoryEstimate(params, grads, opt + step_tmp, data + held_end, 0.0, comm_persist,
                              overhead_bytes, pp_rank, "optimizer")
    if end_total > best_total:
        return MemoryEstimate(params, grads, opt, data + 2 * held_end, 0.0, comm_persist, overhead_bytes,
                              pp_rank, "pipeline_end")
    held, g0, gath0, prev, c = best
    acts = data + cast_cache + held
    if c is None:
        return MemoryEstimate(params, g0, opt, acts + bS + 3 * bout, gath0, comm_persist, overhead_bytes,
                              pp_rank, "loss")
    kind, (gK, gG, aA, aK, tK, cK, cG) = c
    return MemoryEstimate(params, g0 + gK + gG * ws, opt, acts + aA * b + aK, gath0 + tK,
                          comm_persist + cK + cG * ws, overhead_bytes, pp_rank, kind)


def estimate_memory(profile: ModelProfile, plan: ParallelPlan, batch: Batch, *,
                    optimizer: str = "adamw", overhead_bytes: float = 0.0, foreach: bool = False,
                    recv_per_microbatch: bool = True, fused: bool = True,
                    gloo: bool = False, fused_tp_optimizer: bool = False,
                    ddp_bucket_copy: bool | None = None) -> MemoryEstimate:
    """Peak memory per rank for ``plan``: the most loaded pipeline rank, with its parts (bytes).

    Args:
        profile: `profile_model` output (any batch; it is scaled per sample).
        plan: the layout; its ``precision`` sets the activation element size.
        batch: global and local batch sizes (samples).
        optimizer: ``"sgd"``, ``"sgd_momentum"`` or ``"adamw"``.
        overhead_bytes: framework allowance (``Hardware.framework_overhead_bytes``).
        foreach: with ``fused=False``, the optimizer uses torch's foreach kernels (torch's default on
            CUDA), whose step transient is one copy of the local parameters.
        recv_per_microbatch: the pipeline runtime is torch.distributed.pipelining (what modelpar
            runs): a receive buffer per micro-batch, and the last stage keeps every micro-batch's
            output until the next step; False: Megatron-LM's, two reused buffers, outputs dropped
            after the loss.
        fused: AdamW runs torch's fused kernel (modelpar's default), which makes no temporaries;
            tensor-parallel plans still use the single-tensor loop (modelpar's TP mixes plain tensors
            and DTensors) unless ``fused_tp_optimizer`` (Megatron-LM's fused Adam).
        ddp_bucket_copy: see `rank_memory`.

    Raises:
        ValueError: unknown optimizer, batch sizes that do not divide, more stages than blocks.
    """
    if optimizer not in OPTIMIZER_BYTES:
        raise ValueError(f"optimizer={optimizer!r} is unknown; valid: {', '.join(OPTIMIZER_BYTES)}")
    b = batch.micro_batch_size(plan)
    acc = batch.accumulation_steps(plan)
    loads = rank_loads(profile, plan, act_bytes=2 if plan.precision == "bf16" else 4)
    ests = [rank_memory(ld, plan, micro_batch_size=b, optimizer=optimizer, overhead_bytes=overhead_bytes,
                        pp_rank=r, accumulation=acc, global_batch_size=batch.global_batch_size, foreach=foreach,
                        recv_per_microbatch=recv_per_microbatch, fused=fused, gloo=gloo,
                        fused_tp_optimizer=fused_tp_optimizer, ddp_bucket_copy=ddp_bucket_copy)
            for r, ld in enumerate(loads)]
    return max(ests, key=lambda e: e.total)

