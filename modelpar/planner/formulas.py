"""Closed-form collective and pipeline-bubble formulas of the step-time model (`cost.py`).

Sources: Thakur, Rabenseifner & Gropp, "Optimization of Collective Communication Operations in
MPICH", IJHPCA 2005, Sec. 4 (ring algorithms); Narayanan et al. SC'21, Sec. 2.2 (bubbles of GPipe,
1F1B and interleaved schedules); Qi et al., "Zero Bubble Pipeline Parallelism", ICLR'24, Sec. 3.
"""

from __future__ import annotations


def alpha_beta_form(op: str, n: int) -> tuple[float, float]:
    """(latency steps, bandwidth volume factor) of ``op`` over ``n`` ranks, so that its time is
    steps x latency + volume x bytes / bandwidth (Thakur et al. 2005, ring algorithms): all-reduce
    2(n-1) and 2(n-1)/n; all-gather and reduce-scatter (bytes = the gathered size) n-1 and (n-1)/n;
    send/recv 1 and 1. Raises KeyError for another op."""
    if op == "send_recv":
        return 1, 1
    k = {"all_reduce": 2, "all_gather": 1, "reduce_scatter": 1}[op]
    return k * (n - 1), k * (n - 1) / n


def all_reduce_time(nbytes: float, n: int, bw: float, lat: float) -> float:
    """Ring all-reduce of ``nbytes`` over ``n`` ranks: 2(n-1) lat + 2(n-1)/n nbytes/bw seconds."""
    steps, volume = alpha_beta_form("all_reduce", n)
    return 0.0 if n <= 1 else steps * lat + volume * nbytes / bw


def all_gather_time(nbytes: float, n: int, bw: float, lat: float) -> float:
    """Ring all-gather (or reduce-scatter) whose gathered size is ``nbytes``: (n-1) lat + (n-1)/n B/bw."""
    steps, volume = alpha_beta_form("all_gather", n)
    return 0.0 if n <= 1 else steps * lat + volume * nbytes / bw


def bubble_fraction(schedule: str, p: int, m: int, v: int = 1) -> float:
    """Pipeline bubble time / ideal time (see module docstring). 0 without a pipeline.

    Raises:
        ValueError: ``m < 1`` or an unknown schedule.
    """
    if p <= 1:
        return 0.0
    if m < 1:
        raise ValueError(f"n_microbatches must be >= 1, got {m}")
    if schedule in ("gpipe", "1f1b"):
        return (p - 1) / m
    if schedule in ("interleaved1f1b", "loopedbfs"):
        return (p - 1) / (v * m)
    if schedule == "interleavedzerobubble":
        return (p - 1) / (3 * v * m)     # ZB-H1 applied per virtual chunk (assumption)
    if schedule in ("zbvzerobubble", "dualpipev"):
        # ZB-V reaches ~0 only once m >= 2p micro-batches fill the V; below that, ZB-H1's bound
        return 0.0 if m >= 2 * p else (p - 1) / (3 * m)
    raise ValueError(f"unknown pp_schedule {schedule!r}")


def bubble_share_of_step(schedule: str, p: int, m: int, v: int = 1) -> float:
    """The bubble as a fraction of the whole pipeline step, ``f / (1 + f)`` with ``f`` =
    `bubble_fraction` (bubble over ideal time); for GPipe / 1F1B this is (p - 1) / (v m + p - 1)
    (Narayanan et al. 2021, Sec. 2.2). The one bubble definition: benchmarks that print a measured
    idle share next to the formula use this.

    Raises:
        ValueError: see `bubble_fraction`.
    """
    f = bubble_fraction(schedule, p, m, v)
    return f / (1 + f)


def fill_drain_seconds(schedule: str, fwd: list[float], bwd: list[float], k: int, m: int) -> float:
    """Seconds the slowest pipeline stage ``k`` waits per schedule step while a GPipe or 1F1B
    pipeline of ``len(fwd)`` stages (one per rank) runs ``m`` micro-batches; ``fwd[s]`` / ``bwd[s]``:
    stage ``s``'s forward / backward seconds of one micro-batch. The step is m (F_k + B_k) plus this.

    The critical path of m micro-batches through the stages in order and back (each rank runs its
    actions in the schedule's order, a forward waits for the previous stage's, a backward for the next
    stage's): stage k waits for the forward of the first micro-batch through the stages before it and,
    after its last backward, for their backwards, U = sum over s < k of (F_s + B_s). The stages after
    it, D = sum over s > k of (F_s + B_s), delay k's first and last backward:
    - GPipe (all forwards, then all backwards; torch's `ScheduleGPipe`): k's first backward waits for
      the last stage's last forward and the backwards back to k, and everything after is paced by k:
      U + D.
    - 1F1B (torch's `Schedule1F1B`: stage s warms up with min(m, p - s) forwards, then alternates
      one backward and one forward): between k's forward of a micro-batch and its backward run
      p - k - 1 of k's own forwards (warm-up: the first micro-batch) or backwards (cool-down: the
      last), which hide that much of D: U + max(0, D - (p-k-1) F_k) + max(0, D - (p-k-1) B_k).
      With m < p - k micro-batches (torch refuses 1F1B with m < p) GPipe's U + D, exact for m = 1
      and an upper bound otherwise.
    With p equal stages both give (p - 1)(F + B), i.e. the bubble (p - 1)/m of the ideal time
    (Narayanan et al. 2021, Sec. 2.2); with unequal stages the heavy stage waits only for the others.
    Exact for one stage that is the slowest in forward and in backward (tests: an event model of the
    schedules).

    Raises:
        ValueError: another schedule, ``fwd`` / ``bwd`` of different lengths, ``k`` outside them,
            or ``m < 1``.
    """
    p = len(fwd)
    if len(bwd) != p or not 0 <= k < p or m < 1:
        raise ValueError(f"fill_drain_seconds: {p} forward and {len(bwd)} backward times, stage k={k}, m={m}")
    up = sum(fwd[s] + bwd[s] for s in range(k))
    down = sum(fwd[s] + bwd[s] for s in range(k + 1, p))
    return fill_drain_from_sums(schedule, up, down, fwd[k], bwd[k], p - k, m)


def fill_drain_from_sums(schedule: str, up: float, down: float, f_k: float, b_k: float, after: int,
                         m: int) -> float:
    """`fill_drain_seconds` from its sums: ``up`` = U, ``down`` = D, stage k's ``f_k`` / ``b_k``, and
    ``after`` = p - k (stage k and the stages after it).

    Raises:
        ValueError: a schedule other than ``gpipe`` or ``1f1b``.
    """
    if schedule == "gpipe":
        return up + down
    if schedule == "1f1b":
        if m < after:       # fewer micro-batches than the stages from k on (torch's 1F1B refuses m < p)
            return up + down
        hidden = after - 1
        return up + max(0.0, down - hidden * f_k) + max(0.0, down - hidden * b_k)
    raise ValueError(f"fill_drain_seconds: pp_schedule {schedule!r} is not gpipe or 1f1b")
