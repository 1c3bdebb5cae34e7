"""One-process tests of the C12 / C15 logic and of how a launched command reports its ranks' end
(the multi-rank behaviour is in test_preflight_checks.py and test_verify_outcome.py)."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn as nn

from modelpar.parallel.grad_use import _diagnose
from modelpar.plan import ParallelPlan


def _layout(*ranks):
    """ranks: (key, names) -> the gathered layout, every parameter trainable at wrap time."""
    return [(key, names, [True] * len(names)) for key, names in ranks]


AB = ["a.weight", "b.weight", "c.weight"]


def test_c12_divergent_within_a_group_names_params_and_ranks():
    msg = _diagnose(_layout(((0, 0), AB), ((0, 0), AB)), [[1, 0, 1], [0, 1, 1]], 3, ddp=False, find_unused=False)
    assert msg.startswith("rank-divergent parameter use at step 3 (case C12): 2 parameter(s)")
    assert "a.weight (a gradient on rank(s) [0], none on [1])" in msg
    assert "b.weight (a gradient on rank(s) [1], none on [0])" in msg
    assert "c.weight" not in msg and "find_unused_parameters" not in msg


def test_c12_groups_are_data_parallel_groups_not_the_world():
    # pp=2 x dp=2: ranks 0, 2 hold stage 0 (a, b), ranks 1, 3 stage 1 (c): different names, no divergence
    lay = _layout(((0, 0), ["a", "b"]), ((1, 0), ["c"]), ((0, 0), ["a", "b"]), ((1, 0), ["c"]))
    assert _diagnose(lay, [[1, 1], [1, 0], [1, 1], [1, 0]], 2, ddp=False, find_unused=False) is None
    msg = _diagnose(lay, [[1, 1], [1, 0], [1, 0], [0, 0]], 2, ddp=False, find_unused=False)
    assert "b (a gradient on rank(s) [0], none on [2])" in msg
    assert "c (a gradient on rank(s) [1], none on [3])" in msg


def test_c1_unused_everywhere_first_step_vs_later():
    lay = _layout(((0, 0), AB), ((0, 0), AB))
    first = _diagnose(lay, [[1, 1, 0], [1, 1, 0]], 0, ddp=False, find_unused=False)
    assert first.startswith("1 trainable parameter(s) got no gradient in the first step (on rank(s) [0, 1]): c.weight")
    assert "unused everywhere" in first and "rank-divergent" not in first
    # later: one device skips a parameter without a gradient too (FSDP agrees); DDP would fail next forward
    assert _diagnose(lay, [[1, 1, 0], [1, 1, 0]], 4, ddp=False, find_unused=False) is None
    ddp = _diagnose(lay, [[1, 1, 0], [1, 1, 0]], 4, ddp=True, find_unused=False)
    assert "got no gradient at step 4" in ddp and "find_unused_parameters=True" in ddp
    assert _diagnose(lay, [[1, 1, 0], [1, 1, 0]], 4, ddp=True, find_unused=True) is None


def test_ddp_requires_grad_changed_after_wrapping():
    lay = [((0, 0), AB, [True, True, False])] * 2
    msg = _diagnose(lay, [[1, 2, 3], [1, 2, 3]], 1, ddp=True, find_unused=False)
    assert msg.startswith("2 parameter(s) changed requires_grad after DDP wrapped the model: "
                          "b.weight (trainable -> frozen), c.weight (frozen -> trainable)")
    assert _diagnose(lay, [[1, 2, 1], [1, 2, 1]], 1, ddp=False, find_unused=False) is None    # FSDP: fine


def test_first_step_hook_tells_divergent_from_unused():
    from modelpar.train.preflight_checks import _raise_unused

    with pytest.raises(ValueError, match=r"rank-divergent use, case C12\): a \(none on rank\(s\) \[1\], "
                                         r"a gradient on \[0\]\)"):
        _raise_unused([([], ["a", "b"]), (["a"], ["a", "b"])])
    with pytest.raises(ValueError, match=r"1 trainable parameter\(s\) got no gradient in the first step "
                                         r"\(on rank\(s\) \[0, 1\]\): b\. Forward uses them on no rank"):
        _raise_unused([(["b"], ["a", "b"]), (["b"], ["a", "b"])])
    _raise_unused([([], ["a"]), ([], ["b"])])          # pipeline stages: different names, all used


def test_check_is_a_no_op_on_one_process():
    from modelpar.parallel.grad_use import GradUseCheck

    m = nn.Linear(2, 2)
    chk = GradUseCheck(m.named_parameters(), (0, 0))
    chk()                                              # no process group: nothing to compare
    assert chk.local_marks().tolist() == [0, 0]
    m(torch.ones(1, 2)).sum().backward()
    m.bias.requires_grad_(False)
    assert chk.local_marks().tolist() == [1, 3]


def test_c15_sync_batchnorm_refused_on_cpu_and_hints():
    from modelpar.parallel.batchnorm import check_sync_batchnorm
    from modelpar.parallel.layer_checks import dropout_note, parity_hints

    with pytest.raises(ValueError, match="sync_batchnorm=True .* runs on CUDA tensors only and this run is on cpu"):
        check_sync_batchnorm(True, "cpu")
    sbn = nn.Sequential(nn.Linear(2, 2), nn.SyncBatchNorm(2))
    with pytest.raises(ValueError, match=r"the model holds SyncBatchNorm layers \(1\)"):
        check_sync_batchnorm(False, "cpu", [sbn])
    check_sync_batchnorm(True, "cuda")
    model = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4), nn.Dropout(0.1), nn.Linear(4, 2))
    hints = parity_hints(model)
    assert len(hints) == 2 and "1 BatchNorm layer(s) (1)" in hints[0] and "dropout layer(s) with p > 0 (2)" in hints[1]
    assert parity_hints(nn.Sequential(nn.Linear(2, 2), nn.Dropout(0.0))) == []
    assert dropout_note([model], ParallelPlan(tp=2)).startswith("  note: dropout 0.1 under tensor parallelism")
    assert "pipeline" in dropout_note([nn.Linear(2, 2)], ParallelPlan(pp=2, n_microbatches=2), dropout=0.2)
    assert dropout_note([model], ParallelPlan(dp_shard=2)) is None          # the note is for TP and PP layouts
    assert dropout_note([nn.Linear(2, 2)], ParallelPlan(tp=2)) is None      # dropout 0: nothing to say


def test_c15_train_preflight_refuses_sync_batchnorm_on_cpu():
    from modelpar.train.config import TrainConfig
    from modelpar.train.loop import preflight

    if torch.cuda.is_available():
        pytest.skip("the refusal is for runs without CUDA")
    with pytest.raises(ValueError, match="runs on CUDA tensors only"):
        preflight(TrainConfig(model="gpt-nano", strategy="ddp", sync_batchnorm=True, global_batch_size=8), 2)


def test_buffer_sync_without_groups_is_off():
    from modelpar.parallel.batchnorm import BatchNormBufferSync

    assert not BatchNormBufferSync([nn.Sequential(nn.BatchNorm1d(3))], [])
    assert not BatchNormBufferSync([nn.Linear(2, 2)], [object()])


def test_checkpoint_io_on_one_process_gives_no_dist_warning(tmp_path):
    import torch.distributed.checkpoint as dcp

    from modelpar.train.checkpoint.storage import single_process_dcp

    state = {"w": torch.arange(4.0)}
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        with single_process_dcp():
            dcp.save(state, checkpoint_id=str(tmp_path / "c"), no_dist=True)
            dcp.load(state, checkpoint_id=str(tmp_path / "c"), no_dist=True)
        warnings.warn("another warning still shows", UserWarning)
    texts = [str(w.message) for w in seen]
    assert not any("torch.distributed is disabled" in t for t in texts), texts
    assert "another warning still shows" in texts


def test_launch_outcome_report():
    from modelpar.rank_outcome import LaunchOutcome

    assert LaunchOutcome(1).report("p") == (1, None)                  # a FAIL verdict: exit 1, no noise
    assert LaunchOutcome(0).report("p") == (0, None)
    crash = LaunchOutcome(None, {0: {"kind": "crash", "line": "RuntimeError: Connection reset", "t": 2.0},
                                 1: {"kind": "crash", "line": "RuntimeError: boom", "t": 1.0}}, "ChildFailedError")
    code, msg = crash.report("p")
    assert code == 1 and msg.splitlines() == ["p: rank 1 crashed: RuntimeError: boom",
                                              "p: then rank 0 failed: RuntimeError: Connection reset"]
    same = LaunchOutcome(None, {0: {"kind": "value", "line": "x", "t": 1}, 1: {"kind": "value", "line": "x", "t": 1}})
    assert same.report("p") == (2, "p: stopped by the error above (raised on rank(s) [0, 1])")
    # the ranks left their messages to the launching process: each distinct one is printed once
    v = {"kind": "value", "line": "ValueError: bad"}
    once = LaunchOutcome(None, {0: {**v, "message": "bad\nsecond line", "t": 1.0},
                                1: {**v, "message": "bad\nsecond line", "t": 1.1}})
    assert once.report("p") == (2, "p: error: bad\nsecond line\n"
                                   "p: stopped by the error above (raised on rank(s) [0, 1])")
    split = LaunchOutcome(None, {0: {**v, "message": "a", "t": 2.0}, 1: {**v, "message": "b", "t": 1.0},
                                 2: {**v, "message": "b", "t": 1.5}})
    assert split.report("p") == (2, "p: error: b (rank(s) [1, 2])\np: error: a (rank(s) [0])\n"
                                    "p: stopped by the error above (raised on rank(s) [0, 1, 2])")
    assert LaunchOutcome(None, {}, "ChildFailedError").report("p")[0] == 1
    # rank 0's ValueError came first; rank 1 then lost its peer: the error is the cause, not a crash
    chain = LaunchOutcome(None, {0: {"kind": "value", "line": "x", "t": 1.0},
                                 1: {"kind": "crash", "line": "RuntimeError: Connection closed", "t": 2.0}})
    assert chain.report("p") == (2, "p: stopped by the error above (raised on rank(s) [0])\n"
                                    "p: then rank 1 failed: RuntimeError: Connection closed")


def test_flags_and_fields_default_on_and_off():
    from modelpar.train.config import TrainConfig
    from modelpar.cli.verify import build_parser

    a = build_parser().parse_args([])
    assert a.check_unused_params is True and a.sync_batchnorm is False
    b = build_parser().parse_args(["--no-check-unused-params", "--sync-batchnorm"])
    assert b.check_unused_params is False and b.sync_batchnorm is True
    assert TrainConfig().check_unused_params is True and TrainConfig().sync_batchnorm is False
