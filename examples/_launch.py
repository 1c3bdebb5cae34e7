"""Shared by the examples: re-run the calling script under torch's launcher when it was started plainly."""

from __future__ import annotations

import os
import sys


def tiny() -> bool:
    """``MODELPAR_TINY=1`` or ``--tiny``: the small sizes the test suite runs on CPU."""
    return os.environ.get("MODELPAR_TINY") == "1" or "--tiny" in sys.argv


def relaunch(script: str, nproc: int) -> bool:
    """Start ``nproc`` local ranks of ``script`` (`modelpar.launch.run_local`) unless already a rank.

    Returns True in the launching process (the ranks have finished), False inside a rank.

    Raises:
        SystemExit: a rank failed (with torchrun's exit code).
    """
    from modelpar.launch import run_local, under_launcher

    if under_launcher():
        return False
    rc = run_local([script, *sys.argv[1:]], nproc)
    if rc != 0:
        raise SystemExit(rc)
    return True
