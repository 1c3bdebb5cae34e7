"""GPU communication terms of the step model (issue 14, item 2): FSDP's exposed collectives by
window, NCCL's SM share inside and across nodes, replicate under a pipeline. Split from
tests/test_planner_published.py (file size). Pure Python on the meta device."""

from __future__ import annotations

import dataclasses
import math

import pytest

from modelpar.plan import ParallelPlan
from modelpar.planner import published
from modelpar.planner.cost import estimate_step
from modelpar.planner.gpu import A100, H100
from modelpar.planner.hardware import BUILTIN, cpu_profile
from modelpar.planner.memory import Batch, rank_loads


@pytest.fixture(scope="module")
def bench():
    return published


# ---- FSDP2's exposed communication on GPUs (issue 14: gpt-1b on 8 H100s showed 0% communication) --
def test_fsdp_exposed_pieces_by_window():
    from modelpar.planner.cost import _fsdp_exposed
    # per micro-batch: unit gathers 10 s in all (first block 1), root gather 2; reduce-scatters 12
    # (first block 1.5, root 3)
    cm = {"ag": 10.0, "first": 1.0, "ag_root": 2.0, "rs": 12.0, "rs_unit": 1.5, "rs_root": 3.0}
    # forward window 5 s hides 5 of the 9 later gathers; backward window 100 s hides the re-gathers
    # (10) and the middle reduce-scatters (12 - 3 - 1.5); head (2 + 1) and tail (1.5 + 3) never hide
    got = _fsdp_exposed(cm, 2, 5.0, 100.0, 0.0, reduce=True)
    assert math.isclose(got, 3.0 + 4.0 + 0.0 + 4.5)
    # contention: the hidden 5 + 17.5 s cost NCCL's SM share of compute
    assert math.isclose(_fsdp_exposed(cm, 2, 5.0, 100.0, 0.25, reduce=True), 11.5 + 0.25 * 22.5)
    # no reduce-scatter this micro-batch (deferred sync): no tail, backward only re-gathers
    assert math.isclose(_fsdp_exposed(cm, 2, 5.0, 100.0, 0.0, reduce=False), 3.0 + 4.0)
    # a backward window shorter than its communication exposes the excess
    assert math.isclose(_fsdp_exposed(cm, 2, 100.0, 10.0, 0.0, reduce=True), 3.0 + 0.0 + 7.5 + 4.5)


def test_fsdp_on_h100_exposes_root_gather_and_last_reduce_scatter(bench, monkeypatch):
    from modelpar.planner import gpu
    hw = BUILTIN["H100-80GB-SXM"]
    prof = bench.gpt_profile(50368, 2048, 24, 16, 2048, attention="flash", dropout=0.0)
    plan = ParallelPlan(dp_shard=8, precision="bf16")
    batch = Batch(32, 4)
    st = estimate_step(prof, plan, batch, hw)
    ld = rank_loads(prof, plan, act_bytes=2)[0]
    # the root's (embedding, head) bf16 gather before any compute and its fp32 reduce-scatter after
    # the last, at NCCL's H100 bus bandwidth (ring: 7/8 of the bytes each)
    root = (2 + 4) * ld.root_params * 7 / 8 / H100.intra_busbw
    assert st.dp_comm >= root > 0
    assert st.comm_share > 0.02, st.parts()
    # NCCL's CTAs slow the compute they overlap: without them the step is shorter
    monkeypatch.setitem(gpu.GPU_PHYSICS, "H100-80GB-SXM", dataclasses.replace(H100, nccl_sm_share=0.0))
    quiet = estimate_step(prof, plan, batch, hw)
    assert quiet.dp_comm < st.dp_comm and quiet.compute == st.compute


def test_nccl_sm_share_across_nodes_counts_two_channels_per_nic(bench, monkeypatch):
    from modelpar.planner import gpu
    from modelpar.planner.comms import _nccl_share
    hw = BUILTIN["A100-80GB"]
    # inside a node: 24 ring channels (nccl-tests #100); a group spanning nodes: 16 (8 NICs x 2)
    assert _nccl_share(ParallelPlan(dp_shard=8), "dp_shard", hw, A100) == pytest.approx(24 / 108)
    assert _nccl_share(ParallelPlan(dp_shard=32), "dp_shard", hw, A100) == pytest.approx(16 / 108)
    assert _nccl_share(ParallelPlan(dp_replicate=4, tp=8), "dp_replicate", hw, A100) == pytest.approx(16 / 108)
    assert H100.nccl_sm_share_inter == pytest.approx(16 / 132)
    assert _nccl_share(ParallelPlan(dp_shard=32), "dp_shard", cpu_profile(2), None) == 0.0
    # FSDP over 4 nodes: the gathers hidden under compute slow it by that share of their time
    prof = bench.gpt_profile(50368, 2048, 8, 16, 2048, attention="flash", dropout=0.0)
    plan, batch = ParallelPlan(dp_shard=32, precision="bf16"), Batch(64, 2)
    st = estimate_step(prof, plan, batch, hw)
    monkeypatch.setitem(gpu.GPU_PHYSICS, "A100-80GB", dataclasses.replace(A100, nccl_sm_share_inter=0.0))
    quiet = estimate_step(prof, plan, batch, hw)
    assert quiet.dp_comm < st.dp_comm and quiet.compute == st.compute


def test_replicate_under_pipeline_reduces_after_the_schedule(bench):
    # modelpar runs dp_replicate under PP through FSDP2's replicate, which torch's pipelining
    # reduces once after the schedule (perform_reduce_grad): the all-reduce is exposed, where torch
    # DDP's buckets would hide behind the backward; plain DDP is priced as before
    hw = BUILTIN["H100-80GB-SXM"]
    prof = bench.gpt_profile(50368, 2048, 24, 16, 2048, attention="flash", dropout=0.0)
    plan = ParallelPlan(dp_replicate=2, pp=4, n_microbatches=8, pp_schedule="1f1b", precision="bf16")
    rep = estimate_step(prof, plan, Batch(32, 16), hw)
    ddp = estimate_step(prof, plan, Batch(32, 16), hw, replicate=False)
    ld = max(rank_loads(prof, plan, act_bytes=2), key=lambda x: x.params)
    # ring all-reduce of the fp32 gradients over 2 ranks inside the node: 2 (n-1)/n = 1 x bytes
    assert rep.dp_comm >= 4 * ld.params / H100.intra_allreduce_busbw > ddp.dp_comm
    plain = ParallelPlan(dp_replicate=8, precision="bf16")
    assert estimate_step(prof, plain, Batch(32, 4), hw) == estimate_step(prof, plain, Batch(32, 4), hw,
                                                                             replicate=False)
