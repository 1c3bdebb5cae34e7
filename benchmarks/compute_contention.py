"""Does a one-process training step slow down while a second process runs the same step at the same
moment (shared L3 / memory bus), independent of the calibration?

Two processes (``multiprocessing``, spawn; torch threads 1 each) build the same one-process case
(default gpt-1m at a DDP rank's local batch, 16 of the global 32: forward + backward + AdamW,
`modelpar.measure.runs.step`). Each pair of trials, in alternating order: *alone* -- process 0 runs
``--steps`` steps while process 1 waits at a barrier, then process 1 runs while 0 waits; *together*
-- both run the same steps, a barrier before each step so they start at the same moment. Each step
is timed in the main thread's CPU time (``time.thread_time``: time the thread was descheduled, e.g.
by other load on the host, is not counted), the median over the trial's steps kept. Printed: per
process, the median and spread (min-max) over the pairs of alone and together, and of the per-pair
ratio together / alone, and the share of each step's wall time the process was on a core (on a
loaded host well below 1: "together" then overlaps the two steps' computing only in part, and
"alone" shares the caches with other load).

Run: ``python benchmarks/compute_contention.py [--model gpt-1m] [--pairs 12] [--steps 3] [--batch 16]
[--json OUT.json]``.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import statistics
import sys
import time


def _worker(rank: int, args, barrier, q) -> None:
    import torch
    torch.set_num_threads(1)
    from modelpar.measure import Case
    from modelpar.measure.runs import build_case, step
    from modelpar.plan import ParallelPlan
    b = build_case(Case(f"{args.model}/one", args.model, ParallelPlan().to_dict(), args.batch, args.batch))
    for _ in range(2):
        step(b)

    share = []      # thread CPU / wall of each timed step: how much of the step the process was on a core

    def trial(active: bool) -> float | None:
        ts = []
        for _ in range(args.steps):
            barrier.wait()
            if active:
                t, w = time.thread_time(), time.perf_counter()
                step(b)
                ts.append(time.thread_time() - t)
                share.append(ts[-1] / (time.perf_counter() - w))
        barrier.wait()
        return statistics.median(ts) if ts else None

    rows = []
    for p in range(args.pairs):
        row = {}
        order = ("alone", "together") if p % 2 == 0 else ("together", "alone")
        for mode in order:
            if mode == "alone":
                for who in (0, 1):
                    v = trial(who == rank)
                    if v is not None:
                        row["alone"] = v
            else:
                row["together"] = trial(True)
        rows.append(row)
    q.put((rank, {"rows": rows, "share": statistics.median(share)}))


def _stats(xs: list[float]) -> str:
    return f"median {statistics.median(xs):.4f} (min {min(xs):.4f}, max {max(xs):.4f})"


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="gpt-1m")
    ap.add_argument("--pairs", type=int, default=12)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    for k in ("pairs", "steps", "batch"):
        if getattr(args, k) < 1:
            raise SystemExit(f"--{k} must be >= 1, got {getattr(args, k)}")
    ctx = mp.get_context("spawn")
    barrier, q = ctx.Barrier(2), ctx.Queue()
    ps = [ctx.Process(target=_worker, args=(r, args, barrier, q)) for r in range(2)]
    for p in ps:
        p.start()
    import os
    load0 = os.getloadavg()[0]
    res = dict(q.get() for _ in ps)
    for p in ps:
        p.join()
    out = {}
    for r in (0, 1):
        rows = res[r]["rows"]
        ratio = [x["together"] / x["alone"] for x in rows]
        out[r] = {"rows": rows, "ratio_median": statistics.median(ratio)}
        print(f"process {r} ({args.model}, batch {args.batch}, {args.pairs} pairs x {args.steps} steps, thread CPU s/step)")
        print(f"  alone    {_stats([x['alone'] for x in rows])}")
        print(f"  together {_stats([x['together'] for x in rows])}")
        print(f"  together / alone per pair: {_stats(ratio)}")
        print(f"  thread CPU / wall per timed step (median): {res[r]['share']:.2f}")
    allr = [x["together"] / x["alone"] for r in (0, 1) for x in res[r]["rows"]]
    print(f"both processes: together / alone {_stats(allr)}; load average {load0:.1f} -> {os.getloadavg()[0]:.1f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
