"""Tensor / sequence parallel plans of Hugging Face models (one process; the multi-rank parity rows are
``hf-*`` in tests/helpers/parity_cases.py): translation of transformers' ``_tp_plan``, the GPT-2 derived plan,
head / vocabulary / sequence legality before launch, the fused q|k|v permutation and its inverse."""

import pytest
import torch
from helpers.hf_tiny import TINY, build, cli_args
from helpers.pure_fixtures import requires

from modelpar.parallel import hf_tp
from modelpar.parallel.tensor import (COLWISE, COLWISE_VOCAB, COLWISE_VOCAB_SEQ, ROWWISE, ROWWISE_SEQ, ROWWISE_VOCAB,
                                      SEQ_NORM, default_tp_plan, tp_plan_for, validate_tp_plan)

pytestmark = requires("transformers")  # checks it is installed without importing it at collection


def test_llama_plan_is_its_own_tp_plan_translated():
    m = build("llama")
    plan, vocab = default_tp_plan(m, tp_degree=2)
    assert vocab
    p = "hf.model.layers.1."
    assert plan[p + "self_attn.q_proj"] == plan[p + "self_attn.k_proj"] == plan[p + "self_attn.v_proj"] == COLWISE
    assert plan[p + "self_attn.o_proj"] == plan[p + "mlp.down_proj"] == ROWWISE
    assert plan[p + "mlp.gate_proj"] == plan[p + "mlp.up_proj"] == COLWISE
    assert plan["hf.model.embed_tokens"] == ROWWISE_VOCAB and plan["hf.lm_head"] == COLWISE_VOCAB
    assert len([k for k in plan if k.endswith("_proj")]) == 4 * 7
    validate_tp_plan(m, plan, 2, seq_len=16)
    assert tp_plan_for(m, tp_degree=2) == plan


def test_unknown_hf_style_is_refused_by_name():
    m = build("llama")
    m.hf._tp_plan = {**m.hf._tp_plan, "model.layers.*.mlp.up_proj": "packed_colwise"}
    with pytest.raises(ValueError, match=r"'model\.layers\.\*\.mlp\.up_proj' the style 'packed_colwise'.*supported: "):
        default_tp_plan(m, tp_degree=2)


def test_gqa_key_value_heads_refused_before_launch():
    m = build("llama")
    plan = tp_plan_for(m, tp_degree=4)
    # the module, the dimension and the degree (issue 12 item 2): the projections the heads split
    with pytest.raises(ValueError, match=r"degree 4 does not divide LlamaConfig\.num_key_value_heads=2: the key/value "
                       r"projections 'hf\.model\.layers\.0\.self_attn\.k_proj', 'hf\.model\.layers\.0\.self_attn\.v_proj' "
                       r"\(and the same in every block\)"):
        validate_tp_plan(m, plan, 4)
    plan = tp_plan_for(m, tp_degree=3)
    with pytest.raises(ValueError, match=r"degree 3 does not divide LlamaConfig\.num_attention_heads=4: the attention "
                       r"projections 'hf\.model\.layers\.0\.self_attn\.q_proj' \(and the same in every block\) are "
                       r"split by query heads; use a TP degree dividing 2"):
        validate_tp_plan(m, plan, 3)


def test_vit_heads_refusal_names_its_projections():
    """ViT (a derived plan): heads that the degree does not divide name q, k and v of the first block."""
    spec, cfg = TINY["vit"]
    from modelpar.models.hf import build_hf

    m = build_hf(spec, {**cfg, "hidden_size": 30, "num_attention_heads": 5}, device="meta")
    with pytest.raises(ValueError, match=r"degree 2 does not divide ViTConfig\.num_attention_heads=5: the attention "
                       r"projections 'hf\.vit\.layers\.0\.attention\.q_proj', 'hf\.vit\.layers\.0\.attention\.k_proj', "
                       r"'hf\.vit\.layers\.0\.attention\.v_proj'"):
        validate_tp_plan(m, tp_plan_for(m, tp_degree=2), 2)


def test_vocab_that_does_not_divide_leaves_embedding_and_head_replicated():
    spec, cfg = TINY["gpt2"]
    from modelpar.models.hf import build_hf

    m = build_hf(spec, {**cfg, "vocab_size": 127}, device="meta")
    plan, vocab = default_tp_plan(m, tp_degree=2)
    assert not vocab and "hf.transformer.wte" not in plan and "hf.lm_head" not in plan
    validate_tp_plan(m, plan, 2)
    plan, vocab = default_tp_plan(m)            # degree unknown: vocab parallel, refused at validation
    with pytest.raises(ValueError, match=r"does not divide GPT2Config\.vocab_size=127"):
        validate_tp_plan(m, plan, 2)


def test_gpt2_plan_is_derived_for_conv1d_and_fused_qkv():
    m = build("gpt2")
    plan = tp_plan_for(m, tp_degree=2)
    p = "hf.transformer.h.2."
    assert plan[p + "attn.c_attn"] == hf_tp.CONV1D_COLWISE_QKV and plan[p + "attn.c_proj"] == hf_tp.CONV1D_ROWWISE
    assert plan[p + "mlp.c_fc"] == hf_tp.CONV1D_COLWISE and plan[p + "mlp.c_proj"] == hf_tp.CONV1D_ROWWISE
    assert plan["hf.transformer.wte"] == ROWWISE_VOCAB and plan["hf.lm_head"] == COLWISE_VOCAB
    validate_tp_plan(m, plan, 2, seq_len=16)
    with pytest.raises(ValueError, match=r"degree 3 does not divide GPT2Config\.num_attention_heads=4: the attention "
                       r"projections 'hf\.transformer\.h\.0\.attn\.c_attn' \(and the same"):
        validate_tp_plan(m, tp_plan_for(m, tp_degree=3), 3)


def test_sequence_parallel_plans_and_sequence_legality():
    for name, blk, norms, final in (("llama", "hf.model.layers", ("input_layernorm", "post_attention_layernorm"),
                                     "hf.model.norm"),
                                    ("gpt2", "hf.transformer.h", ("ln_1", "ln_2"), "hf.transformer.ln_f")):
        m = build(name)
        plan = tp_plan_for(m, sequence_parallel=True, tp_degree=2)
        assert plan[f"{blk}.0"] == hf_tp.SHARD_SEQ_INPUT and f"{blk}.1" not in plan
        for i in range(4):
            assert all(plan[f"{blk}.{i}.{n}"] == SEQ_NORM for n in norms)
        assert plan[final] == SEQ_NORM and plan["hf.lm_head"] == COLWISE_VOCAB_SEQ
        rows = [s for s in plan.values() if s in (ROWWISE, hf_tp.CONV1D_ROWWISE)]
        assert not rows and sum(s in (ROWWISE_SEQ, hf_tp.CONV1D_ROWWISE_SEQ) for s in plan.values()) == 8
        with pytest.raises(ValueError, match=r"degree 2 does not divide the sequence length seq_len=15"):
            validate_tp_plan(m, plan, 2, seq_len=15)


def test_derived_plans_for_models_without_one():
    """ViT declares none: q, k, v / o and fc1 / fc2 are derived; a Llama stripped of its plan derives
    the plan it declares."""
    plan = tp_plan_for(build("vit"), tp_degree=2)
    p = "hf.vit.layers.3."
    assert all(plan[p + f"attention.{n}_proj"] == COLWISE for n in "qkv") and plan[p + "attention.o_proj"] == ROWWISE
    assert plan[p + "mlp.fc1"] == COLWISE and plan[p + "mlp.fc2"] == ROWWISE and len(plan) == 24
    m = build("llama")
    declared = tp_plan_for(m, tp_degree=2)
    m.hf._tp_plan = {}
    assert hf_tp.derive_hf_plan(m, tp_degree=2) == declared


def test_tp_refusals_for_families_without_a_plan_or_sequence_parallel():
    from modelpar.models.hf import build_hf

    resnet = build_hf("hf:resnet", {"hidden_sizes": [8, 16], "depths": [2, 2], "embedding_size": 8,
                                    "num_labels": 5, "image_size": 32}, device="meta")
    with pytest.raises(ValueError, match=r"ResNetForImageClassification declares no TP plan \(_tp_plan\) and "
                                         r"modelpar found no \(colwise \.\.\., rowwise\) group"):
        tp_plan_for(resnet, tp_degree=2)

    m = build_hf("hf:mistral", {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
                                "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 128}, device="meta")
    assert tp_plan_for(m, tp_degree=2)          # mistral declares a plan: translated
    with pytest.raises(ValueError, match=r"sequence parallel is supported for the Hugging Face families llama, gpt2; "
                                         r"MistralForCausalLM \(model_type 'mistral'\)"):
        tp_plan_for(m, sequence_parallel=True, tp_degree=2)


def test_qkv_permutation_gives_each_rank_its_heads_and_inverts():
    e, t = 8, 2                                  # 4 heads of 2 columns per part
    canonical = torch.arange(3 * e)              # q: 0..7, k: 8..15, v: 16..23
    perm = hf_tp.qkv_permutation(3 * e, t)
    shards = canonical[perm].chunk(t)
    assert shards[0].tolist() == [0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19]
    assert shards[1].tolist() == [4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23]
    assert torch.equal(canonical[perm][torch.argsort(perm)], canonical)
    w = torch.randn(4, 3 * e)
    state = {"model": {"a.weight": w[:, perm], "a.bias": canonical[perm].float()},
             "optim": {"state.a.weight.exp_avg": w[:, perm], "state.a.weight.step": torch.tensor(3.0)}}
    canon = hf_tp.canonical_state(state, {"a.weight": perm, "a.bias": perm})
    assert torch.equal(canon["model"]["a.weight"], w) and torch.equal(canon["optim"]["state.a.weight.exp_avg"], w)
    assert torch.equal(canon["model"]["a.bias"], canonical.float())
    assert canon["optim"]["state.a.weight.step"] is state["optim"]["state.a.weight.step"]
    hf_tp.restore_layout(canon, {"a.weight": perm, "a.bias": perm})        # in place, back to the layout
    assert torch.equal(canon["model"]["a.weight"], w[:, perm])


def test_permuted_attention_state_dict_is_the_original_order():
    """One process, degree 2 permutation without sharding: state_dict hooks undo it, load redoes it."""
    m, ref = build("gpt2"), build("gpt2")
    plan = tp_plan_for(m, tp_degree=2)
    hf_tp.prepare_modules(m, plan, 2, set(plan))
    attn = m.hf.transformer.h[0].attn
    assert attn.split_size == 16 and not torch.equal(attn.c_attn.weight, ref.hf.transformer.h[0].attn.c_attn.weight)
    sd = m.state_dict()
    assert all(torch.equal(sd[k], v) for k, v in ref.state_dict().items())
    with torch.no_grad():
        for p in ref.parameters():
            p.add_(1.0)
    m.load_state_dict(ref.state_dict())
    assert all(torch.equal(m.state_dict()[k], v) for k, v in ref.state_dict().items())
    assert hf_tp.permuted_params([m]) .keys() == {f"hf.transformer.h.{i}.attn.c_attn.{leaf}" for i in range(4)
                                                  for leaf in ("weight", "bias")}


@pytest.mark.parametrize("name", ["llama", "gpt2"])
def test_wrapped_forward_equals_the_untouched_model(name):
    m = build(name, dropout=0.0)
    x = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(0))
    assert torch.equal(m(x), m.hf(input_ids=x).logits)


def test_verify_refuses_tp4_on_two_kv_heads_before_launch(capsys):
    from modelpar.cli.verify import verify_main

    rc = verify_main([*cli_args("llama"), "--strategy", "tp", "--nproc", "4"])
    err = capsys.readouterr().err
    assert rc == 2, err
    assert "tensor parallel degree 4 does not divide LlamaConfig.num_key_value_heads=2" in err
    assert "'hf.model.layers.0.self_attn.k_proj', 'hf.model.layers.0.self_attn.v_proj'" in err


@pytest.mark.slow
@pytest.mark.parametrize("world,name", [(2, "hf-gpt2-tp2-ckpt"), (4, "hf-gpt2-ddp2xtp2-ckpt-tp4")])
def test_gpt2_checkpoint_under_tp_holds_the_original_layout(dist_results, world, name):
    """Save under tp2 / ddp2 x tp2 (GPT-2's c_attn permuted per rank) -> one-process export equals
    one-process training; resume under tp2 restores the layout (parameters and optimizer state: the
    next step is bit-identical), under tp4 (another permutation) the same original-order weights."""
    res = dist_results(world).get(name)
    assert res is not None, "the case produced no result (the launch died before it)"
    assert "error" not in res, res.get("trace", res.get("error"))
    assert res["passed"], "\n".join(res["failures"])
    assert res["export_vs_one_process"] <= 1e-5 and res["laid_out_vs_original"] > 1e-3


def test_planner_sees_the_hf_plans():
    from modelpar.planner.profile import _tp_styles

    kinds = _tp_styles(build("gpt2"))
    assert kinds["hf.transformer.h.0.attn.c_attn"] == "colwise" and kinds["hf.transformer.h.0.mlp.c_proj"] == "rowwise"
    assert kinds["hf.transformer.wte"] == "rowwise" and kinds["hf.lm_head"] == "colwise"
    kinds = _tp_styles(build("llama"))
    assert kinds["hf.model.layers.0.self_attn.k_proj"] == "colwise" and len(kinds) == 30


def test_phi3_gathered_and_split_styles_translate():
    """Phi-3 declares colwise_gather_output on its fused qkv / gate_up projections (gathered output) and
    rowwise_split_input on o / down (replicated input sliced): translated, the head still vocab-parallel.
    (A 2-rank forward of this plan equals one process: checked by hand, see the h-tp report.)"""
    from modelpar.models.hf import build_hf

    m = build_hf("hf:phi3", {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
                             "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 128,
                             "pad_token_id": 0, "bos_token_id": 0, "eos_token_id": 0}, device="meta")
    plan = tp_plan_for(m, tp_degree=2)
    assert plan["hf.model.layers.1.mlp.gate_up_proj"] == hf_tp.COLWISE_GATHER
    assert plan["hf.model.layers.1.mlp.down_proj"] == hf_tp.ROWWISE_SPLIT
    assert plan["hf.lm_head"] == COLWISE_VOCAB and plan["hf.model.embed_tokens"] == ROWWISE_VOCAB
    validate_tp_plan(m, plan, 2)


@pytest.mark.parametrize("own", [False, True])
def test_split_outputs_may_be_modified_in_place_in_a_model_s_code(own):
    """Falcon's block adds the attention's output into the MLP's in place (``mlp_output +=
    attention_output``); under TP the MLP's rowwise output is ``DTensor.to_local()``, a view made inside
    an autograd Function, and the ranks crashed ("... is a view and is being modified inplace"). The
    split modules of a model that is not the built-in GPT hand on tensors of their own (no copy), with
    the same values and gradients (fake 2-rank group: shapes and placements only)."""
    import torch.distributed as dist
    import torch.nn as nn
    from torch.distributed.device_mesh import init_device_mesh
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from modelpar.parallel.tensor import apply_tp

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    try:
        torch.manual_seed(0)
        m = nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 4))
        apply_tp(m, init_device_mesh("cpu", (2,)), {"0": COLWISE, "1": ROWWISE}, own_outputs=own)
        x = torch.randn(3, 4, requires_grad=True)
        out = m(x)
        if not own:
            with pytest.raises(RuntimeError, match="is a view and is being modified inplace"):
                out += 1.0
            out.detach().sum().item()           # waits for the (fake) all-reduce the output came from
            return
        base = out.detach().clone()
        out += 1.0
        assert torch.equal(out.detach(), base + 1.0)
        out.sum().backward()
        assert x.grad is not None and m[0].weight.grad is not None
    finally:
        dist.destroy_process_group()
