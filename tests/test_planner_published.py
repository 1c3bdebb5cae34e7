"""Published GPU runs as tests (issue 14, item 4): a fast subset of `modelpar.planner.published`
(the rows benchmarks/planner_published.py prints),
the cited GPU tables (modelpar/planner/gpu.py) and Megatron-LM's runtime terms. Pure Python on the
meta device (a few seconds)."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from modelpar.models.gpt import GPT, GPTConfig
from modelpar.plan import ParallelPlan
from modelpar.planner.cost import estimate_step
from modelpar.planner.gpu import A100, GPU_PHYSICS, H100, physics_for
from modelpar.planner.calibration import Calibration
from modelpar.planner.hardware import BUILTIN, cpu_profile
from modelpar.planner.memory import Batch, estimate_memory, rank_loads
from modelpar.planner import published
from modelpar.planner.profile import profile_model
from modelpar.planner.runtimes import vocab_parallel_profile


@pytest.fixture(scope="module")
def bench():
    return published


# ---- the published rows ------------------------------------------------------------------------
@pytest.mark.timeout(300)
def test_fast_published_rows_fit_and_stay_within_reached_errors(bench):
    results, one, loo = bench.run(fast=True)
    assert {r.source for r in results} == {"korthikanti", "megatron", "mosaic"} and len(results) == 7
    assert all(r.fits for r in results), [(r.name, r.memory.total / 2**30) for r in results if not r.fits]
    # factor 1 (no fitted constant): the errors this model reaches on these rows (full benchmark:
    # docs/planner.md); predictions err on the fast side (kernels below their published peaks)
    assert one["largest"] <= 0.19, one["errors"]        # 18.5% (SC'21 1.7B; 20.2% before wave quantization, 27.5% before the core roofline)
    # one leave-one-out factor per framework (fitted on the other rows of the subset)
    assert loo["median"] <= 0.05 and loo["largest"] <= 0.15, loo["errors"]
    # Korthikanti 22B: factor 1 mean 8.1% here with the GEMMs' wave quantization (13.9% before it;
    # 9.6% with the unfused core's per-kernel roofline alone, 12.4% before that; Megatron's
    # asynchronous TP backward hides ~5% of the 22B step, so factor 1 moved away); its
    # leave-one-out factor in this 3-row Megatron subset is set mostly by the 1.7B row (4.5% here;
    # 2.7% before wave quantization, 4.5% and 6.1% before the two earlier terms). Session 10: the
    # fp16 optimizer's gradient copy is an alias with fp32 main gradients (`runtimes.
    # main_grad_copy_seconds`): 22B's step 9-10 ms shorter, factor 1 mean 8.1 -> 9.1%
    assert one["mean_by_source"]["korthikanti"] <= 0.095
    assert loo["mean_by_source"]["korthikanti"] <= 0.05


@pytest.mark.timeout(300)
def test_out_of_sample_h100_rows(bench):
    # llm-foundry's H100 80GB BF16 table: the same sweep on H100s, never used for a factor or a choice;
    # predicted with the A100 rows' runtime description (FlashAttention v1 included) on the H100 profile
    rows = bench.mosaic_rows(fast=True, gpu="H100-80GB-SXM")
    assert [r.name for r in rows] == ["7b s65536 8g b1", "3b s512 8g b40"] and all(r.fits for r in rows)
    assert {r.source for r in rows} == {"mosaic-h100"}
    errs = [r.predicted / r.published - 1 for r in rows]
    # attention-bound (7b s65536: -4.0%) and matmul-bound (3b s512: +15.3%, MAMF measured with later cuBLAS)
    assert abs(errs[0]) <= 0.08 and 0 < errs[1] <= 0.20, errs
    # with FlashAttention-2's H100 rates (the kernel these runs did not have) the long row is far off (+56%)
    fa2 = bench.mosaic_rows(fast=True, kernel="fa2", gpu="H100-80GB-SXM")
    assert fa2[0].predicted / fa2[0].published - 1 > 0.4
    with pytest.raises(ValueError, match="gpu='H200'"):
        bench.mosaic_rows(gpu="H200")
    # FSDP1 under autocast without checkpointing (3b s512, DEFAULT) holds every block's bf16 weight copy
    prof = bench.gpt_profile(50368, 512, 32, 20, 2560, attention="flash", dropout=0.0)
    copies = sum(b.fwd_gemm_param_bytes for b in prof.blocks[1:-1])
    assert copies == pytest.approx(2 * 32 * 12 * 2560 ** 2, rel=0.01)
    plain = estimate_memory(prof, ParallelPlan(dp_shard=8, precision="bf16"), Batch(1920, 40), fp32_loss=False,
                            overhead_bytes=BUILTIN["H100-80GB-SXM"].framework_overhead_bytes, loss_tensors=1.0)
    assert rows[1].memory.total == pytest.approx(plain.total + copies)


@pytest.mark.timeout(300)
def test_out_of_sample_a100_40gb_rows_fit(bench):
    # the README's A100 40GB table: 350m s2048 b18 ran on 16-128 A100s of 40 GB; with modelpar's loss
    # (3 logits-sized tensors beside the logits at its backward) they were predicted at 42.3-42.5 GiB
    rows = bench.mosaic_rows(fast=True, gpu="A100-40GB")
    assert [r.name for r in rows] == [f"350m s2048 {g}g b18" for g in (128, 64, 32, 16)]
    assert all(r.fits and r.memory.total < 37 * 2**30 for r in rows), [r.memory.total / 2**30 for r in rows]
    assert all(abs(r.predicted / r.published - 1) <= 0.08 for r in rows)     # +0.8..+5.0% at factor 1


def test_loss_tensors_beside_the_logits():
    # flash-attn's cross entropy (llm-foundry's MPT loss) writes one gradient beside its saved logits;
    # modelpar's loss holds three logits-sized tensors beside them at its backward
    prof = _gpt(vocab_size=8192, seq_len=64, n_layer=1, n_head=2, d_model=32)
    plan, batch = ParallelPlan(precision="bf16"), Batch(8, 8)
    three = estimate_memory(prof, plan, batch, fp32_loss=False)
    one = estimate_memory(prof, plan, batch, fp32_loss=False, loss_tensors=1.0)
    # the loss's backward is the peak with three; with one, the head's backward (logits and their gradient held)
    assert three.phase == "loss" and one.phase == "backward"
    assert 0 < three.total - one.total <= 2 * 8 * 64 * 8192 * 2       # at most two bf16 logits tensors less
    assert estimate_memory(prof, plan, batch, fp32_loss=False, loss_tensors=3.0).total == three.total


def test_leave_one_out_factor_excludes_the_row(bench):
    R = bench.Result
    rows = [R("a", "F", "x", "", 1.0, 2.0, "", None, None, True), R("a", "F", "y", "", 1.0, 1.0, "", None, None, True),
            R("b", "G", "z", "", 3.0, 1.0, "", None, None, True)]
    f = bench.loo_factors(rows)
    assert math.isclose(f[0], 1.0) and math.isclose(f[1], 0.5) and f[2] == 1.0


def test_activation_memory_matches_korthikanti_formulas(bench):
    text = bench.activation_check()
    ratios = [float(line.split()[-1]) for line in text.splitlines()[2:]]
    assert len(ratios) == 6 and all(abs(r - 1) < 0.01 for r in ratios), text


def test_published_1t_layout_fits_with_megatron_terms(bench):
    # issue 14: the published 1T layout (TP 8, PP 64) was predicted at 93 GiB without the
    # vocabulary-parallel embedding / head and with a DDP bucket copy and logits-sized sends
    prof = bench.gpt_profile(51200, 2048, 128, 160, 25600, attention="megatron", dropout=0.1)
    plan = ParallelPlan(tp=8, pp=64, n_microbatches=512, activation_checkpointing="full", precision="bf16")
    st, mem = bench.megatron_estimate(prof, plan, Batch(512, 512), ddp="local", selective=False, micro=1)
    assert mem.total < 80 * 2**30
    plain = estimate_memory(prof, plan, Batch(512, 512), overhead_bytes=2**30, recv_per_microbatch=False,
                            fused_tp_optimizer=True)
    assert plain.total > mem.total + 10 * 2**30      # the unsharded 1.3B-parameter embedding alone: 18 B/param


# ---- Megatron-LM runtime terms -----------------------------------------------------------------
def _gpt(**kw):
    with torch.device("meta"):
        m = GPT(GPTConfig(**kw))
    # the replicated embedding / head profile, which vocab_parallel_profile shards
    return profile_model(m, torch.zeros(1, m.cfg.seq_len, dtype=torch.long, device="meta"), dtype=torch.bfloat16,
                         vocab_parallel=False)


def test_vocab_parallel_profile_shards_embedding_head_and_logits():
    prof = _gpt(vocab_size=1024, seq_len=64, n_layer=2, n_head=4, d_model=64)
    vp = vocab_parallel_profile(prof)
    assert vp.blocks[0].tp_sharded_params == 1024 * 64 and vp.blocks[-1].tp_sharded_params == 1024 * 64
    assert vp.blocks[1:-1] == prof.blocks[1:-1]
    plan = ParallelPlan(tp=4, pp=2, n_microbatches=2, precision="bf16")
    a, b = rank_loads(prof, plan, act_bytes=2), rank_loads(vp, plan, act_bytes=2)
    assert math.isclose(a[0].params - b[0].params, 1024 * 64 * 3 / 4)       # embedding shard
    assert math.isclose(b[-1].out * 4, a[-1].out)                            # loss on sharded logits
    # pipeline sends carry the hidden state, not the last stage's logits
    assert b[-1].p2p == b[0].p2p == 64 * 64 * 2


def test_megatron_attention_profile_saves_korthikanti_terms():
    s, h, a = 256, 128, 8
    prof = _gpt(vocab_size=512, seq_len=s, n_layer=2, n_head=a, d_model=h, dropout=0.1)
    with torch.device("meta"):
        m = GPT(GPTConfig(vocab_size=512, seq_len=s, n_layer=2, n_head=a, d_model=h, dropout=0.1))
    meg = profile_model(m, torch.zeros(1, s, dtype=torch.long, device="meta"), dtype=torch.bfloat16,
                        attention="megatron")
    assert meg.blocks[1].saved_bytes == pytest.approx(s * h * (34 + 5 * a * s / h), rel=5e-3)
    assert meg.blocks[1].fwd_flops == pytest.approx(prof.blocks[1].fwd_flops, rel=1e-6)
    with pytest.raises(ValueError, match="attention"):
        profile_model(m, torch.zeros(1, s, dtype=torch.long, device="meta"), attention="nope")


def test_ddp_bucket_copy_term():
    prof = _gpt(vocab_size=256, seq_len=64, n_layer=2, n_head=4, d_model=64)
    plan = ParallelPlan(dp_replicate=4, precision="bf16")
    with_copy = estimate_memory(prof, plan, Batch(16, 4))
    without = estimate_memory(prof, plan, Batch(16, 4), ddp_bucket_copy=False)
    assert with_copy.comm_buffers - without.comm_buffers == pytest.approx(4 * prof.num_params)


# ---- GPU tables --------------------------------------------------------------------------------
def test_gpu_tables_cited_values_and_interpolation():
    assert H100.attention_flops("fwd", 2048, 128, False, "fa3") == pytest.approx(625e12)
    assert H100.attention_flops("bwd", 16384, 128, False, "fa2") == pytest.approx(322e12)
    mid = H100.attention_flops("fwd", 3000, 128, True, "fa2")
    assert 298e12 < mid < 319e12
    assert H100.attention_flops("fwd", 100, 128, True) == H100.attention_flops("fwd", 512, 128, True)
    assert max(A100.attention[("fa2", "fwd", False, 128)]) == pytest.approx(0.73 * 312)
    assert A100.allreduce_latency_steps(2) == 2 and A100.allreduce_latency_steps(1024) == 20
    with pytest.raises(ValueError, match="fa3"):
        A100.attention_flops("fwd", 2048, 128, True, "fa3")
    assert set(GPU_PHYSICS) == {"A100-40GB", "A100-80GB", "H100-80GB-SXM", "H200"}
    # FlashAttention v1: FlashAttention-2's curves x 0.40 / 0.73 (the kernels' stated A100 peaks) on both GPUs
    for gpu in (A100, H100):
        for (k, *rest), v in gpu.attention.items():
            if k == "fa1":
                assert v == pytest.approx(tuple(x * 0.40 / 0.73 for x in gpu.attention[("fa2", *rest)]))
    assert sorted({k for k, *_ in H100.attention}) == ["fa1", "fa2", "fa3"]


def test_cpu_and_calibrated_profiles_never_read_gpu_tables():
    assert physics_for(cpu_profile(2)) is None
    assert physics_for(dataclasses.replace(BUILTIN["A100-80GB"], calibration=Calibration(matmul_flops={64: 1e9}))) is None
    assert physics_for(BUILTIN["H100-80GB-SXM"]) is H100


def test_inter_node_bandwidth_counts_the_nics_a_group_drives():
    prof = _gpt(vocab_size=256, seq_len=128, n_layer=2, n_head=4, d_model=256)
    hw = BUILTIN["A100-80GB"]
    # DDP across 2 nodes: all 8 GPUs of a node in the group (8 NICs) vs one GPU per node beside TP 8
    full = estimate_step(prof, ParallelPlan(dp_replicate=16, precision="bf16"), Batch(16, 1), hw, dp_overlap=False)
    one = estimate_step(prof, ParallelPlan(dp_replicate=2, tp=8, precision="bf16"), Batch(2, 1), hw, dp_overlap=False)
    # ring volume over 8 NICs' busbw, plus tree latency steps (2 ceil(log2 16)) across nodes
    n_full = (2 * 15 / 16 * 4 * prof.num_params / min(A100.intra_allreduce_busbw, 8 * A100.inter_busbw)
              + 8 * A100.inter_latency)
    assert full.dp_comm == pytest.approx(n_full, rel=0.05)
    local = rank_loads(prof, ParallelPlan(dp_replicate=2, tp=8, precision="bf16"), act_bytes=2)[0].params
    n_one = 2 * 1 / 2 * 4 * local / A100.inter_busbw + 2 * A100.inter_latency     # one NIC per group
    assert one.dp_comm == pytest.approx(n_one, rel=0.05)


# ---- full recompute: the checkpointed blocks only ----------------------------------------------
def test_full_recompute_replays_the_blocks_not_embedding_head_or_loss():
    # modelpar (`parallel.checkpointing`: the transformer blocks), Megatron-LM (--recompute-granularity
    # full: the transformer layers) and llm-foundry (MPT blocks) checkpoint the blocks only: the
    # embedding, the output layer and the loss run once; full == every-k with k = 1
    prof = _gpt(vocab_size=50304, seq_len=256, n_layer=2, n_head=4, d_model=256)
    hw = BUILTIN["A100-80GB"]
    plans = {ac: ParallelPlan(dp_shard=8, precision="bf16", activation_checkpointing=ac, ac_every=1)
             for ac in ("none", "full", "every-k")}
    st = {ac: estimate_step(prof, p, Batch(64, 8), hw) for ac, p in plans.items()}
    assert st["full"].recompute == pytest.approx(st["every-k"].recompute, rel=1e-9)
    blocks = sum(b.fwd_flops for b in prof.blocks[1:-1]) / prof.batch_size
    assert blocks < 0.5 * prof.fwd_flops_per_sample          # the 50k-vocabulary head dominates here
    assert st["full"].hardware_flops - st["full"].model_flops == pytest.approx(64 * blocks, rel=1e-9)
    # a model without a transformer's embedding / head (every block checkpointed): the whole forward
    from modelpar.models import build_model
    mp = profile_model(build_model("mlp-small", device="meta"), torch.zeros(4, 1000, device="meta"))
    full = estimate_step(mp, ParallelPlan(activation_checkpointing="full"), Batch(4, 4), hw)
    assert full.hardware_flops - full.model_flops == pytest.approx(4 * mp.fwd_flops_per_sample, rel=1e-9)


# ---- autocast over fp32 weights -----------------------------------------------------------------
def test_autocast_weight_casts_on_gpus():
    # torch.autocast casts each fp32 matmul weight to bf16 once per forward region (read 4, write 2
    # bytes per element) and its gradient back to fp32 in backward (read 2, write 4): Composer's
    # DEFAULT mode (fp32 parameters gathered) and modelpar's autocast runs (bf16 without FSDP2)
    prof = _gpt(vocab_size=1024, seq_len=256, n_layer=4, n_head=4, d_model=512)
    hw, batch = BUILTIN["A100-80GB"], Batch(16, 2)
    fsdp = ParallelPlan(dp_shard=8, precision="bf16")
    ld = rank_loads(prof, fsdp, act_bytes=2)[0]
    weights = ld.gemm_param_bytes[0] / 2
    mem_s = hw.mem_bandwidth * A100.hbm_fraction
    plain = estimate_step(prof, fsdp, batch, hw)                    # FSDP2's bf16 parameters: no cast
    cast = estimate_step(prof, fsdp, batch, hw, gather_bytes=4, autocast_weights=True)
    assert cast.compute - plain.compute == pytest.approx(12 * weights / mem_s, rel=1e-6)
    ddp = ParallelPlan(dp_replicate=8, precision="bf16")            # modelpar's DDP runs under autocast
    assert (estimate_step(prof, ddp, batch, hw).compute
            > estimate_step(prof, ddp, batch, hw, autocast_weights=False).compute)
    cpu = cpu_profile(2)                                            # CPU profiles: unchanged
    assert (estimate_step(prof, ParallelPlan(dp_replicate=2, precision="bf16"), Batch(4, 2), cpu)
            == estimate_step(prof, ParallelPlan(dp_replicate=2, precision="bf16"), Batch(4, 2), cpu,
                             autocast_weights=False))


# ---- FSDP2's copies on the compute stream -------------------------------------------------------
def test_fsdp2_copy_out_and_reduce_scatter_copy_in_on_gpus():
    # torch's FSDP2 (`_fsdp_collectives.foreach_all_gather_copy_out` after the all-gather event, and
    # `foreach_reduce_scatter_copy_in` before the reduce-scatter stream waits) copies on the compute
    # stream: gathered parameters out of the flat buffer (read + write, every gather), unsharded
    # gradients into the reduce-scatter input (read in the parameter dtype, write in the reduce
    # dtype). FSDP1's flat parameter gathers in place and casts on its own streams: no such copies
    prof = _gpt(vocab_size=1024, seq_len=256, n_layer=4, n_head=4, d_model=512)
    hw, plan, batch = BUILTIN["H100-80GB-SXM"], ParallelPlan(dp_shard=8, precision="bf16"), Batch(16, 2)
    ld = rank_loads(prof, plan, act_bytes=2)[0]
    mem_s = hw.mem_bandwidth * H100.hbm_fraction
    root = ld.root_params
    want = (2 * 2 * 2 * (ld.params - root) + 2 * 2 * root + (2 + 4) * ld.params) / mem_s
    fsdp2 = estimate_step(prof, plan, batch, hw)
    fsdp1 = estimate_step(prof, plan, batch, hw, fsdp_stream_copies=False)
    assert fsdp2.dp_comm - fsdp1.dp_comm == pytest.approx(want, rel=1e-6)
    # CPU profiles (no overlap) keep their own copy terms: unchanged
    cpu = cpu_profile(2)
    p2 = ParallelPlan(dp_shard=2)
    assert estimate_step(prof, p2, Batch(4, 2), cpu) == estimate_step(prof, p2, Batch(4, 2), cpu,
                                                                       fsdp_stream_copies=False)


# ---- Megatron-LM's fp16 optimizer with fp32 main weights ---------------------------------------
def test_master_weights_optimizer_traffic():
    # Float16OptimizerWithFloat16Params: model gradients copied to fp32 main gradients (read 2,
    # write 4), unscaled and checked for inf / nan (read 4, write 4), main weights copied back to
    # the 16-bit model weights (read 4, write 2): 20 B/parameter beyond the AdamW step
    prof = _gpt(vocab_size=1024, seq_len=256, n_layer=4, n_head=4, d_model=512)
    hw, plan, batch = BUILTIN["A100-80GB"], ParallelPlan(tp=8, precision="bf16"), Batch(8, 8)
    ld = rank_loads(prof, plan, act_bytes=2)[0]
    a = estimate_step(prof, plan, batch, hw, fused_tp_optimizer=True)
    m = estimate_step(prof, plan, batch, hw, fused_tp_optimizer=True, master_weights=True)
    assert m.optimizer - a.optimizer == pytest.approx(20 * ld.params / (hw.mem_bandwidth * A100.hbm_fraction))
    cpu, p1 = cpu_profile(1), ParallelPlan()
    assert estimate_step(prof, p1, Batch(2, 2), cpu, master_weights=True) == estimate_step(prof, p1, Batch(2, 2), cpu)


def test_unfused_core_products_priced_at_their_own_roofline(bench):
    # the per-kernel roofline (Williams et al. 2009) for Megatron-LM's core products: with the
    # layer's matmuls compute-bound in sum, the products' bytes (intensity ~ head dim 96, below
    # the A100's ridge ~155 FLOP/B) add B_c / W - F_c / R per layer and direction
    from modelpar.planner.runtimes import core_products, core_roofline_excess
    prof = bench.gpt_profile(51200, 2048, 4, 24, 2304, attention="megatron", dropout=0.1)
    plan = ParallelPlan(precision="bf16", activation_checkpointing="full")
    ld = rank_loads(prof, plan, act_bytes=2)[0]
    core = core_products(prof, micro_batch=16, tp=1)
    f, byt = core["fwd"]
    assert math.isclose(f, 4 * 16 * 24 * 2048 ** 2 * 96) and math.isclose(byt, 2 * 16 * 24 * (2 * 2048 ** 2 + 4 * 2048 * 96))
    R, W = A100.mamf_bf16, BUILTIN["A100-80GB"].mem_bandwidth * A100.hbm_fraction
    ex_f, ex_b = core_roofline_excess(ld, prof, BUILTIN["A100-80GB"], micro_batch=16, tp=1)
    assert math.isclose(ex_f, 4 * (byt / W - f / R), rel_tol=1e-9) and ex_f > 0
    assert math.isclose(ex_b, 4 * (2 * byt / W - 2 * f / R), rel_tol=1e-9)
    # it reaches the step: the Megatron estimate is slower than the planner's (which already holds
    # the GEMMs' wave quantization, `gpu.layer_wave_seconds`) by exactly the excess (+ the replay)
    base = estimate_step(prof, plan, Batch(16, 16), BUILTIN["A100-80GB"], reduce_bytes=2, replicate=False,
                         autocast_weights=False, master_weights=True, p2p_scatter_gather=True,
                         optimizer="adamw", fused_tp_optimizer=True)
    st, _ = bench.megatron_estimate(prof, plan, Batch(16, 16), ddp="torch", selective=False, micro=16)
    assert math.isclose(st.total - base.total, 2 * ex_f + ex_b, rel_tol=1e-6)
    # a fused-attention profile has no such products
    flash = bench.gpt_profile(50368, 2048, 4, 24, 2304, attention="flash", dropout=0.0)
    assert core_roofline_excess(rank_loads(flash, plan, act_bytes=2)[0], flash, BUILTIN["A100-80GB"],
                                micro_batch=16, tp=1) == (0.0, 0.0)


def test_megatron_async_tp_backward_overlaps_column_parallel_collectives(bench):
    # Megatron-LM's LinearWithGradAccumulationAndAsyncCommunication: without SP the input-gradient
    # all-reduce runs beside the weight-gradient GEMM; with SP the re-gather and the reduce-scatter
    # run beside the GEMMs and the row-parallel output gradients' all-gathers stay exposed
    from modelpar.planner.runtimes import tp_backward_overlap_delta
    prof = bench.gpt_profile(51200, 2048, 4, 64, 6144, attention="megatron", dropout=0.1)
    hw = BUILTIN["A100-80GB"]
    share = A100.nccl_sm_share
    ar = 1e-4                        # shorter than every GEMM (QKV wgrad of b 4 x s 2048 x h 6144 / 8: ~0.9 ms)
    d = tp_backward_overlap_delta(prof, hw, micro_batch=4, tp=8, sequence_parallel=False, layers=3, all_reduce_s=ar)
    assert math.isclose(d, 3 * (2 * share * ar - 2 * ar))
    d_sp = tp_backward_overlap_delta(prof, hw, micro_batch=4, tp=8, sequence_parallel=True, layers=3, all_reduce_s=ar)
    assert math.isclose(d_sp, 3 * (ar + 4 * share * ar / 2 - 2 * ar))
    # a collective longer than its GEMM exposes the excess
    big = 1.0
    w_qkv = 2 * 4 * 2048 * 6144 * 3 * 6144 / 8 / A100.mamf_bf16
    w_mlp = 2 * 4 * 2048 * 6144 * 4 * 6144 / 8 / A100.mamf_bf16
    d_big = tp_backward_overlap_delta(prof, hw, micro_batch=4, tp=8, sequence_parallel=False, layers=1, all_reduce_s=big)
    assert math.isclose(d_big, (big - w_qkv + share * w_qkv) + (big - w_mlp + share * w_mlp) - 2 * big)
    # wired into the Korthikanti rows' estimate (TP 8): less exposed TP time than the synchronous model
    plan = ParallelPlan(tp=8, activation_checkpointing="full", precision="bf16")
    sync, _ = bench.megatron_estimate(prof, plan, Batch(4, 4), ddp="local", selective=False, micro=4)
    asy, _ = bench.megatron_estimate(prof, plan, Batch(4, 4), ddp="local", selective=False, micro=4, async_tp=True)
    assert asy.tp_comm < sync.tp_comm and asy.compute == sync.compute


def test_fused_accumulation_seconds_counts_the_linear_weights(bench):
    # Megatron-LM's gradient-accumulation fusion (wgrad_gemm_accum_fp32 into main_grad): the
    # linear weights of a rank's transformer layers, and the output layer's on the last rank, skip
    # the step model's 12 B/param accumulation pass after the first micro-batch; norms, biases
    # and the embedding lookup keep it
    from modelpar.planner.runtimes import fused_accumulation_seconds
    V, h, L, tp, m = 1024, 64, 4, 2, 6
    prof = vocab_parallel_profile(_gpt(vocab_size=V, seq_len=64, n_layer=L, n_head=4, d_model=h))
    hw = BUILTIN["A100-80GB"]
    W = hw.mem_bandwidth * A100.hbm_fraction
    plan = ParallelPlan(tp=tp, pp=2, n_microbatches=m, precision="bf16")
    first, last = rank_loads(prof, plan, act_bytes=2)
    layer = 12 * h * h / tp                                  # QKV 3h^2 + projection h^2 + MLP 2 x 4h^2
    assert fused_accumulation_seconds(first, prof, hw, tp=tp, micro_batches=m) == pytest.approx(
        (m - 1) * 12 * 2 * layer / W)
    assert fused_accumulation_seconds(last, prof, hw, tp=tp, micro_batches=m) == pytest.approx(
        (m - 1) * 12 * (2 * layer + V * h / tp) / W)
    # less than the whole pass: the rest of the rank's parameters keep it
    assert fused_accumulation_seconds(first, prof, hw, tp=tp, micro_batches=m) < (m - 1) * 12 * first.params / W
    assert fused_accumulation_seconds(last, prof, hw, tp=tp, micro_batches=1) == 0.0


def test_megatron_fp32_accumulation_drops_the_pass_and_holds_18_bytes(bench):
    # the Korthikanti rows (fp32 main gradients, so the fusion is on): compute lower by exactly the
    # slowest rank's fused pass, the optimizer by the gradient copy, nothing else in the step moves;
    # model state 2 + 4 + 12 B/param
    from modelpar.planner.runtimes import fused_accumulation_seconds
    prof = bench.gpt_profile(51200, 2048, 8, 16, 2048, attention="megatron", dropout=0.1)
    plan = ParallelPlan(tp=8, pp=4, n_microbatches=16, activation_checkpointing="full", precision="bf16")
    batch = Batch(16, 16)
    off, m_off = bench.megatron_estimate(prof, plan, batch, ddp="local", selective=False, micro=1, async_tp=True)
    on, m_on = bench.megatron_estimate(prof, plan, batch, ddp="local", selective=False, micro=1, async_tp=True,
                                       fp32_accumulation=True)
    vp = bench.regather_profile(vocab_parallel_profile(prof))
    last = rank_loads(vp, plan, act_bytes=2)[-1]             # the output layer's stage: the most work
    saved = fused_accumulation_seconds(last, vp, BUILTIN["A100-80GB"], tp=8, micro_batches=16)
    assert saved > 0 and off.compute - on.compute == pytest.approx(saved)
    # the fp16 optimizer's model-to-main gradient copy (read 2, write 4) is an alias of the fp32 buffer
    W = BUILTIN["A100-80GB"].mem_bandwidth * A100.hbm_fraction
    assert off.optimizer - on.optimizer == pytest.approx(6 * last.params / W)
    assert dataclasses.replace(on, compute=off.compute, optimizer=off.optimizer) == off
    assert m_on.params == pytest.approx(m_off.params / 2) and m_on.optimizer == pytest.approx(1.5 * m_off.optimizer)
    assert m_on.grads == m_off.grads and m_on.activations == m_off.activations
    # one micro-batch per step: no accumulation to fuse
    p1 = ParallelPlan(tp=8, activation_checkpointing="full", precision="bf16")
    a, _ = bench.megatron_estimate(prof, p1, Batch(4, 4), ddp="local", selective=False, micro=4, async_tp=True)
    b, _ = bench.megatron_estimate(prof, p1, Batch(4, 4), ddp="local", selective=False, micro=4, async_tp=True,
                                   fp32_accumulation=True)
    assert a.compute == b.compute and b.optimizer < a.optimizer


@pytest.mark.parametrize("ddp,pp", [("local", 4), ("torch", 1)])
def test_megatron_memory_at_unit_scale_is_the_planners(bench, ddp, pp):
    prof = bench.regather_profile(vocab_parallel_profile(
        bench.gpt_profile(51200, 2048, 8, 16, 2048, attention="megatron", dropout=0.1)))
    plan = ParallelPlan(tp=8, pp=pp, n_microbatches=8 if pp > 1 else 1, activation_checkpointing="full",
                        precision="bf16")
    batch = Batch(8, 8 if pp > 1 else 4)
    mine = bench.megatron_memory(prof, plan, batch, ddp=ddp)
    ref = estimate_memory(prof, plan, batch, overhead_bytes=BUILTIN["A100-80GB"].framework_overhead_bytes,
                          recv_per_microbatch=False, ddp_bucket_copy=(ddp == "torch"), fp32_loss=False,
                          optimizer="adamw", fused_tp_optimizer=True)
    assert mine == ref


def test_gemm_tile_and_wave_quantization():
    # NVIDIA's Matrix Multiplication Background guide, Ch. 3: a 1792 x 1792 output in 256 x 128 tiles
    # is 7 x 14 = 98 tiles, one wave of the A100's 108 SMs at 98 / 108; one tile more than a wave
    # costs a second wave; a partial tile costs a whole one; no SM count: no term
    from modelpar.planner.gpu import wave_efficiency
    assert math.isclose(wave_efficiency(1792, 1792, 108), 98 / 108)
    assert math.isclose(wave_efficiency(256 * 109, 128, 108), 109 / 216)
    assert math.isclose(wave_efficiency(256 * 108, 128, 108), 1.0)
    assert math.isclose(wave_efficiency(256 * 108 + 1, 128, 108), (256 * 108 + 1) / (2 * 108 * 256))
    assert wave_efficiency(100, 100, 0) == 1.0 and A100.sms == 108 and H100.sms == 132
    # the split-K sensitivity check (not the model): a 768 x 2304 weight-gradient output is 54 tiles,
    # half a wave; two slices of a long reduction fill it, a short one is not split
    assert math.isclose(wave_efficiency(768, 2304, 108), 0.5)
    assert math.isclose(wave_efficiency(768, 2304, 108, k=49152, max_split=16), 1.0)
    assert math.isclose(wave_efficiency(768, 2304, 108, k=768, max_split=16), 0.5)


def test_wave_quantization_seconds_of_the_layer_gemms(bench):
    # Korthikanti's 175B layer at TP 8, b = 1 (T = 2048 tokens): e.g. the QKV output 2048 x 4608
    # is 8 x 36 = 288 tiles, 3 waves (324): 8/9 of MAMF; the whole layer's excess is the sum over
    # its 12 products of F / R (1 / e - 1) (all compute-bound here); with more tokens the waves
    # fill (the term shrinks per FLOP); a profile without physics (CPU) gets none
    from modelpar.planner.gpu import wave_efficiency
    from modelpar.planner.runtimes import layer_gemm_shapes, wave_quantization_seconds
    prof = bench.gpt_profile(51200, 2048, 2, 96, 12288, attention="megatron", dropout=0.1)
    hw = BUILTIN["A100-80GB"]
    sh = layer_gemm_shapes(prof, micro_batch=1, tp=8)
    assert sh["fwd"][0] == (2048, 12288, 4608) and len(sh["bwd"]) == 8 and (12288, 2048, 4608) in sh["bwd"]
    assert math.isclose(wave_efficiency(2048, 4608, 108), 8 / 9)
    R = A100.mamf_bf16
    want = sum(2 * m * k * n / R * (1 / wave_efficiency(m, n, 108) - 1) for m, k, n in sh["fwd"])
    wf, wb = wave_quantization_seconds(prof, hw, micro_batch=1, tp=8)
    assert math.isclose(wf, want, rel_tol=1e-9) and wf > 0 and wb > 0
    fl = sum(2 * m * k * n for m, k, n in sh["fwd"])
    wf16, _ = wave_quantization_seconds(prof, hw, micro_batch=16, tp=8)
    assert wf16 / (16 * fl) < wf / fl
    assert wave_quantization_seconds(prof, cpu_profile(2), micro_batch=1, tp=8) == (0.0, 0.0)


def _without_waves(monkeypatch):
    """The step model with the GEMMs' wave quantization switched off (`gpu.layer_wave_seconds` -> 0)."""
    import modelpar.planner.cost as cost
    monkeypatch.setattr(cost, "layer_wave_seconds", lambda *a, **k: (0.0, 0.0))


@pytest.mark.parametrize("mode,ac_every,replayed", [("none", 1, 0), ("full", 1, 4), ("every-k", 2, 2),
                                                    ("selective", 1, 0)])
def test_planner_prices_the_gemm_waves_per_layer(bench, monkeypatch, mode, ac_every, replayed):
    # the term lives in the planner's GPU step pricing (`cost.StepForm`): every bf16 plan on a
    # built-in GPU pays it per transformer layer of each rank, forward and backward of every
    # micro-batch, and the replayed forward of the layers its checkpointing recomputes (full: all 4,
    # every 2nd: 2, selective: the attention cores only, no weight GEMM); the embedding and head none
    from modelpar.planner.runtimes import wave_quantization_seconds
    prof = bench.gpt_profile(50368, 2048, 4, 16, 2048, attention="flash", dropout=0.0)
    hw = BUILTIN["H100-80GB-SXM"]
    plan = ParallelPlan(dp_shard=8, precision="bf16", activation_checkpointing=mode, ac_every=ac_every)
    batch = Batch(64, 2)                     # 8 samples per rank in micro-batches of 2: 4 accumulation steps
    with_w = estimate_step(prof, plan, batch, hw)
    b = batch.micro_batch_size(plan)
    acc = batch.accumulation_steps(plan)
    wf, wb = wave_quantization_seconds(prof, hw, micro_batch=b, tp=1)
    assert wf > 0 and wb > 0 and acc == 4
    _without_waves(monkeypatch)
    without = estimate_step(prof, plan, batch, hw)
    assert math.isclose(with_w.compute - without.compute, acc * 4 * (wf + wb), rel_tol=1e-9)
    assert math.isclose(with_w.recompute - without.recompute, acc * replayed * wf, rel_tol=1e-9, abs_tol=1e-15)
    assert math.isclose(with_w.total - without.total, acc * (4 * (wf + wb) + replayed * wf), rel_tol=1e-6)


def test_planner_gemm_waves_under_tp_and_pp_bubble(bench, monkeypatch):
    # under TP the shards' shapes (column-parallel N / t, row-parallel K / t) set the waves; under a
    # pipeline each rank pays for its own layers, and the bubble idles for the slowest rank's
    # per-micro-batch work, replayed forward included; a CPU profile never pays it
    from modelpar.planner.cost import bubble_fraction
    from modelpar.planner.runtimes import wave_quantization_seconds
    prof = bench.gpt_profile(51200, 2048, 8, 32, 4096, attention="flash", dropout=0.0)
    hw = BUILTIN["A100-80GB"]
    plan = ParallelPlan(tp=4, pp=2, n_microbatches=4, precision="bf16", activation_checkpointing="full")
    batch = Batch(8, 8)
    with_w = estimate_step(prof, plan, batch, hw)
    b = batch.micro_batch_size(plan)
    wf, wb = wave_quantization_seconds(prof, hw, micro_batch=b, tp=4)
    assert (wf, wb) != wave_quantization_seconds(prof, hw, micro_batch=b, tp=1)
    cpu = cpu_profile(2)
    cpu_before = estimate_step(prof, plan, batch, cpu)
    _without_waves(monkeypatch)
    without = estimate_step(prof, plan, batch, hw)
    layers, m = 8 / 2, 4
    assert math.isclose(with_w.compute - without.compute, m * layers * (wf + wb), rel_tol=1e-9)
    assert math.isclose(with_w.recompute - without.recompute, m * layers * wf, rel_tol=1e-9)
    bub = bubble_fraction(plan.pp_schedule, 2, m, 1) * m
    assert bub > 0 and math.isclose(with_w.bubble - without.bubble, bub * layers * (2 * wf + wb), rel_tol=1e-9)
    assert estimate_step(prof, plan, batch, cpu) == cpu_before


def test_composer_loss_delta_counts_fused_loss_and_two_train_metrics():
    # llm-foundry's fused cross entropy (4 + 4 B per logit) plus Composer's two per-micro-batch train
    # metrics (a forward torch cross entropy each, 14 B) against the step model's 14 + 18 B
    from modelpar.planner.runtimes import composer_loss_delta_seconds
    prof = _gpt(vocab_size=512, seq_len=64, n_layer=2, n_head=4, d_model=64)
    hw = BUILTIN["A100-80GB"]
    ld = rank_loads(prof, ParallelPlan(dp_shard=8, precision="bf16"), act_bytes=2)[0]
    logits = 64 * 512 * 3                                   # tokens x vocabulary, micro-batch 3
    mem_s = hw.mem_bandwidth * A100.hbm_fraction
    got = composer_loss_delta_seconds(ld, hw, micro_batch=3, micro_batches=2)
    assert got == pytest.approx(2 * (8 + 28 - 32) * logits / mem_s)
    assert composer_loss_delta_seconds(ld, hw, micro_batch=3, micro_batches=2, metrics=0) < 0
    pp = rank_loads(prof, ParallelPlan(pp=2, n_microbatches=2, precision="bf16"), act_bytes=2)
    assert composer_loss_delta_seconds(pp[0], hw, micro_batch=3, micro_batches=2) == 0.0
