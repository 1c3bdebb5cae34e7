"""Shared by the benchmark scripts: launch a script's own 2-rank worker through torchrun, read its JSON."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path


def run_worker(script: str, worker_args: list[str], out: str, *, nproc: int = 2) -> dict:
    """Run ``script --worker ...`` on ``nproc`` local ranks (one thread each) and return the JSON the
    worker wrote to ``out``. The results count once written, even if a rank then failed while shutting
    down.

    Raises:
        SystemExit: the worker ended without writing ``out``.
    """
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    Path(out).unlink(missing_ok=True)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}", script,
           "--worker", *worker_args]
    rc = subprocess.run(cmd, env=env).returncode
    if not Path(out).exists():
        raise SystemExit(f"the benchmark worker failed (exit {rc}) before writing {out}")
    return json.loads(Path(out).read_text())
