"""The planner's autocast profile (pure tier): modelpar's runtime trains bf16 without FSDP under
torch.autocast with fp32 parameters (`plan.autocasts`), so the residual stream, the norms' inputs and
the block boundaries are fp32 and every Linear casts its own bf16 copy of its input. The bf16 profile
(bf16 parameters, FSDP2's mixed precision) missed that: on an H100 it predicted 45.2 GiB for gpt-1b
without checkpointing where 50.6 GiB were allocated (docs/planner.md, "GPU check")."""

import dataclasses

import pytest
import torch

from modelpar.models import build_model
from modelpar.plan import ParallelPlan, autocasts
from modelpar.planner.memory import Batch, estimate_memory, memory_form, rank_loads
from modelpar.planner.profile import ModelProfile, profile_model

SEQ = 64


def _profiles():
    m = build_model("gpt-nano", device="meta", seq_len=SEQ)
    return m, profile_model(m, torch.zeros(1, SEQ, dtype=torch.long, device="meta"), dtype=torch.bfloat16,
                            autocast=True)


def _saved_under_autocast(block: torch.nn.Module, x: torch.Tensor) -> int:
    """Bytes a real block saves for backward in CPU bf16 autocast, each storage once, neither the
    parameters nor autocast's bf16 copies of them (parameter-shaped bf16 tensors; the batch of 3 makes
    no activation parameter-shaped)."""
    params = {p.untyped_storage().data_ptr() for p in block.parameters()}
    shapes = {tuple(p.shape) for p in block.parameters()}
    seen: dict[int, int] = {}

    def pack(t):
        st = t.untyped_storage()
        cast = t.dtype == torch.bfloat16 and (tuple(t.shape) in shapes or tuple(t.shape)[::-1] in shapes)
        if st.data_ptr() not in params and not cast:
            seen.setdefault(st.data_ptr(), st.nbytes())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), torch.autocast("cpu", dtype=torch.bfloat16):
        block(x)
    return sum(seen.values())


def test_autocast_profile_saves_what_a_real_autocast_block_saves():
    m, prof = _profiles()
    real = build_model("gpt-nano", device="cpu", seq_len=SEQ)
    x = torch.randn(3, SEQ, real.cfg.d_model, requires_grad=True)      # the fp32 residual stream
    want = _saved_under_autocast(real.blocks[1], x) / 3
    ac, bf = prof.autocast.blocks[2], prof.blocks[2]                    # blocks[0] is the embedding
    assert ac.saved_bytes == want
    # the fp32 residual: 8 more bytes per token and width than bf16 parameters save (two fp32 norm
    # inputs, 2 x 2 B, and two more bf16 copies of the first norm's output for k and v, 2 x 2 B)
    d = m.cfg.d_model
    assert ac.saved_bytes - bf.saved_bytes == 8 * SEQ * d
    assert ac.input_bytes == ac.output_bytes == 4 * SEQ * d == 2 * bf.input_bytes
    # the same matmuls, FLOPs and weight reads; the casts are more kernels and more traffic
    assert (ac.fwd_flops, ac.bwd_flops, ac.fwd_gemm_param_bytes) == (bf.fwd_flops, bf.bwd_flops, bf.fwd_gemm_param_bytes)
    assert ac.fwd_ops > bf.fwd_ops and ac.fwd_mem_bytes > bf.fwd_mem_bytes and ac.bwd_mem_bytes > bf.bwd_mem_bytes
    assert prof.autocast.num_params == prof.num_params and prof.autocast.dtype == "bf16"


def test_plans_read_the_profile_their_runtime_trains_with():
    _, prof = _profiles()
    plain = dataclasses.replace(prof, autocast=None)
    batch = Batch(8, 8)
    one = ParallelPlan(precision="bf16")
    fsdp = ParallelPlan(precision="bf16", dp_shard=2)
    assert autocasts(one) and not autocasts(fsdp) and not autocasts(ParallelPlan())
    # one device, bf16: autocast, so more activations than the bf16 profile says
    assert estimate_memory(prof, one, batch).total > estimate_memory(plain, one, batch).total
    # FSDP2 holds bf16 parameters (no autocast): the bf16 profile, unchanged
    assert estimate_memory(prof, fsdp, Batch(16, 8)).total == estimate_memory(plain, fsdp, Batch(16, 8)).total
    ld_ac = rank_loads(prof, one, act_bytes=2, autocast=True)[0]
    ld_bf = rank_loads(prof, one, act_bytes=2)[0]
    assert ld_ac.autocast and not ld_bf.autocast and ld_ac.key != ld_bf.key
    assert ld_ac.saved > ld_bf.saved and ld_ac.params == ld_bf.params


def test_weight_copies_follow_the_checkpointing_and_the_pipeline():
    """Autocast caches one bf16 copy of each weight a matmul reads until it exits; the matmuls save
    them. Without a pipeline backward runs after autocast exits, so a recomputed block's copies are
    gone from the loss's backward on and its recompute makes its own while its backward runs (the
    H100's peaks: gpt-1b full predicted +6.2% before, -0.4% after); a pipeline's schedule runs
    inside autocast, so every copy lives through the step. The copies are the matmuls' weights, not
    the embedding tables or the norms (2 B per parameter overstated gpt-1m by the embeddings; the
    CPU measurements of `modelpar.measure.memory.autocast_cases` check the totals)."""
    _, prof = _profiles()

    def form(**kw):
        plan = ParallelPlan(precision="bf16", **kw)
        ld = rank_loads(prof, plan, act_bytes=2, autocast=True)[0]
        return ld, memory_form(ld, plan, optimizer="adamw")

    ld, none = form()
    g = ld.gemm_param_bytes[0]
    assert (none.cast_cache, none.fwd_cast) == (g, 0.0) and g < 2 * ld.params
    unit = 2 * ld.max_unit_params       # one block's copies (its norms' few parameters included)
    layers = (ld.params - ld.root_params) / ld.max_unit_params
    _, full = form(activation_checkpointing="full")
    assert full.cast_cache == pytest.approx(g - layers * unit + unit) and full.cast_cache < g
    assert full.fwd_cast == g - full.cast_cache > 0          # until autocast exits (the loss's forward): all
    _, every = form(activation_checkpointing="every-k", ac_every=2)   # gpt-nano: layer 0 of 2 recomputed
    assert every.cast_cache == pytest.approx(g) and full.cast_cache < every.cast_cache
    _, pipe = form(activation_checkpointing="full", pp=2, n_microbatches=2)
    pld = rank_loads(prof, ParallelPlan(precision="bf16", pp=2), act_bytes=2, autocast=True)[0]
    assert (pipe.cast_cache, pipe.fwd_cast) == (pld.gemm_param_bytes[0], 0.0)
    # a load of the bf16 profile (Megatron-LM's bf16 parameters, `planner.published`): every parameter
    plan = ParallelPlan(precision="bf16", activation_checkpointing="full")
    bf = memory_form(rank_loads(prof, plan, act_bytes=2)[0], plan, optimizer="adamw")
    assert (bf.cast_cache, bf.fwd_cast) == (2 * ld.params, 0.0)


def test_weight_gradients_of_the_copies_are_not_activations():
    """Under autocast a matmul's weight gradient is its bf16 copy's, cast to fp32 to become the .grad:
    the profile counted it among the block's backward temporaries, per sample, so the memory model
    multiplied a weight-sized tensor by the micro-batch (gpt-1m full checkpointing on CPU: +12% on
    activations). It is a not-yet-stored gradient: the peaks scale with the batch in their
    activation bytes only, and the pending gradients are the same at any batch."""
    m = build_model("gpt-nano", device="meta", seq_len=SEQ)
    one, two = (profile_model(m, torch.zeros(b, SEQ, dtype=torch.long, device="meta"), dtype=torch.bfloat16,
                              autocast=True).autocast.blocks[2].bwd_peaks for b in (1, 2))
    assert len(one) == len(two) and any(p[3] for p in one)
    for p1, p2 in zip(one, two):
        assert (2 * p1[0], 2 * p1[1], p1[2], p1[3]) == tuple(p2)


def test_full_checkpointing_counts_a_blocks_input_once():
    """Full checkpointing keeps each block's input; the recompute saves that same storage again (the
    first norm's input), so inside block k's backward the input is counted once: the other blocks'
    kept inputs, block k's saved bytes, its temporaries (CPU, gpt-1m fp32 full: +3.0% activations
    before, one block input)."""
    from modelpar.planner.loads import _backward_moments
    from modelpar.planner.records import BlockRecord
    rec = BlockRecord(saved=10.0, kept=3.0, peaks=((1.0, 0.0, 0, 0),), params=5.0, is_root=False, in_grad=0.0,
                      in_saved=3.0, trainable=5.0)
    first = rec._replace(saved=7.0, kept=0.0, in_saved=0.0)          # a stage's first block
    bwd, _ = _backward_moments((first, rec, rec))
    assert max(m.act_ac for m in bwd) == 0.0 + 3.0 + 10.0 + 1.0     # block 2: blocks 0-1 kept, its own saved
    assert min(m.act_ac for m in bwd) == 7.0 + 1.0                  # block 0: its saved bytes only


def test_loss_forward_moment_holds_every_weight_copy():
    """gpt-3b with full checkpointing on the H100 peaked at the loss's forward (51.3 GiB; the loss's
    backward, the only loss moment the model had, gave 49.1): there all 2 B / parameter of autocast's
    copies are still cached, while the backward holds one fp32 logits-sized tensor more
    (`test_planner_against_recorded_gpu_runs` checks the GPU rows). Here the moment's terms: with the
    copies made large it is the peak, and it counts them, the logits and two fp32 logits-sized tensors."""
    _, prof = _profiles()
    full = ParallelPlan(precision="bf16", activation_checkpointing="full")
    f = memory_form(rank_loads(prof, full, act_bytes=2, autocast=True)[0], full, optimizer="adamw")
    b = 2
    loss = f.parts(b, 1, 1, 1.0)
    f.fwd_cast = big = 1e9
    fwd = f.parts(b, 1, 1, 1.0)
    assert fwd.phase == "loss_forward" and loss.phase != "loss_forward"
    # the same base (parameters, optimizer, cast cache, the logits) and saved inputs; the loss's two
    # fp32 tensors instead of its backward's loss_n, plus the copies
    acts_loss_bwd = f.cast_cache + b * f.out + b * f.S + f.loss_n * f.loss_out * b
    assert fwd.activations == pytest.approx(acts_loss_bwd - (f.loss_n - 2) * f.loss_out * b + big)


def test_profile_dict_round_trip_keeps_the_autocast_variant():
    _, prof = _profiles()
    back = ModelProfile.from_dict(prof.to_dict())
    assert back == prof and back.autocast == prof.autocast and back.autocast.autocast is None


def test_a_model_autocast_cannot_trace_keeps_its_bf16_profile(monkeypatch):
    """The autocast pass failing (a model whose forward CPU autocast cannot run) is said once and the
    bf16 profile stands in (the planner as before it), instead of the command failing."""
    import modelpar.planner.profile as pr

    real, want = pr._profile, _profiles()[1]

    def fail_under_autocast(*args):
        if args[-1]:
            raise RuntimeError("no autocast here")
        return real(*args)

    monkeypatch.setattr(pr, "_profile", fail_under_autocast)
    m = build_model("gpt-nano", device="meta", seq_len=SEQ)
    with pytest.warns(UserWarning, match="autocast profile of GPT failed .*no autocast here"):
        prof = profile_model(m, torch.zeros(1, SEQ, dtype=torch.long, device="meta"), dtype=torch.bfloat16,
                             autocast=True)
    assert prof.autocast is None and prof == want and want.autocast is not None


def test_autocast_profile_is_the_same_every_time():
    """Autocast's copies are freed during the pass and their storages' addresses reused; a key kept
    after its storage was freed took unrelated tensors for weight copies or gathered inputs, so two
    profiles of one model differed (matmul weight / activation bytes, gathered bytes). Keys now leave
    with their storage (`_OpCounter.track`)."""
    m = build_model("gpt-nano", device="meta", n_layer=7, seq_len=48)
    x = torch.zeros(1, 48, dtype=torch.long, device="meta")
    a, b = (profile_model(m, x, dtype=torch.bfloat16, autocast=True).autocast for _ in range(2))
    assert a.blocks == b.blocks


def test_profiled_attention_follows_autocast_like_torchs():
    """The profile routes F.scaled_dot_product_attention to the CPU flash kernel, which autocast does not
    see: fp32 q / k / v (Llama's rotary embedding multiplies bf16 projections by fp32 cos / sin) stayed
    fp32 there, where torch's sdpa under autocast runs in bf16. HF Llama (2 layers, bf16 DDP on CPU):
    activations +7.9% before (56 KiB per sample and layer: fp32 q, k, output and one more cast),
    +0.9% after (`planner_accuracy_memory`-style measurement, docs/planner.md session 16)."""
    from modelpar.planner.profile_ops import _FlashAttention
    q, k, v = (torch.randn(1, 2, 16, 8) for _ in range(3))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        want = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        with _FlashAttention():
            got = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
    assert want.dtype == got.dtype == torch.bfloat16
    with _FlashAttention():                      # no autocast: fp32 stays fp32
        assert torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True).dtype == torch.float32


def test_colwise_linears_cast_replicated_inputs():
    """The profile counts the saved tensors between a colwise Linear's output and its rowwise partner as
    sharded over TP. Under autocast k's and v's Linears each cast the (replicated) norm output
    themselves, after q's output had opened that region, so the profile halved those two casts under TP
    (gpt-1m tp2 bf16 on CPU: activations -5.6%). Replicated per block: the two fp32 norm inputs (2 B more
    each than the bf16 profile's) and the k / v casts (2 B each): 8 bytes per token and width more."""
    m, prof = _profiles()
    ac, bf = prof.autocast.blocks[2], prof.blocks[2]
    rep_ac = ac.saved_bytes - ac.saved_tp_sharded_bytes
    rep_bf = bf.saved_bytes - bf.saved_tp_sharded_bytes
    assert rep_ac - rep_bf == 8 * SEQ * m.cfg.d_model
    # the sharded part is the same tensors at the same dtype (q / k / v outputs, attention, MLP hidden)
    assert ac.saved_tp_sharded_bytes == bf.saved_tp_sharded_bytes


def test_pipeline_holds_the_copies_gradients_until_the_stages_backward_ends():
    """A pipeline's schedule runs inside autocast: the copies were made in the step's first forward, so in
    a later micro-batch's backward their cast nodes have the lowest autograd sequence numbers and run
    last; each copy's bf16 gradient (2 B / parameter) of the stage's completed blocks is alive meanwhile.
    The moment with earlier micro-batches' gradients (``prev``) of an autocast pipeline load counts it
    (``ProjMode.pp`` = 2); other loads do not."""
    from modelpar.planner.memory import _bwd_terms
    from modelpar.planner.records import BwdMoment, ProjMode
    c = BwdMoment(act=1.0, act_ac=1.0, done_units=10.0, done_root=3.0, stored=0.0, unit=5.0, prev_unit=0.0,
                  next_unit=0.0, units_upto=5.0, pending=2.0, done_units_trainable=10.0)

    def acts_k(pp):
        return _bwd_terms(c, ProjMode(fsdp=False, ac=False, prev=True, rafw=False, work=2, pp=pp, gloo=False,
                                      sharded_acc=False)).acts_k
    assert acts_k(2) - acts_k(1) == 2 * (10.0 + 3.0) and acts_k(1) == acts_k(0) == 4 * 2.0
    # the forms of an autocast pipeline load ask for that mode
    _, prof = _profiles()
    plan = ParallelPlan(precision="bf16", pp=2, n_microbatches=4)
    ld = rank_loads(prof, plan, act_bytes=2, autocast=True)[0]
    memory_form(ld, plan, optimizer="adamw").parts(1, 4, 1, 2.0)
    assert ld.projections and all(m.pp == 2 for m in ld.projections)
