"""Launch `tests/helpers/ckpt_worker.py` scenarios on N ranks and read their results."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
LAUNCH_TIMEOUT_S = 300


def launch(nproc: int, specs: list[dict], work: Path, tag: str) -> dict:
    """Run the scenarios ``specs`` (see `ckpt_worker.py`) on ``nproc`` ranks; the test fails with the
    ranks' output on a non-zero exit or a run past `LAUNCH_TIMEOUT_S`."""
    from modelpar.launch import torchrun_cmd

    spec_file, out = work / f"{tag}.spec.json", work / f"{tag}.out.json"
    spec_file.write_text(json.dumps(specs))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    cmd = ["timeout", "-k", "10", str(LAUNCH_TIMEOUT_S),
           *torchrun_cmd(nproc, [str(ROOT / "tests" / "helpers" / "ckpt_worker.py"), str(out), str(spec_file)])]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, env=env, timeout=LAUNCH_TIMEOUT_S + 30)
    if proc.returncode != 0 or not out.exists():
        pytest.fail(f"launch {tag} ({nproc} ranks) failed, rc {proc.returncode}:\n{proc.stderr[-4000:]}")
    return json.loads(out.read_text())
