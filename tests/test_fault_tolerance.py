"""Fault tolerance (case C11) and no hangs.

- kill and restart: under ``torchrun --max-restarts 1`` on gloo, rank 1 is SIGKILLed at the start of
  step 5 (after the step-4 checkpoint; test-only hook ``MODELPAR_TEST_KILL_AT_STEP``); the launcher
  restarts both ranks, the new attempt builds its process group on a store of its own (C11),
  resumes from step 4 and ends bit-identical to an uninterrupted run.
- a stalled rank: the survivor's collective times out (``--timeout_s 6``) and it raises one error
  naming the stalled rank and step, instead of gloo's message that names neither.
- the heartbeat's diagnosis, in one process over a HashStore.
"""

from __future__ import annotations

import json
import os
import subprocess
import time
from pathlib import Path

import pytest

from helpers import workers
from helpers.ckpt_worker import data_dir

ROOT = Path(__file__).resolve().parent.parent
TINY = ["--model", "gpt-nano", "--seq-len", "16", "--global-batch-size", "8", "--steps", "8", "--warmup-steps", "2",
        "--eval-every", "0", "--eval-samples", "8", "--sample-bytes", "0", "--no-track-memory",
        "--threads", "1", "--strategy", "ddp", "--data", data_dir()]


def _reference(work: Path) -> list[dict]:
    """TINY's uninterrupted run: it rides in the session's first 2-rank scenario launch (`helpers.workers`),
    through `modelpar.train.runner.train` as the ranks of `modelpar train` run it."""
    cfg = dict(model="gpt-nano", seq_len=16, global_batch_size=8, steps=8, warmup_steps=2, eval_every=0,
               eval_samples=8, sample_bytes=0, track_memory=False, threads=1, strategy="ddp", data=data_dir(),
               out_dir=str(work / "out"))
    return [{"name": "ref", "kind": "train", "cfg": cfg, "run_dir": str(work / "ref" / "run")}]


workers.ride("ft_ref", 2, _reference, module=__file__)


def torchrun(args: list[str], *, restarts: int, env: dict | None = None, timeout: int = 240):
    from modelpar.launch import torchrun_cmd

    cmd = ["timeout", "-k", "10", str(timeout), *torchrun_cmd(2, ["-m", "modelpar", "train", *args],
                                                              max_restarts=restarts)]
    e = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore", **(env or {})}
    t = time.time()
    p = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, env=e, timeout=timeout + 30)
    return p, time.time() - t


def final(out_dir: Path) -> tuple[float, float]:
    """(loss at step 8, validation loss after training) from the run record that reached step 8."""
    for run in sorted(out_dir.iterdir()):
        if not (run / "summary.json").exists():
            continue
        rows = [json.loads(l) for l in (run / "metrics.jsonl").read_text().splitlines()]
        loss = [r["loss"] for r in rows if r["step"] == 8 and "loss" in r]
        return loss[0], json.loads((run / "summary.json").read_text())["val_loss_after"]
    raise AssertionError(f"no finished run record in {out_dir}: {list(out_dir.iterdir())}")


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_kill_one_rank_restart_resume_bit_identical(tmp_path):
    ref = workers.rider_results("ft_ref")["ref"]        # the uninterrupted run of the same config
    assert not ref["errors"], ref["errors"]
    ckpt = tmp_path / "ckpt"
    run, secs = torchrun([*TINY, "--out-dir", str(tmp_path / "run"), "--ckpt-dir", str(ckpt), "--ckpt-every", "2",
                          "--resume", "auto"], restarts=1,
                         env={"MODELPAR_TEST_KILL_AT_STEP": "5", "MODELPAR_TEST_FAULT_RANK": "1"})
    log = run.stdout + run.stderr
    assert run.returncode == 0, log[-4000:]
    assert "[test fault] rank 1: SIGKILL at step 5" in log
    assert "resumed from" in log and "step-00000004 at step 4" in log, log[-3000:]
    assert final(tmp_path / "run") == final(workers.group_dir("ft_ref") / "ref")   # bit-identical: loss, val loss
    assert [p.name for p in sorted(ckpt.iterdir())] == ["step-00000004", "step-00000006", "step-00000008"]


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_stalled_rank_is_named_within_the_timeout(tmp_path):
    run, secs = torchrun([*TINY, "--out-dir", str(tmp_path), "--timeout-s", "6"], restarts=0,
                         env={"MODELPAR_TEST_STALL_AT_STEP": "2", "MODELPAR_TEST_FAULT_RANK": "1"}, timeout=150)
    log = run.stdout + run.stderr
    assert run.returncode != 0
    assert "RankFailureError" in log and "rank 1 stalled at step 1" in log and "never began step 2" in log, log[-4000:]
    assert secs < 60, f"took {secs:.0f} s"


def test_heartbeat_names_a_dead_rank_and_a_stalled_one():
    import torch.distributed as dist

    from modelpar.train.health import Heartbeat

    store = dist.HashStore()
    a, b, c = (Heartbeat(store, r, 3, interval_s=0.1) for r in range(3))
    for hb in (a, b, c):
        hb.beat(3)
    a.beat(4)
    c.beat(4)
    assert "rank 1 stalled at step 3" in a.diagnose()
    c.close()                                     # rank 2's process is gone
    msg = a.diagnose()
    assert "rank 2 stopped" in msg and "at step 4" in msg
    a.close()
    b.close()


def test_heartbeat_read_costs_two_store_requests_at_any_world_size():
    """After a failure every surviving rank reads every rank's heartbeat: per-key requests would put
    2 x world^2 of them on the launcher's store (3,072 ranks: ~19M). One ``check`` and one
    ``multi_get`` per read where all have written; per-key requests only where one never did."""
    import torch.distributed as dist

    from modelpar.train.health import Heartbeat

    class Counting:
        def __init__(self, inner):
            self.inner, self.calls = inner, 0

        def __getattr__(self, name):
            fn = getattr(self.inner, name)

            def call(*a):
                self.calls += 1
                return fn(*a)
            return call

    world = 64
    store = Counting(dist.HashStore())
    beats = [Heartbeat(store, r, world, interval_s=60) for r in range(world)]
    try:
        store.calls = 0
        got = beats[0].read()
        assert store.calls == 2, store.calls
        assert sorted(got) == list(range(world)) and all(v is not None and v[0] == -1 for v in got.values())
        store.inner.delete_key("hb/5")              # a rank that never wrote one: named None, the rest read
        got = beats[0].read()
        assert got[5] is None and all(got[r] is not None for r in range(world) if r != 5)
    finally:
        for hb in beats:
            hb.close()


@pytest.mark.slow
@pytest.mark.timeout(200)
def test_sigterm_on_one_process_saves_and_exits_like_a_rank(tmp_path):
    """`modelpar train --strategy single` (no launch: the run is this process) preempted by SIGTERM: it
    saved the checkpoint after its step, then ended in a traceback of `RunStopped` with exit code 1 (a
    scheduler reads a failure); now exit 128 + 15 and no traceback, as a launched rank, and ``--resume
    auto`` continues from that step."""
    import signal
    import sys

    from modelpar.train.checkpoint.storage import list_checkpoints

    out, ck = tmp_path / "out", tmp_path / "ck"
    argv = [sys.executable, "-m", "modelpar", "train", *TINY[:-4], "--strategy", "single", "--data", data_dir(),
            "--ckpt-every", "100000", "--ckpt-dir", str(ck), "--out-dir", str(out)]
    e = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    p = subprocess.Popen([*argv, "--steps", "100000"], env=e, cwd=ROOT, stdout=subprocess.PIPE,
                         stderr=subprocess.STDOUT, text=True)
    t0 = time.time()
    while not any(sum(1 for _ in m.open()) > 3 for m in out.glob("*/metrics.jsonl")):
        assert time.time() - t0 < 120 and p.poll() is None, "training did not start"
        time.sleep(0.1)
    p.send_signal(signal.SIGTERM)
    text, _ = p.communicate(timeout=90)
    assert p.returncode == 128 + signal.SIGTERM and "Traceback" not in text, text[-2000:]
    assert "stopped by SIGTERM after step" in text
    (step, _), = [c for c in list_checkpoints(ck) if c[0] > 0]
    r = subprocess.run([*argv, "--steps", str(step + 2), "--resume", "auto"], env=e, cwd=ROOT, capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 0 and f"at step {step}" in r.stdout, (r.stdout + r.stderr)[-2000:]
