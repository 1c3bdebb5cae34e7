"""Memory accuracy with frozen parameters: predicted peak per rank against MemTracker's, part by part.

Factory models of `tests/helpers/frozen_factory.py` (``lora``: a LoRA-style fine-tune, 3.5% of its
parameters trainable; ``frozen_backbone``: the head alone trains; ``llama_frozen_embed``: a Hugging
Face Llama with frozen token embeddings; ``lora_full`` / ``llama_full``: the same models all
trainable, the reference) one process, DDP and FSDP on 2 ranks, measured as
`benchmarks/planner_accuracy_memory.py` measures (`modelpar.measure`: the peak of step 3, fused
AdamW, gloo) and predicted by `modelpar.planner.memory.estimate_memory` on the profile `modelpar plan`
makes of the factory (`modelpar.cli.common.profile_for`). Parts as in `modelpar.measure.memory`.

Run (the factories import as ``helpers.frozen_factory``, so ``tests`` is on the path):

    PYTHONPATH=$PWD:$PWD/tests .venv/bin/python benchmarks/planner_frozen_memory.py --save m.json
    PYTHONPATH=$PWD:$PWD/tests .venv/bin/python benchmarks/planner_frozen_memory.py --measured m.json

``--measured FILE`` re-predicts against saved measurements without running (measurements are tensor
bytes, deterministic), so the same file prices the planner of another checkout (``PYTHONPATH`` of it
first): the before / after comparison of docs/planner.md.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

MODELS = ("lora", "lora_full", "frozen_backbone", "llama_frozen_embed", "llama_full")
STRATEGIES = {"single": {}, "ddp": {"dp_replicate": 2}, "fsdp": {"dp_shard": 2}}
GLOBAL_BATCH = 8
PARTS = ("params", "grads", "optimizer", "activations", "total")
MIB = 2 ** 20


def cases(models=MODELS) -> list:
    """One `modelpar.measure.Case` per model and strategy (global batch 8, local 8 / 4)."""
    from modelpar.measure import Case
    from modelpar.plan import ParallelPlan

    out = []
    for m in models:
        for s, deg in STRATEGIES.items():
            p = ParallelPlan(**deg)
            out.append(Case(f"{m}/{s}", f"helpers.frozen_factory:{m}", p.to_dict(), GLOBAL_BATCH,
                            GLOBAL_BATCH // p.dp))
    return out


def predicted(case, fused: bool) -> dict[str, float]:
    """The planner's parts for ``case`` with this checkout's code (its factory profile, as `modelpar
    plan` makes it; gloo collectives and the optimizer kernel the run used)."""
    from modelpar.cli.common import profile_for
    from modelpar.plan import ParallelPlan
    from modelpar.planner.memory import Batch, estimate_memory

    plan = ParallelPlan.from_dict(case.plan)
    prof = profile_for(case.model, {}, case.seq_len, plan.precision)[0]
    e = estimate_memory(prof, plan, Batch(case.global_batch_size, case.local_batch_size), optimizer=case.optimizer,
                        gloo=True, fused=fused)
    return {"params": e.params + e.fsdp_gathered, "grads": e.grads, "optimizer": e.optimizer,
            "activations": e.activations + e.comm_buffers + e.overhead, "total": e.total,
            # (a checkout before frozen parameters were priced: all of them trainable to its planner)
            "trainable": getattr(prof, "trainable_params", prof.num_params), "num_params": prof.num_params}


def measured(result: dict) -> dict[str, float]:
    pk = result["peak"]
    return {"params": pk["Parameter"], "grads": pk["Gradient"], "optimizer": pk["Optstate"],
            "activations": pk["Activation"] + pk["Temp"] + pk["Buffer"] + pk["Other"], "total": pk["Total"]}


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default=",".join(MODELS))
    ap.add_argument("--save", metavar="FILE", help="write the measurements (JSON) to FILE")
    ap.add_argument("--measured", metavar="FILE", help="re-predict against measurements saved with --save")
    ap.add_argument("--timeout", type=float, default=1200)
    args = ap.parse_args(argv)
    cs = cases(args.models.split(","))
    t = time.perf_counter()
    if args.measured:
        saved = json.loads(open(args.measured).read())
        res = {c.name: saved[c.name] for c in cs if c.name in saved}
    else:
        from modelpar.measure import launch
        res = launch(cs, 2, timeout=args.timeout)
    if args.save:
        with open(args.save, "w") as f:
            json.dump(res, f, indent=1)
    print("MiB at the peak of step 3: measured / predicted (relative error) per part")
    print(f"{'case':<26} {'trainable':>10} " + " ".join(f"{k:>25}" for k in PARTS) + "   (trainable: the planner's view)")
    bad = 0
    for c in cs:
        r = res.get(c.name)
        if r is None or "error" in r:
            print(f"{c.name:<26} ERROR {(r or {}).get('error', 'no result')[:200]}")
            bad += 1
            continue
        m, p = measured(r), predicted(c, bool(r.get("fused")))
        cells = [f"{m[k] / MIB:7.2f} / {p[k] / MIB:7.2f} ({(p[k] - m[k]) / m[k] if m[k] else 0.0:+6.1%})"
                 for k in PARTS]
        print(f"{c.name:<26} {p['trainable'] / p['num_params']:>9.1%} " + " ".join(f"{x:>25}" for x in cells))
        bad += abs(p["total"] - m["total"]) > max(0.05 * m["total"], MIB)
    print(f"\n{len(cs) - bad}/{len(cs)} totals within max(5%, 1 MiB) [{time.perf_counter() - t:.0f} s]")
    return 0 if not bad else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
