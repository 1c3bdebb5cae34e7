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
