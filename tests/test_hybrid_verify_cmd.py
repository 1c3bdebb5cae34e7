"""`modelpar verify` on a user model (``module:factory``): PASS, FAIL and bad input.

The factories below are what a user writes; the command imports them from this file.
"""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn as nn

from modelpar.cli.verify import verify_main

HERE = Path(__file__).resolve().parent


class UserNet(nn.Module):
    """A user model in the ModuleList form: stem -> layers -> classifier."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(3)
        self.stem = nn.Linear(12, 24)
        self.layers = nn.ModuleList(nn.Sequential(nn.Linear(24, 24), nn.Tanh()) for _ in range(4))
        self.classifier = nn.Linear(24, 5)

    def forward(self, x):
        x = self.stem(x)
        for layer in self.layers:
            x = layer(x)
        return self.classifier(x)


def make_user_net():
    return UserNet()


def make_mislabelled_loss():
    """A sum loss declared as a mean: the data-parallel gradient is off by the DP degree -> FAIL."""
    return {"model": UserNet(), "loss_fn": lambda out, y: nn.functional.cross_entropy(out, y, reduction="sum"),
            "loss_reduction": "mean"}


def _verify(*args, timeout=240):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    return subprocess.run([sys.executable, "-m", "modelpar", "verify", *args], capture_output=True, text=True,
                          cwd=HERE, env=env, timeout=timeout)


@pytest.mark.slow
def test_user_model_pipeline_passes():
    p = _verify("--model", "test_hybrid_verify_cmd:make_user_net", "--plan",
                '{"pp": 2, "pp_schedule": "interleaved1f1b", "virtual_stages": 2, "n_microbatches": 4}',
                "--steps", "4")
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-3000:]
    assert "UserNet from test_hybrid_verify_cmd:make_user_net" in p.stdout and "\nPASS" in p.stdout
    assert "largest parameter difference" in p.stdout


@pytest.mark.slow
def test_wrong_loss_scale_fails_under_ddp():
    p = _verify("--model", "test_hybrid_verify_cmd:make_mislabelled_loss", "--strategy", "ddp", "--nproc", "2",
                "--steps", "3", "--optimizer", "sgd", "--lr", "0.01")
    assert p.returncode == 1, p.stdout[-2000:] + p.stderr[-2000:]
    assert "\nFAIL:" in p.stdout and "beyond tolerance" in p.stdout


def test_bad_model_and_plan_exit_2(capsys):
    assert verify_main(["--model", "no_such_module:f", "--strategy", "ddp"]) == 2
    assert "cannot load f from module no_such_module" in capsys.readouterr().err
    assert verify_main(["--model", "gpt-nano", "--plan", '{"pp": 2, "n_microbatches": 3}']) == 2
    assert "not divisible by n_microbatches=3" in capsys.readouterr().err


def test_one_process_plan_runs_in_process(capsys):
    assert verify_main(["--model", "mlp-small", "--plan", "{}", "--steps", "2"]) == 0
    assert "PASS" in capsys.readouterr().out
