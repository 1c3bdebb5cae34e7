"""Tier 1: hybrid layouts as data: TP / sequence-parallel plans, checks before any process group."""

import pytest

from modelpar.models import build_gpt, build_mlp
from modelpar.parallel.tensor import (COLWISE_VOCAB, COLWISE_VOCAB_SEQ, GATHER_SEQ_INPUT, ROWWISE_SEQ, SEQ_NORM,
                                      SHARD_SEQ_OUTPUT, derive_tp_plan, head_is_vocab_sharded, validate_tp_plan)
from modelpar.plan import ParallelPlan


def test_sequence_parallel_plan_shards_norm_regions():
    model = build_gpt("gpt-nano", seq_len=16)
    plan = derive_tp_plan(model, sequence_parallel=True, shard_head=True)
    assert plan["embed"] == SHARD_SEQ_OUTPUT
    for i in range(2):
        assert plan[f"blocks.{i}.ln1"] == plan[f"blocks.{i}.ln2"] == SEQ_NORM
        assert plan[f"blocks.{i}.attn"] == plan[f"blocks.{i}.mlp"] == GATHER_SEQ_INPUT
        assert plan[f"blocks.{i}.attn.o"] == plan[f"blocks.{i}.mlp.down"] == ROWWISE_SEQ
    assert plan["head.ln_f"] == SEQ_NORM and plan["head.out"] == COLWISE_VOCAB_SEQ
    assert head_is_vocab_sharded(plan)
    validate_tp_plan(model, plan, 2)


def test_sequence_parallel_without_vocab_head_gathers_before_the_head():
    plan = derive_tp_plan(build_gpt("gpt-nano", seq_len=16), sequence_parallel=True)
    assert plan["head"] == GATHER_SEQ_INPUT and "head.ln_f" not in plan and not head_is_vocab_sharded(plan)
    plan = derive_tp_plan(build_gpt("gpt-nano", seq_len=16), shard_head=True)
    assert plan["head.out"] == COLWISE_VOCAB and "embed" not in plan


def test_sequence_parallel_checks_seq_len_and_vocab():
    model = build_gpt("gpt-nano", seq_len=18, n_head=4)
    with pytest.raises(ValueError, match="degree 4 does not divide the sequence length seq_len=18"):
        validate_tp_plan(model, derive_tp_plan(model, sequence_parallel=True), 4)
    model = build_gpt("gpt-nano", seq_len=16, vocab_size=250, n_head=4)
    with pytest.raises(ValueError, match=r"degree 4 does not divide GPTConfig.vocab_size=250: the token "
                                         r"embedding and output head are split over the vocabulary"):
        validate_tp_plan(model, derive_tp_plan(model, shard_head=True), 4)


def test_sequence_parallel_is_refused_for_other_models():
    with pytest.raises(ValueError, match="derived for modelpar's GPT and transformers models only"):
        derive_tp_plan(build_mlp([8, 8, 2]), sequence_parallel=True)
    with pytest.raises(ValueError, match="sequence_parallel=True needs tp > 1"):
        ParallelPlan(dp_shard=2, sequence_parallel=True).validate(2)


@pytest.mark.parametrize("fields,axes", [
    (dict(dp_replicate=2, dp_shard=2), (("dp_replicate", 2), ("dp_shard", 2))),
    (dict(pp=2, dp_shard=2, tp=2), (("pp", 2), ("dp_shard", 2), ("tp", 2))),
    (dict(pp=2, dp_replicate=2), (("pp", 2), ("dp_replicate", 2))),
])
def test_hybrid_mesh_axes_outermost_pp_innermost_tp(fields, axes):
    plan = ParallelPlan(**fields, n_microbatches=2).validate(4 if len(axes) == 2 else 8)
    assert plan.mesh_axes() == axes


def test_degrees_must_multiply_to_world():
    with pytest.raises(ValueError, match=r"2 x 2 x 2 x 2 = 16 does not equal the world size 8"):
        ParallelPlan(dp_replicate=2, dp_shard=2, tp=2, pp=2).validate(8)


def test_seed_policy_shares_tp_and_separates_dp_and_pp():
    from modelpar.parallel.mesh import MeshInfo
    from modelpar.parallel.seeding import rank_seed

    seeds = {(d, p): rank_seed(5, dp_rank=d, pp_rank=p) for d in range(64) for p in range(16)}
    assert len(set(seeds.values())) == len(seeds)               # dp x pp ranks all differ
    a, b = MeshInfo(None, dp_rank=1, tp_rank=0, pp_rank=1), MeshInfo(None, dp_rank=1, tp_rank=3, pp_rank=1)
    from modelpar.parallel.seeding import seed_rank
    assert seed_rank(5, a) == seed_rank(5, b)                    # TP peers draw the same masks
