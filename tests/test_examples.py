"""Every example runs on CPU with tiny sizes (MODELPAR_TINY=1) and prints what it demonstrates."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow
EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
# in start order, longest first (CPU seconds of each, quiet 2-core host, parent + ranks: hf_from_config 39,
# pipeline_three_stages 30, fsdp_cpu_offload 22, ddp 20, activation_checkpointing 9,
# two_device_placement 8), so the two slots end together instead of a long one starting last;
# most of each is process start-up (import torch / transformers once per rank), not the example's work
EXPECT = {
    "hf_from_config.py": ["plan: ddp2", "wrote", "a transformers folder", "= GPT2LMHeadModel",
                          "head tied to the embedding: True", "max |difference| 0.0e+00"],
    "pipeline_three_stages.py": ["rank 2 (last stage): step 2 loss", "stage 0 = blocks", "3-stage pipeline trained"],
    "fsdp_cpu_offload.py": ["CPU offload skipped: this machine has no CUDA", "holds", "(50%)"],
    "ddp.py": ["DDP on 2 ranks", "replicas differ by at most 0.0e+00"],
    "activation_checkpointing.py": ["20 layers", "saved", "largest gradient difference 0.0e+00"],
    "two_device_placement.py": ["blocks 0..", "on cpu", "step 3: loss"],
}


CONCURRENT = 2          # examples run two at a time: most of them are one process on one thread
TIMEOUT_S = 300


@pytest.fixture(scope="module")
def ran(tmp_path_factory):
    """name -> (exit code, stdout, stderr) of every example, started as a user starts it (a plain
    ``python examples/NAME.py``; the multi-rank ones relaunch themselves), ``CONCURRENT`` at a time so a
    single-process example does not leave the second core idle. Each has its own limit."""
    import time

    work = tmp_path_factory.mktemp("examples")
    env = {**os.environ, "MODELPAR_TINY": "1", "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    todo, running, done = list(EXPECT), {}, {}
    while todo or running:
        while todo and len(running) < CONCURRENT:
            name = todo.pop(0)
            out, err = open(work / f"{name}.out", "w"), open(work / f"{name}.err", "w")
            proc = subprocess.Popen([sys.executable, str(EXAMPLES / name)], stdout=out, stderr=err, env=env,
                                    cwd=EXAMPLES, start_new_session=True)
            running[name] = (proc, out, err, time.monotonic())
        for name, (proc, out, err, t0) in list(running.items()):
            rc = proc.poll()
            if rc is None and time.monotonic() - t0 > TIMEOUT_S:
                os.killpg(proc.pid, 9)
                rc = proc.wait()
                err.write(f"\n[test] killed after {TIMEOUT_S} s\n")
            if rc is not None:
                out.close()
                err.close()
                done[name] = (rc, (work / f"{name}.out").read_text(), (work / f"{name}.err").read_text())
                del running[name]
        time.sleep(0.2)
    return done


@pytest.mark.timeout(1200)
@pytest.mark.parametrize("name", sorted(EXPECT))
def test_example_runs(name, ran):
    expect = list(EXPECT[name])
    if name == "fsdp_cpu_offload.py" and __import__("torch").cuda.is_available():
        expect = ["cpu_offload=True", "holds"]
    rc, stdout, stderr = ran[name]
    assert rc == 0, stderr[-3000:]
    for s in expect:
        assert s in stdout, (s, stdout[-2000:])
    if name == "activation_checkpointing.py":        # checkpointing must actually save memory
        line = next(l for l in stdout.splitlines() if l.startswith("saved"))
        assert float(line.split()[1]) > 0
