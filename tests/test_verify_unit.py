"""The parity check itself can fail: perturbed runs are caught (tier 1, no processes)."""

import torch

from modelpar.models import build_mlp
from modelpar.parallel.mesh import MeshInfo
from modelpar.plan import ParallelPlan
from modelpar.train.task import classification_loss
from modelpar.verify import compare, run_steps


def _run(lr=1e-3, optimizer="adamw", local=8):
    model = build_mlp([8, 16, 4], seed=0)

    def batch_fn(step):
        g = torch.Generator().manual_seed(step)
        return torch.randn(8, 8, generator=g), torch.randint(0, 4, (8,), generator=g)
    return run_steps(model, ParallelPlan(), loss_fn=classification_loss, batch_fn=batch_fn, steps=5,
                     global_batch_size=8, local_batch_size=local, optimizer=optimizer, lr=lr,
                     mesh=MeshInfo(mesh=None))


def test_identical_runs_pass_and_accumulation_matches():
    ref = _run()
    assert compare("same", ref, _run()).passed
    rep = compare("accum", ref, _run(local=4))   # 2 accumulation steps of 4 == one batch of 8
    assert rep.passed, rep.failures


def test_different_lr_fails():
    rep = compare("lr", _run(lr=1e-3), _run(lr=1.1e-3))
    assert not rep.passed
    assert rep.max_param_abs_diff > 1e-6


def test_sgd_tolerance_is_elementwise():
    ref = _run(optimizer="sgd", lr=0.1)
    got = _run(optimizer="sgd", lr=0.1)
    k = next(iter(got.state))
    got.state[k] = got.state[k].clone()
    got.state[k].view(-1)[0] += 1e-3
    rep = compare("sgd", ref, got, optimizer="sgd")
    assert not rep.passed and any(k in f for f in rep.failures)


def test_report_header_names_the_batch_terms():
    """A user could not tell from verify's report how the batch was split (it printed only the plan):
    the header now says the local batch, the accumulation steps and the pipeline micro-batches."""
    from modelpar.cli.verify import format_report

    ref = _run()
    rep = compare("same", ref, ref)
    head = format_report("mlp", ParallelPlan(dp_shard=2), 2, rep, ref, ref, global_batch=16, local=2).splitlines()[0]
    assert head.endswith("5 steps; batch 16 = local 2 x dp 2 x 4 accumulation step(s)"), head
    pp = ParallelPlan(pp=2, n_microbatches=4)
    head = format_report("mlp", pp, 2, rep, ref, ref, global_batch=16, local=16).splitlines()[0]
    assert head.endswith("x 1 accumulation step(s), 4 micro-batches of 4"), head
    assert "batch" not in format_report("mlp", pp, 2, rep, ref, ref).splitlines()[0]


def test_noise_hint_only_when_single_elements_differ_under_adamw():
    from types import SimpleNamespace

    from modelpar.cli.verify import noise_hints

    elem = SimpleNamespace(failures=["a.bias: elementwise difference 1.02e-04 beyond tolerance (x1.02)"])
    assert "AdamW" in noise_hints(elem, "adamw")[0]
    assert noise_hints(elem, "sgd") == []
    both = SimpleNamespace(failures=elem.failures + ["loss differs by 1e-3 relative (> 1e-05) at step 1"])
    assert noise_hints(both, "adamw") == [] and noise_hints(SimpleNamespace(failures=[]), "adamw") == []
