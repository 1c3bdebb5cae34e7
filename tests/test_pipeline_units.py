"""Tier 1: pipeline schedules and stage partitioning as data (no processes)."""

import pytest
import torch

from modelpar.models import build_gpt, build_mlp
from modelpar.parallel.parts import balanced_partition, block_costs, get_model_parts, measure_part_costs
from modelpar.parallel.pipeline import SCHEDULE_CLASSES, get_schedule_class, split_stages, stage_costs, stage_indices
from modelpar.plan import PP_SCHEDULES, ParallelPlan


def test_every_plan_schedule_maps_to_an_installed_torch_schedule():
    assert set(PP_SCHEDULES) == set(SCHEDULE_CLASSES)
    for name in PP_SCHEDULES:
        assert get_schedule_class(name).__name__ == SCHEDULE_CLASSES[name]


def test_unknown_schedule_lists_valid_names():
    with pytest.raises(ValueError, match="valid: gpipe, 1f1b, interleaved1f1b"):
        get_schedule_class("zigzag")
    with pytest.raises(ValueError, match="pp_schedule='zigzag' is unknown; valid: gpipe"):
        ParallelPlan(pp=2, pp_schedule="zigzag").validate(2)


def test_schedules_torch_refuses_for_few_micro_batches_fail_validation():
    # torch's Schedule1F1B / ScheduleDualPipeV raise at construction when n_microbatches < stages
    with pytest.raises(ValueError, match=r"pp_schedule='1f1b' needs n_microbatches >= the number of pipeline "
                                         r"stages \(2\), got n_microbatches=1"):
        ParallelPlan(pp=2, pp_schedule="1f1b", n_microbatches=1).validate(2)
    with pytest.raises(ValueError, match=r"stages \(4\), got n_microbatches=3"):
        ParallelPlan(pp=2, pp_schedule="dualpipev", virtual_stages=2, n_microbatches=3).validate(2)
    ParallelPlan(pp=2, pp_schedule="1f1b", n_microbatches=2).validate(2)
    ParallelPlan(pp=2, pp_schedule="gpipe", n_microbatches=1).validate(2)


def test_interleaved_micro_batches_not_a_multiple_of_the_rounds_fail_validation():
    # torch's ScheduleInterleaved1F1B / ScheduleInterleavedZeroBubble run max(1, m // pp) rounds and
    # raise at construction, after launch, when m is not a multiple of them (pp 2, m 5: 2 rounds)
    for sched in ("interleaved1f1b", "interleavedzerobubble"):
        with pytest.raises(ValueError, match=rf"pp_schedule='{sched}' .* multiple of 2, got --n-microbatches 5 "
                                             r"with --pp 2"):
            ParallelPlan(pp=2, pp_schedule=sched, virtual_stages=2, n_microbatches=5).validate(2)
        with pytest.raises(ValueError, match=r"multiple of 3, got --n-microbatches 10 with --pp 3"):
            ParallelPlan(pp=3, pp_schedule=sched, virtual_stages=2, n_microbatches=10).validate(3)
        for m in (1, 2, 3, 4, 6, 8):                # one round (m < 2 pp) or whole rounds: torch accepts
            ParallelPlan(pp=2, pp_schedule=sched, virtual_stages=2, n_microbatches=m).validate(2)
    ParallelPlan(pp=2, pp_schedule="loopedbfs", virtual_stages=2, n_microbatches=5).validate(2)


def test_stage_indices_round_robin_and_v_shape():
    assert [stage_indices(r, 2, 2, "interleaved1f1b") for r in range(2)] == [[0, 2], [1, 3]]
    assert [stage_indices(r, 2, 4, "loopedbfs") for r in range(2)] == [[0, 2, 4, 6], [1, 3, 5, 7]]
    assert [stage_indices(r, 4, 2, "zbvzerobubble") for r in range(4)] == [[0, 7], [1, 6], [2, 5], [3, 4]]
    assert stage_indices(1, 2, 2, "dualpipev") == [1, 2]


def test_flop_costs_count_embedding_and_head():
    model = build_gpt("gpt-nano", seq_len=16, n_layer=4)
    parts = get_model_parts(model)
    x = torch.zeros(2, 16, dtype=torch.long)
    pre, blocks, post = measure_part_costs(parts, x, kind="flops")
    assert len(blocks) == 4 and len(set(blocks)) == 1          # identical blocks, identical cost
    b, t, d, f, v = 2, 16, 64, 256, 256
    linear = 2 * b * t * (4 * d * d + 2 * d * f)                # q, k, v, o, up, down
    assert blocks[0] > linear                                   # + attention scores and element-wise work
    assert post[0] >= 2 * b * t * d * v                         # the head's matmul is counted
    assert pre[0] > 0                                           # the embedding is counted (element-wise)
    costs = block_costs(parts, "flops", x)
    assert costs[0] == pytest.approx(blocks[0] + pre[0]) and costs[-1] == pytest.approx(blocks[-1] + post[0])


def test_flop_balanced_split_of_the_large_mlp_is_optimal():
    model = build_mlp("mlp-large", device="meta")
    parts = get_model_parts(model)
    # 2 x in x out per sample for each Linear: the first block dominates, so it gets a stage alone
    costs = [2.0 * a * b for a, b in zip([10000, 5000, 2000, 1000, 500], [5000, 2000, 1000, 500, 10])]
    assert split_stages(parts, 2, block_costs=costs) == [(0, 1), (1, 5)]
    assert split_stages(parts, 4, block_costs=costs) == [(0, 1), (1, 2), (2, 3), (3, 5)]


def test_user_split_points_and_cost_list_are_checked():
    parts = get_model_parts(build_mlp([8, 8, 8, 8, 8, 2]))
    assert split_stages(parts, 2, boundaries=[1]) == [(0, 1), (1, 5)]
    with pytest.raises(ValueError, match="block_costs has 3 entries; the model has 5 blocks"):
        stage_costs(parts, [1.0, 2.0, 3.0], None)
    with pytest.raises(ValueError, match="3 pipeline stages but the model has only 2 blocks"):
        split_stages(get_model_parts(build_mlp([4, 4, 2])), 3)


def test_balanced_partition_matches_brute_force_on_random_costs():
    import itertools
    import random

    rng = random.Random(0)
    for _ in range(30):
        n, k = rng.randint(3, 8), rng.randint(2, 3)
        costs = [rng.random() for _ in range(n)]
        cuts = balanced_partition(costs, k)
        bounds = [0, *cuts, n]
        got = max(sum(costs[a:b]) for a, b in zip(bounds, bounds[1:]))
        best = min(max(sum(costs[a:b]) for a, b in zip((0, *c), (*c, n)))
                   for c in itertools.combinations(range(1, n), k - 1))
        assert got == pytest.approx(best)
