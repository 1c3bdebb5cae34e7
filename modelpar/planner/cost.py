"""Step-time model: compute, collectives, pipeline bubble, recompute; MFU and HFU.

Sources:
- Collectives, alpha-beta ring costs (Thakur, Rabenseifner & Gropp, "Optimization of Collective
  Communication Operations in MPICH", IJHPCA 2005, Sec. 4): for n ranks and B bytes,
  all-reduce 2(n-1) alpha + 2(n-1)/n B/beta; all-gather and reduce-scatter (n-1) alpha + (n-1)/n B/beta
  (B = the full, gathered size); send/recv alpha + B/beta.
- Tensor parallel: 2 all-reduces per layer in forward, 2 in backward (Shoeybi et al., "Megatron-LM", 2019,
  Sec. 3, Fig. 4); sequence parallel: a reduce-scatter + all-gather each (Korthikanti et al. 2022, Sec.
  4.2.2). CPU without SP: modelpar's DTensor runtime's one per sharded matrix (`StepForm.tp_per_matrix`).
- Pipeline bubble / ideal time (Narayanan et al. SC'21, Sec. 2.2): (p-1)/m for GPipe and 1F1B,
  (p-1)/(v m) interleaved; ZB-H1 (p-1)/(3m) (Qi et al., "Zero Bubble Pipeline Parallelism", ICLR'24,
  Sec. 3); ZB-V about 0.
- Compute: matmul-class FLOPs / (peak x achievable GEMM fraction) + memory-bound bytes /
  (bandwidth x fraction) + ops x per-op overhead (a roofline split, Williams et al., CACM 2009).
  On CPU the achievable rate is calibrated: each 2-D product the profile recorded by shape and
  layout (`BlockProfile.gemm_shapes`) at the square-product curve's rate for its FLOPs
  (`Hardware.gemm_flops`) times its shape's factor from the calibrated grid
  (`Hardware.shape_factor`, log-space interpolation), the other matmul FLOPs at the curve at their
  mean call; files without the grid, TP loads and GPUs price every matmul the old way; built-in GPUs
  (bf16) add each layer's GEMM wave quantization (`gpu.layer_wave_seconds`), replays included.
- Full recompute adds the blocks' forward per micro-batch (Chen et al. 2016; Korthikanti Sec. 5; a
  transformer's embedding, head and loss are not checkpointed, so they run once); every-k the
  checkpointed blocks' share of it, selective the attention cores' forward
  (`modelpar.planner.recompute`); recomputed blocks replay their TP all-reduces. A split backward
  (zero bubble) replays a checkpointed block at ``I`` and again at ``W``.
- MFU / HFU: Chowdhery et al., "PaLM" (2022), App. B: model FLOPs count each forward once, hardware
  FLOPs include the recomputed forward.

Overlap: DDP overlaps the gradient all-reduce with the last backward except its final 25 MiB bucket
(``bucket_cap_mb`` default); FSDP prefetches, hiding its gathers behind the forward and its re-gathers
and reduce-scatters behind the backward, except what precedes or follows all compute (the root's and
the first block's gather, the first block's and the root's reduce-scatter) and what exceeds each
window (`_fsdp_exposed`); under a pipeline FSDP reduces once after the schedule, exposed. On built-in
GPUs the hidden collectives hold NCCL's share of the SMs (`gpu.GpuPhysics.nccl_sm_share` inside a
node, ``nccl_sm_share_inter`` for groups spanning nodes), slowing the compute they overlap by that share of their time. TP and pipeline p2p are not overlapped.
Where ``Hardware.comm_overlap`` is False (CPU ranks that own every core: gloo copies and reduces with
those cores) nothing overlaps: DDP adds its bucketed all-reduces and its bucket copies, FSDP its
gathers, reduce-scatters and the copies into and out of its flat buffers.

Collectives inside one node use the calibrated table of measured times when there is one
(`Hardware.collective_seconds`), else the alpha-beta forms above.

Fresh allocations (CPU): glibc's malloc serves blocks above its mmap threshold (at most 32 MiB on
64-bit) with new pages on every allocation, so such a tensor costs page faults and zeroing on first
touch and unmapping on free, at a per-byte cost `modelpar calibrate` measures. Counted: each
micro-batch's weight gradients, FSDP's flat gather / reduce-scatter buffers and unsharded
parameters (the fused AdamW step and the gradient norm make no temporaries).
Gradient accumulation adds one in-place add (12 B/param) per micro-batch after the first (of the
local shards where FSDP accumulates sharded gradients). FSDP without a pipeline reduce-scatters
every local batch (FSDP2's default) unless the plan defers the sync (``defer_grad_sync``: once per
step); HSDP's all-reduce across replicas runs once per step either way. DDP's buckets are views of
its gradients (``gradient_as_bucket_view=True``): no copy into or out of them. Frozen parameters have no
gradient to reduce, accumulate or step (`loads.RankLoad.trainable`); their backward FLOPs are profiled.
"""

from __future__ import annotations

from modelpar.plan import SPLIT_BACKWARD_SCHEDULES, ParallelPlan, autocasts, runtime_layout
# formulas.py (collective alpha-beta, pipeline bubble) and comms.py (one rank's collectives), re-exported
from modelpar.planner.formulas import (all_gather_time, all_reduce_time, alpha_beta_form,  # noqa: F401
                                       bubble_fraction, fill_drain_from_sums)
from modelpar.planner.comms import (DDP_BUCKET_BYTES, DDP_FIRST_BUCKET_BYTES, _coll,  # noqa: F401
                                    _comm_terms, _fsdp_exposed, _nccl_share, ddp_buckets)
from modelpar.planner.gpu import gpu_load_times, layer_wave_seconds, physics_for
from modelpar.planner.calibration import NO_CALIBRATION
from modelpar.planner.hardware import Hardware
from modelpar.planner.memo import PlannerCache
from modelpar.planner.memory import Batch, RankLoad, rank_loads
from modelpar.planner.profile import ModelProfile
from modelpar.planner.recompute import recompute_layers, recompute_share
from modelpar.planner.records import SlowestRank
# CPU pricing of the profiled shapes (matmuls by shape and layout, attention by S and D)
from modelpar.planner.cpu_shapes import _attention_seconds, _framework_seconds, _shape_seconds, lockstep_contention  # noqa: F401
# the result type, MFU / HFU and the wrapping of step parts live in step_estimate.py, re-exported here
from modelpar.planner.step_estimate import StepEstimate, _finish, hfu, mfu, tp_bytes_per_sample  # noqa: F401

# bytes read + written per parameter by the optimizer step: torch's fused AdamW (modelpar's default,
# `modelpar.train.step.adamw`, on GPUs and CPUs) reads param, grad and both moments and writes param and
# moments, 28; SGD's in-place add_ 12; with momentum (foreach on GPUs) 20, on CPU's single-tensor loop
# mul_ + add_ + add_ = 32. Gradient clipping adds a norm (read 4) and a scale (read + write 8) = 12.
OPT_TRAFFIC = {"sgd": 12 + 12, "sgd_momentum": 20 + 12, "adamw": 28 + 12}
OPT_TRAFFIC_CPU = {"sgd": 12 + 12, "sgd_momentum": 32 + 12, "adamw": 28 + 12}
# kernels launched per parameter tensor on CPU: the update (fused AdamW loops inside one call) and
# clipping's norm, square, accumulate and scale
OPT_KERNELS = {"sgd": 1 + 4, "sgd_momentum": 3 + 4, "adamw": 1 + 4}
# tensor-parallel plans mix plain tensors and DTensors, which the fused kernel refuses, so AdamW runs
# torch's single-tensor loop (`modelpar.train.step.adamw`): mul_ 8, lerp_ 12, mul_ 8, addcmul_ 16,
# sqrt 8, div 8, add_ 8, addcdiv_ 16 = 84 B/param, 8 kernels and two new tensors (sqrt, div) per tensor
ADAMW_LOOP_TRAFFIC, ADAMW_LOOP_KERNELS = 84 + 12, 8 + 4
# 16-bit model weights with fp32 main weights in the optimizer (Megatron-LM's
# Float16OptimizerWithFloat16Params, megatron/optimizer/optimizer.py): per step the model gradients
# are copied into fp32 main gradients (read 2, write 4), unscaled and checked for inf / nan (read 4,
# write 4), and the updated main weights copied back into the model's (read 4, write 2)
MASTER_WEIGHT_TRAFFIC = 6 + 8 + 6


# ---- the step ---------------------------------------------------------------------------------


def _load_times(ld: RankLoad, hw: Hardware, b: int, prec: str, mem_s: float, ew_s: float, attn_rate: float,
                curve: bool, flops_s: float, alone: bool, phys=None, kernel=None, ctn: float = 1.0,
                rates: dict | None = None) -> tuple[float, float]:
    """Forward and backward seconds of one micro-batch of ``b`` samples on a rank holding ``ld``
    (memoized by `rank_step`). ``phys``: the built-in GPU's published tables (`gpu.gpu_load_times`),
    None elsewhere, with ``rates`` its memo of attention rates. ``ctn``: compute's slowdown on ranks in
    lockstep (`cpu_shapes.lockstep_contention`)."""
    if phys is not None:
        return gpu_load_times(ld, b, mem_s, flops_s, phys, kernel, rates)
    # fused attention kernels at their own calibrated rate where there is one (on CPU far below
    # the GEMM rate); otherwise they count as matmuls
    af, ab = ld.attn_flops if attn_rate else (0.0, 0.0)
    ac_calls = ld.attn_calls if attn_rate else 0
    mf, mb_ = ld.fwd_flops - af, ld.bwd_flops - ab
    nf, nb = max(ld.fwd_gemms - ac_calls, 1), max(ld.bwd_gemms - ac_calls, 1)
    # 2-D products priced by shape and layout where the calibration has the grid (`_shape_seconds`);
    # the rest (and everything on files without the grid) on the FLOPs-only curve at its mean call
    (s_f, s_b), (fl_f, fl_b), (k_f, k_b) = _shape_seconds(ld, hw, b, prec)
    rest_f, rest_b = max(mf * b - fl_f, 0.0), max(mb_ * b - fl_b, 0.0)
    rf = (hw.gemm_flops(prec, rest_f / max(nf - k_f, 1)) if curve and ld.fwd_gemms else flops_s) if rest_f else 1.0
    rb = (hw.gemm_flops(prec, rest_b / max(nb - k_b, 1)) if curve and ld.bwd_gemms else flops_s) if rest_b else 1.0
    # matmuls: roofline of their FLOPs and the bytes they move (weights once per micro-batch)
    g_f = max((s_f + rest_f / rf) * ctn, (ld.gemm_param_bytes[0] + ld.gemm_act_bytes[0] * b) / mem_s)
    g_b = max((s_b + rest_b / rb) * ctn, (ld.gemm_param_bytes[1] + ld.gemm_act_bytes[1] * b) / mem_s)
    if attn_rate:
        (a_f, a_b), (fa_f, fa_b) = _attention_seconds(ld, hw, b, attn_rate)
        g_f += (a_f + max(af * b - fa_f, 0.0) / attn_rate) * ctn
        g_b += (a_b + max(ab * b - fa_b, 0.0) / attn_rate) * ctn
    fw_f, fw_b = _framework_seconds(ld, hw)         # per-call framework cost (dispatch, autograd, modules)
    t_f = g_f + ld.fwd_mem * b / min(mem_s, ew_s / ctn) + fw_f * ctn
    # backward: every micro-batch's weight gradients (of the trainable parameters) are new tensors
    # (the first become .grad, later ones are added into it)
    t_b = (g_b + ld.bwd_mem * b / min(mem_s, ew_s / ctn) + fw_b * ctn
           + hw.fresh_seconds(ld.trainable_sizes, 4, alone=alone))
    return t_f, t_b


def rank_step(loads: list[RankLoad], plan: ParallelPlan, hw: Hardware, *, micro_batch_size: int,
              accumulation: int, optimizer: str, tp_bytes: float, dp_overlap: bool = True,
              fused_tp_optimizer: bool = False, reduce_bytes: float = 4,
              gather_bytes: float | None = None, attention_kernel: str | None = None,
              p2p_scatter_gather: bool = False, replicate: bool | None = None,
              autocast_weights: bool | None = None, fsdp_stream_copies: bool = True,
              master_weights: bool = False, cache: PlannerCache | None = None) -> dict:
    """Seconds of one step on the slowest pipeline rank; ``tp_bytes`` = block output per sample.

    CPU-specific terms (zero where the hardware profile lacks them): fresh allocations
    (`Hardware.fresh_seconds`: each micro-batch's weight gradients; FSDP's gathered and
    reduce-scatter buffers), and no overlap
    of communication with compute when ``hw.comm_overlap`` is False.
    ``reduce_bytes`` / ``gather_bytes``: bytes per element of reduced gradients (4: fp32, modelpar's
    reductions) and of FSDP-gathered parameters (None: the plan's precision); other runtimes differ
    (Megatron-LM fp16 reduces fp16 gradients; Composer's FSDP mixed-precision modes).
    ``attention_kernel``: fused-attention table on built-in GPUs (`gpu.GpuPhysics`; None: its default).
    ``p2p_scatter_gather``: Megatron-LM's scatter / gather of pipeline transfers (`_comm_terms`).
    ``replicate``: dp_replicate runs FSDP2's replicate (per-group reductions; under a pipeline once
    after the schedule) rather than torch DDP's buckets; None: modelpar's runtime (replicate under
    PP or TP, DDP otherwise); False for other runtimes' DDP (Megatron-LM rows).
    ``autocast_weights``: the matmuls' weights are fp32 under ``torch.autocast`` (bf16 plans), which
    casts each weight to bf16 once per forward region (read 4 + write 2 bytes per element, the
    recomputed forward again) and its gradient back to fp32 in backward (read 2 + write 4), at the
    HBM rate (built-in GPUs; `gpu.py`). None: modelpar's runtime (autocast unless FSDP2's or
    replicate's MixedPrecisionPolicy holds bf16 parameters: `ParallelModel`); True for Composer's
    DEFAULT mode (fp32 parameters gathered), False for runtimes that keep 16-bit weights.
    ``fsdp_stream_copies``: FSDP2's all-gather copy-out and reduce-scatter copy-in run on the compute
    stream (devices that overlap; torch's ``_fsdp_collectives``); False for FSDP1's flat parameters
    (gathered in place, gradients cast on FSDP1's post-backward stream).
    ``master_weights``: 16-bit model weights with fp32 main weights in the optimizer
    (`MASTER_WEIGHT_TRAFFIC` per parameter and step; GPU profiles; Megatron-LM's fp16 runs).
    ``cache``: the search's memo tables (`memo.PlannerCache`, bound to ``hw``); None: a fresh one.

    Raises:
        ValueError: ``cache`` serves another hardware profile.
    """
    return step_form(loads, plan, hw, optimizer=optimizer, tp_bytes=tp_bytes, dp_overlap=dp_overlap,
                     fused_tp_optimizer=fused_tp_optimizer, reduce_bytes=reduce_bytes, gather_bytes=gather_bytes,
                     attention_kernel=attention_kernel, p2p_scatter_gather=p2p_scatter_gather,
                     replicate=replicate, autocast_weights=autocast_weights,
                     fsdp_stream_copies=fsdp_stream_copies, master_weights=master_weights,
                     cache=cache).at(plan, micro_batch_size, accumulation)


def step_form(loads: list[RankLoad], plan: ParallelPlan, hw: Hardware, *, optimizer: str, tp_bytes: float,
              dp_overlap: bool = True, fused_tp_optimizer: bool = False, reduce_bytes: float = 4,
              gather_bytes: float | None = None, attention_kernel: str | None = None,
              p2p_scatter_gather: bool = False, replicate: bool | None = None,
              autocast_weights: bool | None = None, fsdp_stream_copies: bool = True,
              master_weights: bool = False, cache: PlannerCache | None = None) -> "StepForm":
    """`rank_step`'s terms that depend only on the layout: ``plan``'s degrees, schedule, virtual
    stages, precision and sharding, ``hw`` and the options (as `rank_step`); `StepForm.at` adds
    the micro-batch size, the accumulation steps, and ``plan``'s micro-batch count, checkpointing
    and deferred sync, with the same arithmetic as one `rank_step` call. The search evaluates one
    form at every candidate of a layout."""
    f = StepForm()
    f.loads, f.hw, f.tp_bytes, f.dp_overlap, f.reduce_bytes = loads, hw, tp_bytes, dp_overlap, reduce_bytes
    f.attention_kernel, f.p2p_scatter_gather = attention_kernel, p2p_scatter_gather
    f.fsdp_stream_copies = fsdp_stream_copies
    f.cache = cache = (cache or PlannerCache()).bind(hw=hw)
    f.prec = prec = plan.precision
    f.flops_s = hw.achievable_flops(prec)
    # ranks in lockstep (data / tensor parallel peers on one node) stream memory and fault pages at
    # the same moments and share the bus; a pure pipeline's stages run different work at any moment,
    # so each streams at the one-rank rate (both calibrated on CPU; the same number elsewhere)
    f.alone = alone = plan.dp * plan.tp == 1 and plan.pp > 1
    f.cal = cal = hw.calibration or NO_CALIBRATION
    f.ctn = lockstep_contention(plan, hw)       # data / tensor parallel ranks compute at the same moments
    mem_s = ((cal.mem_bandwidth_alone if alone and cal.mem_bandwidth_alone is not None else hw.mem_bandwidth)
             * hw.mem_bw_fraction)
    f.phys = phys = physics_for(hw)
    if phys is not None:            # built-in GPU: measured HBM fraction and MAMF (gpu.py)
        mem_s = hw.mem_bandwidth * phys.hbm_fraction
    f.mem_s = mem_s
    f.v, f.p = plan.virtual_stages, plan.pp
    f.overlap = dp_overlap and hw.comm_overlap
    f.curve = bool(hw.matmul_curve())
    # the non-matmul operators' traffic moves at their calibrated rate (arithmetic-heavy: GELU's erf,
    # norms' reductions), never above the streaming bandwidth
    f.ew_s = min(mem_s, cal.elementwise_bw if cal.elementwise_bw is not None else mem_s)
    f.attn_rate = cal.attention_flops * hw.peak_flops[prec] / hw.peak_flops.get("fp32", hw.peak_flops[prec])
    # zero-bubble schedules split each backward into an input-gradient and a weight-gradient pass
    # (Qi et al. ICLR'24; torch's stage_backward_input / stage_backward_weight): the weight pass
    # re-reads activations and output gradients the cache has lost; calibrated on CPU, 1 elsewhere
    f.zb = (cal.zero_bubble_backward_factor
            if plan.pp > 1 and plan.pp_schedule in SPLIT_BACKWARD_SCHEDULES else 1.0)
    # modelpar's runtime: autocast unless FSDP2 / replicate holds bf16 parameters (`runtime_layout`)
    f.layout = layout = runtime_layout(plan)
    if autocast_weights is None:
        autocast_weights = layout.dp_wrapper in ("none", "ddp")
    # seconds per byte of bf16 matmul weights: 6 B moved per element (2 B) in each direction
    f.cast_b = 3.0 / mem_s if (phys is not None and prec == "bf16" and autocast_weights) else 0.0
    # data parallel
    f.wb = gather_bytes or (2 if prec == "bf16" else 4)
    # modelpar runs dp_replicate under PP or TP through FSDP2's replicate (`parallel.compose`):
    # per-group all-reduces (on devices that overlap; CPU keeps its calibrated bucket terms)
    f.rep_rt = (layout.dp_wrapper == "replicate" if replicate is None
                else (replicate and layout.dp_wrapper in ("ddp", "replicate")))
    f.shard_share = _nccl_share(plan, "dp_shard", hw, phys) if plan.dp_shard > 1 and f.overlap else 0.0
    f.rep_share = _nccl_share(plan, "dp_replicate", hw, phys) if plan.dp_replicate > 1 and f.overlap else 0.0
    # the optimizer step of each rank (no micro-batch term)
    loop = optimizer == "adamw" and plan.tp > 1 and not fused_tp_optimizer
    ds = plan.dp_shard
    if hw.kind == "cpu":
        traffic, kernels = ((ADAMW_LOOP_TRAFFIC, ADAMW_LOOP_KERNELS) if loop
                            else (OPT_TRAFFIC_CPU[optimizer], OPT_KERNELS[optimizer]))
        f.opt = [ld.trainable / ds * traffic / mem_s + len(ld.trainable_sizes) * kernels * hw.op_overhead_s
                 + (2 * hw.fresh_seconds([k / ds for k in ld.trainable_sizes], 4) if loop else 0.0) for ld in loads]
    else:
        traffic = ADAMW_LOOP_TRAFFIC if loop else OPT_TRAFFIC[optimizer]
        f.opt = ([ld.trainable / ds * traffic / mem_s + ld.trainable / ds * MASTER_WEIGHT_TRAFFIC / mem_s
                  for ld in loads] if master_weights else [ld.trainable / ds * traffic / mem_s for ld in loads])
    # `runtime_layout(plan).sharded_grad_accumulation` of this layout's plans is this and not defer_grad_sync
    f.shard_acc = plan.dp_shard > 1 and plan.pp == 1
    f.per_b, f.slowest, f.comms, f.floors = {}, {}, {}, {}      # floors: `topk._exposed_terms` per rank
    # CPU without SP (DTensor): colwise Linears all-reduce input grads in backward (q, k, v apart), rowwise
    # outputs in forward: 1 per sharded matrix (`cpu_step_waits.py`: gpt-1m 26, hf-llama 30; `_tp_linear_cost`)
    f.tp_per_matrix = hw.kind == "cpu" and phys is None and plan.tp > 1 and not plan.sequence_parallel
    return f


class StepForm:
    """One layout's `rank_step` (`step_form`); `at` evaluates it for one candidate."""

    __slots__ = ("loads", "hw", "tp_bytes", "dp_overlap", "reduce_bytes", "attention_kernel", "p2p_scatter_gather",
                 "fsdp_stream_copies", "cache", "prec", "flops_s", "alone", "cal", "mem_s", "phys", "v", "p",
                 "overlap", "curve", "ew_s", "attn_rate", "zb", "layout", "cast_b", "wb", "rep_rt", "shard_share",
                 "rep_share", "opt", "per_b", "slowest", "shard_acc", "comms", "tp_per_matrix", "ctn", "floors")

    def _times(self, plan: ParallelPlan, b: int) -> tuple:
        """Per micro-batch size ``b`` (memoized): each rank's forward and backward seconds, the TP
        all-reduce and the per-Linear TP cost."""
        hit = self.per_b.get(b)
        if hit is not None:
            return hit
        hw, cal, cache, tp_bytes, prec, alone, zb, cast_b = (self.hw, self.cal, self.cache, self.tp_bytes, self.prec,
                                                             self.alone, self.zb, self.cast_b)
        ar_tp = (_coll(plan, "tp", hw, "all_reduce", tp_bytes * b, plan.tp, not hw.comm_overlap, cache)
                 if plan.tp > 1 else 0.0)
        # DTensor's cost per sharded Linear (forward + backward): fixed + per byte of its input activation
        tp_linear = ((cal.tp_linear_overhead_s + cal.tp_linear_overhead_s_per_byte * tp_bytes * b)
                     if plan.tp > 1 else 0.0)
        load_times = cache.load_times
        times = []
        for ld in self.loads:
            key = (ld.key, b, prec, alone, self.attention_kernel, self.ctn)
            hit = load_times.get(key)
            if hit is not None and hit[0] is ld:
                t_f, t_b = hit[1]
            else:
                t_f, t_b = _load_times(ld, hw, b, prec, self.mem_s, self.ew_s, self.attn_rate, self.curve,
                                       self.flops_s, alone, self.phys, self.attention_kernel, self.ctn,
                                       cache.attn_rates)
                load_times[key] = (ld, (t_f, t_b))
            # built-in GPU, bf16: each layer's weight-GEMM tile / wave quantization (`gpu.layer_wave_seconds`)
            w_f = 0.0
            if self.phys is not None and prec == "bf16" and ld.layer_gemm:
                tok, h, ffn, layers = ld.layer_gemm
                wk = (b * tok, h, ffn, plan.tp)
                w_f, w_b = cache.waves.get(wk) or cache.waves.setdefault(
                    wk, layer_wave_seconds(*wk, self.phys.sms, self.flops_s, self.mem_s))
                t_f += layers * w_f
                t_b += layers * w_b
            t_b *= zb                       # 1.0 but for zero-bubble schedules
            if cast_b:                      # autocast's weight casts, forward and backward
                t_f += cast_b * ld.gemm_param_bytes[0]
                t_b += cast_b * ld.gemm_param_bytes[0]
            times.append((ld, t_f, t_b, w_f))
        out = self.per_b[b] = (times, ar_tp, tp_linear)
        return out

    def _slowest(self, plan: ParallelPlan, b: int) -> SlowestRank:
        """The slowest rank at micro-batch size ``b`` under ``plan``'s checkpointing (memoized; ``fill``:
        GPipe / 1F1B's sums before ``m`` for `formulas.fill_drain_from_sums`, (U, D, F_k, B_k, p - k))."""
        mode = plan.activation_checkpointing
        skey = (b, mode, plan.ac_every, plan.pp_schedule)
        hit = self.slowest.get(skey)
        if hit is not None:
            return hit
        times, ar_tp, tp_linear = self._times(plan, b)
        ac_any = mode in ("full", "every-k", "selective")
        split = 2.0 if self.p > 1 and plan.pp_schedule in SPLIT_BACKWARD_SCHEDULES else 1.0
        attn_rate, flops_s = self.attn_rate, self.flops_s
        best_key, best, fb = None, 0, []
        for i, (ld, t_f, t_b, w_f) in enumerate(times):
            t_rc, rc_share = 0.0, 0.0
            if ac_any:     # the checkpointed blocks' share / the cores (`modelpar.planner.recompute`)
                rc_share, attn_f = recompute_share(ld, plan)
                t_rc = rc_share * t_f
                if w_f:    # the replayed layers' GEMM waves, per layer (not by the FLOPs share)
                    layers = ld.layer_gemm[3]
                    t_rc += (recompute_layers(ld, plan) - rc_share * layers) * w_f
                # split backward: blocks replay at I and at W (`pipeline.group_weight_pass`), cores at I only
                t_rc = t_rc * split + (attn_f * b / attn_rate if attn_rate else attn_f * b / flops_s)
            # all-reduces: 2 x forward's (Megatron-LM) or 1 per sharded matrix (`tp_per_matrix`), + replays; and
            # DTensor's calibrated per-call cost of each sharded Linear (dispatch, conversions; fwd + bwd)
            ars = (ld.tp_linears if self.tp_per_matrix else 2 * ld.tp_collectives) + rc_share * split * ld.tp_collectives
            t_tp = ars * ar_tp + ld.tp_linears * tp_linear
            work = t_f + t_b + t_rc + t_tp
            fb.append((t_f + t_tp / 2, t_b + t_rc + t_tp / 2))     # TP's cost split evenly (forward, backward)
            key = (work, ld.params)
            if best_key is None or key > best_key:
                best_key, best = key, (i, ld, t_f, t_b, t_rc, t_tp)      # the first fields of `SlowestRank`
        # GPipe / 1F1B with one stage per rank and every rank's load: the other stages' times before and
        # after the slowest rank, for its wait while the pipeline fills and drains
        # (`formulas.fill_drain_seconds`); None: the bubble fraction (`at`)
        fill = None
        if self.p > 1 and self.v == 1 and plan.pp_schedule in ("gpipe", "1f1b") and len(fb) == self.p:
            k = best[0]
            fill = (sum(f + b_ for f, b_ in fb[:k]), sum(f + b_ for f, b_ in fb[k + 1:]), *fb[k], self.p - k)
        out = self.slowest[skey] = SlowestRank(*best, fill)
        return out

    def comms_at(self, plan: ParallelPlan, i: int, ld, b: int) -> dict:
        """`comms._comm_terms` of rank ``i`` (load ``ld``) at ``b`` samples: the rest is the form's, so memoized per form."""
        return self.comms.get((i, b)) or self.comms.setdefault((i, b), _comm_terms(
            ld, plan, self.hw, b, self.wb, self.dp_overlap, self.reduce_bytes, self.p2p_scatter_gather,
            self.rep_rt and self.overlap, self.cache))

    def at(self, plan: ParallelPlan, micro_batch_size: int, accumulation: int) -> dict:
        """`rank_step`'s parts for ``plan`` (this form's layout) at ``micro_batch_size`` samples and
        ``accumulation`` local batches."""
        b = micro_batch_size
        hw, cal, mem_s, phys, v, p, overlap, wb, dp_overlap, reduce_bytes = (
            self.hw, self.cal, self.mem_s, self.phys, self.v, self.p, self.overlap, self.wb, self.dp_overlap, self.reduce_bytes)
        m = plan.n_microbatches if p > 1 else 1
        s = self._slowest(plan, b)
        i, ld, fill, t_f, t_b, t_rc, t_tp = s.index, s.load, s.fill, s.t_f, s.t_b, s.t_rc, s.t_tp
        mbs = accumulation * m                          # micro-batches per step on this rank
        # gradient accumulation: micro-batches after the first add their gradients in place (read 2,
        # write 1 fp32 values per parameter); FSDP without a pipeline adds reduce-scattered shards
        # unless the plan defers the sync (`plan.runtime_layout`)
        sharded_acc = self.shard_acc and not plan.defer_grad_sync     # = runtime_layout(plan).sharded_grad_accumulation
        t_acc = (mbs - 1) * 12 * ld.trainable / (plan.dp_shard if sharded_acc else 1) / mem_s
        layout, rep_rt = self.layout, self.rep_rt
        cm = self.comms_at(plan, i, ld, b)
        t_p2p = 2 * v * cm["p2p"] if p > 1 else 0.0
        dp_exposed, fsdp_per_mb = 0.0, 0.0
        if plan.dp_shard > 1:
            n = plan.dp_shard
            gathers = 2 if plan.reshard_after_forward else 1
            units = ld.unit_sizes or (ld.params - ld.root_params,)
            root = ld.root_params
            ag, ag_root, rs = cm["ag"], cm["ag_root"], cm["rs"]
            if overlap:
                share = self.shard_share
                # a micro-batch reduce-scatters where FSDP accumulates sharded gradients; a deferred
                # sync only in the last local batch; under a pipeline torch's runtime reduces once
                # after the schedule's last backward (`PipelineStage.perform_reduce_grad`), exposed
                deferred = plan.defer_grad_sync and mbs > 1
                fsdp_per_mb = _fsdp_exposed(cm, gathers, t_f, t_b + t_rc, share,
                                            reduce=p == 1 and not deferred)
                if deferred:
                    dp_exposed = _fsdp_exposed(cm, gathers, t_f, t_b + t_rc, share, reduce=True) - fsdp_per_mb
                elif p > 1:
                    dp_exposed = rs
                if self.fsdp_stream_copies:
                    # FSDP2 copies on the compute stream (torch's `_fsdp_collectives`): every gather's
                    # copy-out of the flat buffer (read + write; the root once per micro-batch), and each
                    # reduce-scatter's copy-in of the unsharded gradients (read wb, write reduce dtype)
                    fsdp_per_mb += 2 * wb * (gathers * (ld.params - root) + root) / mem_s
                    copy_in = (wb + reduce_bytes) * ld.trainable / mem_s
                    if p == 1 and not deferred:
                        fsdp_per_mb += copy_in
                    else:
                        dp_exposed += copy_in
            else:
                # FSDP2's buffers: each gather fills a new flat all-gather output and copies it out into
                # new unsharded parameters (read + write); reduce-scatter copies the unsharded gradients
                # into a new flat input and writes a new shard (fresh where the allocator maps them)
                ag_mem = (hw.fresh_seconds(units, wb) + hw.fresh_seconds(ld.param_sizes, wb)
                          + 2 * wb * (ld.params - root) / mem_s)
                g_units = ld.unit_trainable or (ld.trainable - ld.root_trainable,)     # trainable only
                rs_mem = (hw.fresh_seconds(g_units, 4) + hw.fresh_seconds([u / n for u in g_units], 4)
                          + 8 * (ld.trainable - ld.root_trainable) / mem_s)
                # + FSDP2's per-unit cost (hooks, copy-in/out bookkeeping; forward + backward), calibrated
                fsdp_per_mb = (gathers * (ag + ag_mem) + ag_root
                               + (len(units) + 1) * cal.fsdp_unit_overhead_s
                               + ld.num_tensors * cal.fsdp_tensor_overhead_s)
                # the reduce-scatter: once per step where the last micro-batch syncs (deferred sync, and
                # torch.distributed.pipelining's runtime, which reduces at the end of each schedule step:
                # modelled once per step), every local batch where FSDP accumulates sharded gradients
                dp_exposed = (rs + rs_mem) * (accumulation if sharded_acc else 1)
            dp_exposed += cm["rep"]
        elif plan.dp_replicate > 1:
            t_ar, last = cm["t_ar"], cm["last"]
            if overlap and rep_rt and p > 1:
                # FSDP2 replicate under torch.distributed.pipelining: the runtime reduces once after the
                # schedule's last backward (`PipelineStage.perform_reduce_grad`), nothing left to hide
                # it; each group's gradients copied into the flat fp32 buffer and back (read + write)
                dp_exposed = t_ar + 16 * ld.trainable / mem_s
            elif overlap:
                # torch DDP's buckets, or replicate's groups (under TP), behind the backward, except the
                # last bucket (replicate: the first block's and the root's group, reduced after the last
                # compute); the hidden part slows the backward it overlaps by NCCL's share of the SMs
                dp_exposed = max(t_ar - t_b, last) + self.rep_share * min(t_ar, t_b)
            elif not dp_overlap:         # one all-reduce of a contiguous gradient buffer after backward
                dp_exposed = t_ar
            elif layout.dp_wrapper == "ddp":
                # torch DDP with gradient_as_bucket_view=True (`apply_ddp`): the gradients are the
                # buckets, nothing is copied
                dp_exposed = t_ar
            else:
                # FSDP2's replicate (DDP semantics under PP / TP) copies the gradients into a flat
                # buffer and the reduced values back (read + write each way)
                dp_exposed = t_ar + 16 * ld.trainable / mem_s
        # the bubble: GPipe / 1F1B from the other stages' times along the schedule's critical path
        # (`formulas.fill_drain_seconds`; (p - 1)(F + B) for equal stages, Narayanan et al. 2021,
        # Sec. 2.2); other schedules: their bubble fraction of the slowest rank's ideal time
        if fill is not None:
            bub = fill_drain_from_sums(plan.pp_schedule, *fill, m)
        else:
            bub = bubble_fraction(plan.pp_schedule, p, m, v) * m * (t_f + t_b + t_tp + t_rc)
        return {"compute": mbs * (t_f + t_b) + t_acc, "recompute": mbs * t_rc,
                "tp_comm": mbs * t_tp, "pp_comm": mbs * t_p2p,
                "dp_comm": dp_exposed + mbs * fsdp_per_mb, "bubble": accumulation * bub,
                "optimizer": self.opt[i]}


def estimate_step(profile: ModelProfile, plan: ParallelPlan, batch: Batch, hw: Hardware, *,
                  optimizer: str = "adamw", dp_overlap: bool = True,
                  fused_tp_optimizer: bool = False, reduce_bytes: float = 4,
                  gather_bytes: float | None = None, attention_kernel: str | None = None,
                  p2p_scatter_gather: bool = False, replicate: bool | None = None,
                  autocast_weights: bool | None = None, fsdp_stream_copies: bool = True,
                  master_weights: bool = False, cache: PlannerCache | None = None) -> StepEstimate:
    """Predict one optimizer step of ``plan`` on ``hw`` (see module docstring for the formulas).

    Args:
        profile: `profile_model` output (any batch; scaled per sample).
        plan: the layout (its precision picks the peak FLOP/s).
        batch: global and local batch sizes (samples).
        hw: the device and its links.
        optimizer: ``"sgd"``, ``"sgd_momentum"`` or ``"adamw"`` (optimizer-step memory traffic).
        dp_overlap: whether DDP overlaps its all-reduce with backward (torch DDP does).
        fused_tp_optimizer: tensor-parallel plans step with a fused AdamW too (Megatron-LM's fused
            Adam); by default they pay the single-tensor loop modelpar's TP runs (see
            `modelpar.train.step.adamw`).
        reduce_bytes, gather_bytes, attention_kernel, p2p_scatter_gather, replicate,
            autocast_weights, fsdp_stream_copies, master_weights: see `rank_step`.
        cache: memo tables (`memo.PlannerCache`) to share between estimates of one profile and
            hardware; None: a fresh one for this call.

    Raises:
        ValueError: batch sizes that do not divide, unknown optimizer or precision, a ``cache`` of
            another profile or hardware.
    """
    cache = (cache or PlannerCache()).bind(profile=profile, hw=hw)
    if optimizer not in OPT_TRAFFIC:
        raise ValueError(f"optimizer={optimizer!r} is unknown; valid: {', '.join(OPT_TRAFFIC)}")
    b = batch.micro_batch_size(plan)
    acc = batch.accumulation_steps(plan)
    loads = rank_loads(profile, plan, act_bytes=2 if plan.precision == "bf16" else 4, cache=cache,
                       autocast=autocasts(plan) if autocast_weights is None else autocast_weights)
    parts = rank_step(loads, plan, hw, micro_batch_size=b, accumulation=acc, optimizer=optimizer,
                      tp_bytes=tp_bytes_per_sample(profile, plan), dp_overlap=dp_overlap,
                      fused_tp_optimizer=fused_tp_optimizer, reduce_bytes=reduce_bytes,
                      gather_bytes=gather_bytes, attention_kernel=attention_kernel,
                      p2p_scatter_gather=p2p_scatter_gather, replicate=replicate,
                      autocast_weights=autocast_weights, fsdp_stream_copies=fsdp_stream_copies,
                      master_weights=master_weights, cache=cache)
    return _finish(parts, profile, plan, batch.global_batch_size, cache=cache)
