"""Preflight checks on the live model and optimizer (cases C1, C2, C8, C9, C12, C15, DDP parameters frozen
after wrapping), one launch per world size."""

from __future__ import annotations


import pytest
import torch
import torch.nn as nn

from helpers import workers

# both scenario groups ride in the first launch of their world size in the session (the checkpoint
# tests' launches; `helpers.workers`), or run alone when this module is selected by itself
PRE2 = [{"name": "c1_ddp", "kind": "c1", "plan": {"dp_replicate": 2}},
        {"name": "c1_fsdp", "kind": "c1", "plan": {"dp_shard": 2}},
        {"name": "c9", "kind": "c9"},
        {"name": "c12_fsdp", "kind": "c12", "plan": {"dp_shard": 2}, "split_at": 1},
        {"name": "c12_ddp", "kind": "c12", "plan": {"dp_replicate": 2}, "split_at": 1},
        {"name": "c12_fsdp_at0", "kind": "c12", "plan": {"dp_shard": 2}, "split_at": 0},
        {"name": "c12_fsdp_off", "kind": "c12", "plan": {"dp_shard": 2}, "split_at": 1, "check": False},
        {"name": "c12_ddp_find_unused", "kind": "c12", "plan": {"dp_replicate": 2}, "split_at": 1,
         "find_unused": True},
        {"name": "c15_ddp", "kind": "c15", "plan": {"dp_replicate": 2}},
        {"name": "c15_fsdp", "kind": "c15", "plan": {"dp_shard": 2}},
        {"name": "frozen_ddp", "kind": "frozen_ddp"},
        {"name": "ddp_accum_early_only", "kind": "ddp_accum_early_only"},
        {"name": "gathered_bytes_fsdp", "kind": "gathered_bytes", "plan": {"dp_shard": 2}},
        {"name": "gathered_bytes_ddp", "kind": "gathered_bytes", "plan": {"dp_replicate": 2}}]
PRE4 = [{"name": "c2", "kind": "c2"}, {"name": "c2_steps", "kind": "c2", "steps_differ": True}]


def _pre2(work):
    from helpers.ckpt_worker import base_cfg

    # an unseeded factory under a pipeline: each stage kept its own random build (a user's tied GPT-2 trained
    # with its head and embedding 0.1 apart); refused on every rank before the model is parallelised
    unseeded = {"name": "unseeded_pp", "kind": "train", "run_dir": str(work / "unseeded_pp"),
                "cfg": base_cfg(model="helpers.lm_factory:lm_unseeded", strategy="pp", seq_len=16, steps=1)}
    return PRE2 + [unseeded]


workers.ride("pre2", 2, _pre2, module=__file__)
workers.ride("pre4", 4, lambda work: PRE4, module=__file__)


@pytest.fixture(scope="module")
def two_ranks():
    res = workers.rider_results("pre2")
    assert set(res) == {s["name"] for s in PRE2} | {"unseeded_pp"}, sorted(res)
    return res


@pytest.mark.slow
@pytest.mark.timeout(400)
@pytest.mark.parametrize("name", ["c1_ddp", "c1_fsdp"])
def test_c1_unused_parameters_one_error_on_every_rank(two_ranks, name):
    errs = two_ranks[name]["errors"]
    assert set(errs) == {"0", "1"} and errs["0"] == errs["1"], errs
    assert "2 trainable parameter(s) got no gradient in the first step" in errs["0"]
    assert "unused.bias, unused.weight" in errs["0"]


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_an_unseeded_factory_is_refused_on_every_rank(two_ranks):
    errs = two_ranks["unseeded_pp"]["errors"]
    assert set(errs) == {"0", "1"} and errs["0"] == errs["1"], errs
    assert "'helpers.lm_factory:lm_unseeded': the ranks built different initial weights" in errs["0"], errs
    assert "must seed itself" in errs["0"]


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_c9_forward_before_optimizer_updates_like_reference(two_ranks):
    r = two_ranks["c9"]
    assert not r["errors"], r["errors"]
    res = r["result"]
    assert res["max_param_diff_vs_reference"] < 1e-6 and res["min_param_change"] > 1e-4, res
    assert "stale tensor(s)" in res["stale_error"] and "case C9" in res["stale_error"]


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_c2_same_steps_and_eval_counts_each_sample_once():
    res = workers.rider_results("pre4")
    r = res["c2"]
    assert not r["errors"], r["errors"]
    assert abs(r["result"]["eval"] - r["result"]["reference"]) <= 1e-5 * r["result"]["reference"], r["result"]
    errs = res["c2_steps"]["errors"]
    assert set(errs) == {"0", "1", "2", "3"} and len(set(errs.values())) == 1
    assert "different numbers of optimizer steps ({0: 10, 1: 10, 2: 10, 3: 11})" in errs["0"]


class _Blocks(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.blocks = nn.ModuleList([nn.Linear(4, 4), nn.Linear(4, 4)])

    def forward(self, x):
        for b in self.blocks:
            x = torch.relu(b(x))
        return x


def _first_step(model):
    from modelpar.train.preflight_checks import install_first_step_checks

    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    install_first_step_checks(model.named_parameters(), opt)
    model(torch.randn(3, 4)).sum().backward()       # the input does not require grad
    opt.step()


def test_c8_reentrant_checkpoint_without_grads_is_an_error():
    import functools
    import warnings

    from torch.utils.checkpoint import checkpoint

    m = _Blocks()
    m.blocks[0].forward = functools.partial(checkpoint, m.blocks[0].forward, use_reentrant=True)
    with warnings.catch_warnings(), pytest.raises(ValueError, match=r"2 trainable parameter\(s\) got no gradient.*"
                                                  r"blocks\.0\.bias, blocks\.0\.weight.*case C8"):
        warnings.simplefilter("ignore")
        _first_step(m)


def test_c8_modelpar_checkpointing_gives_every_parameter_a_grad():
    from modelpar.parallel.checkpointing import apply_ac

    m = _Blocks()
    apply_ac(list(m.blocks), mode="full")
    _first_step(m)                                   # no error: non-reentrant by default
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in m.parameters())


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_c12_rank_divergent_use_is_one_error_at_the_step(two_ranks):
    errs = two_ranks["c12_fsdp"]["errors"]
    assert set(errs) == {"0", "1"} and errs["0"] == errs["1"], errs
    e = errs["0"]
    assert "rank-divergent parameter use at step 1 (case C12)" in e, e
    assert "a.bias, a.weight (a gradient on rank(s) [0], none on [1])" in e, e
    assert "b.bias, b.weight (a gradient on rank(s) [1], none on [0])" in e, e
    assert "find_unused_parameters=True" not in e


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_c12_under_ddp_each_rank_names_what_it_lacks_at_the_step(two_ranks):
    """DDP after the first step checks on each rank alone (no collective, `grad_use`): here both
    ranks lack a branch, so both raise at step 1, before the update, each naming its own."""
    errs = two_ranks["c12_ddp"]["errors"]
    assert set(errs) == {"0", "1"}, errs
    for rank, lacks in (("0", "b.bias, b.weight"), ("1", "a.bias, a.weight")):
        e = errs[rank]
        assert e.startswith(f"ValueError: 2 trainable parameter(s) got no gradient on rank {rank} at step 1: "
                            f"{lacks}."), e
        assert "rank-divergent use, case C12" in e and "find_unused_parameters=True" in e, e


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_c12_split_from_step0_is_not_called_unused(two_ranks):
    e = two_ranks["c12_fsdp_at0"]["errors"]["0"]
    assert "rank-divergent parameter use at step 0" in e and "never uses" not in e and "no rank" not in e, e


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_c12_handled_by_ddp_find_unused_and_silent_without_the_check(two_ranks):
    ok = two_ranks["c12_ddp_find_unused"]
    assert not ok["errors"], ok["errors"]
    assert ok["result"]["max_param_diff_vs_dp_reference"] < 1e-6, ok["result"]
    off = two_ranks["c12_fsdp_off"]                   # what the check prevents: FSDP mixes a and b
    assert not off["errors"], off["errors"]
    assert off["result"]["max_param_diff_vs_dp_reference"] > 1e-3, off["result"]


@pytest.mark.slow
@pytest.mark.timeout(400)
@pytest.mark.parametrize("name", ["c15_ddp", "c15_fsdp"])
def test_c15_batchnorm_warned_and_buffers_agree(two_ranks, name):
    r = two_ranks[name]
    assert not r["errors"], r["errors"]
    res = r["result"]
    assert res["warnings_per_rank"] == [1, 0], res              # one warning, on rank 0 only
    w = res["warnings"][0]
    assert "1 BatchNorm layer(s) (seq.1)" in w and "2 data-parallel ranks" in w and "--sync-batchnorm" in w, w
    assert res["mean_diff_after_1"] < 1e-6, res                 # mean of per-rank EMAs = one device's
    assert res["rank_spread_after_3"] == 0.0, res
    assert "SyncBatchNorm runs on CUDA tensors only" in res["refused"], res


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_ddp_params_frozen_after_wrapping_named(two_ranks):
    errs = two_ranks["frozen_ddp"]["errors"]
    assert set(errs) == {"0", "1"} and errs["0"] == errs["1"], errs
    assert "1 parameter(s) changed requires_grad after DDP wrapped the model: 0.weight (trainable -> frozen)" \
        in errs["0"], errs
    assert "Set requires_grad before parallelize()" in errs["0"]
    assert errs["0"].startswith("ValueError: ")            # not torch's RuntimeError at the next forward


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_ddp_param_used_only_in_an_earlier_micro_batch_named(two_ranks):
    errs = two_ranks["ddp_accum_early_only"]["errors"]
    assert set(errs) == {"0", "1"} and errs["0"] == errs["1"], errs
    e = errs["0"]
    assert e.startswith("ValueError: 2 trainable parameter(s) got no gradient in the first step (on rank(s) "
                        "[0, 1]): b.bias, b.weight."), e
    assert "the backward of the last accumulation micro-batch" in e


@pytest.mark.slow
@pytest.mark.timeout(400)
@pytest.mark.parametrize("name", ["gathered_bytes_fsdp", "gathered_bytes_ddp"])
def test_a_good_run_gathers_no_parameter_names(two_ranks, name):
    """The checks' `all_gather_object` payloads of a good run are a few bytes per rank, not the names
    (each rank receives world x the largest pickle: ~1 GB per rank at 16,384 ranks of a 70B model when
    every rank sent its names); a run with something to report still names it (C1)."""
    r = two_ranks[name]
    assert not r["errors"], r["errors"]
    res = r["result"]
    assert res["params"] == 48 and res["names_bytes"] > 2000, res
    assert res["good_run_sizes"] and max(res["good_run_sizes"]) < 100, res
    assert "2 trainable parameter(s) got no gradient in the first step" in res["c1_error"], res
    assert "unused.bias, unused.weight" in res["c1_error"], res
    assert max(res["c1_sizes"]) > 100, res            # the names, gathered only to report them
