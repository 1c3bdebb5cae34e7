"""No hangs: a heartbeat through the launcher's store, so a dead or stalled rank is named.

Collectives carry a timeout (``TrainConfig.timeout_s``, 60 s by default, passed to the process
group). When a collective fails, gloo's message ("Connection closed by peer", "Timed out waiting
... for recv") names neither the rank at fault nor the step. So every rank publishes a heartbeat in
torchrun's store (the agent's TCPStore, which outlives the ranks) under a key of this restart
attempt: ``"<step> <seconds since the step began> <counter>"``, the counter advanced by a daemon
thread every ``interval_s``. When a collective raises on a surviving rank, `guard` reads every
rank's heartbeat twice, ``3 x interval_s`` apart, and re-raises one `RankFailureError` naming:

- a rank whose counter did not advance: its process is gone (``stopped at step s``);
- else a rank behind the others' step, or making no progress in its step: it stalled.

Because the read happens only after a failure, a healthy run costs one store write per rank per
interval. Test-only fault injection (attempt 0 only, so an elastic restart runs clean):
``MODELPAR_TEST_KILL_AT_STEP=s`` SIGKILLs, ``MODELPAR_TEST_STALL_AT_STEP=s`` stalls (sleeps) rank
``MODELPAR_TEST_FAULT_RANK`` (default 1) at the start of step s.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time
from datetime import timedelta

import torch.distributed as dist


class RankFailureError(RuntimeError):
    """A rank died or stalled; the message names the rank and the step."""


def _attempt() -> int:
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))


def inject_test_fault(step: int, rank: int) -> None:
    """The test-only hooks described in the module docstring (no-op unless the env vars are set)."""
    if _attempt() != 0 or rank != int(os.environ.get("MODELPAR_TEST_FAULT_RANK", "1")):
        return
    if os.environ.get("MODELPAR_TEST_KILL_AT_STEP") == str(step):
        print(f"[test fault] rank {rank}: SIGKILL at step {step}", flush=True)
        os.kill(os.getpid(), signal.SIGKILL)
    if os.environ.get("MODELPAR_TEST_STALL_AT_STEP") == str(step):
        print(f"[test fault] rank {rank}: stalling at step {step}", flush=True)
        time.sleep(3600)


class Heartbeat:
    """Publishes this rank's heartbeat; diagnoses the others after a failure.

    Args:
        store: a c10d Store shared by all ranks (prefixed per attempt by the caller).
        interval_s: seconds between heartbeats.
    """

    def __init__(self, store, rank: int, world_size: int, *, interval_s: float = 1.0):
        self.store, self.rank, self.world = store, rank, world_size
        self.interval_s = interval_s
        self.step = -1
        self._step_t = time.monotonic()
        self._count = 0
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._publish()
        self._thread = threading.Thread(target=self._run, name="modelpar-heartbeat", daemon=True)
        self._thread.start()

    def _publish(self) -> None:
        with self._lock:
            self._count += 1
            value = f"{self.step} {time.monotonic() - self._step_t:.1f} {self._count}"
            self.store.set(f"hb/{self.rank}", value)

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                self._publish()
            except Exception:      # the store is gone: the job is ending
                return

    def beat(self, step: int) -> None:
        """Mark the start of ``step`` (main thread); runs the test-only fault hooks first."""
        inject_test_fault(step, self.rank)
        self.step, self._step_t = step, time.monotonic()

    def read(self) -> dict[int, tuple[int, float, int] | None]:
        """rank -> (step, seconds in that step, counter), None where no heartbeat was ever written.

        Two store requests where every rank has written one (``check`` of all keys, ``multi_get``):
        after a failure every surviving rank reads all ranks' heartbeats, so one request per key would
        put 2 x world^2 requests on the launcher's store (3,072 ranks: ~19M, against the store the
        elastic agent needs to restart the job); one per key only where some heartbeat is missing."""
        keys = [f"hb/{r}" for r in range(self.world)]
        if self.store.check(keys):
            values = self.store.multi_get(keys)
        else:                   # some rank never wrote one (it died first): only those are None
            values = [self.store.get(k) if self.store.check([k]) else None for k in keys]
        out = {}
        for r, v in enumerate(values):
            if v is None:
                out[r] = None
                continue
            s, age, c = v.decode().split()
            out[r] = (int(s), float(age), int(c))
        return out

    def diagnose(self) -> str | None:
        """Which rank is at fault, from two reads ``3 x interval_s`` apart; None if none stands out."""
        first = self.read()
        time.sleep(3 * self.interval_s + 0.2)
        second = self.read()
        dead = [r for r in range(self.world) if r != self.rank
                and (second[r] is None or (first[r] is not None and second[r][2] == first[r][2]))]
        if dead:
            return "; ".join(f"rank {r} stopped (its process is gone: no heartbeat for "
                             f"{3 * self.interval_s:.0f}+ s) at step {second[r][0] if second[r] else '?'}"
                             for r in dead)
        steps = {r: v[0] for r, v in second.items() if v is not None}
        top = max(steps.values())
        behind = [r for r, s in steps.items() if s < top]
        if behind:
            return "; ".join(f"rank {r} stalled at step {steps[r]} (no progress for {second[r][1]:.0f} s; it "
                             f"never began step {steps[r] + 1}) while the others reached step {top}" for r in behind)
        slow = max(second, key=lambda r: second[r][1])
        return (f"no rank made progress in step {top} for {second[slow][1]:.0f} s; the longest in its step is "
                f"rank {slow}")

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=2 * self.interval_s)


_ACTIVE: Heartbeat | None = None


def start_heartbeat(rank: int, world_size: int, *, interval_s: float = 1.0,
                    timeout_s: float = 60.0) -> Heartbeat | None:
    """Start this rank's heartbeat on torchrun's agent store (None without torchrun or on one rank)."""
    global _ACTIVE
    if world_size < 2 or "MASTER_PORT" not in os.environ or \
            os.environ.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() != "true":
        return None
    base = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                         timeout=timedelta(seconds=timeout_s))
    _ACTIVE = Heartbeat(dist.PrefixStore(f"modelpar/attempt{_attempt()}/", base), rank, world_size,
                        interval_s=interval_s)
    return _ACTIVE


def stop_heartbeat() -> None:
    global _ACTIVE
    if _ACTIVE is not None:
        _ACTIVE.close()
        _ACTIVE = None


_COMM_WORDS = ("gloo", "nccl", "connection", "connect", "socket", "peer", "timed out", "timeout", "broken pipe",
               "store", "process group", "collective")


def _looks_like_comm_failure(e: BaseException) -> bool:
    """Whether ``e`` came from a collective or the launcher's store, not from local computation (a
    local bug that every rank hits must be reported as itself, not as a stalled peer)."""
    if isinstance(e, dist.DistError):
        return True
    text = f"{type(e).__name__}: {e}".lower()
    return any(w in text for w in _COMM_WORDS)


@contextlib.contextmanager
def guard():
    """Turn a failed collective into one `RankFailureError` naming the rank and step at fault."""
    try:
        yield
    except (RuntimeError, dist.DistError) as e:
        hb = _ACTIVE
        if hb is None or isinstance(e, RankFailureError) or not _looks_like_comm_failure(e):
            raise           # a local error (same on every rank, or this rank's own): keep it as it is
        try:
            found = hb.diagnose()
        except Exception:          # the store itself is gone: keep the original error
            found = None
        stop_heartbeat()
        if found is None:
            raise
        msg = f"rank {hb.rank} (at step {hb.step}): a collective failed because {found}"
        print(f"modelpar: error: {msg}", flush=True)
        raise RankFailureError(msg) from e
    finally:
        stop_heartbeat()
