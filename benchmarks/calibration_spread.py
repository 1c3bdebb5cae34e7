"""Which calibrated term moves between calibrations of one host kind, and what it does to predictions.

Pure Python, nothing is timed: loads N calibration files (`modelpar calibrate` output), prints

1. every measured term's spread over the files: min, max and ``max / min - 1``;
2. the planner's predicted step time (`planner_accuracy_time.predict_seconds`) of every case of the
   step-time accuracy benchmark (`planner_accuracy_time.cases_for`) under each file, and its spread;
3. the attribution of that spread to the terms: starting from the first file (the reference), one
   term group at a time is replaced by each other file's value and the case predicted again; a
   group's share is the largest relative move it alone causes (``max |pred / pred_ref - 1|``). The
   groups are the `GROUPS` below (a table counts as one term);
4. the plan `auto` picks for each built-in model of ``--models`` (2 ranks, global batch 32, fp32:
   `modelpar plan`'s defaults here) under each file, with its margin over the runner-up, and whether
   the pick is the same under every file (``--check-picks``: exit 1 where it is not).

Run: ``python benchmarks/calibration_spread.py /work/prompts/cal_pinned.json A.json B.json ...
[--models gpt-1m,mlp-large,hf-llama,hf-gpt2] [--check-picks]``
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import sys

# term groups: name -> (top-level `Hardware` fields, `Calibration` fields)
GROUPS = {
    "matmul curve": ((), ("matmul_flops",)),
    "matmul shapes": ((), ("matmul_shapes",)),
    "attention rate": ((), ("attention_flops",)),
    "elementwise bw": ((), ("elementwise_bw",)),
    "per-op overhead": (("op_overhead_s",), ()),
    "memory bw (all ranks)": (("mem_bandwidth",), ()),
    "memory bw (alone)": ((), ("mem_bandwidth_alone",)),
    "fresh allocation": ((), ("fresh_alloc_s_per_byte", "fresh_alloc_min_bytes", "fresh_alloc_s_per_byte_alone")),
    "TP Linear overhead": ((), ("tp_linear_overhead_s", "tp_linear_overhead_s_per_byte")),
    "FSDP unit/tensor overhead": ((), ("fsdp_unit_overhead_s", "fsdp_tensor_overhead_s")),
    "collectives": (("intra_bw", "intra_latency", "inter_bw", "inter_latency"), ("collectives",)),
    # parts of the collective tables (`swap`): calls between compute segments up to 1 MiB (the pooled
    # wait), above 1 MiB, and the back-to-back tables with their alpha-beta fits
    "collectives in context <= 1 MiB": ((), ("collectives",)),
    "collectives in context > 1 MiB": ((), ("collectives",)),
    "collectives back to back": (("intra_bw", "intra_latency", "inter_bw", "inter_latency"), ("collectives",)),
    "zero-bubble factor": ((), ("zero_bubble_backward_factor",)),
}


def scalar_terms(hw) -> dict[str, float]:
    """Every measured number of a profile, flattened: ``{name: value}`` (tables by key)."""
    c = hw.calibration
    out = {"op_overhead_s": hw.op_overhead_s, "mem_bandwidth": hw.mem_bandwidth, "peak_fp32": hw.peak_flops["fp32"]}
    for f in dataclasses.fields(c):
        v = getattr(c, f.name)
        if f.name == "matmul_flops":
            out.update({f"matmul_flops[{n}]": r for n, r in sorted(v.items())})
        elif f.name == "collectives":
            for op, t in sorted(v.items()):
                out.update({f"{op}.in_context[{b >> 10} KiB]": s for b, s in sorted(t.in_context.items())})
                out.update({f"{op}.seconds[{b >> 10} KiB]": s for b, s in sorted(t.seconds.items())})
        elif isinstance(v, (int, float)) and v is not None and not isinstance(v, bool):
            out[f.name] = float(v)
        elif isinstance(v, dict) and f.name == "spread":
            continue
    return out


def _mix_tables(ref, other, group: str) -> dict:
    """``ref``'s collective tables with the part ``group`` names taken from ``other``."""
    from modelpar.planner.calibration import CollectiveTable
    out = {}
    for op, t in ref.collectives.items():
        o = other.collectives.get(op, t)
        ctx = dict(t.in_context)
        if group.startswith("collectives in context"):
            small = group.endswith("<= 1 MiB")
            ctx.update({b: s for b, s in o.in_context.items() if (b <= 2 ** 20) == small})
            out[op] = CollectiveTable(t.latency_s, t.bandwidth, dict(t.seconds), ctx)
        else:
            out[op] = CollectiveTable(o.latency_s, o.bandwidth, dict(o.seconds), ctx)
    return out


def swap(ref, other, group: str):
    """``ref`` with the terms of ``group`` taken from ``other``."""
    top, cal = GROUPS[group]
    if group.startswith("collectives "):
        c = dataclasses.replace(ref.calibration, collectives=_mix_tables(ref.calibration, other.calibration, group))
        return dataclasses.replace(ref, calibration=c, **{k: getattr(other, k) for k in top})
    c = dataclasses.replace(ref.calibration, **{k: getattr(other.calibration, k) for k in cal
                                                 if hasattr(ref.calibration, k)})
    return dataclasses.replace(ref, calibration=c, **{k: getattr(other, k) for k in top})


def main(argv: list[str]) -> int:
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from planner_accuracy_time import cases_for, predict_seconds

    from modelpar.planner.hardware import load_profile
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("files", nargs="+", help="calibration JSON files; the first is the reference")
    ap.add_argument("--models", default="gpt-1m,gpt-3m,gpt-10m,mlp-large,hf-llama,hf-gpt2")
    ap.add_argument("--check-picks", action="store_true",
                    help="exit 1 if the plan `auto` picks for a built-in model differs between the files")
    a = ap.parse_args(argv)
    hws = [load_profile(f) for f in a.files]
    names = [os.path.basename(f) for f in a.files]
    print("== 1. measured terms over", len(hws), "files:", ", ".join(names))
    terms = [scalar_terms(h) for h in hws]
    keys = [k for k in terms[0] if all(k in t for t in terms)]
    print(f"{'term':<34} {'min':>11} {'max':>11} {'max/min-1':>10}   " + "  ".join(f"{n[:10]:>10}" for n in names))
    for k in keys:
        vs = [t[k] for t in terms]
        lo, hi = min(vs), max(vs)
        sp = hi / lo - 1 if lo > 0 else float("nan")
        print(f"{k:<34} {lo:>11.4g} {hi:>11.4g} {sp:>+10.1%}   " + "  ".join(f"{v:>10.4g}" for v in vs))
    print("\n== 2. predicted step time (ms) of the accuracy benchmark's cases, per file")
    groups = [g for g in GROUPS if all(hasattr(h.calibration, f) or not GROUPS[g][1] for h in hws
                                       for f in GROUPS[g][1])]
    rows = []
    for model in a.models.split(","):
        for case in cases_for(model):
            preds = [predict_seconds(case, h) for h in hws]
            ref = preds[0]
            attr = {}
            for g in groups:
                moves = [abs(predict_seconds(case, swap(hws[0], h, g)) / ref - 1) for h in hws[1:]]
                attr[g] = max(moves) if moves else 0.0
            rows.append((case.name, preds, attr))
            top = sorted(attr.items(), key=lambda kv: -kv[1])[:3]
            print(f"{case.name:<22} " + " ".join(f"{p * 1e3:8.1f}" for p in preds)
                  + f"   spread {max(preds) / min(preds) - 1:+6.1%}   largest one-term moves: "
                  + ", ".join(f"{g} {v:.1%}" for g, v in top))
    print("\n== 3. per term group: largest move it alone causes (swap one group from each other file into the first)")
    print(f"{'group':<28} {'median over cases':>18} {'max over cases':>15}  worst case")
    for g in groups:
        vs = [(r[2][g], r[0]) for r in rows]
        print(f"{g:<28} {statistics.median(v for v, _ in vs):>18.1%} {max(vs)[0]:>15.1%}  {max(vs)[1]}")
    changed = print_picks(hws, names, [m for m in a.models.split(",") if not m.startswith("hf-")])
    return 1 if changed and a.check_picks else 0


def auto_picks(hw, model: str, devices: int = 2, global_batch: int = 32) -> list:
    """The two best candidates of `modelpar plan --model MODEL --nproc 2 --global-batch-size 32`'s
    search (fp32, AdamW: the CPU defaults) under the profile ``hw``: `search_plans`' exact top-k."""
    from modelpar.measure.memory import profile_for
    from modelpar.planner.search import search_plans
    rep = search_plans(profile_for(model), devices, hw, global_batch_size=global_batch, precision="fp32", top_k=2)
    return rep.ranked


def print_picks(hws, names, models) -> bool:
    """Section 4: per model, the plan `auto` picks under each file, its predicted step time and its
    margin over the runner-up; returns whether any model's pick differs between the files."""
    print("\n== 4. the plan `auto` picks (2 ranks, global batch 32), per file: plan (ms, margin over the 2nd)")
    changed = False
    for model in models:
        cells, picks = [], set()
        for h in hws:
            r = auto_picks(h, model)
            first = r[0]
            key = (first.plan.describe(), first.micro_batch_size)
            picks.add(key)
            margin = r[1].step.total / first.step.total - 1 if len(r) > 1 else float("nan")
            cells.append(f"{key[0]} mb {key[1]} ({first.step.total * 1e3:.0f} ms, +{margin:.1%})")
        changed |= len(picks) > 1
        print(f"{model:<10} {'SAME' if len(picks) == 1 else 'DIFFERS':<8} " + " | ".join(cells))
    print("files: " + ", ".join(names))
    return changed


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
