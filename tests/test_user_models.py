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
    assert r.stderr.count(msg) == 2, r.stderr[-3000:]          # the same error on both ranks
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


def test_planner_never_proposes_a_tp_split_that_does_not_divide_case_c7(tmp_path, monkeypatch, capsys):
    """C7 at planning time for a model without transformer facts: `plan` proposes no tp2 for
    Linear(4, 5) -> Linear(5, 4) (nor tp4 for hidden 10, while tp2 stays), and `estimate` refuses tp2
    naming the module, the dimension and the degree (before: both priced tp2 as if it ran)."""
    from modelpar.cli.estimate import main as estimate_main
    from modelpar.cli.plan import main as plan_main

    (tmp_path / "c7_plan.py").write_text(
        "import torch.nn as nn\n\ndef c7():\n    return nn.Sequential(nn.Linear(4, 5), nn.ReLU(), nn.Linear(5, 4))\n"
        "\ndef h10():\n    return nn.Sequential(nn.Linear(8, 10), nn.ReLU(), nn.Linear(10, 3))\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert plan_main(["--model", "c7_plan:c7", "--nproc", "2", "--top", "200"]) == 0
    out = capsys.readouterr().out
    assert "tp does not divide" in out and " tp2 " not in out and "x tp2" not in out
    assert plan_main(["--model", "c7_plan:h10", "--nproc", "4", "--top", "200"]) == 0
    out = capsys.readouterr().out
    assert "tp4" not in out and "tp2" in out
    with pytest.raises(ValueError, match=r"tensor parallel degree tp=2 does not divide 0\.out_features=5, "
                                         r"2\.in_features=5 \(the TP plan's colwise / rowwise splits\)"):
        estimate_main(["--model", "c7_plan:c7", "--nproc", "2", "--strategy", "tp"])
