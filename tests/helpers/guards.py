"""The pure tier's guard: a test not marked ``slow`` starts no process (tests/conftest.py applies it)."""

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
