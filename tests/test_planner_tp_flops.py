"""The planner's TP compute: only the FLOPs the runtime's TP plan splits divide by the TP degree
(`profile_blocks.TPSplitScopes`, `BlockProfile.tp_whole_flops`, `loads._tp_part`). OPT's attention
(left whole by the derived plan: its forward views by the global head count) and a mixture of experts'
experts and router (no plan entry) run whole on every TP rank; a GPT and Llama split everything."""

from __future__ import annotations

import pytest
import torch

from helpers.pure_fixtures import requires

B, S = 2, 32
TOKENS = B * S


def _profile(name: str, cfg: dict):
    from modelpar.models.hf import build_hf
    from modelpar.planner.profile import profile_model

    return profile_model(build_hf(f"hf:{name}", cfg, device="meta"), torch.zeros(B, S, dtype=torch.long))


def _split_check(prof, whole_per_layer: int, layers: int) -> None:
    """Per layer block, the whole forward FLOPs equal the hand count; one TP-2 rank's load computes
    the whole part and half of the rest, forward and backward alike."""
    from modelpar.plan import ParallelPlan
    from modelpar.planner.loads import rank_loads

    blocks = [b for b in prof.blocks if ".layers." in b.name]
    assert len(blocks) == layers
    for b in blocks:
        assert b.tp_whole_flops[0] == whole_per_layer, (b.name, b.tp_whole_flops)
    (ld,) = rank_loads(prof, ParallelPlan(tp=2), act_bytes=4)
    fwd, bwd = (sum(getattr(b, k) for b in prof.blocks) for k in ("fwd_flops", "bwd_flops"))
    whole = sum(b.tp_whole_flops[0] for b in prof.blocks)
    assert ld.fwd_flops * B == pytest.approx(whole + (fwd - whole) / 2, rel=1e-12)
    assert ld.bwd_flops * B == pytest.approx(bwd * (whole / fwd + (1 - whole / fwd) / 2), rel=1e-12)
    assert ld.fwd_flops * B > fwd / 2 * 1.2            # far from the even split the planner assumed before


@requires("transformers")
def test_opt_attention_stays_whole_under_tp():
    h, ffn, layers = 32, 64, 2
    prof = _profile("opt", {"hidden_size": h, "ffn_dim": ffn, "num_hidden_layers": layers, "num_attention_heads": 4,
                            "vocab_size": 256, "word_embed_proj_dim": h})
    attn = next(b for b in prof.blocks if ".layers." in b.name).fwd_attn_flops
    assert attn > 0
    # q, k, v, out projections (2 x tokens x h x h each) and the attention core, whole; fc1 / fc2 split
    _split_check(prof, 4 * 2 * TOKENS * h * h + attn, layers)
    assert all(b.tp_whole_flops[1] == b.fwd_attn_flops for b in prof.blocks)
    # one all-reduce per layer (fc2's), not the two of a layer whose attention splits too; embed and head one each
    from modelpar.plan import ParallelPlan
    from modelpar.planner.loads import rank_loads

    assert [b.tp_rowwise for b in prof.blocks if ".layers." in b.name] == [1] * layers
    assert rank_loads(prof, ParallelPlan(tp=2), act_bytes=4)[0].tp_collectives == layers + 2


@requires("transformers")
def test_mixture_of_experts_experts_and_router_stay_whole_under_tp():
    h, ffn, experts, top_k, layers = 32, 64, 4, 2, 2
    prof = _profile("mixtral", {"hidden_size": h, "intermediate_size": ffn, "num_hidden_layers": layers,
                                "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 256,
                                "num_local_experts": experts, "num_experts_per_tok": top_k})
    rows = TOKENS * top_k               # each token runs top_k experts: gate + up (h -> 2 ffn), down (ffn -> h)
    _split_check(prof, 2 * rows * h * 2 * ffn + 2 * rows * ffn * h + 2 * TOKENS * h * experts, layers)
    assert all(b.tp_whole_flops[1] == 0 for b in prof.blocks)        # its attention splits


@requires("transformers")
def test_llama_and_the_gpt_split_every_flop():
    from modelpar.models.gpt import build_gpt
    from modelpar.planner.profile import profile_model

    llama = _profile("llama", {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
                               "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 256})
    gpt = profile_model(build_gpt("gpt-nano", device="meta"), torch.zeros(B, S, dtype=torch.long))
    for prof in (llama, gpt):
        assert sum(b.fwd_flops for b in prof.blocks) > 0
        assert all(b.tp_whole_flops == (0, 0) for b in prof.blocks), [b.tp_whole_flops for b in prof.blocks]
