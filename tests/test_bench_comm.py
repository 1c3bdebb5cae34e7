"""Communication profile from profiler events: interval arithmetic, matching, classification (no processes)."""

import pytest

from modelpar.bench.comm import (FWD_BWD_MARK, KIND_GRAD_ALLREDUCE, KIND_GRAD_REDUCESCATTER, KIND_PARAM_ALLGATHER,
                                 KIND_PP, KIND_SYNC, KIND_TP, STEP_MARK, CommProfile, TraceEvent, comm_profile,
                                 find_collectives, length, merge_ranks, subtract, union)


def ev(name, start, dur, thread=1, shapes=(), dtypes=()):
    return TraceEvent(name, float(start), float(dur), thread, tuple(shapes), tuple(dtypes))


def test_interval_union_and_subtract():
    assert union([(5, 7), (0, 2), (1, 3)]) == [(0, 3), (5, 7)]
    assert length([(0, 2), (1, 3), (10, 11)]) == 4
    assert subtract([(0, 10)], [(2, 3), (5, 7)]) == [(0, 2), (3, 5), (7, 10)]
    assert subtract([(0, 10)], [(-1, 11)]) == []


def ddp_like_trace():
    """A step: forward/backward 0..1000 us with compute 0..600; a DDP bucket all-reduce issued at 500 on
    the training thread (TensorList, no shapes), run by a gloo worker 510..900; a grad-norm all-reduce
    after backward."""
    return [
        ev(STEP_MARK, 0, 1200),
        ev(FWD_BWD_MARK, 0, 1000),
        ev("aten::mm", 0, 600),
        ev("c10d::allreduce_", 500, 5, shapes=[[], []], dtypes=["TensorList", ""]),
        ev("gloo:all_reduce", 510, 390, thread=2, shapes=[[1000]], dtypes=["float"]),
        ev("aten::add_", 1000, 100),
        ev("_c10d_functional::all_reduce", 1100, 20, shapes=[[1]], dtypes=["float"]),
        ev("c10d::allreduce_", 1101, 10, shapes=[[]], dtypes=["TensorList"]),
        ev("gloo:all_reduce", 1105, 10, thread=3, shapes=[[1]], dtypes=["float"]),
    ]


def test_ddp_bytes_kind_and_exposed_time():
    p = comm_profile(ddp_like_trace())
    g = p.kinds[KIND_GRAD_ALLREDUCE]
    assert (g.calls, g.bytes) == (1, 4000)                  # 1000 fp32 elements from the backend's shapes
    assert g.recorded_s == pytest.approx(390e-6)
    assert g.exposed_s == pytest.approx(300e-6)              # 510..600 hidden behind aten::mm
    assert p.kinds[KIND_SYNC].calls == 1                      # the grad-norm all-reduce, outside forward/backward
    assert p.step_s == pytest.approx(1200e-6)
    assert p.share == pytest.approx(p.exposed_s / p.step_s)


def test_fsdp_tp_pp_classification_and_payload():
    events = [
        ev(STEP_MARK, 0, 1000), ev(FWD_BWD_MARK, 0, 900),
        ev("c10d::_allgather_base_", 10, 5, shapes=[[200], [100]], dtypes=["float", "float"]),
        ev("gloo:all_gather", 20, 50, thread=2, shapes=[[100]], dtypes=["float"]),
        ev("c10d::_reduce_scatter_base_", 100, 5, shapes=[[100], [200]], dtypes=["c10::BFloat16", "c10::BFloat16"]),
        ev("gloo:all_reduce", 110, 50, thread=2, shapes=[[200]], dtypes=["c10::BFloat16"]),
        ev("_c10d_functional::all_reduce", 200, 30, shapes=[[4, 8, 16]], dtypes=["float"]),
        ev("c10d::allreduce_", 201, 20, shapes=[[]], dtypes=["TensorList"]),
        ev("gloo:all_reduce", 205, 20, thread=3, shapes=[[4, 8, 16]], dtypes=["float"]),
        ev("c10d::send", 300, 2, shapes=[[]], dtypes=["TensorList"]),
        ev("gloo:send", 301, 40, shapes=[[2, 64]], dtypes=["float"]),
    ]
    kinds = {c.kind: c for c in find_collectives(events)}
    assert kinds[KIND_PARAM_ALLGATHER].nbytes == 800          # gathered output, 200 fp32
    assert kinds[KIND_GRAD_REDUCESCATTER].nbytes == 400       # unscattered input, 200 bf16
    assert kinds[KIND_GRAD_REDUCESCATTER].backend.name == "gloo:all_reduce"   # gloo's RS is an all-reduce
    assert kinds[KIND_TP].nbytes == 4 * 8 * 16 * 4
    assert kinds[KIND_TP].backend.start_us == 205
    assert kinds[KIND_PP].nbytes == 2 * 64 * 4


def test_profile_needs_the_step_marker():
    with pytest.raises(ValueError, match=STEP_MARK):
        comm_profile([ev("aten::mm", 0, 10)])


def test_merge_ranks_and_round_trip():
    a = comm_profile(ddp_like_trace())
    b = CommProfile.from_dict(a.to_dict())
    m = merge_ranks([a, b])
    assert m.kinds[KIND_GRAD_ALLREDUCE].bytes == 4000
    assert m.exposed_s == pytest.approx(a.exposed_s)
