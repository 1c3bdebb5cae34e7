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


def p2p_time(nbytes: float, bw: float, lat: float) -> float:
    """One send/recv of ``nbytes``: lat + nbytes/bw seconds."""
    return lat + nbytes / bw


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
