"""Plan quality: does `--strategy auto`'s pick run as fast as the best finalist?

On CPU with N ranks (default 2) for one model at the default batch (global 32, AdamW, fp32): the
finalists are the planner's top 5 predicted distinct layouts plus the best-predicted plan of each
basic strategy (ddp, fsdp, tp, pp) and the `rules` baseline's plan; all are built once in one launch
and re-measured in alternation (`modelpar.measure.time_cases`). Goal: the median throughput
of auto's pick >= 90% of the best median, and >= that of rules. When rules picks the very plan auto
picks (same degrees, schedule and local batch), that plan is measured once and the ratio is 100% by
construction (measuring one configuration twice would only compare noise), and the table says so.

Run: ``.venv/bin/python benchmarks/plan_quality.py [--model gpt-3m] [--nproc 2] [--rounds 4]``
(uses the calibration file of `modelpar calibrate`, like ``modelpar train --strategy auto``)
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(__file__))

from modelpar.bench.plan_quality import GLOBAL_BATCH, finalists  # noqa: E402
from modelpar.measure import Case, launch  # noqa: E402


def main(argv: list[str]) -> int:
    from planner_accuracy_memory import profile_for
    from planner_accuracy_time import load_hardware
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="gpt-3m")
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--hardware", default=None)
    ap.add_argument("--timeout", type=float, default=1500)
    args = ap.parse_args(argv)
    hw = load_hardware(args.hardware)
    fin, rep = finalists(profile_for(args.model), args.nproc, hw)
    print(f"{args.model} on {args.nproc} ranks, global batch {GLOBAL_BATCH}: {rep.summary()}")
    cases = [Case(f"{label}", args.model, plan.to_dict(), GLOBAL_BATCH, local) for label, plan, local, _ in fin]
    load0 = os.getloadavg()[0]
    t = time.perf_counter()
    res = launch(cases, args.nproc, mode="time", rounds=args.rounds, timeout=args.timeout)
    load1 = os.getloadavg()[0]
    best = min(res[c.name]["median"] for c in cases)
    print(f"[measured in {time.perf_counter() - t:.0f} s, load average {load0:.1f} -> {load1:.1f}]")
    print(f"{'finalist':<10} {'plan':<44} {'local':>5} {'pred ms':>9} {'median ms':>10} {'IQR ms':>17} {'vs best':>8}")
    for (label, plan, local, pred), c in zip(fin, cases):
        r = res[c.name]
        print(f"{label:<10} {plan.describe():<44} {local:>5} {pred * 1e3:>9.1f} {r['median'] * 1e3:>10.1f} "
              f"{r['q1'] * 1e3:>8.1f}-{r['q3'] * 1e3:<8.1f} {best / r['median']:>8.1%}")
    auto = res["auto"]["median"]
    if "rules" in res:
        rules = res["rules"]["median"]
    else:
        rules = auto
        print("rules picks the same plan as auto (same degrees, schedule and local batch): measured once")
    ratio_best, ratio_rules = best / auto, rules / auto
    print(f"\nauto throughput / best = {ratio_best:.1%} (goal >= 90%); auto / rules = {ratio_rules:.1%} (goal >= 100%)")
    return 0 if ratio_best >= 0.9 and ratio_rules >= 1.0 else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
