"""A user's own model through `modelpar verify`: case C1 (a layer forward never calls) gets one error
naming the parameters on every rank, before DDP's own error at the second step."""

import os
import subprocess
import sys
import textwrap

import pytest


@pytest.mark.slow
@pytest.mark.timeout(200)
def test_verify_unused_layer_case_c1(tmp_path):
    (tmp_path / "c1_models.py").write_text(textwrap.dedent('''
        import torch.nn as nn

        class Unused(nn.Module):
            def __init__(self):
                super().__init__()
                self.a, self.b, self.unused = nn.Linear(8, 16), nn.Linear(16, 4), nn.Linear(3, 3)

            def forward(self, x):
                return self.b(self.a(x).relu())

        def unused():
            return Unused()
    '''))
    env = {**os.environ, "PYTHONPATH": f"{tmp_path}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
           "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    r = subprocess.run([sys.executable, "-m", "modelpar", "verify", "--model", "c1_models:unused", "--strategy", "ddp",
                        "--nproc", "2", "--input-shape", "8", "--num-classes", "4", "--steps", "2"],
                       capture_output=True, text=True, timeout=180, env=env)
    assert r.returncode != 0
    msg = "trainable parameter(s) got no gradient in the first step (on rank(s) [0, 1]): unused.bias, unused.weight"
    assert r.stderr.count(msg) == 1, r.stderr[-3000:]          # the same error on both ranks, printed once
    assert "Expected to have finished reduction" not in r.stderr


@pytest.mark.timeout(120)
def test_verify_refuses_bad_tp_split_before_launch_case_c7(tmp_path, monkeypatch, capsys):
    """In this process (`modelpar.cli.main`): the pure tier's guard fails the test if any rank starts."""
    from modelpar.cli import main

    (tmp_path / "c7_models.py").write_text(
        "import torch.nn as nn\n\ndef c7():\n    return nn.Sequential(nn.Linear(4, 5), nn.ReLU(), nn.Linear(5, 4))\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    rc = main(["verify", "--model", "c7_models:c7", "--strategy", "tp", "--nproc", "2", "--input-shape", "4",
               "--num-classes", "4"])
    err = capsys.readouterr().err
    assert rc == 2, err[-2000:]
    assert "tensor parallel degree 2 does not divide 0.out_features=5 (colwise split of Linear(4, 5))" in err
    assert "torch.distributed.run" not in err and "ChildFailedError" not in err


@pytest.mark.slow
@pytest.mark.timeout(200)
def test_train_batchnorm_warning_reaches_the_user_case_c15(tmp_path):
    """Before: `parallelize` warned on rank 0, but the launcher starts ranks with PYTHONWARNINGS=ignore,
    so `modelpar train` of a BatchNorm model under DDP printed nothing about per-rank statistics."""
    (tmp_path / "c15_models.py").write_text(textwrap.dedent('''
        import torch, torch.nn as nn

        def bn():
            torch.manual_seed(0)
            return nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 3))
    '''))
    env = {**os.environ, "PYTHONPATH": f"{tmp_path}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
           "OMP_NUM_THREADS": "1"}
    r = subprocess.run([sys.executable, "-m", "modelpar", "train", "--model", "c15_models:bn", "--strategy", "ddp",
                        "--nproc", "2", "--steps", "1", "--out-dir", str(tmp_path / "runs")],
                       capture_output=True, text=True, timeout=180, env=env)
    out = r.stdout + r.stderr
    assert r.returncode == 0, out[-3000:]
    assert out.count("ParallelLayoutWarning") == 1, out[-3000:]       # once: rank 0 only
    assert "1 BatchNorm layer(s)" in out and "--sync-batchnorm" in out, out[-3000:]


def test_peak_memory_tracker_takes_frozen_parameters():
    """`modelpar train` of a model with frozen parameters (LoRA-style: base weights with
    ``requires_grad=False``) crashed in its first step on the CPU: torch's MemTracker (``--track-memory``,
    the default) registers a gradient hook on every parameter ('cannot register a hook on a tensor that
    doesn't require gradient'). The tracker now skips their hooks and still counts their bytes."""
    import torch
    import torch.nn as nn

    from modelpar.train.metrics import PeakTensorMemory

    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 8))
    m[0].weight.requires_grad_(False)
    with PeakTensorMemory(torch.device("cpu")) as mem:
        m(torch.randn(4, 64)).sum().backward()
    assert m[0].weight.grad is None and m[2].weight.grad is not None
    assert mem.peak >= 64 * 64 * 4            # the frozen weight's bytes at least




@pytest.mark.timeout(120)
def test_planner_ranks_no_v_schedule_that_splits_a_tie(capsys):
    """A factory LM whose head is its embedding: on 4 ranks `plan` ranked pp2(zbvzerobubble, v=2) x ddp2
    first and `--strategy auto` picked it, which train refuses (rank 0 holds the first and the last
    stage, the tie's two copies in two data-parallel units). Such layouts are now pruned, and `estimate`
    of one refuses it with the reason."""
    from modelpar.cli import main

    assert main(["plan", "--model", "helpers.lm_factory:lm_tied", "--nproc", "4", "--global-batch-size", "8", "--top", "50"]) == 0
    out = capsys.readouterr().out
    rows = [ln for ln in out.splitlines() if ln.strip()[:1].isdigit() and " x " in ln]
    assert rows and not [ln for ln in rows if ("zbvzerobubble" in ln or "dualpipev" in ln) and "ddp" in ln], out[-3000:]
    rc = main(["estimate", "--model", "helpers.lm_factory:lm_tied", "--nproc", "4", "--global-batch-size", "8", "--pp", "2",
               "--dp-replicate", "2", "--pp-schedule", "zbvzerobubble", "--virtual-stages", "2"])
    err = capsys.readouterr().err
    assert rc == 2 and "a tied input embedding and output head would sit in two data-parallel units" in err, err[-2000:]
