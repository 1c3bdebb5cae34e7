"""Published GPU training runs predicted with the planner, row by row (pure: no process, meta device).

The rows, their runtimes and their evaluation (leave-one-out framework factors, tables) live here so
that the benchmark (``benchmarks/planner_published.py``) and the tests import the same code.

Rows (figures from the cited sources, copied in ``/work/shared/reference/published-runs.md`` and
``megatron.md``):

- Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer Models",
  Table 5: 22B / 175B / 530B / 1T on A100 80 GB, "full" (full recomputation, TP all-reduces) and
  "selective + SP" (sequence parallel, recompute of the attention core only), seconds per iteration.
- Narayanan et al. SC'21, Table 1 (1.7B, 18.4B, 145.6B), as Megatron-LM's
  ``examples/sc21/run_table_1.sh`` ran them (micro-batch 16 / 8 / 2, interleaving with 2 virtual
  stages for 145.6B, torch DDP where PP = 1 and Megatron's own DDP where PP > 1), achieved TFLOP/s
  per GPU with the paper's FLOP count.
- MosaicML llm-foundry, ``scripts/train/benchmarking/README.md``, A100 80 GB FSDP rows (Composer,
  PyTorch FSDP1), tokens/s per GPU (= the row's MFU with the row's own formula).
- Out of sample (printed, never used for a factor or a choice): the same README's H100 80GB BF16
  table, the same sweep on 8-64 H100s (``published_rows.MOSAIC_H100``), predicted with the same
  runtime description on the built-in H100 profile, FlashAttention v1 included (`gpu`: its H100 table
  is FlashAttention-2's scaled by the kernels' A100 ratio).

Each row is predicted for the runtime it ran on; describing that runtime is not fitting:

- Megatron-LM: fp16 (the A100's 312 TFLOP/s, the bf16 profile's rates), its unfused core attention
  with the fused scale-mask-softmax and CUDA dropout (``attention="megatron"``, dropout 0.1 as
  Megatron's defaults), the vocabulary-parallel embedding and output layer with the loss on sharded
  logits (`runtimes.vocab_parallel_profile`), apex's fused Adam (``fused_tp_optimizer``), fp16
  gradients reduced in fp16 (``reduce_bytes=2``: Megatron-LM's
  ``accumulate_allreduce_grads_in_fp32`` off: Megatron-LM's ``examples/sc21/CONFIG.sh`` sets
  fp16 with a static loss scale of 8192 and not that option), its own pipeline runtime (two reused
  receive buffers, ``recv_per_microbatch=False``), and the scatter / gather of pipeline transfers
  over the TP ranks (SC'21 Sec. 4.1, ``p2p_scatter_gather``), and Megatron's DDP for PP > 1
  (all-reduce after backward in place: ``dp_overlap=False``, ``ddp_bucket_copy=False``) or torch
  DDP for PP = 1 (overlapped, bucket copy; ``run_table_1.sh``: ``DDP=torch`` for 1.7B and 18B,
  ``DDP=local`` for PP > 1). Selective
  recomputation: `runtimes.selective_recompute_profile` (memory) and
  `runtimes.attention_core_seconds` (the extra forward of the core, per layer and micro-batch).
  Korthikanti's runs (2022, the code that introduced sequence parallelism) overlap the
  column-parallel linears' backward collectives with their GEMMs (``async_tp``,
  `runtimes.tp_backward_overlap_delta`); the SC'21 rows (2021 code, whose version is not pinned
  here) keep the synchronous backward all-reduces (an assumption, stated).
  The unfused core's matmuls (``baddbmm`` Q K^T and ``bmm`` with V, and their backward) are
  priced at their own roofline, not inside the sum of the rank's matmuls where the weight GEMMs
  hide their bytes (`runtimes.core_roofline_excess`: the roofline is a per-kernel bound).
  Its fp16 modules hold 16-bit weights (``autocast_weights=False``) beside fp32 main weights in
  its fp16 optimizer (``master_weights``: gradient copy, unscale and inf check, main-to-model
  weight copy per step). Korthikanti's rows accumulate gradients in fp32 main-gradient buffers
  (their model state is 18 B per parameter: the paper's Fig. 1, `megatron_memory`), with which
  that code's gradient-accumulation fusion is on: the linear weights' gradients are added into
  the buffer by their weight-gradient GEMMs, so the step model's per-micro-batch accumulation pass
  is not paid for them (`runtimes.fused_accumulation_seconds`); the SC'21 rows (fp16 gradients:
  ``CONFIG.sh`` passes no fp32-accumulation option, so Megatron-LM's ``validate_args`` turns the
  fusion off) keep it.
- MosaicML: Composer FSDP1 FULL_SHARD (ZeRO-3 over all GPUs), bf16 autocast, FlashAttention v1
  (the A100 table predates llm-foundry's ``gpu-flash2`` extra: its 2023 environments pin
  ``flash-attn==v1.0.3.post0``, e.g. llm-foundry's Dockerfile and MPT notebooks; the reference calls
  them "the 2023 kernels"; the table is also printed with FlashAttention-2, ``kernel="fa2"``
  (the benchmark's mosaic-kernel option), as a sensitivity check), gradients reduce-scattered
  every micro-batch; Composer's mixed-precision modes (``composer/trainer/dist.py`` of that time):
  DEFAULT gathers fp32 parameters and reduces in bf16, PURE gathers and reduces in bf16.
  Composer's FSDP1 defaults of that time (``composer/trainer/dist.py``: ``backward_prefetch``
  BACKWARD_POST, ``forward_prefetch`` False; llm-foundry's ``submit_benchmarks.py`` sets
  ``limit_all_gathers``). BACKWARD_POST issues a unit's backward all-gather from the previous
  unit's post-backward hook, *before* that unit's reduce-scatter, on FSDP1's unshard stream, which
  does not wait for the compute stream (torch's ``fsdp/_runtime_utils.py``: ``_post_backward_hook``
  -> ``_post_backward_reshard`` -> ``_prefetch_handle``; ``_unshard``); with the CPU thread ahead of
  the GPU (the rate limiter keeps it at most two gathers ahead) the gather runs beside the previous
  unit's backward, as FSDP2's prefetch does, so the same exposure model (`comms._fsdp_exposed`)
  applies.
  Under DEFAULT the gathered fp32 weights are cast by ``torch.autocast`` (``precision: amp_bf16``)
  in every forward and their gradients back in backward (``autocast_weights``). FSDP1's flat
  parameters are gathered in place and its gradient casts run on its post-backward stream
  (``fsdp_stream_copies=False``; FSDP2 copies on the compute stream). Activation checkpointing
  wraps the MPT blocks only (the embedding, head and loss run once, as the planner's "full" does).
  The loss: flash-attn's fused cross entropy, and after every micro-batch Composer's two training
  metrics (a torch cross entropy each) over the logits (`runtimes.composer_loss_delta_seconds`).
  Not described (a known gap): llm-foundry's benchmark yamls of that time select
  ``attn_impl: triton`` (the Triton FlashAttention kernel), for which no cited A100 table is at
  hand; the FlashAttention v1 table stands in for it. The MPT shape: vocabulary 50,368, FFN 4 d,
  learned positions; modelpar's GPT also has biases and an untied head (a small difference in
  parameters, none in matmul FLOPs except biases).

Both frameworks' rows: the transformer layers' weight GEMMs pay tile and wave quantization by their
shapes on the A100's 108 SMs inside the step model (`cost.StepForm`, `gpu.layer_wave_seconds`;
NVIDIA's Matrix Multiplication Background guide, cited in `gpu`), as every bf16 plan on a built-in
GPU does: these rows check the planner users run.

The only constants not from the tables in ``modelpar/planner/gpu.py`` are at most one efficiency
factor per framework, fitted leave-one-out (each row's factor is the geometric mean of published /
predicted throughput over the *other* rows of its framework); every table is printed with the
factor and with it at 1.

Printed by ``benchmarks/planner_published.py`` (its docstring gives the command and options).
"""

from __future__ import annotations

import dataclasses
import math
import statistics

import torch

from modelpar.models.gpt import GPT, GPTConfig
from modelpar.plan import ParallelPlan
from modelpar.planner.comms import _coll
from modelpar.planner.cost import bubble_fraction, estimate_step, tp_bytes_per_sample
from modelpar.planner.memo import PlannerCache
from modelpar.planner.hardware import BUILTIN
from modelpar.planner.memory import Batch, estimate_memory, rank_loads, rank_memory
from modelpar.planner.profile import profile_model
from modelpar.planner.published_rows import (FAST, FAST_40GB, FAST_H100, KORTHIKANTI, MEGATRON,  # noqa: F401
                                            MOSAIC, MOSAIC_A100_40GB, MOSAIC_H100, MPT)
from modelpar.planner.runtimes import (attention_core_seconds, composer_loss_delta_seconds, core_roofline_excess,
                                       fused_accumulation_seconds, main_grad_copy_seconds, regather_profile,
                                       selective_recompute_profile, tp_backward_overlap_delta, vocab_parallel_profile)

A100 = BUILTIN["A100-80GB"]
GIB = 2 ** 30

# ---- rows: `published_rows` (figures and sources) ---------------------------------------------


@dataclasses.dataclass
class Result:
    source: str                 # "korthikanti", "megatron", "mosaic"
    framework: str              # "Megatron-LM" or "Composer FSDP"
    name: str
    layout: str
    published: float            # throughput-like figure (higher = faster)
    predicted: float            # the same figure, factor 1
    unit: str
    step: object                # StepEstimate
    memory: object              # MemoryEstimate
    fits: bool

    @property
    def ratio(self) -> float:
        return self.published / self.predicted


_PROFILES: dict[tuple, object] = {}


def gpt_profile(vocab: int, seq: int, layers: int, heads: int, d: int, *, attention: str, dropout: float):
    """Profile (batch 1, bf16, meta device) of modelpar's GPT of this shape; cached.

    The transformer blocks of the GPT are identical, and so are their profiles (every field but
    the name; checked here on the two profiled blocks), so a 2-layer model is profiled and its
    block repeated ``layers`` times: the same `ModelProfile` as profiling all layers, in seconds."""
    key = (vocab, seq, layers, heads, d, attention, dropout)
    if key not in _PROFILES:
        with torch.device("meta"):
            model = GPT(GPTConfig(vocab_size=vocab, seq_len=seq, n_layer=2, n_head=heads, d_model=d,
                                  dropout=dropout))
        x = torch.zeros(1, seq, dtype=torch.long, device="meta")
        # the replicated embedding / head; the Megatron rows add vocab parallel (vocab_parallel_profile)
        p = profile_model(model, x, dtype=torch.bfloat16, attention=attention, vocab_parallel=False)
        embed, b0, b1, head = p.blocks
        if dataclasses.replace(b1, name=b0.name) != b0:
            raise AssertionError("GPT blocks profile differently; profile every layer instead")
        blocks = (embed, *(dataclasses.replace(b0, name=f"blocks.{i}") for i in range(layers)), head)
        _PROFILES[key] = dataclasses.replace(p, blocks=blocks, arch={**p.arch, "n_layer": layers})
    return _PROFILES[key]


MEGATRON_RUNTIME = dict(optimizer="adamw", fused_tp_optimizer=True)


def megatron_memory(profile, plan, batch, *, ddp: str, state_scale: tuple[float, float] = (1.0, 1.0)):
    """Peak `MemoryEstimate` of a Megatron-LM run: the planner's memory model per pipeline rank
    (`memory.rank_memory`, as `memory.estimate_memory` calls it: Megatron's two reused pipeline
    buffers, its fused Adam, torch DDP's bucket copy only where ``ddp == "torch"``, and the
    vocabulary-parallel cross entropy's one fp32 copy of the logits reused in place for the softmax
    and the gradient: ``fp32_loss=False``), with each rank's ``params`` and ``optimizer`` parts
    scaled by ``state_scale`` before the peak rank is taken.

    (1, 1) is `estimate_memory`'s answer. (0.5, 1.5): Megatron's fp16 model state with fp32
    gradient accumulation (Korthikanti's rows; `korthikanti_rows`): 16-bit weights (2 B) and the fp16
    optimizer's fp32 main weights beside Adam's two moments (12 B) where the planner's bf16 plans
    hold fp32 weights (4 B) and the moments (8 B); the fp32 main gradients (4 B) are what the
    planner already holds: 18 B per parameter (Korthikanti et al. 2022, Fig. 1, parameters and
    optimizer state: 22B on TP 8, 2.72e9 parameters per GPU, at ~45.6 GiB = 18 B each; 16 B would be
    40.5 GiB)."""
    b, acc = batch.micro_batch_size(plan), batch.accumulation_steps(plan)
    loads = rank_loads(profile, plan, act_bytes=2)
    ests = []
    for r, ld in enumerate(loads):
        e = rank_memory(ld, plan, micro_batch_size=b, overhead_bytes=A100.framework_overhead_bytes, pp_rank=r,
                        accumulation=acc, global_batch_size=batch.global_batch_size, recv_per_microbatch=False,
                        ddp_bucket_copy=(ddp == "torch"), fp32_loss=False, **MEGATRON_RUNTIME)
        ests.append(dataclasses.replace(e, params=e.params * state_scale[0], optimizer=e.optimizer * state_scale[1]))
    return max(ests, key=lambda e: e.total)


def megatron_estimate(profile, plan, batch, *, ddp: str, selective: bool, micro: int, async_tp: bool = False,
                      fp32_accumulation: bool = False):
    """(StepEstimate, MemoryEstimate) of one Megatron-LM run (see module docstring): ``profile``
    with the replicated embedding / head (made vocabulary-parallel here when ``plan.tp`` > 1),
    ``ddp`` ``"torch"`` or ``"local"`` (Megatron's own), ``micro`` samples per micro-batch,
    ``async_tp``: the asynchronous TP backward collectives (`runtimes.tp_backward_overlap_delta`),
    ``fp32_accumulation``: gradients accumulate in fp32 main-gradient buffers (Megatron-LM's
    ``accumulate_allreduce_grads_in_fp32``), which turns its gradient-accumulation fusion on (the
    linear weights' gradients accumulate inside their weight-gradient GEMMs:
    `runtimes.fused_accumulation_seconds`), makes the fp16 optimizer's gradient copy an alias
    (`runtimes.main_grad_copy_seconds`) and holds 18 B of model state per parameter
    (`megatron_memory`)."""
    prof = regather_profile(vocab_parallel_profile(profile) if plan.tp > 1 else profile)
    mprof = selective_recompute_profile(prof, dropout=True) if selective else prof
    # fp16 weights (2 B) and fp32 main weights + Adam moments (12 B) where the planner's bf16 plans
    # hold fp32 weights (4 B) and moments (8 B); gradients 4 B either way where they accumulate in fp32
    mem = megatron_memory(mprof, plan, batch, ddp=ddp, state_scale=(0.5, 1.5) if fp32_accumulation else (1.0, 1.0))
    st = estimate_step(prof, plan, batch, A100, dp_overlap=(ddp == "torch"), reduce_bytes=2,
                       p2p_scatter_gather=True, replicate=False, autocast_weights=False, master_weights=True,
                       **MEGATRON_RUNTIME)
    m = plan.n_microbatches if plan.pp > 1 else 1
    acc = batch.accumulation_steps(plan)
    bubble = bubble_fraction(plan.pp_schedule, plan.pp, m, plan.virtual_stages) * m * acc
    # the unfused core's products at their own roofline (`runtimes.core_roofline_excess`), forward,
    # backward and (full recomputation) the replayed forward; the slowest rank's figure
    full = plan.activation_checkpointing == "full"
    ex = max((core_roofline_excess(ld, prof, A100, micro_batch=micro, tp=plan.tp)
              for ld in rank_loads(prof, plan, act_bytes=2)), key=lambda e: e[0] * (2 if full else 1) + e[1])
    st = dataclasses.replace(st, compute=st.compute + acc * m * (ex[0] + ex[1]),
                             recompute=st.recompute + (acc * m * ex[0] if full else 0.0),
                             bubble=st.bubble + bubble * (ex[0] * (2 if full else 1) + ex[1]))
    if fp32_accumulation:
        # the rank the step model prices: the most work (equal layers per stage: the one holding the
        # output layer), then the most parameters, as `cost.StepForm`'s slowest-rank key
        loads = rank_loads(prof, plan, act_bytes=2)
        ld = max(loads, key=lambda x: (x.fwd_flops + x.bwd_flops, x.params))
        saved = fused_accumulation_seconds(ld, prof, A100, tp=plan.tp, micro_batches=acc * m)
        st = dataclasses.replace(st, compute=st.compute - saved,
                                 optimizer=st.optimizer - main_grad_copy_seconds(ld, A100))
    if async_tp and plan.tp > 1:
        cache = PlannerCache().bind(hw=A100)
        ar = _coll(plan, "tp", A100, "all_reduce", tp_bytes_per_sample(prof, plan) * micro, plan.tp, False, cache)
        layers = (len(prof.blocks) - 2) / plan.pp
        d = tp_backward_overlap_delta(prof, A100, micro_batch=micro, tp=plan.tp,
                                      sequence_parallel=plan.sequence_parallel, layers=layers, all_reduce_s=ar)
        st = dataclasses.replace(st, tp_comm=st.tp_comm + acc * m * d, bubble=st.bubble + bubble * d)
    if selective:
        # the attention core's extra forward, per layer and micro-batch, on every rank's layers;
        # the pipeline's idle time grows with the per-micro-batch work (cost.rank_step's bubble)
        layers = (len(prof.blocks) - 2) / plan.pp
        per_mb = layers * attention_core_seconds(prof, A100, micro_batch=micro, tp=plan.tp, dropout=True)
        st = dataclasses.replace(st, recompute=st.recompute + acc * m * per_mb, bubble=st.bubble + bubble * per_mb)
    return st, mem


def korthikanti_rows(fast: bool = False) -> list[Result]:
    out = []
    for name, h, a, l, tp, pp, v, gpus, B, b, t_full, t_sel in KORTHIKANTI:
        if fast and name not in FAST["korthikanti"]:
            continue
        prof = gpt_profile(51200, 2048, l, a, h, attention="megatron", dropout=0.1)
        m = B // b
        for mode, published in (("full", t_full), ("selective+sp", t_sel)):
            sel = mode != "full"
            plan = ParallelPlan(tp=tp, pp=pp, n_microbatches=m if pp > 1 else 1, virtual_stages=v,
                                pp_schedule=("interleaved1f1b" if v > 1 else "1f1b") if pp > 1 else "1f1b",
                                activation_checkpointing="none" if sel else "full", precision="bf16",
                                sequence_parallel=sel)
            batch = Batch(B, B if pp > 1 else b)
            st, mem = megatron_estimate(prof, plan, batch, ddp="local", selective=sel, micro=b, async_tp=True,
                                         fp32_accumulation=True)
            out.append(Result("korthikanti", "Megatron-LM", f"{name} {mode}", plan.describe(), 1 / published,
                              1 / st.total, "1/s", st, mem, mem.total <= A100.memory_bytes))
    return out


def paper_flops(B: int, l: int, h: int, V: int = 51200, S: int = 2048) -> float:
    """FLOPs per iteration with full recomputation (Narayanan et al. SC'21, Eq. 3)."""
    return 96 * B * S * l * h * h * (1 + S / (6 * h) + V / (16 * l * h))


def megatron_rows(fast: bool = False) -> list[Result]:
    out = []
    for name, a, h, l, tp, pp, v, gpus, B, b, ddp, published in MEGATRON:
        if fast and name not in FAST["megatron"]:
            continue
        prof = gpt_profile(51200, 2048, l, a, h, attention="megatron", dropout=0.1)
        dp = gpus // (tp * pp)
        per_dp = B // dp
        plan = ParallelPlan(dp_replicate=dp, tp=tp, pp=pp, n_microbatches=per_dp // b if pp > 1 else 1,
                            virtual_stages=v, pp_schedule="interleaved1f1b" if pp > 1 else "1f1b",
                            activation_checkpointing="full", precision="bf16")
        batch = Batch(B, per_dp if pp > 1 else b)
        st, mem = megatron_estimate(prof, plan, batch, ddp=ddp, selective=False, micro=b)
        tflops = paper_flops(B, l, h) / (st.total * gpus) / 1e12
        out.append(Result("megatron", "Megatron-LM", name, plan.describe(), published, tflops, "TFLOP/s",
                          st, mem, mem.total <= A100.memory_bytes))
    return out


MOSAIC_KERNEL = "fa1"


def mosaic_rows(fast: bool = False, kernel: str | None = None, gpu: str = "A100-80GB") -> list[Result]:
    """The MosaicML rows on ``gpu``: ``"A100-80GB"`` (the handed rows, source ``mosaic``),
    ``"H100-80GB-SXM"`` or ``"A100-40GB"`` (out of sample: sources ``mosaic-h100``, ``mosaic-40gb``),
    each predicted with that built-in profile and the 2023 attention kernel (``kernel``, default
    `MOSAIC_KERNEL`).

    Raises:
        ValueError: ``gpu`` is none of these."""
    tables = {"A100-80GB": ("mosaic", MOSAIC, FAST["mosaic"]),
              "H100-80GB-SXM": ("mosaic-h100", MOSAIC_H100, FAST_H100),
              "A100-40GB": ("mosaic-40gb", MOSAIC_A100_40GB, FAST_40GB)}
    if gpu not in tables:
        raise ValueError(f"gpu={gpu!r}: published MosaicML rows exist for {sorted(tables)}")
    source, rows, fast_keys = tables[gpu]
    hw = BUILTIN[gpu]
    out = []
    for model, seq, gpus, micro, accum, B, tps, mp, ac, *_ in rows:
        if fast and (model, seq, micro) not in fast_keys:
            continue
        d, heads, layers = MPT[model]
        prof = gpt_profile(50368, seq, layers, heads, d, attention="flash", dropout=0.0)
        plan = ParallelPlan(dp_shard=gpus, precision="bf16", activation_checkpointing="full" if ac else "none")
        batch = Batch(B, micro)
        assert batch.accumulation_steps(plan) == accum, (model, seq, gpus)
        gather = 4 if mp == "DEFAULT" else 2
        st = estimate_step(prof, plan, batch, hw, reduce_bytes=2, gather_bytes=gather,
                           attention_kernel=kernel or MOSAIC_KERNEL, autocast_weights=(mp == "DEFAULT"),
                           fsdp_stream_copies=False)
        # the loss as llm-foundry / Composer ran it: fused cross entropy plus two train metrics per micro-batch
        ld = rank_loads(prof, plan, act_bytes=2)[0]
        st = dataclasses.replace(st, compute=st.compute + composer_loss_delta_seconds(
            ld, hw, micro_batch=micro, micro_batches=accum))
        # llm-foundry's MPT loss: flash-attn's CrossEntropyLoss (xentropy kernel) on the bf16 logits, no fp32
        # copy; its backward writes one gradient beside the saved logits (``inplace_backward=False``, the
        # default llm-foundry kept: `memory.rank_memory`'s ``loss_tensors``)
        mem = estimate_memory(prof, plan, batch, overhead_bytes=hw.framework_overhead_bytes, fp32_loss=False,
                              loss_tensors=1.0)
        if mp == "DEFAULT" and not ac:
            # FSDP1 under autocast: each matmul casts its gathered fp32 weight, a view of the flat parameter
            # (autocast caches casts of leaf tensors only), and saves the bf16 copy for its backward, so the
            # first block's backward (the peak's moment) holds every block's copy, unsharded. Recomputed
            # blocks save none; PURE gathers bf16 weights and casts nothing. (modelpar's FSDP2 gathers
            # bf16 parameters: its plans hold no such copies.)
            copies = sum(b.fwd_gemm_param_bytes for b in prof.blocks[1:-1])
            mem = dataclasses.replace(mem, activations=mem.activations + copies)
        pred = B * seq / (st.total * gpus)
        out.append(Result(source, "Composer FSDP", f"{model} s{seq} {gpus}g b{micro}", plan.describe(), tps, pred,
                          "tok/s/GPU", st, mem, mem.total <= hw.memory_bytes))
    return out


# ---- factors and tables -----------------------------------------------------------------------
def loo_factors(results: list[Result]) -> list[float]:
    """Each row's leave-one-out framework factor: the geometric mean of published / predicted over
    the other rows of its framework (1 when it has no other row)."""
    out = []
    for i, r in enumerate(results):
        others = [math.log(x.ratio) for j, x in enumerate(results) if j != i and x.framework == r.framework]
        out.append(math.exp(sum(others) / len(others)) if others else 1.0)
    return out


def summarize(results: list[Result], factors: list[float]) -> dict:
    errs = [r.predicted * f / r.published - 1 for r, f in zip(results, factors)]
    by = {}
    for r, e in zip(results, errs):
        by.setdefault(r.source, []).append(abs(e))
    return {"errors": errs, "median": statistics.median(abs(e) for e in errs),
            "largest": max(abs(e) for e in errs), "mean_by_source": {k: sum(v) / len(v) for k, v in by.items()},
            "not_fit": [r.name for r in results if not r.fits]}


def table(results: list[Result], factors: list[float], title: str) -> str:
    s = summarize(results, factors)
    lines = [title, f"{'source':<11} {'row':<22} {'layout':<46} {'published':>10} {'predicted':>10} {'err':>7} "
             f"{'comp':>5} {'comm':>5} {'bubl':>5} {'opt':>5} {'GiB':>6} fits"]
    for r, f, e in zip(results, factors, s["errors"]):
        st = r.step
        tot = st.total
        comp = (st.compute + st.recompute) / tot
        comm = (st.tp_comm + st.pp_comm + st.dp_comm) / tot
        lines.append(f"{r.source:<11} {r.name:<22} {r.layout[:46]:<46} {_fmt(r.published, r.unit):>10} "
                     f"{_fmt(r.predicted * f, r.unit):>10} {e:>+7.1%} {comp:>5.0%} {comm:>5.0%} "
                     f"{st.bubble / tot:>5.0%} {st.optimizer / tot:>5.0%} {r.memory.total / GIB:>6.1f} "
                     f"{'yes' if r.fits else 'NO'}")
    means = ", ".join(f"{k} {v:.1%}" for k, v in s["mean_by_source"].items())
    lines.append(f"median |error| {s['median']:.1%}, largest {s['largest']:.1%}; mean by source: {means}; "
                 f"predicted not to fit: {len(s['not_fit'])} {s['not_fit']}")
    return "\n".join(lines)


def _fmt(x: float, unit: str) -> str:
    return f"{1 / x:.2f} s" if unit == "1/s" else f"{x:,.0f}" if x >= 1000 else f"{x:.1f}"


def activation_check() -> str:
    """Korthikanti's activation formulas (megatron.md) per layer and setting vs the planner's
    per-layer activation bytes for the 22B shape (s 2048, b 1, h 6144, a 64, t 8)."""
    s, b, h, a, t = 2048, 1, 6144, 64, 8
    prof = gpt_profile(51200, s, 4, a, h, attention="megatron", dropout=0.1)
    sel = selective_recompute_profile(prof, dropout=True)
    rows = [("no parallelism", prof, 1, False, False, s * b * h * (34 + 5 * a * s / h)),
            ("TP", prof, t, False, False, s * b * h * (10 + 24 / t + 5 * a * s / (h * t))),
            ("TP + SP", prof, t, True, False, s * b * h * (34 / t + 5 * a * s / (h * t))),
            ("TP + selective", sel, t, False, False, s * b * h * (10 + 24 / t)),
            ("TP + SP + selective", sel, t, True, False, 34 * s * b * h / t),
            ("full recompute (TP)", prof, t, False, True, 2 * s * b * h)]
    lines = ["activation bytes per layer, Korthikanti et al. 2022 formulas vs the planner (22B shape, b=1):",
             f"{'setting':<22} {'formula MiB':>12} {'planner MiB':>12} {'planner/formula':>16}"]
    for name, p, tp, sp, full, formula in rows:
        ld = rank_loads(p, ParallelPlan(tp=tp, sequence_parallel=sp, precision="bf16"), act_bytes=2)[0]
        mid = len(p.blocks) // 2
        bl = p.blocks[mid]
        if full:
            got = bl.input_bytes / (tp if sp else 1)
        else:
            got = (bl.saved_bytes / tp) if sp else (bl.saved_bytes - bl.saved_tp_sharded_bytes
                                                    + bl.saved_tp_sharded_bytes / tp)
        del ld
        lines.append(f"{name:<22} {formula / 2**20:>12.1f} {got / 2**20:>12.1f} {got / formula:>16.3f}")
    return "\n".join(lines)


def run(fast: bool = False, kernel: str | None = None) -> tuple[list[Result], dict, dict]:
    """All rows (or the fast subset); returns (results, summary with factor 1, summary with LOO factors)."""
    results = korthikanti_rows(fast) + megatron_rows(fast) + mosaic_rows(fast, kernel)
    ones = [1.0] * len(results)
    return results, summarize(results, ones), summarize(results, loo_factors(results))


def report(fast: bool = False, kernel: str | None = None) -> str:
    """The benchmark's text: every row with factor 1 and with its leave-one-out framework factor,
    the factor for runs outside the table, and the activation-memory check."""
    results, _, _ = run(fast, kernel)
    out = [table(results, [1.0] * len(results), "== factor 1 (no fitted constant) =="), ""]
    f = loo_factors(results)
    fw: dict[str, list[float]] = {}
    for r, x in zip(results, f):
        fw.setdefault(r.framework, []).append(x)
    out.append(table(results, f, "== leave-one-out framework factor (range per framework: " + ", ".join(
        f"{k} {min(v):.3f}-{max(v):.3f}" for k, v in fw.items()) + ") =="))
    full: dict[str, list[float]] = {}
    for r in results:
        full.setdefault(r.framework, []).append(math.log(r.ratio))
    outside = {k: math.exp(sum(v) / len(v)) for k, v in full.items()}
    out.append("factor for runs not in this table (geometric mean over all its rows): " + ", ".join(
        f"{k} {outside[k]:.3f} ({len(full[k])} rows)" for k in full))
    n_out = 0
    for gpu, title in (("H100-80GB-SXM", "H100 80GB BF16"), ("A100-40GB", "A100 40GB (RoCE)")):
        rows = mosaic_rows(fast, kernel, gpu=gpu)
        n_out += len(rows)
        f = outside["Composer FSDP"]
        out += ["", table(rows, [1.0] * len(rows), f"== out of sample: llm-foundry's {title} rows (not handed; "
                          "nothing fitted or chosen on them), factor 1 =="), "",
                table(rows, [f] * len(rows),
                      f"== the same with the Composer FSDP factor of the handed rows ({f:.3f}) ==")]
    out += ["", activation_check(), f"\n{len(results)} handed rows, {n_out} out-of-sample rows"]
    return "\n".join(out)
