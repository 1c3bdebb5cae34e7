"""Time the planner's full search (goal: under 1 second) at 3,072 and 16,384 devices.

Profiles gpt-70b on the meta device (bf16 and its autocast variant, as `modelpar plan` does:
`cli.common.profile_for`; not timed as search), then times `search_plans` over every
dp_replicate x dp_shard x tp x pp factorization of N H100s with all schedules, micro-batch counts,
virtual stages, checkpointing modes and micro-batch sizes, and prints the counts and the top layouts.
Default runs: 3,072 devices with a global batch of 3,072 sequences, and 16,384 devices with 16,384
(one per device; a fixed batch of 3,072 would prune most layouts at that size).

Hosts differ (the same search took 0.92 s on one machine and 1.6 s on another), so a fixed
pure-Python reference loop (`reference_loop`: float arithmetic, dict and tuple work of the kind the
search does) is timed beside every search, just before and just after it; compare
``search / reference`` between hosts, not seconds; the sizes alternate within each round. Times are the process's CPU time
(``time.process_time``: on a shared, loaded host it varies far less than wall time; wall time is
printed too). Each size runs ``--repeat`` times (default 5) and prints the median and the spread
(min-max) of the CPU seconds and of the ratio; the goal (< 1 s) is checked on the median CPU time.

Each search runs twice: the exact top-k mode ``top_k=10`` (the number `modelpar plan` prints by
default; the same first 10 candidates as the full ranking, found by evaluating groups in order of a
lower bound on step time) and the full ranking (every feasible candidate, `search_plans`' default),
each with its own CPU time and ratio to the reference loop. The goal is checked on the top-k search's
median: it is the search every command runs (`plan` its top K, `plan --strategy S` its top K of one
family, `estimate` and `train --strategy auto` their top 1); no command ranks every feasible plan, so
the full ranking is printed as the reference the top K is checked equal to, not held to the goal.

Run: ``PYTHONPATH=. .venv/bin/python benchmarks/planner_search_time.py [N:BATCH ...] [--repeat K] [--top K]``
"""

from __future__ import annotations

import gc
import statistics
import sys
import time

from modelpar.cli.common import profile_for
from modelpar.planner.hardware import BUILTIN
from modelpar.planner.search import search_plans


def reference_loop(n: int = 400_000, clock=time.process_time) -> float:
    """Seconds (of ``clock``) of a fixed pure-Python workload (the same on every host and commit).

    Runs with the cyclic garbage collector paused, as the search does: its ~10^5 short-lived tuples
    would otherwise trigger collections that walk every object the process holds, so the loop's time
    depended on the heap the previous search left (one process, 2026-12-06: 0.19-0.59 s collecting,
    0.19-0.24 s paused, over six searches)."""
    was = gc.isenabled()
    gc.disable()
    try:
        t0 = clock()
        d: dict[tuple, float] = {}
        acc = 0.0
        for i in range(n):
            k = (i & 1023, i % 7)
            x = d.get(k, 0.5) * 1.000001 + i * 1e-9
            d[k] = x
            acc += max(x, acc * 1e-12) if i % 3 else min(x, 2.0)
        assert acc > 0
        return clock() - t0
    finally:
        if was:
            gc.enable()


def _spread(xs: list[float], fmt: str) -> str:
    xs = sorted(xs)
    return f"median {fmt.format(statistics.median(xs))} ({fmt.format(xs[0])}-{fmt.format(xs[-1])})"


DEFAULT_RUNS = ((3072, 3072), (16384, 16384))


def run_spec(text: str) -> tuple[int, int]:
    """``N:BATCH`` -> (devices, global batch size in sequences).

    Raises:
        argparse.ArgumentTypeError: not two positive integers joined by ``:`` (naming the value).
    """
    import argparse

    parts = text.split(":")
    if len(parts) != 2 or not all(p.isdigit() and int(p) > 0 for p in parts):
        raise argparse.ArgumentTypeError(f"{text!r} is not N:BATCH (devices and global batch size in sequences, "
                                         f"two positive integers, e.g. 3072:3072)")
    return int(parts[0]), int(parts[1])


def positive(text: str) -> int:
    """An integer >= 1.

    Raises:
        argparse.ArgumentTypeError: anything else (naming the value).
    """
    import argparse

    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a positive integer")
    return int(text)


def build_parser():
    import argparse

    p = argparse.ArgumentParser(prog="planner_search_time.py", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("runs", nargs="*", type=run_spec, metavar="N:BATCH",
                   help="devices and global batch size (sequences) of one search; several alternate within each "
                        "round (default: 3072:3072 16384:16384)")
    p.add_argument("--repeat", type=positive, default=5,
                   help="rounds; the median and the spread (min-max) are printed (default: 5)")
    p.add_argument("--top", type=positive, default=10,
                   help="k of the exact top-k search held to the goal and checked equal to the full ranking's "
                        "first k (default: 10, what `modelpar plan` prints)")
    return p


def main(argv: list[str]) -> int:
    """Exit code 0 when the top-k search's median CPU time is under 1 s at every size and it equals
    the full ranking's head, 1 otherwise (bad arguments: argparse's message, exit code 2)."""
    a = build_parser().parse_args(argv)
    repeat, top = a.repeat, a.top
    runs = a.runs or list(DEFAULT_RUNS)
    t0 = time.perf_counter()
    prof, _ = profile_for("gpt-70b", {}, 0, "bf16")     # as `modelpar plan` profiles it (bf16 and autocast)
    print(f"profile gpt-70b: {time.perf_counter() - t0:.2f} s")
    ok = True
    res = {(n_gbs, k): ([], [], [], []) for n_gbs in runs for k in (None, top)}   # CPU s, wall s, ref s, ratio
    last = {}
    # the sizes alternate within each round (a load that drifts over the run hits every size alike),
    # and the reference loop runs just before and just after every search
    for _ in range(repeat):
        for n, gbs in runs:
            for k in (None, top):
                cpu, wall, refs, ratios = res[(n, gbs), k]
                r0 = reference_loop()
                t1, c1 = time.perf_counter(), time.process_time()
                last[(n, gbs), k] = search_plans(prof, n, BUILTIN["H100-80GB-SXM"], global_batch_size=gbs, top_k=k)
                dc, dt = time.process_time() - c1, time.perf_counter() - t1
                r1 = reference_loop()
                cpu.append(dc)
                wall.append(dt)
                refs.append((r0 + r1) / 2)
                ratios.append(dc / refs[-1])
    for n, gbs in runs:
        full, head = last[(n, gbs), None], last[(n, gbs), top]
        if [(c.plan, c.step.total, c.memory.total) for c in head.ranked] != [
                (c.plan, c.step.total, c.memory.total) for c in full.ranked[:top]]:
            print(f"ERROR: the top-{top} mode differs from the full ranking's first {top}")
            ok = False
        for k in (None, top):
            cpu, wall, refs, ratios = res[(n, gbs), k]
            if k is not None:
                ok &= statistics.median(cpu) < 1.0
            what = "full ranking (reference, no goal)" if k is None else f"top {k} (goal < 1 s)"
            print(f"search {n} devices, global batch {gbs}, {what} ({repeat} runs): CPU {_spread(cpu, '{:.3f}')} s, "
                  f"wall {_spread(wall, '{:.3f}')} s; reference loop CPU {_spread(refs, '{:.3f}')} s; "
                  f"search / reference {_spread(ratios, '{:.2f}')}")
            print("  " + last[(n, gbs), k].summary())
        for c in full.distinct_layouts(3):
            print(f"    {c.plan.describe():<60} b={c.micro_batch_size:<3} "
                  f"{c.step.tokens_per_s:>12,.0f} tok/s  {c.memory.total / 2**30:6.1f} GiB")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
