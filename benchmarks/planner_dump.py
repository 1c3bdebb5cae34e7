"""Dump the planner's ranked plans as JSON, and compare two dumps (the refactoring invariant).

The planner's outputs must not move when its code is reorganised: dump the ranked plan lists of every
benchmark model and device count with one pinned hardware profile before a change, dump again after,
and compare (same order, every number within ``--rtol``, default 1e-12 relative).

    python benchmarks/planner_dump.py --hardware cal.json --out before.json
    ... change the code ...
    python benchmarks/planner_dump.py --hardware cal.json --out after.json --compare before.json

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


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--hardware", default="cpu", help="pinned profile: a calibration JSON, or cpu")
    p.add_argument("--out", required=True, help="write the dump here")
    p.add_argument("--compare", default="", help="a dump to compare the new one with")
    p.add_argument("--rtol", type=float, default=1e-12)
    a = p.parse_args(argv)
    d = dump(a.hardware)
    with open(a.out, "w") as f:
        json.dump(d, f, indent=1, sort_keys=True)
    print(f"{sum(len(v) for v in d.values())} ranked plans over {len(d)} cases -> {a.out}")
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
