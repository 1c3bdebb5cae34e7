"""Stopping a run on request without losing its work: a scheduler's preemption or time limit sends
SIGTERM (Slurm's ``scancel`` and end of time, Kubernetes' pod eviction, ``timeout``; torchrun passes
the one it gets on to every rank) or SIGUSR1 ahead of the limit (sbatch's signal option).

With checkpointing on (``--ckpt-every``), `StopRequest` notes the signal instead of dying, the ranks
agree on it (one all-reduce of one integer per step), and the loop saves a checkpoint and leaves
(`RunStopped`); ``--resume auto`` continues from it. Without checkpointing the signals keep their
default action (the process ends): there is nowhere to save to.

The agreement runs one step behind: the all-reduce of what the ranks noted by the end of step k is
issued then and read at the end of step k + 1, so a signal during step k stops the run after step
k + 1. Read at once, its value would make the host wait for the GPU at every step (a CUDA tensor's
``.item()`` drains the stream): the next step's kernels would then be queued only after the last
one ends, an idle gap per step. Read a step later, the host waits only for step k's work (a CUDA event
recorded after the copy of the result), which the GPU has finished or nearly by then.
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
    handlers; elsewhere it stays off); `agreed` tells every rank whether any rank got one, a step late
    under a process group (see the module's docstring).

    ``device``: where the all-reduce's tensor lives (the rank's device: CUDA under NCCL)."""

    def __init__(self, enabled: bool, device: torch.device | str = "cpu"):
        self.enabled = enabled and threading.current_thread() is threading.main_thread()
        self.device = torch.device(device)
        self.signum = 0
        self._pending: tuple | None = None      # (work, result tensor, CUDA event or None) in flight
        self._host: torch.Tensor | None = None  # CUDA: the pinned host copy of the result (read before reuse)
        self._old: dict = {}
        if self.enabled:
            self._old = {s: signal.signal(s, self._note) for s in STOP_SIGNALS}

    def _note(self, signum, _frame) -> None:
        self.signum = signum

    def agreed(self) -> int:
        """Collective when enabled: the largest signal number any rank had noted when the previous call
        issued its all-reduce (0: none, or no previous call), the same on every rank; then, unless that
        is a stop, the all-reduce of this rank's note now, read by the next call. Without a process
        group (one rank) the note at once; 0 at once when disabled."""
        if not self.enabled:
            return 0
        if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
            return self.signum
        got = self._read()
        if got:
            return got
        # a fill kernel, not a copy from the host: ``torch.tensor([...], device=cuda)`` copies from
        # pageable memory, which synchronises the stream
        t = torch.full((1,), self.signum, dtype=torch.int64, device=self.device)
        work = dist.all_reduce(t, op=dist.ReduceOp.MAX, async_op=True)
        if self.device.type == "cuda":
            work.wait()             # the current stream waits for the all-reduce; the host does not
            if self._host is None:  # pinned: the copy back is asynchronous
                self._host = torch.empty(1, dtype=torch.int64, pin_memory=True)
            host = self._host
            host.copy_(t, non_blocking=True)
            done = torch.cuda.Event()
            done.record()
            self._pending = (work, host, done)
        else:
            self._pending = (work, t, None)
        return 0

    def _read(self) -> int:
        """The result of the all-reduce in flight (0 if none), waiting for it (on CUDA: for its event)."""
        if self._pending is None:
            return 0
        work, t, done = self._pending
        self._pending = None
        if done is not None:
            done.synchronize()
        else:
            work.wait()
        return int(t.item())            # a host tensor: no device synchronisation

    def close(self) -> None:
        """Give the signals their previous handlers back. An all-reduce still in flight is not waited
        for: every rank issued it, and the collectives after it in the group complete after it."""
        self._pending = None
        for s, h in self._old.items():
            signal.signal(s, h)
        self._old = {}
