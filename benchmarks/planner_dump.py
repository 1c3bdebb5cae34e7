"""Dump the planner's ranked plans as JSON, and compare two dumps (the refactoring invariant).

The planner's outputs must not move when its code is reorganised: dump the ranked plan lists of every
benchmark model and device count with one pinned hardware profile before a change, dump again after,
and compare (same order, every number within ``--rtol``, default 1e-12 relative).

    python benchmarks/planner_dump.py --hardware cal.json --out before.json
    ... change the code ...
    python benchmarks/planner_dump.py --hardware cal.json --out after.json --compare before.json

``--by-plan`` compares plan by plan instead of rank by rank (a change meant to move some plans, e.g. one
schedule's: every later rank would differ by position): the plans only in one dump, the plans whose numbers
differ, counted per pipeline schedule, and whether the unchanged plans keep their relative order.

Pure Python over the planner (no process starts); built-in models are profiled on the meta device.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys

CASES = [  # (model, seq_len, devices, global batch, precision)
    ("gpt-3m", 128, 2, 32, "fp32"), ("gpt-3m", 128, 4, 32, "fp32"), ("gpt-1m", 64, 8, 32, "fp32"),
    ("gpt-nano", 16, 4, 8, "fp32"), ("mlp-small", 0, 4, 64, "fp32"),
    ("gpt-1b", 2048, 8, 64, "bf16"), ("gpt-1b", 2048, 64, 512, "bf16"),
]


def dump(hardware: str) -> dict:
    from modelpar.cli.common import profile_for
    from modelpar.planner.hardware import get_hardware
    from modelpar.planner.search import search_plans

    out = {}
    for model, seq, n, gb, prec in CASES:
        prof, _ = profile_for(model, {}, seq, prec)
        hw = get_hardware(hardware, local_ranks=n) if hardware == "cpu" or prec == "fp32" else get_hardware(
            "H100-80GB-SXM")
        rep = search_plans(prof, n, hw, global_batch_size=gb, precision=prec)
        out[f"{model}/s{seq}/n{n}/b{gb}/{prec}"] = [
            {"plan": c.plan.to_dict(), "micro_batch": c.micro_batch_size,
             "memory": dataclasses.asdict(c.memory), "step": dataclasses.asdict(c.step)} for c in rep.ranked]
    return out


def compare(a, b, rtol: float, path: str = "") -> list[str]:
    """Differences between two dumps: structure, order and numbers beyond ``rtol`` relative."""
    if isinstance(a, dict) and isinstance(b, dict):
        if set(a) != set(b):
            return [f"{path}: keys differ {sorted(set(a) ^ set(b))}"]
        return [d for k in a for d in compare(a[k], b[k], rtol, f"{path}/{k}")]
    if isinstance(a, list) and isinstance(b, list):
        if len(a) != len(b):
            return [f"{path}: {len(a)} vs {len(b)} entries"]
        return [d for i, (x, y) in enumerate(zip(a, b)) for d in compare(x, y, rtol, f"{path}[{i}]")]
    if isinstance(a, float) or isinstance(b, float):
        if not (math.isclose(a, b, rel_tol=rtol, abs_tol=0.0) or a == b):
            return [f"{path}: {a!r} vs {b!r}"]
        return []
    return [] if a == b else [f"{path}: {a!r} vs {b!r}"]


def compare_by_plan(a: dict, b: dict, rtol: float) -> tuple[dict, list[str]]:
    """Counts per pipeline schedule (``"-"`` without a pipeline) of plans only in ``a`` / only in ``b`` /
    changed / unchanged, keyed by (plan, micro-batch size); and the cases where the unchanged plans are
    not in the same relative order."""
    counts: dict[str, dict[str, int]] = {}
    reorders = []
    for case in sorted(set(a) | set(b)):
        key = lambda e: json.dumps(e["plan"], sort_keys=True) + f"/b{e['micro_batch']}"     # noqa: E731
        ea, eb = {key(e): e for e in a.get(case, [])}, {key(e): e for e in b.get(case, [])}
        for k in set(ea) | set(eb):
            e = ea.get(k) or eb[k]
            sched = e["plan"]["pp_schedule"] if e["plan"]["pp"] > 1 else "-"
            what = ("only in the old" if k not in eb else "only in the new" if k not in ea
                    else "changed" if compare(ea[k], eb[k], rtol) else "unchanged")
            c = counts.setdefault(sched, {})
            c[what] = c.get(what, 0) + 1
        same = {k for k in set(ea) & set(eb) if not compare(ea[k], eb[k], rtol)}
        if [k for k in map(key, a.get(case, [])) if k in same] != [k for k in map(key, b.get(case, [])) if k in same]:
            reorders.append(case)
    return counts, reorders


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--hardware", default="cpu", help="pinned profile: a calibration JSON, or cpu")
    p.add_argument("--out", required=True, help="write the dump here")
    p.add_argument("--compare", default="", help="a dump to compare the new one with")
    p.add_argument("--rtol", type=float, default=1e-12)
    p.add_argument("--by-plan", action="store_true", help="with --compare: plan by plan, per pipeline schedule")
    a = p.parse_args(argv)
    d = dump(a.hardware)
    with open(a.out, "w") as f:
        json.dump(d, f, indent=1, sort_keys=True)
    print(f"{sum(len(v) for v in d.values())} ranked plans over {len(d)} cases -> {a.out}")
    if a.compare and a.by_plan:
        with open(a.compare) as f:
            counts, reorders = compare_by_plan(json.load(f), json.loads(json.dumps(d)), a.rtol)
        for sched, c in sorted(counts.items()):
            print(f"{sched:>24}: " + ", ".join(f"{n} {w}" for w, n in sorted(c.items())))
        print("relative order of the unchanged plans: " + (f"differs in {reorders}" if reorders else "the same"))
        return 0
    if a.compare:
        with open(a.compare) as f:
            diffs = compare(json.load(f), json.loads(json.dumps(d)), a.rtol)
        for line in diffs[:20]:
            print("DIFF", line)
        print(f"{len(diffs)} difference(s) beyond rtol {a.rtol:g} against {a.compare}")
        return 1 if diffs else 0
    return 0


if __name__ == "__main__":
    sys.exit(main())
