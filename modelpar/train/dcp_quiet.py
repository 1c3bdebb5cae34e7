"""Checkpoint I/O on one process without torch's warning about it."""

from __future__ import annotations

import contextlib
import warnings


@contextlib.contextmanager
def single_process_dcp():
    """Silence the one warning `torch.distributed.checkpoint` gives whenever it saves or loads without
    a process group ("torch.distributed is disabled, unavailable or uninitialized, assuming the intent
    is to load in a single process."): one process is a supported layout here (resume, export), not a
    mistake. Every other warning passes."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")
        yield
