"""CPU step-time terms that must follow what the runtime runs (pure tests, no launch): the profile's
element-wise traffic counts the kernels the runtime dispatches (not FlopCounterMode's decompositions),
and the tensor-parallel all-reduce count per micro-batch is the runtime's one per sharded matrix."""

from __future__ import annotations

import torch
import torch.nn as nn

from modelpar.planner.profile import count_elementwise_bytes, profile_model


def _elementwise_bytes_of_real_run(model: nn.Module, x: torch.Tensor) -> int:
    def run():
        model(x).sum().backward()
    return count_elementwise_bytes(run)


def test_profile_counts_silu_backward_as_the_runtime_runs_it():
    # silu_backward has a composite decomposition that FlopCounterMode applies (sigmoid, rsub, mul, add);
    # the runtime runs one kernel reading grad and input and writing the result
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.SiLU(), nn.Linear(64, 32), nn.SiLU())
    x = torch.randn(8, 32)
    prof = profile_model(model, x, blocks=[("all", model)])
    counted = sum(b.fwd_mem_bytes + b.bwd_mem_bytes for b in prof.blocks)
    real = _elementwise_bytes_of_real_run(model, x)
    # the real run also counts the final .sum() and its backward's ones_like/expand
    extra = real - counted
    assert 0 <= extra <= 4 * (8 * 32 + 1) * 2, (counted, real)


def test_profile_counts_silu_backward_once_per_call():
    model = nn.Sequential(nn.Linear(16, 16), nn.SiLU())
    prof = profile_model(model, torch.randn(4, 16), blocks=[("all", model)])
    # forward: silu reads (4,16) and writes (4,16); backward: silu_backward reads grad and input and
    # writes one (4,16) result: 5 tensors of 256 B, plus the bias gradient's sum (256 + 64 B)
    b = prof.blocks[0]
    assert b.fwd_mem_bytes == 2 * 4 * 16 * 4
    assert b.bwd_mem_bytes <= 3 * 4 * 16 * 4 + (4 * 16 + 16) * 4, b.bwd_mem_bytes


def _tp_parts(hw, plan):
    from helpers.profiles import shared_profile_for as profile_for
    from modelpar.planner.cost import step_form
    from modelpar.planner.memory import rank_loads
    from modelpar.planner.step_estimate import tp_bytes_per_sample

    prof, _ = profile_for("gpt-nano", {}, 16, "fp32")
    loads = rank_loads(prof, plan, act_bytes=4)
    form = step_form(loads, plan, hw, optimizer="adamw", tp_bytes=tp_bytes_per_sample(prof, plan))
    _, ar_tp, tp_linear = form._times(plan, 4)
    return loads[0], ar_tp, tp_linear, form.at(plan, 4, 1)["tp_comm"]


def test_cpu_tp_prices_one_all_reduce_per_sharded_matrix():
    # modelpar's DTensor runtime on CPU: every ColwiseParallel Linear all-reduces its input's
    # gradient in backward (q, k and v separately), every RowwiseParallel its output in forward
    from modelpar.plan import ParallelPlan
    from modelpar.planner.hardware import cpu_profile

    plan = ParallelPlan(tp=2)
    ld, ar_tp, tp_linear, tp_comm = _tp_parts(cpu_profile(2), plan)
    assert ld.tp_linears > 2 * ld.tp_collectives > 0        # GPT: 6 sharded matrices, 2 block outputs
    assert ar_tp > 0
    assert abs(tp_comm - ld.tp_linears * (ar_tp + tp_linear)) <= 1e-12 * tp_comm


def test_gpu_and_sequence_parallel_tp_keep_megatrons_count():
    from modelpar.plan import ParallelPlan
    from modelpar.planner.hardware import cpu_profile

    plan = ParallelPlan(tp=2, sequence_parallel=True)
    ld, ar_tp, tp_linear, tp_comm = _tp_parts(cpu_profile(2), plan)
    assert abs(tp_comm - (2 * ld.tp_collectives * ar_tp + ld.tp_linears * tp_linear)) <= 1e-12 * tp_comm
