"""Per-rank peak memory of a plan, part by part.

Sources:
- Model states: Rajbhandari et al., "ZeRO" (SC'20), Sec. 3.1 and 5 (bytes per parameter; stage 3
  divides parameters, gradients and optimizer state by the sharding degree N).
- Activations: Korthikanti et al., "Reducing Activation Recomputation in Large Transformer Models"
  (2022), Sec. 4 (Eq. 1-2: per-layer bytes; TP shards the attention/MLP interior, sequence parallel the
  rest; full recompute keeps the layer input only) and Sec. 4.2.3 (pipeline: the first stage holds
  p micro-batches under 1F1B, m under GPipe, interleaving multiplies by 1 + (p - 1)/(p v)).
  The per-layer bytes themselves are *measured* by `profile_model`, not taken from Eq. 1.

Bytes per parameter, as modelpar runs them (``precision="bf16"`` keeps fp32 master weights, fp32
gradients and fp32 reductions, computing in bf16, see `ParallelPlan`):
    params 4, grads 4, optimizer 0 (sgd) / 4 (sgd_momentum) / 8 (adamw), plus a bf16 working copy of
    2 bytes: FSDP's gathered units, or autocast's weight cache without FSDP.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

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
    saved: float = 0.0             # saved bytes per sample, TP-split applied
    saved_ac: float = 0.0          # with full checkpointing: block inputs kept per sample
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
    opt_temp: float = 0.0          # elements of the non-foreach AdamW step transient (see `_adamw_temp`)
    data: float = 0.0              # bytes per global-batch sample of inputs + targets (held by every rank)
    fwd_gemms: int = 0             # matmul-class calls per micro-batch (forward, backward)
    bwd_gemms: int = 0
    gemm_param_bytes: tuple = (0.0, 0.0)   # (fwd, bwd) bytes of parameters the matmuls touch, per micro-batch
    gemm_act_bytes: tuple = (0.0, 0.0)     # (fwd, bwd) other matmul bytes, per sample
    # FSDP's busiest backward moment (see `_fsdp_unit_peak`): unit i's parameters, the unit after it
    # (whose reduce-scatter is in flight), activations still saved per sample, parameters whose
    # gradients are already reduce-scattered
    fsdp_unit: float = 0.0
    fsdp_next: float = 0.0
    fsdp_saved: float = 0.0
    fsdp_done: float = 0.0


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


def rank_loads(profile: ModelProfile, plan: ParallelPlan, *, act_bytes: float) -> list[RankLoad]:
    """One `RankLoad` per pipeline rank (``plan.pp`` of them), tensor parallel applied.

    ``act_bytes``: element size the activations will have (2 bf16, 4 fp32), relative to the profile's.
    """
    scale = act_bytes / (2 if profile.dtype == "bf16" else 4)
    t = plan.tp
    sp = plan.sequence_parallel
    bs = profile.batch_size
    rng = stage_ranges(profile, plan.num_stages) if plan.num_stages > 1 else [(0, len(profile.blocks))]
    loads = [RankLoad() for _ in range(plan.pp)]
    numels: list[list[tuple[float, bool]]] = [[] for _ in range(plan.pp)]
    units: list[list[tuple[float, float]]] = [[] for _ in range(plan.pp)]
    n = len(profile.blocks)
    transformer = bool(profile.arch)
    first_in = profile.blocks[0].input_bytes / bs
    data = first_in * (2 if profile.tokens_per_sample > 1 else 1) + (0 if profile.tokens_per_sample > 1 else 8)
    for s, (a, b) in enumerate(rng):
        ld = loads[s % plan.pp]
        for i in range(a, b):
            bl = profile.blocks[i]
            is_end = transformer and (i == 0 or i == n - 1)
            local = bl.num_params - bl.tp_sharded_params + bl.tp_sharded_params / t
            ld.params += local
            if is_end:          # the GPT's embed / head belong to the FSDP root; other blocks are units
                ld.root_params += local
            else:
                ld.max_unit_params = max(ld.max_unit_params, local)
            for k, mat, sh in bl.param_numels:
                numels[s % plan.pp].append((k / t if sh else k, mat))
            rep = bl.saved_bytes - bl.saved_tp_sharded_bytes
            saved = (bl.saved_bytes / t) if sp else (rep + bl.saved_tp_sharded_bytes / t)
            ld.saved += saved * scale / bs
            if not is_end:
                units[s % plan.pp].append((local, saved * scale / bs))
            ld.max_block_saved = max(ld.max_block_saved, saved * scale / bs)
            ld.saved_ac += bl.input_bytes * scale / bs / (t if sp else 1)
            frac = bl.saved_tp_sharded_bytes / bl.saved_bytes if bl.saved_bytes else 0.0
            tp_div = 1.0 / t if sp else (1 - frac) + frac / t   # share of traffic left per rank
            ld.fwd_flops += bl.fwd_flops / bs / t
            ld.bwd_flops += bl.bwd_flops / bs / t
            ld.fwd_mem += bl.fwd_mem_bytes * scale / bs * tp_div
            ld.bwd_mem += bl.bwd_mem_bytes * scale / bs * tp_div
            ld.ops += bl.fwd_ops + bl.bwd_ops
            ld.fwd_ops += bl.fwd_ops
            ld.fwd_gemms += bl.fwd_gemms
            ld.bwd_gemms += bl.bwd_gemms
            shr = local / bl.num_params if bl.num_params else 1.0
            ld.gemm_param_bytes = (ld.gemm_param_bytes[0] + bl.fwd_gemm_param_bytes * scale * shr,
                                   ld.gemm_param_bytes[1] + bl.bwd_gemm_param_bytes * scale * shr)
            ld.gemm_act_bytes = (ld.gemm_act_bytes[0] + bl.fwd_gemm_act_bytes * scale / bs * tp_div,
                                 ld.gemm_act_bytes[1] + bl.bwd_gemm_act_bytes * scale / bs * tp_div)
            if t > 1:
                ld.tp_collectives += 2 if (transformer and not is_end) else 1
        ld.boundary = profile.blocks[b - 1].output_bytes * scale / bs / (t if sp else 1)
        if s > 0:
            ld.recv += profile.blocks[a].input_bytes * scale / bs / (t if sp else 1)
        if s < len(rng) - 1:
            ld.recv += ld.boundary
        ld.data = data
    for ld, nl, un in zip(loads, numels, units):
        ld.max_param = max((k for k, _ in nl), default=0.0)
        ld.opt_temp = _adamw_temp(nl)
        ld.num_tensors = len(nl)
        _fsdp_unit_peak(ld, un)
    last = loads[(len(rng) - 1) % plan.pp]
    last.is_last = True
    # the logits (model output) and the loss's saved copy of them (log-softmax output); replicated
    # under TP unless the head is vocab-sharded (sequence parallel turns loss parallel on)
    last.logits = 2 * profile.blocks[-1].output_bytes * scale / bs / (t if sp else 1)
    return loads


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
                foreach: bool = False, recv_per_microbatch: bool = True) -> MemoryEstimate:
    """Peak memory of one pipeline rank, with its parts at the moment of the peak.

    Two candidate moments (steady state: optimizer state exists; gradients are freed after each
    step, ``zero_grad(set_to_none=True)``):

    - backward start of the micro-batch with the most activations in flight: parameters, optimizer
      state, gradients only if an earlier micro-batch of the step already made them (accumulation, or
      a pipeline rank that runs a backward before its last forward), the saved activations, the
      logits and the loss's copy of them, and the first gradients of backward (two tensors of the
      last output's size: the loss gradient and the logits gradient), FSDP's gathered parameters,
      communication buffers;
    - the optimizer step: parameters, gradients, optimizer state plus the step's transient
      (single-tensor AdamW on CPU: `_adamw_temp`; foreach AdamW on GPUs: one copy of the local
      parameters), communication buffers that persist (DDP buckets).

    The global batch (inputs and targets) is held by every rank at both moments.
    """
    bf16 = plan.precision == "bf16"
    shard = plan.dp_shard
    b = micro_batch_size
    p_local = ld.params / shard
    params = 4 * p_local
    grads = 4 * p_local
    opt = OPTIMIZER_BYTES[optimizer] * p_local
    data = ld.data * global_batch_size
    if plan.activation_checkpointing == "full":
        per_mb = ld.saved_ac
        transient = ld.max_block_saved * b
    else:
        per_mb, transient = ld.saved, 0.0
    flight = in_flight(plan, pp_rank)
    m = plan.n_microbatches if plan.pp > 1 else 1
    # gradient of the loss and of the logits (last stage), or received + computed output gradient
    bw_start = 2 * (ld.logits / 2 if ld.is_last else ld.boundary) * b
    # every micro-batch in flight also keeps its stage output (the pipeline runtime holds it for the
    # stage's backward) or, on the last stage, its logits and the loss's copy of them
    kept = (ld.logits if ld.is_last else (ld.boundary if plan.pp > 1 else 0.0)) * b * flight
    acts = per_mb * b * flight + transient + kept + bw_start + data
    grads_fb = grads if (accumulation > 1 or flight < m) else 0.0
    work = 2 if bf16 else 4                  # bytes of a gathered / working parameter
    comm_persist = 0.0
    if shard > 1:
        # ZeRO-3: the root (embed/head) stays gathered from forward to backward; each block unit is
        # gathered when used (FSDP2 prefetches the next one in backward).
        # at backward start: the root, plus the block unit prefetched for the first block backward
        # (all units with reshard_after_forward=False); no reduce-scatter is in flight yet
        rest = ld.params - ld.root_params
        units = rest if not plan.reshard_after_forward else ld.max_unit_params
        gathered = work * (ld.root_params + (units if units < rest else rest))
        comm = 0.0
    else:
        gathered = 2 * ld.params if bf16 else 0.0   # autocast's bf16 weight cache
        comm = comm_persist = 4 * ld.params if plan.dp_replicate > 1 else 0.0   # DDP buckets
    if plan.pp > 1:
        # torch.distributed.pipelining allocates one receive buffer per micro-batch and stage
        # (activations on non-first stages, gradients on non-last stages); Megatron-LM reuses 2
        recv = (m if recv_per_microbatch else 2) * ld.recv * b
        comm += recv
        comm_persist += recv
    # three candidate moments; only the winner becomes a MemoryEstimate (the search calls this ~10^5 times)
    best = (params, grads_fb, opt, acts, gathered, comm)
    best_total, phase = params + grads_fb + opt + acts + gathered + comm, "backward"
    if shard > 1 and ld.fsdp_unit:
        # inside backward, at the unit with the largest gathered + unsharded-gradient footprint
        g = grads if grads_fb else 4 * ld.fsdp_done / shard
        u = (params, g, opt, ld.fsdp_saved * b * flight + data,
             work * (ld.root_params + ld.fsdp_unit + ld.fsdp_next), 4 * ld.fsdp_unit + 8 * ld.fsdp_next + comm)
        tot = u[0] + u[1] + u[2] + u[3] + u[4] + u[5]
        if tot > best_total:
            best, best_total, phase = u, tot, "fsdp_backward"
    if optimizer == "adamw":
        step_tmp = (ld.params if foreach else ld.opt_temp) * 4 / shard
    else:
        step_tmp = ld.max_param * 4 / shard     # grad-norm's squared copy of one gradient
    if params + grads + opt + step_tmp + data + comm_persist > best_total:
        best, phase = (params, grads, opt + step_tmp, data, 0.0, comm_persist), "optimizer"
    return MemoryEstimate(*best, overhead_bytes, pp_rank, phase)


def estimate_memory(profile: ModelProfile, plan: ParallelPlan, batch: Batch, *,
                    optimizer: str = "adamw", overhead_bytes: float = 0.0, foreach: bool = False,
                    recv_per_microbatch: bool = True) -> MemoryEstimate:
    """Peak memory per rank for ``plan``: the most loaded pipeline rank, with its parts (bytes).

    Args:
        profile: `profile_model` output (any batch; it is scaled per sample).
        plan: the layout; its ``precision`` sets the activation element size.
        batch: global and local batch sizes (samples).
        optimizer: ``"sgd"``, ``"sgd_momentum"`` or ``"adamw"``.
        overhead_bytes: framework allowance (``Hardware.framework_overhead_bytes``).
        foreach: the optimizer uses torch's foreach kernels (the default on CUDA), whose step
            transient is one copy of the local parameters.
        recv_per_microbatch: pipeline receive buffers per micro-batch (torch.distributed.pipelining,
            what modelpar runs) rather than two reused ones (Megatron-LM).

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
                        recv_per_microbatch=recv_per_microbatch)
            for r, ld in enumerate(loads)]
    return max(ests, key=lambda e: e.total)
