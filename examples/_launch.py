"""Shared by the examples: re-run the calling script under torch's launcher when it was started plainly."""

from __future__ import annotations

import os
import sys


def tiny() -> bool:
    """``MODELPAR_TINY=1`` or ``--tiny``: the small sizes the test suite runs on CPU."""
    return os.environ.get("MODELPAR_TINY") == "1" or "--tiny" in sys.argv


def relaunch(script: str, nproc: int) -> bool:
    """Start ``nproc`` local ranks of ``script`` through torch.distributed.run unless already a rank.

    Returns True in the launching process (the ranks have finished), False inside a rank.
    """
    if "RANK" in os.environ:
        return False
    from torch.distributed.run import main

    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main(["--standalone", f"--nproc-per-node={nproc}", "--max-restarts=0", script, *sys.argv[1:]])
    return True
