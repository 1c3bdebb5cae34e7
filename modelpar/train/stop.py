"""Stopping a run on request without losing its work: a scheduler's preemption or time limit sends
SIGTERM (Slurm's ``scancel`` and end of time, Kubernetes' pod eviction, ``timeout``; torchrun passes
the one it gets on to every rank) or SIGUSR1 ahead of the limit (sbatch's signal option).

With checkpointing on (``--ckpt-every``), `StopRequest` notes the signal instead of dying, the ranks
agree on it after each step (one all-reduce of one integer), and the loop saves a checkpoint at that
step and leaves (`RunStopped`); ``--resume auto`` continues from it. Without checkpointing the signals
keep their default action (the process ends): there is nowhere to save to.
"""

from __future__ import annotations

import signal
import threading

import torch
import torch.distributed as dist

STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)


class RunStopped(Exception):
    """The ranks stopped after ``step`` of ``steps`` steps on ``signum`` and saved a checkpoint in ``ckpt_dir``."""

    def __init__(self, signum: int, step: int, steps: int, ckpt_dir: str):
        super().__init__(f"stopped by {signal.Signals(signum).name} after step {step} of {steps}: checkpoint "
                         f"saved in {ckpt_dir}; continue with --resume auto")
        self.signum, self.step, self.ckpt_dir = signum, step, ckpt_dir


class StopRequest:
    """Notes SIGTERM / SIGUSR1 while enabled (installed in the main thread only, where Python runs
    handlers; elsewhere it stays off); `agreed` tells every rank whether any rank got one.

    ``device``: where the all-reduce's tensor lives (the rank's device: CUDA under NCCL)."""

    def __init__(self, enabled: bool, device: torch.device | str = "cpu"):
        self.enabled = enabled and threading.current_thread() is threading.main_thread()
        self.device = torch.device(device)
        self.signum = 0
        self._old: dict = {}
        if self.enabled:
            self._old = {s: signal.signal(s, self._note) for s in STOP_SIGNALS}

    def _note(self, signum, _frame) -> None:
        self.signum = signum

    def agreed(self) -> int:
        """Collective when enabled: the largest signal number any rank has noted (0: none), the same
        on every rank; 0 at once when disabled."""
        if not self.enabled:
            return 0
        if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
            return self.signum
        t = torch.tensor([self.signum], dtype=torch.int64, device=self.device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return int(t.item())

    def close(self) -> None:
        """Give the signals their previous handlers back."""
        for s, h in self._old.items():
            signal.signal(s, h)
        self._old = {}
