"""Issue 14: selective and every-k activation checkpointing, deferred FSDP gradient sync (plan
fields, runtime wrapping, planner terms). Multi-rank parity of the modes is in tests/helpers/parity_cases.py."""

import pytest
import torch

from modelpar.models import build_gpt, build_mlp
from modelpar.models.gpt import AttentionCore
from modelpar.parallel import checkpointing
from modelpar.plan import ParallelPlan


def _ckpt(m) -> bool:
    return bool(getattr(m, "_modelpar_ac", False))


def test_plan_validates_the_new_fields():
    ParallelPlan(activation_checkpointing="every-k", ac_every=2).validate()
    ParallelPlan(activation_checkpointing="selective").validate()
    ParallelPlan(dp_shard=2, defer_grad_sync=True).validate(2)
    with pytest.raises(ValueError, match="activation_checkpointing='sometimes' is unknown"):
        ParallelPlan(activation_checkpointing="sometimes").validate()
    with pytest.raises(ValueError, match="ac_every=3 only applies with activation_checkpointing='every-k'"):
        ParallelPlan(activation_checkpointing="full", ac_every=3).validate()
    with pytest.raises(ValueError, match="ac_every must be a positive integer, got 0"):
        ParallelPlan(activation_checkpointing="every-k", ac_every=0).validate()
    with pytest.raises(ValueError, match=r"defer_grad_sync=True needs FSDP .* got dp_shard=1, pp=1"):
        ParallelPlan(dp_replicate=2, defer_grad_sync=True).validate(2)
    with pytest.raises(ValueError, match=r"got dp_shard=2, pp=2"):
        ParallelPlan(dp_shard=2, pp=2, defer_grad_sync=True).validate(4)
    p = ParallelPlan(activation_checkpointing="every-k", ac_every=4, dp_shard=2, defer_grad_sync=True)
    assert ParallelPlan.from_dict(p.to_dict()) == p
    assert "ac=every-4" in p.describe() and "deferred grad sync" in p.describe()


def test_every_k_checkpoints_blocks_0_k_2k_by_model_index():
    m = build_gpt("gpt-nano", n_layer=6, seq_len=16)
    blocks = list(m.blocks)
    assert checkpointing.apply_ac(blocks, mode="every-k", every=2) == 3
    assert [_ckpt(b) for b in blocks] == [True, False, True, False, True, False]
    # a pipeline stage holding blocks 3..5 checkpoints the model's block 4 only
    m2 = build_gpt("gpt-nano", n_layer=6, seq_len=16)
    stage = list(m2.blocks)[3:]
    assert checkpointing.apply_ac(stage, mode="every-k", every=2, indices=[3, 4, 5]) == 1
    assert [_ckpt(b) for b in stage] == [False, True, False]


def test_selective_checkpoints_only_the_attention_cores_and_keeps_gradients():
    torch.manual_seed(0)
    ref = build_gpt("gpt-nano", n_layer=2, seq_len=16, seed=0)
    sel = build_gpt("gpt-nano", n_layer=2, seq_len=16, seed=0)
    assert checkpointing.apply_ac(list(sel.blocks), mode="selective") == 2
    cores = [m for m in sel.modules() if isinstance(m, AttentionCore)]
    assert len(cores) == 2 and all(_ckpt(c) for c in cores)
    assert not any(_ckpt(b) for b in sel.blocks)
    assert [n for n, _ in ref.named_parameters()] == [n for n, _ in sel.named_parameters()]
    x = torch.randint(0, 256, (2, 16))
    for model in (ref, sel):
        model(x).float().pow(2).mean().backward()
    for (n, a), (_, b) in zip(ref.named_parameters(), sel.named_parameters()):
        assert torch.allclose(a.grad, b.grad, atol=1e-6), n


def test_selective_needs_attention_cores():
    mlp = build_mlp([8, 16, 4])
    with pytest.raises(ValueError, match=r"block '0' \(Sequential\) has none"):
        checkpointing.apply_ac(list(mlp.children()), mode="selective")
    assert not any(_ckpt(c) for c in mlp.children())         # refused before anything is wrapped


def test_parallelize_refuses_selective_without_cores_before_any_work():
    from modelpar.parallel.compose import parallelize
    from modelpar.parallel.mesh import MeshInfo

    mlp = build_mlp([8, 16, 4])
    with pytest.raises(ValueError, match="attention core"):
        parallelize(mlp, ParallelPlan(activation_checkpointing="selective"), MeshInfo(mesh=None),
                    loss_fn=torch.nn.functional.cross_entropy, device=torch.device("cpu"))


def test_planner_orders_the_modes_and_says_what_selective_frees():
    """Memory: none > selective >= every-4 > every-2 > full on a 6-layer GPT; with the fused kernel
    the attention core frees only its log-sum-exp, with the unfused (math) path the (seq x seq)
    tensors; step time: recompute grows with the share of checkpointed blocks."""
    from modelpar.models import build_model
    from modelpar.planner.cost import estimate_step, hfu, mfu
    from modelpar.planner.hardware import get_hardware
    from modelpar.planner.memory import Batch, estimate_memory
    from modelpar.planner.profile import profile_model

    m = build_model("gpt-10m", device="meta")
    x = torch.zeros(1, m.cfg.seq_len, dtype=torch.long, device="meta")
    flash, math_ = profile_model(m, x), profile_model(m, x, attention="math")
    blk, cfg = flash.blocks[1], m.cfg
    lse = 4 * cfg.n_head * cfg.seq_len                             # fp32 (heads, seq) per sample
    assert blk.attn_core_saved_bytes == lse
    assert math_.blocks[1].attn_core_saved_bytes >= 4 * cfg.n_head * cfg.seq_len ** 2
    hw = get_hardware("H100-80GB-SXM")
    tot, rc = {}, {}
    for ac, k in (("none", 1), ("selective", 1), ("every-k", 4), ("every-k", 2), ("full", 1)):
        plan = ParallelPlan(dp_shard=2, activation_checkpointing=ac, ac_every=k)
        tot[(ac, k)] = estimate_memory(math_, plan, Batch(16, 8)).total
        st = estimate_step(flash, plan, Batch(16, 8), hw)
        rc[(ac, k)] = st.recompute
        assert hfu(st, hw, "fp32") >= mfu(st, hw, "fp32")
    order = [("none", 1), ("every-k", 4), ("every-k", 2), ("full", 1)]
    assert all(tot[a] > tot[b] for a, b in zip(order, order[1:]))
    assert tot[("selective", 1)] < tot[("none", 1)]
    assert rc[("none", 1)] == 0 < rc[("selective", 1)] < rc[("every-k", 2)] < rc[("full", 1)]
    assert rc[("every-k", 4)] < rc[("every-k", 2)]


def test_search_tries_the_new_modes_where_none_fits():
    """Every-k is chosen where no checkpointing does not fit and it is cheaper than full; deferred
    FSDP sync is a candidate only with accumulation."""
    from helpers.profiles import gpt_profile
    from modelpar.planner.hardware import get_hardware
    from modelpar.planner.search import search_plans

    prof, _ = gpt_profile("gpt-1b", torch.bfloat16)        # its 24 identical blocks profiled once
    rep = search_plans(prof, 8, get_hardware("H100-80GB-SXM"), global_batch_size=512)
    modes = {(c.plan.activation_checkpointing, c.plan.ac_every) for c in rep.ranked}
    assert {("none", 1), ("every-k", 2), ("every-k", 4), ("full", 1)} <= modes
    assert any(c.plan.defer_grad_sync for c in rep.ranked)
    assert all(c.batch.accumulation_steps(c.plan) > 1 for c in rep.ranked if c.plan.defer_grad_sync)
    only = search_plans(prof, 8, get_hardware("H100-80GB-SXM"), global_batch_size=512,
                        checkpointing=("every-k",), ac_every=(2,), defer_grad_sync=False)
    assert {(c.plan.activation_checkpointing, c.plan.ac_every) for c in only.ranked} == {("every-k", 2)}
