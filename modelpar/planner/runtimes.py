"""Profile terms for runtimes other than modelpar's own (Megatron-LM), as `ModelProfile` rewrites.

`vocab_parallel_profile`: Megatron-LM shards the token embedding over the vocabulary across the
tensor-parallel ranks (``VocabParallelEmbedding``: each rank holds V/t rows, looks up its own
tokens and the partial outputs are all-reduced) and the output layer column-wise over the
vocabulary with the loss computed on the sharded logits (``vocab_parallel_cross_entropy``)
(Shoeybi et al., "Megatron-LM", 2019, Sec. 3, "input embedding ... parallelized along the vocabulary
dimension"; Narayanan et al. SC'21, Sec. 3.2). In the planner's terms: the vocabulary matrices of
the ``embed`` and ``head`` blocks count as TP-sharded parameters (so their parameters, gradients and
optimizer state divide by t), and the logits shard by t (`loads.rank_loads`).
"""

from __future__ import annotations

import dataclasses

from modelpar.planner.profile import ModelProfile


def vocab_parallel_profile(profile: ModelProfile) -> ModelProfile:
    """``profile`` with every vocabulary-sized matrix of its first and last block (the token
    embedding; the output projection) marked TP-sharded, and their FLOPs split (none left whole:
    `BlockProfile.tp_whole_flops`, the replicated head's projection). A profile without ``arch`` (not a
    transformer of embed / blocks / head) is returned unchanged.

    Raises:
        ValueError: the profile's arch lacks ``vocab_size`` or ``d_model``.
    """
    arch = profile.arch
    if not arch or len(profile.blocks) < 3:
        return profile
    if "vocab_size" not in arch or "d_model" not in arch:
        raise ValueError(f"vocab_parallel_profile needs arch vocab_size and d_model, got {sorted(arch)}")
    vocab_numel = arch["vocab_size"] * arch["d_model"]
    blocks = list(profile.blocks)
    for i in (0, len(blocks) - 1):
        bl = blocks[i]
        numels = tuple((n, mat, sh or (mat and n == vocab_numel)) for n, mat, sh in bl.param_numels)
        blocks[i] = dataclasses.replace(bl, param_numels=numels, tp_whole_flops=(0, 0),
                                        tp_sharded_params=sum(n for n, _, sh in numels if sh))
    return dataclasses.replace(profile, blocks=tuple(blocks))


def regather_profile(profile: ModelProfile) -> ModelProfile:
    """``profile`` as Megatron-LM's sequence parallelism saves it: the all-gathered input of each
    column-parallel GEMM is not kept for backward but its sequence shard, gathered again in backward
    (Korthikanti et al. 2022, Sec. 4.2.2), so no saved byte stays at full length
    (`BlockProfile.saved_gathered_bytes` 0; modelpar's runtime, DTensor's ``ColwiseParallel``, keeps
    the gathered tensor)."""
    return dataclasses.replace(profile, blocks=tuple(dataclasses.replace(b, saved_gathered_bytes=0)
                                                     for b in profile.blocks))


class MegatronAttention:
    """A ``TorchFunctionMode`` (built lazily, `megatron_attention_mode`) that profiles
    ``F.scaled_dot_product_attention`` as Megatron-LM's unfused core attention runs it
    (``CoreAttention``: Shoeybi et al. 2019; Korthikanti et al. 2022, Sec. 4.1): Q K^T as one
    batched matmul (the 1/sqrt(d) scale folded into the query), the fused scale-mask-softmax kernel
    (``FusedScaleMaskSoftmax``: one read and one write of the scores, the causal mask applied inside),
    dropout on the probabilities (a 1-byte mask saved) and the product with V; every dropout (also
    the hidden ones) as CUDA's fused ``native_dropout`` kernel. Saved for backward:
    q, k, the softmax output, the dropout mask, the dropout output and v, the terms of Korthikanti's
    Eq. 1 (2 a s^2 b + a s^2 b + 2 a s^2 b per layer beyond the s b h terms)."""


def megatron_attention_mode():
    """A fresh `MegatronAttention` mode (a ``torch.overrides.TorchFunctionMode``)."""
    import math

    import torch
    import torch.nn.functional as F
    from torch.overrides import TorchFunctionMode

    class _Mode(TorchFunctionMode):
        __doc__ = MegatronAttention.__doc__

        def __torch_function__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            if func is F.dropout:
                # CUDA's fused dropout kernel (one read, one write, a 1-byte mask), not the
                # bernoulli / div / mul decomposition the meta and CPU paths dispatch
                x = args[0]
                p = kwargs.get("p", args[1] if len(args) > 1 else 0.5)
                train = kwargs.get("training", args[2] if len(args) > 2 else True)
                if not p or not train:
                    return x
                with self:
                    return torch.native_dropout(x, p, True)[0]
            if func is not F.scaled_dot_product_attention:
                return func(*args, **kwargs)
            q, k, v = args[:3]
            drop = kwargs.get("dropout_p", args[4] if len(args) > 4 else 0.0)
            b, h, s, d = q.shape
            scale = kwargs.get("scale") or 1.0 / math.sqrt(d)
            with self:
                q3 = (q * scale).reshape(b * h, s, d)
                scores = torch.bmm(q3, k.reshape(b * h, k.shape[2], d).transpose(1, 2))
                probs = torch.softmax(scores, dim=-1)
                if drop:
                    probs = F.dropout(probs, drop)
                out = torch.bmm(probs, v.reshape(b * h, v.shape[2], v.shape[3]))
            return out.view(b, h, s, v.shape[3])

    return _Mode()


def selective_recompute_profile(profile: ModelProfile, *, dropout: bool) -> ModelProfile:
    """``profile`` (attention ``"megatron"``) with the attention core's saved bytes removed from
    every transformer block: Korthikanti et al. 2022, Sec. 5 (selective activation recomputation):
    the softmax output (2 a s^2 b), the dropout mask (a s^2 b) and the dropout output (2 a s^2 b)
    are recomputed in backward instead of kept (without dropout only the softmax output, 2 a s^2 b).
    All of it lies inside the TP-sharded region. The recompute's time is `attention_core_seconds`.

    Raises:
        ValueError: the profile has no transformer ``arch``.
    """
    arch = profile.arch
    if not arch or "n_head" not in arch:
        raise ValueError("selective_recompute_profile needs a transformer profile (arch with n_head)")
    s, a, bs = profile.tokens_per_sample, arch["n_head"], profile.batch_size
    core = (5 if dropout else 2) * a * s * s * bs
    blocks = list(profile.blocks)
    for i in range(1, len(blocks) - 1):
        bl = blocks[i]
        blocks[i] = dataclasses.replace(bl, saved_bytes=bl.saved_bytes - core,
                                        saved_tp_sharded_bytes=bl.saved_tp_sharded_bytes - core)
    return dataclasses.replace(profile, blocks=tuple(blocks))


def _rates(hw) -> tuple[float, float]:
    """(achievable GEMM FLOP/s, streaming bytes/s) of ``hw``: the built-in GPU's tables (`gpu.py`)
    or the profile's own figures."""
    from modelpar.planner.gpu import physics_for
    phys = physics_for(hw)
    flops_s = phys.mamf_bf16 if phys else hw.achievable_flops("bf16")
    mem_s = hw.mem_bandwidth * (phys.hbm_fraction if phys else hw.mem_bw_fraction)
    return flops_s, mem_s


def core_products(profile: ModelProfile, *, micro_batch: int, tp: int) -> dict[str, tuple[float, float]]:
    """FLOPs and bytes of one transformer layer's attention-core matmuls on a rank of a ``tp``-way
    split, for ``micro_batch`` samples, as Megatron-LM's ``CoreAttention`` runs them (16-bit
    operands): forward Q K^T (``baddbmm``: reads q, k; writes the a/t x s x s scores) and
    probabilities x V (reads the probabilities and v; writes the context); backward the four
    products autograd makes of them (grad of the probabilities = dctx V^T, dV = P^T dctx,
    dQ = dS K, dK = dS^T Q: each reads or writes one s x s matrix per head and two s x d ones).
    Per head (d = h / a): forward 4 s^2 d FLOPs over 2 (2 s^2 + 4 s d) bytes, backward twice both.
    Returns {"fwd": (FLOPs, bytes), "bwd": (FLOPs, bytes)}; their arithmetic intensity is about the
    head dimension (s d / (s + 2 d) FLOP/B), below an A100's or H100's ridge point (MAMF / HBM,
    ~155 and ~275 FLOP/B) for the head dimensions of Table 1 and Table 5 (96-160)."""
    arch = profile.arch
    s, a, h, b = profile.tokens_per_sample, arch["n_head"], arch["d_model"], micro_batch
    d = h / a
    heads = b * a / tp
    f = 4 * heads * s * s * d
    byt = 2 * heads * (2 * s * s + 4 * s * d)
    return {"fwd": (f, byt), "bwd": (2 * f, 2 * byt)}


def core_roofline_excess(load, profile: ModelProfile, hw, *, micro_batch: int, tp: int) -> tuple[float, float]:
    """(forward, backward) seconds per micro-batch that the per-kernel roofline adds on a rank
    holding ``load`` (`loads.RankLoad`) with Megatron-LM's unfused attention core.

    The roofline bounds one kernel: max(FLOPs / rate, bytes / bandwidth) (Williams, Waterman &
    Patterson, CACM 2009). The step model applies it to the sum of a rank's matmuls
    (`gpu.gpu_load_times`), where the large weight GEMMs, far above the ridge point, hide the
    bytes of the core's products, whose intensity is about the head dimension (`core_products`).
    Here the products are taken out of that sum and given their own bound: the result is the
    difference max(F_w / R, B_w / W) + max(F_c / R, B_c / W) - max((F_w + F_c) / R, (B_w + B_c) / W)
    over the rank's transformer layers (``load.ac_blocks`` entries with a layer index), at the
    same rates (`gpu.py`: MAMF, HBM at its measured fraction). Zero for fused attention (the
    kernel's own table prices it) and off GPU tables' profiles it uses the profile's rates."""
    if load.attn_flops[0] or not profile.arch.get("n_head"):
        return 0.0, 0.0
    flops_s, mem_s = _rates(hw)
    layers = sum(1 for e in load.ac_blocks if e[1] >= 0)
    core = core_products(profile, micro_batch=micro_batch, tp=tp)
    b = micro_batch
    out = []
    for i, d in enumerate(("fwd", "bwd")):
        fc, bc = core[d][0] * layers, core[d][1] * layers
        f = (load.fwd_flops if i == 0 else load.bwd_flops) * b
        byt = load.gemm_param_bytes[i] + load.gemm_act_bytes[i] * b
        agg = max(f / flops_s, byt / mem_s)
        split = max((f - fc) / flops_s, (byt - bc) / mem_s) + max(fc / flops_s, bc / mem_s)
        out.append(max(0.0, split - agg))
    return out[0], out[1]


def attention_core_seconds(profile: ModelProfile, hw, *, micro_batch: int, tp: int, dropout: bool) -> float:
    """Seconds to recompute one transformer layer's attention core for ``micro_batch`` samples on a
    rank of a ``tp``-way split (Korthikanti et al. 2022, Sec. 5): the Q K^T and attention-over-V
    matmuls at their own roofline (`core_products`: max of 4 b s^2 h / t FLOPs at the GPU's
    achievable GEMM rate and their bytes at its streaming rate), and the fused softmax and dropout
    (``MegatronAttention``: softmax read + write 4 bytes, dropout read + write + mask 5 bytes per
    score element; a s^2 b / t elements) at its streaming memory rate."""
    arch = profile.arch
    s, a, b = profile.tokens_per_sample, arch["n_head"], micro_batch
    flops_s, mem_s = _rates(hw)
    elems = a * s * s * b / tp
    f, byt = core_products(profile, micro_batch=micro_batch, tp=tp)["fwd"]
    return max(f / flops_s, byt / mem_s) + (9 if dropout else 4) * elems / mem_s


def tp_backward_overlap_delta(profile: ModelProfile, hw, *, micro_batch: int, tp: int, sequence_parallel: bool,
                              layers: float, all_reduce_s: float) -> float:
    """Seconds per micro-batch that Megatron-LM's asynchronous tensor-parallel backward changes on a
    rank of ``layers`` transformer layers, against the step model's exposed backward collectives
    (two all-reduces of the block output per layer, ``all_reduce_s`` each, for ``micro_batch``
    samples; `cost.rank_step`'s ``t_tp``). Negative: less is exposed.

    Megatron-LM's ``LinearWithGradAccumulationAndAsyncCommunication`` (read in the copy of its
    tensor-parallel layers that NVIDIA ships as apex ``transformer/tensor_parallel/layers.py``) runs
    the backward of each column-parallel linear (per layer: the QKV projection and the first MLP
    matmul) as follows. Without sequence parallelism the all-reduce of the input gradient is issued
    asynchronously and overlaps that linear's weight-gradient GEMM (``async_grad_allreduce``; the
    row-parallel linears have no backward collective). With sequence parallelism the layer input is
    all-gathered again (asynchronously, overlapping the input-gradient GEMM) and the input gradient
    is reduce-scattered (asynchronously, overlapping the weight-gradient GEMM); the row-parallel
    linears' backward all-gathers their output gradient before any GEMM (exposed). A collective of c
    seconds beside a GEMM of w seconds exposes max(0, c - w), and the GEMM loses NCCL's share of the
    SMs for min(c, w) (`gpu.GpuPhysics.nccl_sm_share`). The GEMMs: 2 b s h n / t FLOPs (n = 3 h for
    QKV, the FFN width for the MLP) at the achievable GEMM rate; all-gather and reduce-scatter of
    the block output are each half an all-reduce (Thakur et al. 2005: all-reduce = reduce-scatter +
    all-gather). The embedding and output layer keep the model's terms."""
    from modelpar.planner.gpu import physics_for
    arch = profile.arch
    s, h, b = profile.tokens_per_sample, arch["d_model"], micro_batch
    ffn = arch.get("ffn", 4 * h)
    flops_s, _ = _rates(hw)
    phys = physics_for(hw)
    share = phys.nccl_sm_share if phys else 0.0
    gemms = [2 * b * s * h * n / tp / flops_s for n in (3 * h, ffn)]   # weight- (= input-) gradient GEMMs

    def beside(c: float, w: float) -> float:
        return max(0.0, c - w) + share * min(c, w)

    ar = all_reduce_s
    if sequence_parallel:
        half = ar / 2
        new = 2 * half + sum(beside(half, w) + beside(half, w) for w in gemms)
    else:
        new = sum(beside(ar, w) for w in gemms)
    return layers * (new - 2 * ar)


def fused_accumulation_seconds(load, profile: ModelProfile, hw, *, tp: int, micro_batches: int) -> float:
    """Seconds per step of gradient accumulation that Megatron-LM's gradient-accumulation fusion
    does not spend, on a rank holding ``load`` (`loads.RankLoad`) of ``profile`` split ``tp``-way,
    running ``micro_batches`` micro-batches per step. Subtract it from the step model's compute.

    The runtime fact: in the Megatron-LM that introduced sequence parallelism (Korthikanti et al.
    2022; the tensor-parallel layers NVIDIA also ships as apex ``transformer/tensor_parallel``),
    every column- and row-parallel linear and the output layer (``parallel_lm_logits``) run through
    ``LinearWithGradAccumulationAndAsyncCommunication``, whose backward, with
    ``gradient_accumulation_fusion`` (on by default: Megatron-LM's command-line switch for it is an
    opt-out, argparse ``store_false`` into ``dest="gradient_accumulation_fusion"``, beside the
    sequence-parallel switch in that code's ``arguments.py``; until Megatron-LM commit 07916bf24,
    2022-09-27, "Support gradient accumulation fusion in fp16", ``validate_args`` turned it off
    unless gradients accumulate in fp32, ``accumulate_allreduce_grads_in_fp32``: so it applies to
    runs with fp32 main gradients, the Korthikanti rows, and not to the SC'21 rows, whose
    ``CONFIG.sh`` does not pass that option), computes the weight gradient as
    ``fused_dense_cuda.wgrad_gemm_accum_fp32(total_input, grad_output, weight.main_grad)``: one GEMM
    that adds into the fp32 main-gradient buffer (beta = 1), returning no gradient tensor. So these
    weights never pay the separate in-place accumulation the step model charges every micro-batch
    after the first (`cost.StepForm.at`: 12 bytes per parameter at the HBM rate, `_rates`). What the
    fusion adds instead, the GEMM's fp32 output read and written (8 B per weight element instead of
    2 B written), meets 2 K FLOPs per element (K = b s tokens of the micro-batch): K / 4 FLOP/B,
    512 at K = 2048, above the A100's ridge point (~155 FLOP/B), so the GEMM stays compute-bound and
    no time is added. The layer norms, the biases (``grad_output.sum(0)``) and the embedding lookup
    keep their gradients in autograd and Megatron's DDP hook adds them (``main_grad.add_(grad)``):
    they keep the charge.

    The fused parameters of the rank: the matrices of its transformer layers (``load.ac_blocks``
    entries with a layer index; the GPT block's QKV, projection and MLP weights) and, on the rank
    holding the output layer (``load.is_last``), the output layer's matrix; TP-sharded ones divided
    by ``tp``. 0 with one micro-batch per step."""
    if micro_batches <= 1 or len(profile.blocks) < 3:
        return 0.0
    _, mem_s = _rates(hw)

    def matrices(block) -> float:
        return sum(n / (tp if sh else 1) for n, mat, sh in block.param_numels if mat)

    layers = sum(1 for e in load.ac_blocks if e[1] >= 0)
    fused = layers * matrices(profile.blocks[1]) + (matrices(profile.blocks[-1]) if load.is_last else 0.0)
    return (micro_batches - 1) * 12 * fused / mem_s


def main_grad_copy_seconds(load, hw) -> float:
    """Seconds per step of the fp16 optimizer's model-to-main gradient copy (read 2 B, write 4 B per
    parameter of a rank holding ``load``; part of `cost.MASTER_WEIGHT_TRAFFIC`) that Megatron-LM
    does not spend when its main gradients are already fp32: ``Float16OptimizerWithFloat16Params.
    _copy_model_grads_to_main_grads`` sets ``main_param.grad = model_param.main_grad.float()``, and
    ``.float()`` of an fp32 tensor returns the tensor itself (no kernel). Subtract it from the step
    model's optimizer term for runs with fp32 gradient accumulation (the Korthikanti rows)."""
    _, mem_s = _rates(hw)
    return 6 * load.params / mem_s


def layer_gemm_shapes(profile: ModelProfile, *, micro_batch: int, tp: int) -> dict[str, list[tuple]]:
    """`gpu.layer_gemm_shapes` of ``profile``'s transformer layer for ``micro_batch`` samples
    (T = b s tokens; h = ``arch["d_model"]``, f = ``arch["ffn"]``, 4 h where absent)."""
    from modelpar.planner.gpu import layer_gemm_shapes as shapes
    arch = profile.arch
    h = arch["d_model"]
    return shapes(micro_batch * profile.tokens_per_sample, h, arch.get("ffn", 4 * h), tp)


def wave_quantization_seconds(profile: ModelProfile, hw, *, micro_batch: int, tp: int,
                              max_split: int = 1) -> tuple[float, float]:
    """(forward, backward) seconds per micro-batch that tile and wave quantization add to one
    transformer layer's weight GEMMs on a rank of a ``tp``-way split (`gpu.layer_wave_seconds`,
    sources in `gpu`'s docstring), on a built-in GPU at its MAMF; 0 elsewhere. The step model
    charges the same term per layer of each rank (`cost.StepForm`); the embedding, the output
    layer and the attention core keep the model's terms. ``max_split``: the split-K sensitivity
    check (1: the model)."""
    from modelpar.planner.gpu import layer_wave_seconds, physics_for
    phys = physics_for(hw)
    if phys is None or not phys.sms or not profile.arch.get("d_model"):
        return 0.0, 0.0
    flops_s, mem_s = _rates(hw)
    h = profile.arch["d_model"]
    return layer_wave_seconds(micro_batch * profile.tokens_per_sample, h, profile.arch.get("ffn", 4 * h), tp,
                              phys.sms, flops_s, mem_s, max_split)


def composer_loss_delta_seconds(load, hw, *, micro_batch: int, micro_batches: int, metrics: int = 2) -> float:
    """Seconds per step to add to the step model's loss charge for a rank holding ``load``
    (`loads.RankLoad`; ``load.out`` / 2 logit elements per sample) running ``micro_batches``
    micro-batches of ``micro_batch`` samples under llm-foundry's MPT on Composer (2023). Negative
    where the runtime moves fewer bytes than the model charges.

    The step model charges torch's cross entropy under autocast: `gpu.LOSS_BYTES_PER_LOGIT` (14, 18)
    bytes per logit element. That runtime instead
    - computes the training loss with flash-attn's fused cross entropy (``ComposerMPTCausalLM``'s
      ``loss_fn`` default ``fused_crossentropy``, the v1.0.3 ``xentropy`` kernel):
      `gpu.FUSED_XENTROPY_BYTES_PER_LOGIT` (4, 4);
    - updates its training metrics after every micro-batch's backward (Composer's
      ``Trainer._train_microbatch`` calls ``_eval_train_metrics`` on the micro-batch's outputs, under
      ``torch.no_grad()`` and the precision context): ``ComposerMPTCausalLM``'s train metrics are
      ``LanguageCrossEntropy`` and ``LanguagePerplexity`` (a subclass with the same ``update``), each
      running ``torch.nn.CrossEntropyLoss(reduction="sum")`` over the whole micro-batch's logits
      (``composer/metrics/nlp.py``): ``metrics`` forward-only torch cross entropies under autocast,
      `gpu.LOSS_BYTES_PER_LOGIT`'s forward 14 B each.
    All memory-bound, at the GPU's streaming rate (`_rates`). 0 on a rank without the output layer."""
    from modelpar.planner.gpu import FUSED_XENTROPY_BYTES_PER_LOGIT as fused, LOSS_BYTES_PER_LOGIT as torch_ce
    if not load.is_last:
        return 0.0
    _, mem_s = _rates(hw)
    logits = load.out / 2 * micro_batch
    per_logit = sum(fused) + metrics * torch_ce[0] - sum(torch_ce)
    return micro_batches * per_logit * logits / mem_s
