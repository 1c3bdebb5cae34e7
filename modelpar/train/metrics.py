"""Run records: per-step metrics as JSONL, TensorBoard scalars where installed, memory readings."""

from __future__ import annotations

import json
import os
import resource
from pathlib import Path

import torch


def rss_bytes() -> int:
    """Current resident set size of this process, bytes (Linux /proc; 0 where unavailable)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError):
        return 0


def peak_rss_bytes() -> int:
    """Peak resident set size of this process so far, bytes (ru_maxrss is KiB on Linux)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


class PeakTensorMemory:
    """Peak bytes of live tensors during a region.

    CUDA: ``torch.cuda.max_memory_allocated``. CPU: torch's MemTracker (a private API,
    ``torch.distributed._tools.mem_tracker``; its use is pinned by a test), which counts every tensor
    storage allocated through the dispatcher, parameters, gradients, optimizer state and activations.
    """

    def __init__(self, device: torch.device, enabled: bool = True):
        self.device, self.enabled, self.peak, self._mt = device, enabled, 0, None

    def __enter__(self):
        if not self.enabled:
            return self
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        else:
            from torch.distributed._tools.mem_tracker import MemTracker

            self._mt = MemTracker()
            self._mt.__enter__()
        return self

    def __exit__(self, *exc):
        if not self.enabled:
            return False
        if self.device.type == "cuda":
            self.peak = torch.cuda.max_memory_allocated(self.device)
        else:
            self._mt.__exit__(*exc)
            peaks = self._mt.get_tracker_snapshot("peak")
            self.peak = sum(v.get("Total", 0) for v in peaks.values()) if peaks else 0
        return False


class RunRecord:
    """Writes metrics.jsonl (and TensorBoard scalars) in ``run_dir``; a no-op on non-zero ranks."""

    def __init__(self, run_dir: Path | None):
        self.run_dir = run_dir
        self._f = None
        self._tb = None
        if run_dir is None:
            return
        run_dir.mkdir(parents=True, exist_ok=True)
        self._f = open(run_dir / "metrics.jsonl", "a")
        try:
            from torch.utils.tensorboard import SummaryWriter

            self._tb = SummaryWriter(str(run_dir / "tb"))
        except ImportError:
            self._tb = None

    def write_json(self, name: str, obj) -> None:
        if self.run_dir is not None:
            (self.run_dir / name).write_text(json.dumps(obj, indent=2, sort_keys=True, default=str) + "\n")

    def log(self, step: int, **metrics) -> None:
        if self._f is None:
            return
        self._f.write(json.dumps({"step": step, **metrics}) + "\n")
        self._f.flush()
        if self._tb is not None:
            for k, v in metrics.items():
                if isinstance(v, (int, float)):
                    self._tb.add_scalar(k, v, step)

    def close(self) -> None:
        if self._f is not None:
            self._f.close()
        if self._tb is not None:
            self._tb.close()
