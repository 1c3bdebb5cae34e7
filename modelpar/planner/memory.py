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

    @property
    def total(self) -> float:
        return (self.params + self.grads + self.optimizer + self.activations + self.fsdp_gathered
                + self.comm_buffers + self.overhead)

    def parts(self) -> dict[str, float]:
        return {f.name: getattr(self, f.name) for f in fields(self) if f.name != "pp_rank"}


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
    fwd_flops: float = 0.0
    bwd_flops: float = 0.0
    fwd_mem: float = 0.0
    bwd_mem: float = 0.0
    ops: float = 0.0               # fwd+bwd ops per micro-batch (not per sample)
    fwd_ops: float = 0.0
    tp_collectives: int = 0        # TP all-reduces in one forward of the rank's blocks


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
    n = len(profile.blocks)
    transformer = bool(profile.arch)
    for s, (a, b) in enumerate(rng):
        ld = loads[s % plan.pp]
        for i in range(a, b):
            bl = profile.blocks[i]
            is_end = transformer and (i == 0 or i == n - 1)
            ld.params += bl.num_params / t
            if is_end or not transformer:
                ld.root_params += bl.num_params / t
            ld.max_unit_params = max(ld.max_unit_params, bl.num_params / t)
            rep = bl.saved_bytes - bl.saved_tp_sharded_bytes
            saved = (bl.saved_bytes / t) if sp else (rep + bl.saved_tp_sharded_bytes / t)
            ld.saved += saved * scale / bs
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
            if t > 1:
                ld.tp_collectives += 2 if (transformer and not is_end) else 1
        ld.boundary = profile.blocks[b - 1].output_bytes * scale / bs / (t if sp else 1)
    last = loads[(len(rng) - 1) % plan.pp]
    last.logits = 2 * profile.blocks[-1].output_bytes * scale / bs / t
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
                overhead_bytes: float, pp_rank: int) -> MemoryEstimate:
    """Peak memory of one pipeline rank (see module docstring for bytes per parameter)."""
    bf16 = plan.precision == "bf16"
    shard = plan.dp_shard
    p_local = ld.params / shard
    params = 4 * p_local
    grads = 4 * p_local
    opt = OPTIMIZER_BYTES[optimizer] * p_local
    b = micro_batch_size
    if plan.activation_checkpointing == "full":
        per_mb = ld.saved_ac
        transient = ld.max_block_saved * b
    else:
        per_mb, transient = ld.saved, 0.0
    acts = per_mb * b * in_flight(plan, pp_rank) + transient + ld.logits * b
    work = 2 if bf16 else 4                  # bytes of a gathered / working parameter
    if shard > 1:
        # ZeRO-3: the root (embed/head) stays gathered from forward to backward; each block unit is
        # gathered when used and the next is prefetched (2 units); reshard_after_forward=False keeps all.
        units = (ld.params - ld.root_params) if not plan.reshard_after_forward else 2 * ld.max_unit_params
        gathered = work * (ld.root_params + min(units, ld.params - ld.root_params))
        comm = 2 * 4 * ld.max_unit_params    # unsharded fp32 gradient of the unit being reduce-scattered
    else:
        gathered = 2 * ld.params if bf16 else 0.0   # autocast's bf16 weight cache
        comm = 4 * ld.params if plan.dp_replicate > 1 else 0.0   # DDP buckets (a copy of the grads)
    if plan.pp > 1:
        comm += 2 * ld.boundary * b * plan.virtual_stages    # send + recv activation buffers
    return MemoryEstimate(params, grads, opt, acts, gathered, comm, overhead_bytes, pp_rank)


def estimate_memory(profile: ModelProfile, plan: ParallelPlan, batch: Batch, *,
                    optimizer: str = "adamw", overhead_bytes: float = 0.0) -> MemoryEstimate:
    """Peak memory per rank for ``plan``: the most loaded pipeline rank, with its parts (bytes).

    Args:
        profile: `profile_model` output (any batch; it is scaled per sample).
        plan: the layout; its ``precision`` sets the activation element size.
        batch: global and local batch sizes (samples).
        optimizer: ``"sgd"``, ``"sgd_momentum"`` or ``"adamw"``.
        overhead_bytes: framework allowance (``Hardware.framework_overhead_bytes``).

    Raises:
        ValueError: unknown optimizer, batch sizes that do not divide, more stages than blocks.
    """
    if optimizer not in OPTIMIZER_BYTES:
        raise ValueError(f"optimizer={optimizer!r} is unknown; valid: {', '.join(OPTIMIZER_BYTES)}")
    b = batch.micro_batch_size(plan)
    batch.accumulation_steps(plan)
    loads = rank_loads(profile, plan, act_bytes=2 if plan.precision == "bf16" else 4)
    ests = [rank_memory(ld, plan, micro_batch_size=b, optimizer=optimizer,
                        overhead_bytes=overhead_bytes, pp_rank=r) for r, ld in enumerate(loads)]
    return max(ests, key=lambda e: e.total)
