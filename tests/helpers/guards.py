"""The suite's guards (tests/conftest.py applies them around every test): a test not marked ``slow``
starts no process; no test leaves a thread running (`leaked_threads`) or a process group initialised
(`left_process_group`; no test shares one in this process: the suite's shared launches run their
process groups in their own rank processes)."""

from __future__ import annotations

import contextlib
import os


class ProcessInPureTest(AssertionError):
    """Raised where a guarded test tries to start a process."""


def process_starters() -> list[tuple[object, str]]:
    """(owner, attribute) of every way Python code starts a process: subprocess (and asyncio's,
    which uses it), multiprocessing (every start method goes through `BaseProcess.start`), fork,
    posix_spawn, os.system and the exec family."""
    import multiprocessing.process
    import subprocess

    names = ("fork", "forkpty", "posix_spawn", "posix_spawnp", "system", "execv", "execve", "execvp", "execvpe")
    return ([(subprocess.Popen, "_execute_child"), (multiprocessing.process.BaseProcess, "start")]
            + [(os, n) for n in names if hasattr(os, n)])


@contextlib.contextmanager
def refuse_processes(who: str):
    """Inside the block every `process_starters` entry raises `ProcessInPureTest` naming ``who``;
    yields the list of the attempts (``"Popen._execute_child"``, ...), so a caller can tell an
    attempt the code swallowed. The originals are back on exit."""
    started: list[str] = []
    saved = []

    def refuse_for(owner, attr):
        what = f"{getattr(owner, '__name__', owner)}.{attr}"

        def refuse(*args, **kw):
            started.append(what)
            raise ProcessInPureTest(f"{who} starts a process ({what}) but is not marked @pytest.mark.slow")
        return refuse

    for owner, attr in process_starters():
        saved.append((owner, attr, getattr(owner, attr)))
        setattr(owner, attr, refuse_for(owner, attr))
    try:
        yield started
    finally:
        for owner, attr, orig in saved:
            setattr(owner, attr, orig)


# threads that libraries keep for the whole process by design (tqdm's monitor is started once and
# reused by every later bar; threads started outside Python, such as torch's per-device autograd and
# compile threads, show as `_DummyThread` once they run Python code and live as long as the process:
# seen on an H100 after a torch.compile test); anything else a test starts must be gone when it ends
SHARED_THREADS = ("TMonitor", "tqdm_monitor", "_DummyThread")


def leaked_threads(before: set[int], grace_s: float = 2.0) -> list[str]:
    """``name (class, daemon=...)`` of every live thread not in ``before`` (thread idents) and not a
    library's process-wide thread (`SHARED_THREADS`), after waiting up to ``grace_s`` seconds for them
    to end; [] when none is left."""
    import threading
    import time

    deadline = time.monotonic() + grace_s
    while True:
        new = [t for t in threading.enumerate() if t.ident not in before and t.is_alive()
               and not any(s in (t.name + type(t).__name__) for s in SHARED_THREADS)]
        if not new or time.monotonic() > deadline:
            return [f"{t.name} ({type(t).__name__}, daemon={t.daemon})" for t in new]
        time.sleep(0.05)


def left_process_group() -> bool:
    """True when torch.distributed's default process group is initialised (a test left it behind);
    it is destroyed then, so the next test starts without one. False when there is none."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return False
    dist.destroy_process_group()
    return True
