"""Step-time model: compute, collectives, pipeline bubble, recompute; MFU and HFU.

Sources:
- Collectives, alpha-beta ring costs (Thakur, Rabenseifner & Gropp, "Optimization of Collective
  Communication Operations in MPICH", IJHPCA 2005, Sec. 4): for n ranks and B bytes,
  all-reduce 2(n-1) alpha + 2(n-1)/n B/beta; all-gather and reduce-scatter (n-1) alpha + (n-1)/n B/beta
  (B = the full, gathered size); send/recv alpha + B/beta.
- Tensor parallel: 2 all-reduces of the block output per transformer layer in forward and 2 in
  backward (Shoeybi et al., "Megatron-LM", 2019, Sec. 3, Fig. 4); sequence parallel replaces each by a
  reduce-scatter + all-gather of the same volume (Korthikanti et al. 2022, Sec. 4.2.2).
- Pipeline bubble / ideal time (Narayanan et al. SC'21, Sec. 2.2): (p-1)/m for GPipe and 1F1B,
  (p-1)/(v m) interleaved; ZB-H1 (p-1)/(3m) (Qi et al., "Zero Bubble Pipeline Parallelism", ICLR'24,
  Sec. 3); ZB-V about 0.
- Compute: matmul-class FLOPs / (peak x achievable GEMM fraction) + memory-bound bytes /
  (bandwidth x fraction) + ops x per-op overhead (a roofline split, Williams et al., CACM 2009).
- Full recompute adds one forward per micro-batch (Chen et al. 2016; Korthikanti Sec. 5).
- MFU / HFU: Chowdhery et al., "PaLM" (2022), App. B: model FLOPs count each forward once, hardware
  FLOPs include the recomputed forward.

Overlap: DDP overlaps the gradient all-reduce with the last backward except its final 25 MiB bucket
(``bucket_cap_mb`` default); FSDP prefetches, hiding its gathers and reduce-scatters behind each
micro-batch's compute except the first unit's gather; TP and pipeline p2p are not overlapped.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

from modelpar.plan import ParallelPlan
from modelpar.planner.hardware import Hardware
from modelpar.planner.memory import Batch, RankLoad, rank_loads
from modelpar.planner.profile import ModelProfile

DDP_BUCKET_BYTES = 25 * 2 ** 20
# bytes read + written per parameter by the optimizer step. Accelerators (fused / foreach kernels):
# one pass, read param, grad and state, write param and state (SGD 12, momentum 20, AdamW 28).
# CPU (torch's single-tensor loop, one pass per kernel): AdamW decay mul_ 8, lerp_ 12, mul_ 8,
# addcmul_ 16, sqrt 8, div 8, add_ 8, addcdiv_ 16 = 84; SGD add_ 12; momentum + mul_/add_ 16; plus
# gradient clipping (squared copy 8, sum 4, scale 8 = 20).
OPT_TRAFFIC = {"sgd": 12, "sgd_momentum": 20, "adamw": 28}
OPT_TRAFFIC_CPU = {"sgd": 12 + 20, "sgd_momentum": 28 + 20, "adamw": 84 + 20}
OPT_KERNELS = {"sgd": 1 + 3, "sgd_momentum": 3 + 3, "adamw": 8 + 3}   # per parameter tensor (CPU loop)


# ---- collectives (alpha-beta) ------------------------------------------------------------------
def all_reduce_time(nbytes: float, n: int, bw: float, lat: float) -> float:
    """Ring all-reduce of ``nbytes`` over ``n`` ranks: 2(n-1) lat + 2(n-1)/n nbytes/bw seconds."""
    return 0.0 if n <= 1 else 2 * (n - 1) * lat + 2 * (n - 1) / n * nbytes / bw


def all_gather_time(nbytes: float, n: int, bw: float, lat: float) -> float:
    """Ring all-gather (or reduce-scatter) whose gathered size is ``nbytes``: (n-1) lat + (n-1)/n B/bw."""
    return 0.0 if n <= 1 else (n - 1) * lat + (n - 1) / n * nbytes / bw


def p2p_time(nbytes: float, bw: float, lat: float) -> float:
    """One send/recv of ``nbytes``: lat + nbytes/bw seconds."""
    return lat + nbytes / bw


def bubble_fraction(schedule: str, p: int, m: int, v: int = 1) -> float:
    """Pipeline bubble time / ideal time (see module docstring). 0 without a pipeline.

    Raises:
        ValueError: ``m < 1`` or an unknown schedule.
    """
    if p <= 1:
        return 0.0
    if m < 1:
        raise ValueError(f"n_microbatches must be >= 1, got {m}")
    if schedule in ("gpipe", "1f1b"):
        return (p - 1) / m
    if schedule in ("interleaved1f1b", "loopedbfs"):
        return (p - 1) / (v * m)
    if schedule == "interleavedzerobubble":
        return (p - 1) / (3 * v * m)     # ZB-H1 applied per virtual chunk (assumption)
    if schedule in ("zbvzerobubble", "dualpipev"):
        # ZB-V reaches ~0 only once m >= 2p micro-batches fill the V; below that, ZB-H1's bound
        return 0.0 if m >= 2 * p else (p - 1) / (3 * m)
    raise ValueError(f"unknown pp_schedule {schedule!r}")


@dataclass(slots=True)
class StepEstimate:
    """Predicted time of one optimizer step on the slowest rank, by part (seconds)."""

    compute: float          # forward + backward kernels (incl. memory-bound and per-op terms)
    recompute: float        # the extra forward of full checkpointing
    tp_comm: float
    pp_comm: float
    dp_comm: float          # exposed DDP/FSDP/HSDP communication
    bubble: float
    optimizer: float
    model_flops: float      # per step, whole job, each forward once (FLOPs)
    hardware_flops: float   # including recomputation
    num_devices: int
    samples: int            # global batch size
    tokens_per_sample: int

    @property
    def total(self) -> float:
        return (self.compute + self.recompute + self.tp_comm + self.pp_comm + self.dp_comm + self.bubble
                + self.optimizer)

    @property
    def comm_share(self) -> float:
        return (self.tp_comm + self.pp_comm + self.dp_comm) / self.total

    @property
    def bubble_share(self) -> float:
        return self.bubble / self.total

    @property
    def compute_share(self) -> float:
        return (self.compute + self.recompute + self.optimizer) / self.total

    @property
    def samples_per_s(self) -> float:
        return self.samples / self.total

    @property
    def tokens_per_s(self) -> float:
        return self.samples * self.tokens_per_sample / self.total

    def achieved_flops_per_device(self, *, count_recompute: bool = True) -> float:
        """FLOP/s per device; with ``count_recompute`` the hardware FLOPs (as Megatron reports)."""
        f = self.hardware_flops if count_recompute else self.model_flops
        return f / (self.total * self.num_devices)

    def parts(self) -> dict[str, float]:
        keep = ("compute", "recompute", "tp_comm", "pp_comm", "dp_comm", "bubble", "optimizer")
        return {f.name: getattr(self, f.name) for f in fields(self) if f.name in keep}


def mfu(step: StepEstimate, hw: Hardware, precision: str) -> float:
    """Model FLOPs utilization: model FLOPs per second / (devices x dense peak) (PaLM App. B)."""
    return step.model_flops / (step.total * step.num_devices * hw.peak_flops[precision])


def hfu(step: StepEstimate, hw: Hardware, precision: str) -> float:
    """Hardware FLOPs utilization: as `mfu` but counting the recomputed forward."""
    return step.hardware_flops / (step.total * step.num_devices * hw.peak_flops[precision])


# ---- the step ---------------------------------------------------------------------------------
def _axis_link(plan: ParallelPlan, axis: str, hw: Hardware, op: str = "all_reduce") -> tuple[float, float]:
    """Bandwidth and latency of ``op`` on one mesh axis; axes are (pp, dp_replicate, dp_shard, tp),
    tp innermost. Inside one node a calibrated per-operation fit (`Hardware.collective`) is used."""
    if hw.devices_per_node % (plan.tp * plan.dp * plan.pp) == 0:
        return hw.collective(op) or (hw.intra_bw, hw.intra_latency)
    span = {"tp": 1, "dp_shard": plan.tp, "dp_replicate": plan.tp * plan.dp_shard,
            "pp": plan.tp * plan.dp}[axis]
    n = {"tp": plan.tp, "dp_shard": plan.dp_shard, "dp_replicate": plan.dp_replicate, "pp": 2}[axis]
    return hw.link(n, span)


def rank_step(loads: list[RankLoad], plan: ParallelPlan, hw: Hardware, *, micro_batch_size: int,
              accumulation: int, optimizer: str, tp_bytes: float, dp_overlap: bool = True) -> dict:
    """Seconds of one step on the slowest pipeline rank; ``tp_bytes`` = block output per sample."""
    prec = plan.precision
    flops_s = hw.achievable_flops(prec)
    mem_s = hw.mem_bandwidth * hw.mem_bw_fraction
    b, m, v, p = micro_batch_size, (plan.n_microbatches if plan.pp > 1 else 1), plan.virtual_stages, plan.pp
    ac = plan.activation_checkpointing == "full"
    tp_bw, tp_lat = _axis_link(plan, "tp", hw)
    ar_tp = all_reduce_time(tp_bytes * b, plan.tp, tp_bw, tp_lat)
    best = None
    curve = any(k.startswith("matmul_flops_") for k in hw.extra)
    for ld in loads:
        rf = hw.gemm_flops(prec, ld.fwd_flops * b / ld.fwd_gemms) if curve and ld.fwd_gemms else flops_s
        rb = hw.gemm_flops(prec, ld.bwd_flops * b / ld.bwd_gemms) if curve and ld.bwd_gemms else flops_s
        # matmuls: roofline of their FLOPs and the bytes they move (weights once per micro-batch)
        g_f = max(ld.fwd_flops * b / rf, (ld.gemm_param_bytes[0] + ld.gemm_act_bytes[0] * b) / mem_s)
        g_b = max(ld.bwd_flops * b / rb, (ld.gemm_param_bytes[1] + ld.gemm_act_bytes[1] * b) / mem_s)
        t_f = g_f + ld.fwd_mem * b / mem_s + ld.fwd_ops * hw.op_overhead_s
        t_b = g_b + ld.bwd_mem * b / mem_s + (ld.ops - ld.fwd_ops) * hw.op_overhead_s
        t_rc = t_f if ac else 0.0
        t_tp = ld.tp_collectives * ar_tp * (3 if ac else 2)
        work = t_f + t_b + t_rc + t_tp
        key = (work, ld.params)
        if best is None or key > best[0]:
            best = (key, ld, t_f, t_b, t_rc, t_tp)
    _, ld, t_f, t_b, t_rc, t_tp = best
    t_p2p = 0.0
    if p > 1:
        pbw, plat = _axis_link(plan, "pp", hw, "send_recv")
        t_p2p = 2 * v * p2p_time(ld.boundary * b, pbw, plat)
    # data parallel
    grad_bytes = 4 * ld.params                    # fp32 gradients / reductions
    work_bytes = (2 if prec == "bf16" else 4) * ld.params
    dp_exposed, fsdp_per_mb = 0.0, 0.0
    if plan.dp_shard > 1:
        sbw, slat = _axis_link(plan, "dp_shard", hw, "all_gather")
        rsbw, rslat = _axis_link(plan, "dp_shard", hw, "reduce_scatter")
        n = plan.dp_shard
        gathers = 2 if plan.reshard_after_forward else 1
        comm = gathers * all_gather_time(work_bytes, n, sbw, slat) + all_gather_time(grad_bytes, n, rsbw, rslat)
        first = all_gather_time(work_bytes * ld.max_unit_params / max(ld.params, 1), n, sbw, slat)
        fsdp_per_mb = max(0.0, comm - (t_f + t_b + t_rc)) + first
        if plan.dp_replicate > 1:
            rbw, rlat = _axis_link(plan, "dp_replicate", hw)
            dp_exposed = all_reduce_time(grad_bytes / n, plan.dp_replicate, rbw, rlat)
    elif plan.dp_replicate > 1:
        rbw, rlat = _axis_link(plan, "dp_replicate", hw)
        n = plan.dp_replicate
        t_ar = all_reduce_time(grad_bytes, n, rbw, rlat)
        last = all_reduce_time(min(DDP_BUCKET_BYTES, grad_bytes), n, rbw, rlat)
        dp_exposed = max(t_ar - t_b, last) if dp_overlap else t_ar
    per_mb_compute = t_f + t_b + t_tp
    bub = bubble_fraction(plan.pp_schedule, p, m, v) * m * (per_mb_compute + t_rc)
    if hw.name == "cpu":
        opt = (ld.params / plan.dp_shard * OPT_TRAFFIC_CPU[optimizer] / mem_s
               + ld.num_tensors * OPT_KERNELS[optimizer] * hw.op_overhead_s)
    else:
        opt = ld.params / plan.dp_shard * OPT_TRAFFIC[optimizer] / mem_s
    return {"compute": accumulation * m * (t_f + t_b), "recompute": accumulation * m * t_rc,
            "tp_comm": accumulation * m * t_tp, "pp_comm": accumulation * m * t_p2p,
            "dp_comm": dp_exposed + accumulation * m * fsdp_per_mb, "bubble": accumulation * bub,
            "optimizer": opt}


def estimate_step(profile: ModelProfile, plan: ParallelPlan, batch: Batch, hw: Hardware, *,
                  optimizer: str = "adamw", dp_overlap: bool = True) -> StepEstimate:
    """Predict one optimizer step of ``plan`` on ``hw`` (see module docstring for the formulas).

    Args:
        profile: `profile_model` output (any batch; scaled per sample).
        plan: the layout (its precision picks the peak FLOP/s).
        batch: global and local batch sizes (samples).
        hw: the device and its links.
        optimizer: ``"sgd"``, ``"sgd_momentum"`` or ``"adamw"`` (optimizer-step memory traffic).
        dp_overlap: whether DDP overlaps its all-reduce with backward (torch DDP does).

    Raises:
        ValueError: batch sizes that do not divide, unknown optimizer or precision.
    """
    if optimizer not in OPT_TRAFFIC:
        raise ValueError(f"optimizer={optimizer!r} is unknown; valid: {', '.join(OPT_TRAFFIC)}")
    b = batch.micro_batch_size(plan)
    acc = batch.accumulation_steps(plan)
    loads = rank_loads(profile, plan, act_bytes=2 if plan.precision == "bf16" else 4)
    parts = rank_step(loads, plan, hw, micro_batch_size=b, accumulation=acc, optimizer=optimizer,
                      tp_bytes=tp_bytes_per_sample(profile, plan), dp_overlap=dp_overlap)
    return _finish(parts, profile, plan, batch.global_batch_size)


def tp_bytes_per_sample(profile: ModelProfile, plan: ParallelPlan) -> float:
    """Bytes of one TP all-reduce per sample: a middle block's output at the plan's precision."""
    mid = profile.blocks[len(profile.blocks) // 2]
    scale = (2 if plan.precision == "bf16" else 4) / (2 if profile.dtype == "bf16" else 4)
    return mid.output_bytes * scale / profile.batch_size


def _finish(parts: dict, profile: ModelProfile, plan: ParallelPlan, global_batch: int,
            flops: tuple[float, float] | None = None) -> StepEstimate:
    """Wrap step parts; ``flops`` = (forward, backward) FLOPs per sample, computed if None."""
    if flops is None:
        flops = (profile.fwd_flops_per_sample, profile.train_flops_per_sample - profile.fwd_flops_per_sample)
    fwd, bwd = flops
    model = global_batch * (fwd + bwd)
    hw_flops = model + (global_batch * fwd if plan.activation_checkpointing == "full" else 0.0)
    return StepEstimate(**parts, model_flops=model, hardware_flops=hw_flops,
                        num_devices=plan.world_size, samples=global_batch,
                        tokens_per_sample=profile.tokens_per_sample)
