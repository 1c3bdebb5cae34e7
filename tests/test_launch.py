"""Launch paths: `modelpar train --nproc 2` (torch's elastic launcher inside), and two torchrun agents
on one machine acting as two nodes (c10d rendezvous), each running the same entry point."""

import json
import os
import socket
import subprocess
import sys

import pytest

from helpers import workers

TINY = ["--model", "gpt-nano", "--steps", "3", "--global-batch-size", "4", "--seq-len", "16",
        "--eval-samples", "8", "--sample-bytes", "20", "--log-every", "1", "--warmup-steps", "1"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env():
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}


def _check_run_record(run, plan_key: str) -> None:
    for f in ("config.json", "plan.json", "data.json", "metrics.jsonl", "model.safetensors", "summary.json"):
        assert (run / f).exists(), f
    steps = [json.loads(l) for l in (run / "metrics.jsonl").read_text().splitlines()]
    assert [s["step"] for s in steps if "loss" in s] == [1, 2, 3]
    assert json.loads((run / "plan.json").read_text())[plan_key] == 2
    assert [s for s in steps if "loss" in s][-1]["peak_tensor_bytes"] > 0
    # on CPU the second step is the one measured: the first says so (null), it logged 0 B before
    assert [s for s in steps if "loss" in s][0]["peak_tensor_bytes"] is None
    data = json.loads((run / "data.json").read_text())
    assert data["num_files"] > 100 and len(data["files_sha256"]) == 64


# TINY as the ranks of `modelpar train` run it (`modelpar.train.runner.train`), for the strategies whose
# rank-side path differs (memory tracking: pipelines run modules more than once per step, DDP with
# accumulation); they ride in the session's first 2-rank scenario launch (`helpers.workers`)
RANK_SIDE = {"pp": dict(strategy="pp"), "ddp": dict(strategy="ddp", local_batch_size=1)}


def _rank_side(work):
    cfg = dict(model="gpt-nano", steps=3, global_batch_size=4, seq_len=16, eval_samples=8, sample_bytes=20,
               log_every=1, warmup_steps=1, track_memory=True, threads=1, out_dir=str(work / "out"))
    return [{"name": k, "kind": "train", "cfg": {**cfg, **kw}, "run_dir": str(work / k)} for k, kw in RANK_SIDE.items()]


workers.ride("launch2", 2, _rank_side, module=__file__)


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_cli_train_nproc2_writes_run_record(tmp_path):
    """The whole `modelpar train --nproc 2` path (a subprocess, torch's elastic launcher inside), memory
    tracking included: FSDP with accumulation reduce-scatters every local batch, whose freed storages
    the tracker must skip."""
    r = subprocess.run([sys.executable, "-m", "modelpar", "train", "--strategy", "fsdp", "--nproc", "2",
                        "--out-dir", str(tmp_path), *TINY, "--local-batch-size", "1"], capture_output=True,
                       text=True, timeout=200, env=_env())
    assert r.returncode == 0, r.stderr[-3000:]
    assert "plan fsdp2" in r.stdout and "validation loss" in r.stdout and "tokens/s" in r.stdout
    _check_run_record(next(tmp_path.iterdir()), "dp_shard")


@pytest.mark.slow
@pytest.mark.timeout(400)
@pytest.mark.parametrize("strategy,plan_key", [("pp", "pp"), ("ddp", "dp_replicate")])
def test_ranks_write_run_record_with_memory_tracking(strategy, plan_key):
    """The same record from the ranks' side for a pipeline (modules run more than once per step:
    StepMemory) and DDP with accumulation; the launch path itself is the test above's."""
    r = workers.rider_results("launch2")[strategy]
    assert not r["errors"], r["errors"]
    res = r["result"]
    assert res["world_size"] == 2 and res["plan"][plan_key] == 2 and res["val_loss_after"] > 0
    _check_run_record(workers.group_dir("launch2") / strategy, plan_key)
    # the peak a run reports is its most loaded rank's, the same on every rank: each reported its own
    # (gpt-nano pp2: 1,317,736 and 1,306,752 bytes; hf:gpt2 with 8,192 tokens pp2: rank 0 said 13.6 MiB,
    # where the last stage, holding the logits, peaks at 41.7 MiB)
    peaks = res["peak_tensor_bytes"]
    assert len(peaks) == 2 and peaks[0] == peaks[1] > 0, peaks
    summary = json.loads((workers.group_dir("launch2") / strategy / "summary.json").read_text())
    assert summary["peak_tensor_bytes"] == peaks[0]


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_two_torchrun_agents_as_two_nodes(tmp_path, capsys):
    """`modelpar train --nnodes 2` resolves once and writes the run folder; two torchrun agents (the
    printed per-node line) join one job of world size 2 whose ranks read it."""
    from modelpar.cli.train import main
    from modelpar.launch import node_cmd

    assert main(["--strategy", "ddp", "--nnodes", "2", "--gpus-per-node", "1", "--out-dir", str(tmp_path),
                 *TINY]) == 0
    assert "--run-dir" in capsys.readouterr().out
    (run,) = list(tmp_path.iterdir())
    port = _free_port()
    cmds = [node_cmd(["-m", "modelpar", "train", "--run-dir", str(run)], nnodes=2, nproc_per_node=1, node_rank=i,
                     endpoint=f"127.0.0.1:{port}", rdzv_id="twonode") for i in range(2)]
    procs = [subprocess.Popen(c, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=_env()) for c in cmds]
    outs = []
    for p in procs:
        try:
            outs.append(p.communicate(timeout=200))
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            pytest.fail("two-node launch hung")
    for p, (out, err) in zip(procs, outs):
        assert p.returncode == 0, err[-3000:]
    joined = outs[0][0] + outs[1][0]
    assert "on 2 rank(s), plan ddp2" in joined          # one job of world size 2 across both agents
    assert joined.count("wall time") == 1               # rank 0 alone reports
    assert (run / "summary.json").exists()              # in the run folder the launcher wrote


def _gone(pid: int) -> bool:
    """The process has exited (no /proc entry, or a zombie nobody reaped yet)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except (FileNotFoundError, ProcessLookupError):
        return True


@pytest.mark.slow
@pytest.mark.timeout(240)
@pytest.mark.parametrize("how", ["SIGTERM", "SIGHUP", "SIGKILL"])
def test_stopping_the_command_stops_its_ranks(tmp_path, how):
    """A command stopped while its ranks run (``timeout``'s SIGTERM, a closed terminal's SIGHUP, or
    SIGKILL, which no handler sees) leaves no rank running: the launch ran torchrun in a session of
    its own, and each rank in another, so before this they ran on, reparented, to the end of training."""
    import signal
    import time

    pidfile = tmp_path / "rank.pid"
    rank = tmp_path / "rank.py"
    rank.write_text("import os, sys, time\nopen(sys.argv[1], 'w').write(str(os.getpid()))\ntime.sleep(200)\n")
    parent = subprocess.Popen([sys.executable, "-c", "import sys; from modelpar.launch import run_command; "
                               f"run_command([{str(rank)!r}, {str(pidfile)!r}], 1)"], env=_env())
    t0 = time.time()
    while not (pidfile.exists() and pidfile.read_text()):
        assert time.time() - t0 < 90 and parent.poll() is None, "the rank did not start"
        time.sleep(0.2)
    pid = int(pidfile.read_text())
    assert not _gone(pid)
    parent.send_signal(getattr(signal, how))
    rc = parent.wait(timeout=60)
    if how != "SIGKILL":           # the handler stopped the launch, then exited as the signal would
        assert rc == 128 + getattr(signal, how), rc
    t0 = time.time()
    while not _gone(pid):
        assert time.time() - t0 < 60, f"rank {pid} still runs {time.time() - t0:.0f} s after {how}"
        time.sleep(0.2)


def test_stop_request_notes_the_signal_only_while_enabled():
    """`StopRequest` (no process group: one rank) turns SIGTERM into a noted request while enabled and
    gives the handler back on close; disabled, it installs nothing."""
    import signal

    from modelpar.train.stop import StopRequest

    before = signal.getsignal(signal.SIGTERM)
    off = StopRequest(False)
    assert signal.getsignal(signal.SIGTERM) is before and off.agreed() == 0
    on = StopRequest(True)
    try:
        assert on.agreed() == 0
        os.kill(os.getpid(), signal.SIGTERM)
        assert on.agreed() == signal.SIGTERM
    finally:
        on.close()
    assert signal.getsignal(signal.SIGTERM) is before


def test_stop_request_agrees_one_step_late_without_reading_a_device_value(monkeypatch):
    """Under a process group `StopRequest.agreed` reads the all-reduce it issued at the previous call
    (a host tensor on CPU; on CUDA a pinned copy behind an event), never the one it just issued: a
    signal noted during step k stops the run after step k + 1, the same step on every rank, and no
    call waits for the collective it issues (fake 2-rank group: the all-reduce returns this rank's
    value)."""
    import signal

    import torch
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from modelpar.train.stop import StopRequest

    issued, waited = [], []
    orig = dist.all_reduce

    def all_reduce(t, *a, **k):
        assert k.get("async_op") is True, "the agreement must not block the step"
        work = orig(t, *a, **k)
        issued.append(int(t[0]))
        n = len(issued)

        class Work:                     # counts which all-reduce is waited for
            def wait(self):
                waited.append(n)
                return work.wait()
        return Work()
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    on = StopRequest(True)
    try:
        monkeypatch.setattr(dist, "all_reduce", all_reduce)
        assert on.agreed() == 0 and issued == [0] and waited == []       # step 1: nothing in flight yet
        os.kill(os.getpid(), signal.SIGTERM)                             # noted during step 2
        assert on.agreed() == 0 and waited == [1]                        # step 2 reads step 1's: no stop
        assert issued == [0, signal.SIGTERM]
        assert on.agreed() == signal.SIGTERM and waited == [1, 2]        # step 3 reads step 2's: stop
        assert issued == [0, signal.SIGTERM]                             # and issues nothing more
    finally:
        on.close()
        dist.destroy_process_group()


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_sigterm_saves_a_checkpoint_and_resume_continues_from_it(tmp_path):
    """A preempted run (SIGTERM to `modelpar train`, passed on by torchrun to the ranks) with
    checkpointing on finishes its step, saves a checkpoint there and exits 128 + 15; ``--resume auto``
    continues from that step. Before, the ranks died where they were: the work since the last
    periodic checkpoint (here: since step 0) was lost."""
    import signal
    import time

    from modelpar.train.checkpoint.storage import list_checkpoints

    out = tmp_path / "out"
    argv = [sys.executable, "-m", "modelpar", "train", *TINY[:2], "--nproc", "2", "--strategy", "ddp",
            "--global-batch-size", "4", "--seq-len", "16", "--eval-samples", "8", "--ckpt-every", "100000",
            "--log-every", "1", "--out-dir", str(out)]
    parent = subprocess.Popen(argv + ["--steps", "100000"], env=_env(), stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True)
    t0 = time.time()
    while True:
        metrics = list(out.glob("*/metrics.jsonl"))
        if metrics and sum(1 for _ in metrics[0].open()) > 4:
            break
        assert time.time() - t0 < 120 and parent.poll() is None, "training did not start"
        time.sleep(0.2)
    parent.send_signal(signal.SIGTERM)
    text, _ = parent.communicate(timeout=90)
    assert parent.returncode == 128 + signal.SIGTERM, text[-2000:]
    steps = [s for s, _ in list_checkpoints(out / "checkpoints")]
    assert len(steps) == 2 and steps[0] == 0 and steps[1] > 0, (steps, text[-2000:])
    assert f"stopped by SIGTERM after step {steps[1]} of 100000: checkpoint saved in" in text
    r = subprocess.run(argv + ["--steps", str(steps[1] + 2), "--resume", "auto"], env=_env(), capture_output=True,
                       text=True, timeout=180)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    assert f"at step {steps[1]} " in r.stdout, r.stdout[-2000:]


def test_max_over_ranks_takes_each_value_s_largest(monkeypatch):
    """`metrics.max_over_ranks` (what train reports as its peaks): one MAX all-reduce of the values, with
    'not measured' (None) as 0 and back; the values as they are on one process."""
    import torch
    import torch.distributed as dist

    from modelpar.train.metrics import max_over_ranks

    assert max_over_ranks([5, None], torch.device("cpu")) == [5, None]          # no process group
    other = torch.tensor([7.0, 0.0, 3.0], dtype=torch.float64)                   # another rank's values
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_world_size", lambda *a: 2)
    monkeypatch.setattr(dist, "all_reduce", lambda t, op=None: t.copy_(torch.maximum(t, other)))
    assert max_over_ranks([5, None, 9], torch.device("cpu")) == [7, None, 9]
