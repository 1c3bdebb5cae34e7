"""The one place that knows torchrun (`torch.distributed.run`): every command, benchmark, example and
test that starts ranks goes through here.

- `under_launcher()`: is this process a rank started by torchrun (or srun with torchrun's variables)?
- `torchrun_cmd(nproc, target)`: the argv of a standalone launch of ``target`` on ``nproc`` local ranks.
- `multinode_commands(target, ...)`: the torchrun and srun lines to run ``target`` on many nodes
  (printed for the user; nothing is started).
- `run_local(target, nproc)`: run ``target`` on ``nproc`` local ranks with this terminal's output;
  returns the exit code.
- `run_command(target, nproc)`: the same for a modelpar command whose ranks report their own verdict
  (`modelpar.rank_outcome`): torchrun's own failure report is silenced and the ranks' outcome is
  returned as a `LaunchOutcome`.
- `run_workers(target, nproc, result_path)`: run ranks with a hard timeout, output to a log or
  captured, and read the JSON result the workers wrote; never raises for a failed or hung launch.
- `exit_rank(code)`: end a launched rank after its work (barrier, flush, no gloo teardown).

``target`` is what torchrun runs: ``["-m", "modelpar", "train", ...]`` or ``[script.py, args...]``.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

LAUNCHER_VARS = ("TORCHELASTIC_RUN_ID",)


def under_launcher() -> bool:
    """True in a rank started by torchrun (``TORCHELASTIC_RUN_ID``) or by anything that sets both
    ``RANK`` and ``WORLD_SIZE`` (srun with torchrun's variables, a manual ``env://`` launch)."""
    return "TORCHELASTIC_RUN_ID" in os.environ or ("RANK" in os.environ and "WORLD_SIZE" in os.environ)


def worker_env(threads: int = 1, extra: dict | None = None) -> dict[str, str]:
    """This process's environment for launched ranks: ``OMP_NUM_THREADS=threads`` (torchrun's own
    default of 1 made explicit), warnings off, plus ``extra``."""
    return {**os.environ, "OMP_NUM_THREADS": str(threads), "PYTHONWARNINGS": "ignore",
            **{k: str(v) for k, v in (extra or {}).items()}}


def torchrun_cmd(nproc: int, target: list[str], *, max_restarts: int = 0, python: str | None = None) -> list[str]:
    """``python -m torch.distributed.run --standalone --nproc-per-node N --max-restarts R TARGET...``.

    Raises:
        ValueError: ``nproc`` < 1 or an empty target.
    """
    if nproc < 1:
        raise ValueError(f"--nproc must be >= 1, got {nproc}")
    if not target:
        raise ValueError("nothing to launch: empty target")
    return [python or sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
            f"--max-restarts={max_restarts}", *target]


def node_cmd(target: list[str], *, nnodes: int, nproc_per_node: int, node_rank: int | None = None,
             endpoint: str = "$HEAD_NODE:29500", rdzv_id: str = "$JOB_ID", max_restarts: int = 0,
             python: str | None = None) -> list[str]:
    """The torchrun argv one node runs to join an ``nnodes`` x ``nproc_per_node`` job (c10d
    rendezvous at ``endpoint``); ``node_rank`` None lets the rendezvous assign it."""
    rank = [f"--node-rank={node_rank}"] if node_rank is not None else []
    return [python or sys.executable, "-m", "torch.distributed.run", f"--nnodes={nnodes}",
            f"--nproc-per-node={nproc_per_node}", *rank, "--rdzv-backend=c10d", f"--rdzv-endpoint={endpoint}",
            f"--rdzv-id={rdzv_id}", f"--max-restarts={max_restarts}", *target]


def multinode_commands(target: list[str], *, nnodes: int, nproc_per_node: int, port: int = 29500) -> str:
    """Text with the torchrun line to run on every node and the equivalent srun line (c10d rendezvous
    on the first node). ``target`` as for `torchrun_cmd`."""
    tail = " ".join(_quote(a) for a in target)
    tr = (f"torchrun --nnodes {nnodes} --nproc-per-node {nproc_per_node} --rdzv-backend c10d "
          f"--rdzv-endpoint $HEAD_NODE:{port} --rdzv-id $JOB_ID --max-restarts 0 {tail}")
    srun = (f"srun --nodes {nnodes} --ntasks-per-node 1 bash -c 'torchrun --nnodes {nnodes} "
            f"--nproc-per-node {nproc_per_node} --rdzv-backend c10d --rdzv-endpoint "
            f"$(scontrol show hostnames $SLURM_JOB_NODELIST | head -n1):{port} --rdzv-id $SLURM_JOB_ID {tail}'")
    return (f"on each of the {nnodes} nodes (HEAD_NODE = the first node's address):\n  {tr}\n"
            f"or under Slurm:\n  {srun}")


def _quote(a: str) -> str:
    import shlex
    return shlex.quote(a)


class _Stopped(BaseException):
    """A stop signal (SIGTERM, SIGHUP) arrived while this process waited on a launch."""

    def __init__(self, signum: int):
        super().__init__(f"stopped by signal {signal.Signals(signum).name}")
        self.signum = signum


@contextmanager
def _stop_on_signals():
    """While a launch runs: SIGTERM (``timeout``, ``kill``, Slurm's ``scancel``) and SIGHUP (a closed
    terminal) raise `_Stopped` here, so the waiting code stops the launch's process group before this
    process exits (their default action ends it at once: torchrun and its ranks, in a session of
    their own, then ran on). Outside the main thread (where Python delivers signals) nothing changes."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def stop(signum, _frame):
        for sig in old:             # a second signal must not cut the stopping of the launch short
            signal.signal(sig, signal.SIG_IGN)
        raise _Stopped(signum)

    old = {sig: signal.signal(sig, stop) for sig in (signal.SIGTERM, signal.SIGHUP)}
    try:
        yield
    finally:
        for sig, handler in old.items():
            signal.signal(sig, handler)


def _exit_code(e: BaseException) -> None:
    """Re-raise a `_Stopped` as the exit a shell reports for that signal (128 + its number)."""
    if isinstance(e, _Stopped):
        print(f"modelpar: {e}; the launch's processes were stopped", file=sys.stderr, flush=True)
        raise SystemExit(128 + e.signum) from None


def run_local(target: list[str], nproc: int, *, threads: int = 1, env: dict | None = None,
              max_restarts: int = 0) -> int:
    """Run ``target`` on ``nproc`` local ranks, output to this terminal; returns torchrun's exit code
    (0 when every rank exited 0). Ctrl-C, SIGTERM or SIGHUP stops the launch's whole process group,
    then re-raises (the signals as ``SystemExit(128 + signal number)``)."""
    with _stop_on_signals():
        proc = subprocess.Popen(torchrun_cmd(nproc, target, max_restarts=max_restarts),
                                env=worker_env(threads, env), start_new_session=True)
        try:
            return proc.wait()
        except BaseException as e:
            _kill_group(proc)
            _exit_code(e)
            raise


def run_command(target: list[str], nproc: int, *, threads: int = 1, env: dict | None = None):
    """Run a modelpar command's ranks (``target``, ending in `rank_outcome.run_rank_and_exit`) on
    ``nproc`` local ranks with this terminal's output, and return their `rank_outcome.LaunchOutcome`.

    torchrun runs in a child process (`_quiet_torchrun`) whose own logging and ``ChildFailedError``
    report are silenced: the ranks' first error line, written into ``$MODELPAR_OUTCOME_DIR``, is what
    the command reports. Ctrl-C, SIGTERM or SIGHUP stops the launch's whole process group, then
    re-raises (as `run_local`); should this process die without that (SIGKILL), the launcher child
    notices it lost its parent and stops its ranks (`_main`)."""
    import tempfile

    from modelpar.rank_outcome import OUTCOME_ENV, LaunchOutcome

    with tempfile.TemporaryDirectory(prefix="modelpar-outcome-") as d, _stop_on_signals():
        cmd = [sys.executable, "-m", "modelpar.launch", str(os.getpid()), *torchrun_cmd(nproc, target)[3:]]
        proc = subprocess.Popen(cmd, env=worker_env(threads, {**(env or {}), OUTCOME_ENV: d}), start_new_session=True)
        try:
            rc = proc.wait()
        except BaseException as e:
            _kill_group(proc)
            _exit_code(e)
            raise
        code_file = Path(d, "code")
        code = int(code_file.read_text()) if code_file.exists() else None
        errors = {int(p.stem[4:]): json.loads(p.read_text()) for p in Path(d).glob("rank*.err")}
    return LaunchOutcome(code, errors, None if rc == 0 else f"torchrun exit code {rc}")


def _quiet_torchrun(argv: list[str]) -> int:
    """``torch.distributed.run.main(argv)`` with torch.distributed's logging at CRITICAL; a failed child
    gives exit code 1 without torchrun's report (the ranks reported their own errors)."""
    import logging

    from torch.distributed.run import main as torchrun

    for name in [n for n in list(logging.root.manager.loggerDict) if n.startswith("torch.distributed")] + [
            "torch.distributed.elastic"]:
        logging.getLogger(name).setLevel(logging.CRITICAL)
    try:
        torchrun(argv)
    except Exception:  # noqa: BLE001 - ChildFailedError: the outcome files say what happened
        return 1
    return 0


@dataclass
class WorkerRun:
    """What `run_workers` saw. ``result``: the JSON the workers wrote (None if none); ``returncode``
    None when the launch was killed at its timeout; ``output``: captured stdout + stderr (or the
    log file's text), last 20,000 characters."""

    returncode: int | None
    result: dict | list | None
    output: str
    wall_s: float

    @property
    def timed_out(self) -> bool:
        return self.returncode is None

    def reason(self) -> str:
        """One line saying why there is no result (timeout, the last error line, or the exit code)."""
        if self.timed_out:
            return f"timed out after {self.wall_s:.0f} s"
        lines = [l for l in self.output.strip().splitlines() if l.strip()]
        errs = [l for l in lines if "Error" in l or "error:" in l]
        return (errs[-1] if errs else (lines[-1] if lines else f"exit code {self.returncode}")).strip()[:300]


def run_workers(target: list[str], nproc: int, result_path: str | os.PathLike | None, *, timeout_s: float,
                threads: int = 1, env: dict | None = None, cwd: str | os.PathLike | None = None,
                log_path: str | os.PathLike | None = None, max_restarts: int = 0) -> WorkerRun:
    """Run ``target`` on ``nproc`` local ranks with a hard ``timeout_s`` (the launch's whole process
    group is killed at it) and read the JSON the workers wrote to ``result_path``.

    Output goes to ``log_path`` when given, else it is captured. A result file counts once written,
    even if a rank then failed while shutting down; the file is removed before the launch so a stale
    one is never read. Never raises for a failed or hung launch: see `WorkerRun`.
    """
    if result_path is not None:
        Path(result_path).unlink(missing_ok=True)
    cmd = torchrun_cmd(nproc, target, max_restarts=max_restarts)
    t0 = time.time()
    log = open(log_path, "w") if log_path else None
    try:
        with _stop_on_signals():
            proc = subprocess.Popen(cmd, stdout=log or subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                    env=worker_env(threads, env), cwd=cwd, start_new_session=True)
            try:
                out, _ = proc.communicate(timeout=timeout_s)
                rc = proc.returncode
            except subprocess.TimeoutExpired:
                _kill_group(proc)
                out, _ = proc.communicate()
                rc = None
            except BaseException as e:      # Ctrl-C, SIGTERM, SIGHUP: stop this launch's processes, then re-raise
                _kill_group(proc)
                _exit_code(e)
                raise
    finally:
        if log is not None:
            log.close()
    if log_path:
        out = Path(log_path).read_text(errors="replace")
    res = None
    if result_path is not None and Path(result_path).exists():
        res = json.loads(Path(result_path).read_text())
    return WorkerRun(rc, res, (out or "")[-20000:], time.time() - t0)


def _kill_group(proc: subprocess.Popen | None) -> None:
    """SIGTERM to the launch's process group (torchrun stops its ranks, each in a session of its own:
    SIGTERM, then SIGKILL after its 30 s), SIGKILL to the group if it is not gone after 35 s."""
    if proc is None:
        return
    try:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=35)
    except (ProcessLookupError, subprocess.TimeoutExpired):
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def write_json_atomic(path: str | os.PathLike, obj) -> None:
    """Write ``obj`` as JSON to a temporary file and rename it over ``path``: a reader sees the whole
    file or none (a worker's result file)."""
    tmp = Path(path).with_suffix(Path(path).suffix + ".tmp")
    tmp.write_text(json.dumps(obj))
    tmp.replace(path)


def exit_rank(code: int = 0):
    """End a launched rank after its work is done: wait for every rank, flush, and leave without
    interpreter teardown.

    Destroying gloo process groups (or letting interpreter exit destroy them) occasionally aborted a
    rank with "terminate called without an active exception" after all results were written (seen
    about once in ten launches under load, with and without pipelines). Once every rank has passed
    the final barrier nothing is in flight, so ``os._exit`` is safe and skips that teardown. Entry
    points of launched ranks call this; library code never does.
    """
    try:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            dist.barrier()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def _watch_parent(parent: int, period_s: float = 1.0) -> None:
    """Send this process SIGTERM once ``parent`` is no longer its parent (it died, even by SIGKILL,
    and this process was re-parented): torchrun's handler then stops its ranks. Runs in a daemon thread."""
    while os.getppid() == parent:
        time.sleep(period_s)
    os.kill(os.getpid(), signal.SIGTERM)


def _main(argv: list[str]) -> int:
    """``python -m modelpar.launch PARENT_PID TORCHRUN_ARGS...`` (`run_command`): torchrun, quiet, in
    this process, stopped when the process ``PARENT_PID`` is gone."""
    threading.Thread(target=_watch_parent, args=(int(argv[0]),), daemon=True).start()
    return _quiet_torchrun(argv[1:])


if __name__ == "__main__":        # `python -m modelpar.launch PARENT_PID TORCHRUN_ARGS...`: see `run_command`
    sys.exit(_main(sys.argv[1:]))
