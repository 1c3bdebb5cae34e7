"""Memory accuracy: predicted peak per rank against MemTracker's, part by part (issue 4, item 7).

For each model and strategy (single, ddp, fsdp, tp, pp gpipe / 1f1b on 2 ranks; fsdp x tp on 4),
at two batch sizes (one where activations dominate, one where model states do), the run measures
the peak tensor bytes of step 3 (`modelpar.planner.measure`) and compares it with
`modelpar.planner.memory.estimate_memory` on the model's profile. Parts compared (measured
MemTracker reference types -> predicted parts):

    params       Parameter                       <- params (+ fsdp_gathered when the peak is at backward
                                                    start: MemTracker types the parameters FSDP gathered
                                                    for a forward as Parameter, later ones as Temp)
    grads        Gradient                        <- grads
    optimizer    Optstate                        <- optimizer
    activations  Activation + Temp + Buffer + Other <- activations + comm_buffers + overhead
    total        Total                           <- total

each the value *at the moment of the peak* (the model's `MemoryEstimate` is that moment). Goal:
|error| <= max(5%, 1 MiB) for each.

Run: ``.venv/bin/python benchmarks/planner_accuracy_memory.py [--models gpt-nano,gpt-1m,...] [--worlds 1,2,4]``
"""

from __future__ import annotations

import argparse
import sys
import time

import torch

from modelpar.plan import ParallelPlan
from modelpar.planner.measure import Case, launch

MIB = 2 ** 20
# per model: (activation-dominated global batch, model-state-dominated global batch)
BATCHES = {"gpt-nano": (32, 4), "gpt-1m": (16, 4), "gpt-3m": (16, 4), "gpt-10m": (8, 4),
           "mlp-small": (512, 8), "mlp-large": (512, 8)}
STRATEGIES_2 = {"ddp": dict(dp_replicate=2), "fsdp": dict(dp_shard=2), "tp": dict(tp=2),
                "pp_gpipe": dict(pp=2, pp_schedule="gpipe", n_microbatches=4),
                "pp_1f1b": dict(pp=2, pp_schedule="1f1b", n_microbatches=4)}
STRATEGIES_4 = {"fsdp_tp": dict(dp_shard=2, tp=2)}
PARTS = ("params", "grads", "optimizer", "activations", "total")


def make_cases(models, worlds, *, optimizer: str = "adamw") -> dict[int, list[Case]]:
    """world size -> cases; a 1-rank ("single") case runs inside the 2-rank launch on rank 0."""
    out: dict[int, list[Case]] = {w: [] for w in worlds}
    for m in models:
        for tag, gb in zip(("act", "states"), BATCHES[m]):
            def add(world, name, plan):
                p = ParallelPlan(**plan)
                local = gb // p.dp
                out.setdefault(world, []).append(Case(f"{m}/{name}/{tag}", m, p.to_dict(), gb, local,
                                                      optimizer=optimizer))
            launch_world = 2 if 2 in worlds else min(worlds)
            if 1 in worlds:
                add(launch_world, "single", {})
            if 2 in worlds:
                for n, plan in STRATEGIES_2.items():
                    add(2, n, plan)
            if 4 in worlds:
                for n, plan in STRATEGIES_4.items():
                    add(4, n, plan)
    return {w: c for w, c in out.items() if c and w != 1}


_PROFILES: dict[str, object] = {}


def profile_for(model: str):
    """fp32 profile of a built-in model at batch 1 (meta device, fused attention as torch runs it)."""
    from modelpar.models import MLP_PRESETS, build_model
    from modelpar.planner.profile import profile_model
    if model not in _PROFILES:
        mod = build_model(model, device="meta")
        x = (torch.zeros(1, MLP_PRESETS[model][0], device="meta") if model in MLP_PRESETS
             else torch.zeros(1, mod.cfg.seq_len, dtype=torch.long, device="meta"))
        _PROFILES[model] = profile_model(mod, x)
    return _PROFILES[model]


def predict(case: Case):
    from modelpar.planner.memory import Batch, estimate_memory
    plan = ParallelPlan.from_dict(case.plan)
    return estimate_memory(profile_for(case.model), plan, Batch(case.global_batch_size, case.local_batch_size),
                           optimizer=case.optimizer)


def measured_parts(m: dict) -> dict[str, float]:
    pk = m["peak"]
    return {"params": pk["Parameter"], "grads": pk["Gradient"], "optimizer": pk["Optstate"],
            "activations": pk["Activation"] + pk["Temp"] + pk["Buffer"] + pk["Other"], "total": pk["Total"]}


def predicted_parts(e) -> dict[str, float]:
    # MemTracker types a module's parameters when its forward starts: FSDP's gathered root (and the
    # unit gathered for backward start) count as Parameter; units gathered later in backward as Temp
    g = e.fsdp_gathered if e.phase == "backward" else 0.0
    return {"params": e.params + g, "grads": e.grads, "optimizer": e.optimizer,
            "activations": e.activations + e.fsdp_gathered - g + e.comm_buffers + e.overhead, "total": e.total}


def within(pred: float, meas: float) -> bool:
    """|pred - meas| <= max(5% of meas, 1 MiB)."""
    return abs(pred - meas) <= max(0.05 * meas, MIB)


def compare(case: Case, result: dict) -> dict:
    """Per part: predicted, measured, error (bytes and relative) and whether within tolerance."""
    if "error" in result:
        return {"case": case.name, "error": result["error"]}
    p, m = predicted_parts(predict(case)), measured_parts(result)
    rows = {k: {"pred": p[k], "meas": m[k], "err": p[k] - m[k], "rel": (p[k] - m[k]) / m[k] if m[k] else 0.0,
                "ok": within(p[k], m[k])} for k in PARTS}
    return {"case": case.name, "parts": rows, "ok": all(r["ok"] for r in rows.values())}


def format_table(rows: list[dict]) -> str:
    head = f"{'case':<30} " + " ".join(f"{k:>20}" for k in PARTS) + "  ok"
    lines = [head, "-" * len(head)]
    for r in rows:
        if "error" in r:
            lines.append(f"{r['case']:<30} ERROR {r['error'][:150]}")
            continue
        cells = []
        for k in PARTS:
            x = r["parts"][k]
            cells.append(f"{x['meas'] / MIB:8.2f}M {x['rel']:+7.1%}{'' if x['ok'] else '!':1}")
        lines.append(f"{r['case']:<30} " + " ".join(f"{c:>20}" for c in cells) + f"  {'yes' if r['ok'] else 'NO'}")
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="gpt-nano,gpt-1m,gpt-3m,gpt-10m,mlp-large")
    ap.add_argument("--worlds", default="1,2,4")
    ap.add_argument("--timeout", type=float, default=1200)
    args = ap.parse_args(argv)
    models = args.models.split(",")
    worlds = [int(w) for w in args.worlds.split(",")]
    rows = []
    t = time.perf_counter()
    for world, cases in sorted(make_cases(models, worlds).items()):
        res = launch(cases, world, timeout=args.timeout)
        rows += [compare(c, res.get(c.name, {"error": "no result"})) for c in cases]
    print("measured MiB at the peak of step 3, and (predicted - measured) / measured; ! = outside max(5%, 1 MiB)")
    print(format_table(rows))
    ok = sum(r.get("ok", False) for r in rows)
    print(f"\n{ok}/{len(rows)} cases within max(5%, 1 MiB) on every part [{time.perf_counter() - t:.0f} s]")
    return 0 if ok == len(rows) else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
