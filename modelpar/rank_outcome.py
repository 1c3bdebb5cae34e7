"""How a launched command's ranks end, and how the launching process reports it.

A command that launches its own ranks through torch's elastic launcher (``modelpar verify``) wants
its own verdict, not the launcher's: a parity FAIL is a result (exit 1 with the report), not a
crashed child ("failed (exitcode: 1)", ``ChildFailedError``), and a rank that really crashed should
be named with its first error line.

- In a launched rank, `run_rank_and_exit` runs the rank's work. On success rank 0 writes the exit
  code into ``$MODELPAR_OUTCOME_DIR`` and every rank leaves with 0 through `exit_rank` (a final
  barrier every rank reaches). On an exception the rank writes ``rank<r>.err`` (its first error
  line, and a ValueError's whole message), prints the error (a ValueError, which the checks raise the
  same on every rank, only where no outcome folder takes it: the launching process prints each
  distinct message once; the traceback of any other error, with its rank) and leaves at once with ``os._exit``: no barrier (the other ranks
  may never reach one) and no interpreter teardown, which is where "terminate called without an
  active exception" came from (gloo's process group and c10d's threads destroyed while a thread
  still runs, in Python's finalisation after an uncaught error).
- The launching process starts the ranks with `modelpar.launch.run_command`, which silences
  torchrun's own report and reads the outcome back from the files (`LaunchOutcome`).
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

OUTCOME_ENV = "MODELPAR_OUTCOME_DIR"


def first_error_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0] if text else ''}".strip()


def leave_after_error(e: BaseException, prog: str) -> None:
    """Report ``e`` for this rank and end the process now (exit code 2 for a ValueError, else 1).

    Writes ``rank<r>.err`` into ``$MODELPAR_OUTCOME_DIR`` when set; stops the heartbeat thread; no
    barrier, no teardown (module docstring)."""
    import torch.distributed as dist

    rank = dist.get_rank() if dist.is_initialized() else int(os.environ.get("RANK", "0"))
    out = os.environ.get(OUTCOME_ENV)
    recorded = False
    if out:
        with contextlib.suppress(OSError):
            Path(out, f"rank{rank}.err").write_text(json.dumps(
                {"kind": "value" if isinstance(e, ValueError) else "crash", "line": first_error_line(e),
                 "message": str(e), "t": time.time()}))
            recorded = True
    if isinstance(e, ValueError):
        if not recorded:      # else the launching process prints it, once for all ranks that raised it
            print(f"{prog}: error: {e}", file=sys.stderr)
    else:
        print(f"[rank {rank}] {prog}: " + "".join(traceback.format_exception(e)), file=sys.stderr)
    try:
        from modelpar.train.health import stop_heartbeat

        stop_heartbeat()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(2 if isinstance(e, ValueError) else 1)


def run_rank_and_exit(fn: Callable[[], int], prog: str) -> None:
    """Run a launched rank's work ``fn`` (returns the command's exit code, the same on every rank)
    and end the process (module docstring). Never returns."""
    import warnings

    from modelpar.launch import exit_rank
    from modelpar.parallel.layer_checks import ParallelLayoutWarning

    # the launcher starts ranks with PYTHONWARNINGS=ignore (torch's notices); modelpar's own warnings
    # about the layout (BatchNorm statistics per rank, case C15) must still reach the user
    warnings.filterwarnings("default", category=ParallelLayoutWarning)
    try:
        code = fn()
    except Exception as e:  # noqa: BLE001 - every error ends this rank, reported
        leave_after_error(e, prog)
    out = os.environ.get(OUTCOME_ENV)
    rank = int(os.environ.get("RANK", "0"))
    if out:
        if rank == 0:
            Path(out, "code").write_text(str(code))
        code = 0                 # the verdict travels in the file: the launcher sees a clean exit
    exit_rank(code)


@dataclass
class LaunchOutcome:
    code: int | None                         # rank 0's exit code, None when it did not finish
    errors: dict[int, dict] = field(default_factory=dict)  # rank -> {"kind": value|crash, "line", "t"}
    launcher_error: str | None = None

    def report(self, prog: str) -> tuple[int, str | None]:
        """``(exit code, message or None)`` for the launching process."""
        if self.code is not None and not self.errors and self.launcher_error is None:
            return self.code, None
        events = sorted((e["t"], r, e) for r, e in self.errors.items())
        if events:            # the first to fail is the cause; the others' errors usually follow from it
            _, r0, first = events[0]
            values = sorted(r for r, e in self.errors.items() if e["kind"] == "value")
            if first["kind"] == "value":
                code, lines = 2, self._value_messages(prog, events)
                lines.append(f"{prog}: stopped by the error above (raised on rank(s) {values})")
            else:
                code, lines = 1, [f"{prog}: rank {r0} crashed: {first['line']}"]
            lines += [f"{prog}: then rank {r} failed: {e['line']}" for _, r, e in events[1:] if e["kind"] == "crash"]
            return code, "\n".join(lines)
        return 1, f"{prog}: a rank ended without a result ({self.launcher_error or 'no error was recorded'})"

    @staticmethod
    def _value_messages(prog: str, events: list) -> list[str]:
        """The ValueErrors' messages, each distinct one once in the order raised, with the ranks that
        raised it when not every failing rank did (a rank-divergent error)."""
        by_msg: dict[str, list[int]] = {}
        for _, r, e in events:
            if e["kind"] == "value" and "message" in e:
                by_msg.setdefault(e["message"], []).append(r)
        many = len(by_msg) > 1
        return [f"{prog}: error: {m}" + (f" (rank(s) {sorted(rs)})" if many else "") for m, rs in by_msg.items()]
