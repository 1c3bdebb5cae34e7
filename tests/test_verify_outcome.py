"""`modelpar verify` reports its own verdict: a parity FAIL (exit 1) with the table and the likely
reason (BatchNorm, case C15), an error raised the same on every rank (exit 2; case C12 here), a rank
that really crashed (exit 1, named with its first error line), each without torchrun's
"failed (exitcode: 1)" / ChildFailedError noise and without "terminate called without an active
exception"; SyncBatchNorm on CPU refused before any process starts.

The command runs in this process (`modelpar.cli.main`, what ``python -m modelpar`` calls); its ranks
are real torchrun processes and everything they and torchrun print lands in the captured file
descriptors (``capfd``), which is what the checks read. ``python -m modelpar verify`` itself, as a
user starts it, is `tests/test_user_models.py`'s subprocess: here that would add a Python process
that imports torch (~3-4 s of CPU) to each run and test nothing more."""

import os
import sys
import textwrap
from types import SimpleNamespace

import pytest

MODELS = '''
import torch, torch.nn as nn, torch.distributed as dist

def bn():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 4))

def sync_bn():
    return nn.SyncBatchNorm.convert_sync_batchnorm(bn())

class Branchy(nn.Module):
    def __init__(self):
        super().__init__(); torch.manual_seed(0)
        self.inp, self.a, self.b, self.out = nn.Linear(8, 16), nn.Linear(16, 16), nn.Linear(16, 16), nn.Linear(16, 4)
    def forward(self, x):
        h = self.inp(x).relu()
        if dist.is_initialized():          # C12: rank 0 takes branch a, rank 1 branch b
            h = (self.a if dist.get_rank() == 0 else self.b)(h)
        else:
            h = self.a(h) + self.b(h)
        return self.out(h.relu())

def branchy():
    return Branchy()

class Crashy(nn.Module):
    def __init__(self):
        super().__init__(); torch.manual_seed(0)
        self.l, self.calls = nn.Linear(8, 4), 0
    def forward(self, x):
        self.calls += 1
        if dist.is_initialized() and dist.get_rank() == 1 and self.calls == 2:
            raise RuntimeError("boom on rank 1\\nsecond line")
        return self.l(x)

def crashy():
    return Crashy()
'''

NOISE = ("exitcode", "ChildFailedError", "Root Cause", "terminate called", "FAIL or a rank failed")


def verify(tmp_path, monkeypatch, capfd, model, *extra, strategy="ddp"):
    """``modelpar verify`` on ``outcome_models:<model>`` (2 ranks); its exit code and the output of
    the command, torchrun and the ranks, as ``returncode`` / ``stdout`` / ``stderr``."""
    from modelpar.cli import main

    (tmp_path / "outcome_models.py").write_text(textwrap.dedent(MODELS))
    monkeypatch.syspath_prepend(str(tmp_path))                    # the command imports the model here
    monkeypatch.setenv("PYTHONPATH", f"{tmp_path}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")  # ranks
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    monkeypatch.setenv("PYTHONWARNINGS", "ignore")
    capfd.readouterr()
    try:
        rc = main(["verify", "--model", f"outcome_models:{model}", "--strategy", strategy, "--nproc", "2",
                   "--input-shape", "8", "--num-classes", "4", "--steps", "2", *extra])
    finally:
        sys.modules.pop("outcome_models", None)
    out = capfd.readouterr()
    return SimpleNamespace(returncode=rc, stdout=out.out, stderr=out.err)


def _no_noise(r):
    out = r.stdout + r.stderr
    for n in NOISE:
        assert n not in out, f"{n!r} in output:\n{out[-3000:]}"


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_parity_fail_is_a_verdict_with_the_likely_reason_case_c15(tmp_path, monkeypatch, capfd):
    r = verify(tmp_path, monkeypatch, capfd, "bn", strategy="fsdp")
    assert r.returncode == 1, r.stderr[-3000:]
    assert "step   loss 1 process" in r.stdout and "\nFAIL:\n" in r.stdout
    assert "likely reason:\n  the model has 1 BatchNorm layer(s) (1)" in r.stdout, r.stdout
    _no_noise(r)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_rank_divergent_model_is_one_error_case_c12(tmp_path, monkeypatch, capfd):
    r = verify(tmp_path, monkeypatch, capfd, "branchy", strategy="fsdp")
    assert r.returncode == 2, r.stderr[-3000:]
    msg = ("rank-divergent parameter use at step 0 (case C12): 4 parameter(s) got a gradient on some "
           "data-parallel ranks and not on others")
    assert r.stderr.count(msg) == 1, r.stderr[-3000:]             # raised on both ranks, printed once
    assert "modelpar verify: stopped by the error above (raised on rank(s) [0, 1])" in r.stderr
    assert "Traceback" not in r.stderr
    _no_noise(r)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_crashed_rank_is_named_with_its_first_error_line(tmp_path, monkeypatch, capfd):
    r = verify(tmp_path, monkeypatch, capfd, "crashy")
    assert r.returncode == 1
    assert "modelpar verify: rank 1 crashed: RuntimeError: boom on rank 1\n" in r.stderr, r.stderr[-3000:]
    _no_noise(r)


@pytest.mark.timeout(120)
def test_sync_batchnorm_refused_before_launch_on_cpu(tmp_path, monkeypatch, capsys):
    """In this process (`verify_main`): the pure tier's guard (tests/conftest.py) fails the test if
    the command starts any process, so the refusal provably comes before the launch."""
    import torch

    from modelpar.cli.verify import verify_main

    if torch.cuda.is_available():
        pytest.skip("the refusal is for runs without CUDA")
    (tmp_path / "outcome_models.py").write_text(textwrap.dedent(MODELS))
    monkeypatch.syspath_prepend(str(tmp_path))
    for model, extra in (("bn", ("--sync-batchnorm",)), ("sync_bn", ())):
        rc = verify_main(["--model", f"outcome_models:{model}", "--strategy", "ddp", "--nproc", "2",
                          "--input-shape", "8", "--num-classes", "4", "--steps", "2", *extra])
        err = capsys.readouterr().err
        assert rc == 2, err[-2000:]
        assert "SyncBatchNorm runs on CUDA tensors only and this run is on cpu" in err
