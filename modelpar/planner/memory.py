"""Per-rank peak memory of a plan, part by part.

Sources:
- Model states: Rajbhandari et al., "ZeRO" (SC'20), Sec. 3.1 and 5 (bytes per parameter; stage 3
  divides parameters, gradients and optimizer state by the sharding degree N).
- Activations: Korthikanti et al., "Reducing Activation Recomputation in Large Transformer Models"
  (2022), Sec. 4 (Eq. 1-2: per-layer bytes; TP shards the attention/MLP interior, sequence parallel the
  rest; full recompute keeps the layer input only) and Sec. 4.2.3 (pipeline: the first stage holds
  p micro-batches under 1F1B, m under GPipe, interleaving multiplies by 1 + (p - 1)/(p v)); the
  interleaved and V schedules' counts per rank come from torch's action tables (`vshape`). The per-layer
  bytes themselves are *measured* by `profile_model`, not taken from Eq. 1.
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
Gradients and optimizer state exist for trainable parameters only (``requires_grad``; ZeRO Sec. 3.1
counts its 2 + 12 B per trainable parameter): a frozen one is held and gathered, never reduced
(`loads.RankLoad.trainable`, docs/planner.md "Frozen parameters").
"""

from __future__ import annotations

from dataclasses import dataclass, fields

from modelpar.plan import ParallelPlan, autocasts, runtime_layout
from modelpar.planner.loads import RankLoad, _adamw_temp, rank_loads, stage_ranges  # noqa: F401  (re-exported)
from modelpar.planner.memo import PlannerCache
from modelpar.planner.moments import _bwd_terms, _projections, _rs_terms  # noqa: F401  (re-exported)
from modelpar.planner.profile import ModelProfile
from modelpar.planner.recompute import cast_copies
from modelpar.planner.records import MemoryParts, ProjMode, fast_new
from modelpar.planner.vshape import in_flight
from modelpar.stage_split import V_SCHEDULES

OPTIMIZER_BYTES = {"sgd": 0, "sgd_momentum": 4, "adamw": 8}   # fp32 state bytes per parameter
MIB = 2 ** 20
_parts, _mode = fast_new(MemoryParts), fast_new(ProjMode)   # (values in field order)


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
    phase: str = "backward"   # "loss", "loss_forward" (the loss's moments), "backward", "fsdp_backward", "optimizer"

    @property
    def total(self) -> float:
        return (self.params + self.grads + self.optimizer + self.activations + self.fsdp_gathered
                + self.comm_buffers + self.overhead)

    def parts(self) -> dict[str, float]:
        return {f.name: getattr(self, f.name) for f in fields(self) if f.name not in ("pp_rank", "phase")}


def rank_memory(ld: RankLoad, plan: ParallelPlan, *, micro_batch_size: int, optimizer: str,
                overhead_bytes: float, pp_rank: int, accumulation: int = 1, global_batch_size: int = 0,
                foreach: bool = False, recv_per_microbatch: bool = True, fused: bool = True,
                gloo: bool = False, fused_tp_optimizer: bool = False,
                ddp_bucket_copy: bool | None = None, cache: PlannerCache | None = None,
                fp32_loss: bool = True, loss_tensors: float | None = None) -> MemoryEstimate:
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
      in-place update; ``fused=False``: single-tensor AdamW `loads._adamw_temp`, foreach AdamW one copy of
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
    ``cache``: the search's memo tables (`memo.PlannerCache`); None: nothing shared between calls
    beyond what ``ld`` keeps.
    ``fp32_loss``: the loss runs on fp32 logits (modelpar's `lm_loss`; see `memory_form`).
    ``loss_tensors``: logits-sized tensors beside the logits at the loss's backward peak; None:
    modelpar's loss (3; 4 under ``loss_parallel``); flash-attn's fused cross entropy, whose backward
    writes one gradient beside its saved logits (``inplace_backward=False``, its default): 1.
    """
    form = memory_form(ld, plan, optimizer=optimizer, global_batch_size=global_batch_size, foreach=foreach,
                       recv_per_microbatch=recv_per_microbatch, fused=fused, gloo=gloo,
                       fused_tp_optimizer=fused_tp_optimizer, ddp_bucket_copy=ddp_bucket_copy, cache=cache,
                       fp32_loss=fp32_loss, loss_tensors=loss_tensors)
    m = plan.n_microbatches if plan.pp > 1 else 1
    return form.at(micro_batch_size, m, accumulation, in_flight(plan, pp_rank, gloo) if plan.pp > 1 else 1.0,
                   pp_rank, overhead_bytes)


class MemoryForm:
    """`rank_memory` of one rank load and plan with the terms that do not depend on the micro-batch
    size, the micro-batch count, the accumulation steps or the micro-batches in flight computed once
    (`memory_form`); `at` adds those. The search evaluates one form at many of them."""

    __slots__ = ("ld", "cache", "fsdp", "ws", "P", "Pt", "params", "grads", "opt", "data", "work", "ac", "S", "pp",
                 "last", "out", "rafw", "recv_mult", "comm_add", "ddp_view", "sharded_layout", "cast_cache",
                 "fwd_cast", "root_g", "po", "pgo_d", "pgos_d", "proj", "keep", "step_tmp", "gloo", "loss_out", "loss_n",
                 "vshape", "chunk_S", "chunk_out", "chunk_proj", "chunk_io", "sends")

    def at(self, b: int, m: int, accumulation: int, W: float, pp_rank: int,
           overhead_bytes: float) -> MemoryEstimate:
        """The estimate at micro-batch size ``b``, ``m`` micro-batches (1 without a pipeline),
        ``accumulation`` local batches, ``W`` micro-batches in flight on the rank (`in_flight`)."""
        q = self.parts(b, m, accumulation, W)      # `MemoryEstimate`'s fields before overhead, in order
        return MemoryEstimate(*q[:6], overhead_bytes, pp_rank, q.phase)

    def parts(self, b: int, m: int, accumulation: int, W: float) -> MemoryParts:
        """`at`'s estimate without building it: `records.MemoryParts`, the fields of `MemoryEstimate`
        before ``overhead``;
        `grid._parts_total` sums them as `MemoryEstimate.total` does (the search compares the
        totals of many ranks and builds an estimate for the fullest only)."""
        ld, fsdp, ws, P, Pt, pp, last = self.ld, self.fsdp, self.ws, self.P, self.Pt, self.pp, self.last
        out, rafw = self.out, self.rafw
        params, grads, opt, data, work, keep = self.params, self.grads, self.opt, self.data, self.work, self.keep
        # buffers that live through the whole step (see `memory_form`)
        comm_persist = ((m if self.recv_mult else 2) * ld.recv * b) if pp else 0.0
        if self.comm_add:
            comm_persist += self.comm_add
        # FSDP without a pipeline accumulates sharded gradients (reduce-scatter every local batch) unless
        # the plan defers the sync (`ParallelPlan.defer_grad_sync`: unsharded gradients accumulate)
        sharded_acc = self.sharded_layout and accumulation > 1
        root_g = self.root_g
        fixed = self.po + comm_persist + data + self.cast_cache

        # variants: the step's first backward on this rank (no gradients yet, unless an earlier local
        # batch of gradient accumulation made them; W micro-batches in flight), and, in a pipeline, a
        # later one with every gradient present: 1F1B keeps W in flight while forwards remain (W < m),
        # GPipe has finished one backward (m - 1 left)
        # torch.distributed.pipelining's last stage keeps each micro-batch's output (below); Megatron-LM
        # (``recv_per_microbatch=False``) drops it after the loss
        # interleaved (`in_flight`): moments (W, between I and W, sent outputs, sent input gradients), the
        # last three priced as the gradients kept for W (`RankLoad.wgrad`) and the sends gloo holds
        if pp and self.vshape and type(W) is tuple:
            variants = ()          # a V schedule's moments (`_v_cases`)
        elif pp and type(W) is not tuple:       # one moment, nothing beyond the in-flight count
            variants = ((W, W if keep else 1.0, accumulation > 1, 0.0),)
            if m > 1:
                variants += ((W if W < m else m - 1.0, float(m) if keep else 1.0, True, 0.0),)
        elif pp:
            variants = []
            for w, i_, f_, g_ in W:
                ex = b * (i_ * ld.wgrad + f_ * self.sends[0] + g_ * self.sends[1]) if (i_ or f_ or g_) else 0.0
                variants += [(w, w if keep else 1.0, accumulation > 1, ex)] + (
                    [(w if w < m else m - 1.0, float(m) if keep else 1.0, True, ex)] if m > 1 else [])
        else:
            # DDP's stored gradients are bucket views (always there); sharded FSDP accumulation: the
            # earlier local batches' sharded gradients (in `grads`), the moments of a first backward
            variants = ((1.0, 1.0, (accumulation > 1 or self.ddp_view) and not sharded_acc, 0.0),)
        bS = b * self.S
        bout = b * out
        bls = b * self.loss_out      # one logits-sized tensor of the loss (fp32 under `lm_loss`)
        # other micro-batches in flight keep their saved bytes and, on the last stage, the loss's saved
        # log-softmax; the last stage keeps every micro-batch's output it has computed (the schedule
        # returns them merged: ``PipelineStage.output_chunks``), a non-last stage each in-flight
        # micro-batch's stage output (``fwd_cache``, until its backward); without a pipeline the caller
        # holds the model output through backward
        per_other, per_out = (bS + bls, bout) if last else (bS, b * ld.boundary if pp else 0.0)
        # (held bytes of the other micro-batches, gradients present, the chunk in backward (V schedules) or None)
        if self.vshape and type(W) is tuple:
            cases = self._v_cases(b, accumulation, W, bls, bout)
        else:
            cases = [((F - 1) * per_other + (n_out if last else F) * per_out + ex, prev, None)
                     for F, n_out, prev, ex in variants]
        best_total, best = -1.0, None
        for held, prev, x in cases:
            # gradients of earlier micro-batches: sharded, or (FSDP without gradient sync) unsharded
            g0 = (4 * Pt if fsdp else grads) if prev else (grads if sharded_acc else 0.0)
            # a pipeline under FSDP keeps every unit gathered after its first backward
            gath0 = root_g + work * (P - ld.root_params) if (fsdp and pp and prev and rafw) else root_g
            base = fixed + held + g0 + gath0
            if last and x != 0:
                # the loss's backward (logits in ``held``): log-softmax (saved) and the gradients of both
                # (``loss_out``); FSDP has gathered nothing for backward yet (the root's pre-backward
                # hook, which starts the first unit's all-gather, fires when the logits' gradient is complete)
                tot = base + bS + self.loss_n * bls
                if tot > best_total:
                    best_total, best = tot, (held, g0, gath0, prev, None)
                # the loss's forward (its fp32 logits and log-softmax), all weight copies still cached
                if self.fwd_cast and base + self.fwd_cast + bS + 2 * bls > best_total:
                    best_total, best = base + self.fwd_cast + bS + 2 * bls, (held, g0, gath0, prev, "loss_forward")
            if x is None:
                # the block / reduce moments, as totals b * A + K + G / dp_shard (see `_projections`)
                proj = self.proj[prev][sharded_acc]         # this form's, else the load's table
                if proj is None:
                    mode = _mode((self.fsdp, self.ac, prev, self.rafw, self.work, self.pp * (1 + ld.autocast),
                                  self.gloo, sharded_acc))
                    proj = self.proj[prev][sharded_acc] = ld.projections.get(mode) or self._projections(mode)
                    ld.projections[mode] = proj
            else:
                # one chunk's backward: its own moments, the other chunk's in-flight micro-batches all held
                proj = self._chunk_proj(x, prev, sharded_acc)
                held += b * (self.S - self.chunk_S[x])
                base += b * (self.S - self.chunk_S[x])
            for A, K, G, c in proj:
                tot = base + b * A + K + ws * G
                if tot > best_total:
                    best_total, best = tot, (held, g0, gath0, prev, c)
        # the last stage's outputs stay referenced until the next step starts
        # (``clear_runtime_states``); when the schedule ends it also merges them into one batch
        held_end = m * out * b if (keep and last) else 0.0
        end_total = self.pgo_d + comm_persist + 2 * held_end
        opt_total = self.pgos_d + held_end + comm_persist
        if opt_total >= best_total and opt_total >= end_total:
            return _parts((params, grads, opt + self.step_tmp, data + held_end, 0.0, comm_persist, "optimizer"))
        if end_total > best_total:
            return _parts((params, grads, opt, data + 2 * held_end, 0.0, comm_persist, "pipeline_end"))
        held, g0, gath0, prev, c = best
        acts = data + self.cast_cache + held
        if c is None or c == "loss_forward":
            loss = self.fwd_cast + 2 * bls if c else self.loss_n * bls
            return _parts((params, g0, opt, acts + bS + loss, gath0, comm_persist, c or "loss"))
        kind, t = c
        return _parts((params, g0 + t.grads_k + t.grads_g * ws, opt, acts + t.acts_a * b + t.acts_k,
                       gath0 + t.gathered_k, comm_persist + t.buffers_k + t.buffers_g * ws, kind))

    def _v_cases(self, b: int, accumulation: int, states: tuple, bls: float, bout: float) -> list:
        """`parts`' cases of a V schedule's rank (`in_flight`: `vshape.v_states`): per moment (c0, c1,
        n_out, grads, chunk), the other micro-batches' bytes with the one in backward's whole (both
        chunks' saved bytes ``S``) taken out, as the whole-rank moments count it: c0 x chunk 0's saved
        bytes + c1 x chunk 1's - S, each in-flight micro-batch's stage outputs of a non-last chunk
        (``fwd_cache``), and on the rank holding the model's last stage (chunk 1 of rank 0) the loss's
        saved log-softmax of chunk 1's other micro-batches and the ``n_out`` outputs it has kept; besides, per
        chunk, the gradients its ``I``s keep for their ``W`` (``RankLoad.chunk_io``) and, on gloo, the stage
        outputs and input gradients its sends still hold (`vshape.v_states`)."""
        (S0, S1), (o0, o1), ((w0, i0), (w1, i1)) = self.chunk_S, self.chunk_out, self.chunk_io
        out = []
        for c0, c1, n_out, g, x, p0, p1, f0, f1, g0, g1 in states:
            # + the gradients kept from I to W, and (gloo) the sent outputs and input gradients
            held = b * (c0 * S0 + c1 * S1 - self.S + c0 * o0 + c1 * o1
                        + p0 * w0 + p1 * w1 + f0 * o0 + f1 * o1 + g0 * i0 + g1 * i1)
            if self.last:
                held += max(c1 - x, 0) * bls + (n_out if self.keep else min(n_out, 1)) * bout
            out.append((held, bool(g) or accumulation > 1, x))
        return out

    def _chunk_proj(self, x: int, prev: bool, sharded_acc: bool) -> tuple:
        """`_projections` of chunk ``x``'s blocks alone (`loads.RankLoad.chunk_moments`), memoized on the
        form, on the load (per mode: the forms of one load share it) and in the cache (per moments and
        mode: loads whose chunks hold equal blocks share it)."""
        key = (x, prev, sharded_acc)
        proj = self.chunk_proj.get(key)
        if proj is None:
            ld, cache = self.ld, self.cache
            mode = _mode((self.fsdp, self.ac, prev, self.rafw, self.work, self.pp * (1 + ld.autocast), self.gloo,
                          sharded_acc))
            proj = ld.projections.get((x, mode))
            if proj is None:
                bwd, rs = ld.chunk_moments(x)
                pkey = (bwd, rs, mode)
                proj = cache.projections.get(pkey) if cache is not None else None
                if proj is None:
                    proj = _projections(bwd, rs, mode)
                    if cache is not None:
                        cache.projections[pkey] = proj
                ld.projections[(x, mode)] = proj
            self.chunk_proj[key] = proj
        return proj

    def _projections(self, mode: ProjMode) -> tuple:
        ld, cache = self.ld, self.cache
        pkey = (ld.bwd_moments, ld.rs_moments, mode)
        proj = cache.projections.get(pkey) if cache is not None else None
        if proj is None:
            proj = _projections(ld.bwd_moments, ld.rs_moments, mode)
            if cache is not None:
                cache.projections[pkey] = proj
        return proj


def memory_form(ld: RankLoad, plan: ParallelPlan, *, optimizer: str, global_batch_size: int = 0,
                foreach: bool = False, recv_per_microbatch: bool = True, fused: bool = True,
                gloo: bool = False, fused_tp_optimizer: bool = False, ddp_bucket_copy: bool | None = None,
                cache: PlannerCache | None = None, fp32_loss: bool = True,
                loss_tensors: float | None = None) -> MemoryForm:
    """`rank_memory`'s terms of ``ld`` under ``plan`` that hold for every micro-batch size, micro-batch
    count, accumulation and pipeline rank position (arguments as `rank_memory`); ``plan``'s
    ``n_microbatches`` is not read."""
    if plan.activation_checkpointing in ("selective", "every-k"):
        from modelpar.planner.recompute import ac_load
        ld = ac_load(ld, plan, cache)
    f = MemoryForm()
    f.ld, f.cache, f.gloo = ld, cache, gloo
    shard = plan.dp_shard
    f.fsdp = fsdp = shard > 1
    f.ws = 1.0 / shard
    f.P = P = ld.params
    f.params = params = 4 * P * f.ws
    # gradients and optimizer state: of the trainable parameters only (frozen ones have neither; ZeRO's
    # 2 + 2 + 12 B per trainable parameter, Rajbhandari et al. 2020, Sec. 3.1, as modelpar's fp32 4 + 4 + 8)
    f.Pt = Pt = ld.trainable
    grads = 4 * Pt * f.ws
    f.opt = opt = OPTIMIZER_BYTES[optimizer] * Pt * f.ws
    f.data = data = ld.data * global_batch_size
    bf16 = plan.precision == "bf16"
    f.work = work = 2 if bf16 else 4         # bytes of a gathered / working parameter (and its gradient)
    # checkpointing: ``saved_ac`` holds what the mode keeps (full: block inputs; else `recompute.ac_load`)
    f.ac = ac = plan.activation_checkpointing != "none"
    f.S = ld.saved_ac if ac else ld.saved    # one micro-batch's saved bytes per sample
    f.pp = pp = plan.pp > 1
    # a V schedule's rank holds two chunks with their own micro-batches in flight (`in_flight`, `_v_cases`)
    f.vshape = pp and plan.pp_schedule in V_SCHEDULES and len(ld.chunks) == 2
    if f.vshape:
        from modelpar.planner.recompute import chunk_kept
        f.chunk_S, f.chunk_out, f.chunk_proj = chunk_kept(ld, plan), tuple(o for _, o in ld.chunks), {}
        f.chunk_io = ld.chunk_io
    # interleaved: a chunk's output and input gradient per sample, summed over the rank's chunks (`in_flight`)
    f.sends = (sum(o for _, o in ld.chunks), sum(i for _, i in ld.chunk_io))
    f.last = ld.is_last
    f.out = ld.out
    # the loss's logits-sized tensors per sample (saved log-softmax, its gradient, the logits' fp32
    # gradient): fp32 under bf16 too, as `train.task.lm_loss` casts ``logits.float()``; measured at the
    # peak (``_log_softmax_backward_data``) per logit: fp32 4 + 3 x 4 B, bf16 2 + 3 x 4 B
    # (tests/test_planner_loss_memory.py). ``fp32_loss=False``: a loss at the activation dtype.
    f.loss_out = ld.out * (2.0 if (fp32_loss and bf16) else 1.0)
    # logits-sized tensors beside the logits at the loss's backward peak: 3 in one process; 4 under torch's
    # loss_parallel, whose backward (tensor/parallel/loss.py `_nll_loss_and_log_softmax_backward`: ``(zeros_like(x)
    # + exp(x)) * grad``) holds zeros, exp and sum (tests/test_planner_loss_memory.py); Megatron's in-place loss: 3
    f.loss_n = loss_tensors if loss_tensors is not None else 4.0 if (ld.loss_parallel and fp32_loss) else 3.0
    f.rafw = rafw = plan.reshard_after_forward
    # buffers that live through the whole step: torch.distributed.pipelining's receive buffers, one
    # per micro-batch and stage (activations on non-first stages, gradients on non-last stages;
    # Megatron-LM reuses 2), and DDP's gradient buckets (below)
    f.recv_mult = recv_per_microbatch
    # DDP's buckets (4 B/param, from construction on). modelpar's runtime (``ddp_bucket_copy=None``):
    # `apply_ddp` makes the gradients views into them (gradient_as_bucket_view=True): no gradient storage
    # beside them. Under PP or TP it runs FSDP2's replicate (`plan.runtime_layout`): no buckets; each
    # block's (last the root's) unsharded gradients are copied into one flat fp32 buffer, all-reduced and
    # written into the replicated fp32 gradients, then freed: beside the gradients one group's buffer at
    # a time, counted as the largest group's through the step. True: torch DDP's default, the buckets a
    # copy beside the gradients; False: gradients reduced in place (Megatron-LM's contiguous buffer).
    layout = runtime_layout(plan)            # the wrapper `parallelize` applies (modelpar's runtime)
    ddp = layout.dp_wrapper in ("ddp", "replicate")
    replicate = ddp_bucket_copy is None and layout.dp_wrapper == "replicate"
    f.ddp_view = ddp_view = ddp_bucket_copy is None and layout.dp_wrapper == "ddp"
    f.comm_add = 0.0
    # (DDP's buckets and replicate's groups hold the gradients that exist: the trainable parameters')
    if replicate:
        f.comm_add = 4 * max(ld.max_unit_trainable, ld.root_trainable)
    elif ddp and ddp_bucket_copy is not False:
        f.comm_add = 4 * Pt
    grads = f.grads = 0.0 if ddp_view else grads
    f.sharded_layout = layout.sharded_grad_accumulation
    # bf16 weight copies (Megatron's bf16 parameters, `published`); an autocast load's: `recompute.cast_copies`
    # (from the loss's backward on; ``fwd_cast`` more until autocast exits, at the loss's forward)
    f.cast_cache, f.fwd_cast = ((0.0, 0.0) if (not bf16 or fsdp) else cast_copies(ld, plan) if ld.autocast
                                else (2 * P, 0.0))
    # FSDP's root (embed/head) stays gathered through backward (reshard_after_forward=False; with it, every unit)
    f.root_g = work * (ld.root_params + (0.0 if rafw else P - ld.root_params)) if fsdp else 0.0
    f.po = params + opt
    # `_projections` per (earlier micro-batches' gradients, sharded accumulation), filled by `parts` (`records.ProjMode`)
    f.proj = [[None, None], [None, None]]
    f.keep = pp and recv_per_microbatch
    # modelpar's TP leaves some parameters plain tensors, and torch's fused kernel refuses mixed
    # lists, so tensor-parallel plans step with the single-tensor loop (`modelpar.train.step.adamw`)
    if optimizer == "adamw" and not (fused and (plan.tp == 1 or fused_tp_optimizer)):
        if not foreach and ld.opt_temp < 0:
            ld.opt_temp = _adamw_temp(list(ld.trainable_numels))     # the optimizer's tensors
        f.step_tmp = (Pt if foreach else ld.opt_temp) * 4 / shard
    else:
        f.step_tmp = 0.0   # fused AdamW and in-place SGD; the gradient norm copies nothing either
    f.pgo_d = params + grads + opt + data
    f.pgos_d = params + grads + opt + f.step_tmp + data
    return f


def estimate_memory(profile: ModelProfile, plan: ParallelPlan, batch: Batch, *,
                    optimizer: str = "adamw", overhead_bytes: float = 0.0, foreach: bool = False,
                    recv_per_microbatch: bool = True, fused: bool = True,
                    gloo: bool = False, fused_tp_optimizer: bool = False,
                    ddp_bucket_copy: bool | None = None, cache: PlannerCache | None = None,
                    fp32_loss: bool = True, loss_tensors: float | None = None) -> MemoryEstimate:
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
        fp32_loss: the loss's logits-sized tensors are fp32 (modelpar's loss; default), else at the
            activation dtype; see `rank_memory`.
        loss_tensors: logits-sized tensors beside the logits at the loss's backward (`rank_memory`).
        cache: memo tables (`memo.PlannerCache`) to share between estimates of one profile; None: a
            fresh one for this call.

    Raises:
        ValueError: unknown optimizer, batch sizes that do not divide, more stages than blocks, a
            ``cache`` of another profile.
    """
    return max(rank_estimates(profile, plan, batch, optimizer=optimizer, overhead_bytes=overhead_bytes,
                              foreach=foreach, recv_per_microbatch=recv_per_microbatch, fused=fused, gloo=gloo,
                              fused_tp_optimizer=fused_tp_optimizer, ddp_bucket_copy=ddp_bucket_copy,
                              cache=cache, fp32_loss=fp32_loss, loss_tensors=loss_tensors), key=lambda e: e.total)


def rank_estimates(profile: ModelProfile, plan: ParallelPlan, batch: Batch, *,
                   optimizer: str = "adamw", overhead_bytes: float = 0.0, foreach: bool = False,
                   recv_per_microbatch: bool = True, fused: bool = True,
                   gloo: bool = False, fused_tp_optimizer: bool = False,
                   ddp_bucket_copy: bool | None = None, cache: PlannerCache | None = None,
                   fp32_loss: bool = True, loss_tensors: float | None = None) -> list[MemoryEstimate]:
    """`estimate_memory` of every pipeline rank, in pipeline-rank order (bytes by part; arguments and
    errors as `estimate_memory`, which returns the largest)."""
    if optimizer not in OPTIMIZER_BYTES:
        raise ValueError(f"optimizer={optimizer!r} is unknown; valid: {', '.join(OPTIMIZER_BYTES)}")
    b, acc = batch.micro_batch_size(plan), batch.accumulation_steps(plan)
    cache = (cache or PlannerCache()).bind(profile=profile)
    loads = rank_loads(profile, plan, act_bytes=2 if plan.precision == "bf16" else 4, cache=cache, autocast=autocasts(plan))
    ests = [rank_memory(ld, plan, micro_batch_size=b, optimizer=optimizer, overhead_bytes=overhead_bytes,
                        pp_rank=r, accumulation=acc, global_batch_size=batch.global_batch_size, foreach=foreach,
                        recv_per_microbatch=recv_per_microbatch, fused=fused, gloo=gloo,
                        fused_tp_optimizer=fused_tp_optimizer, ddp_bucket_copy=ddp_bucket_copy, cache=cache,
                        fp32_loss=fp32_loss, loss_tensors=loss_tensors)
            for r, ld in enumerate(loads)]
    return ests

