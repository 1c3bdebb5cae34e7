"""Memory accuracy: predicted peak per rank against MemTracker's, part by part.

For each model and strategy (single, ddp, fsdp, tp, pp gpipe / 1f1b on 2 ranks; fsdp x tp on 4),
at two batch sizes (one where activations dominate, one where model states do), the run measures
the peak tensor bytes of step 3 (`modelpar.measure`) and compares it with
`modelpar.planner.memory.estimate_memory` on the model's profile, part by part (params, grads,
optimizer, activations, total: the mapping of MemTracker's reference types to the planner's parts is
in `modelpar.measure.memory`, which also holds the cases, shared with ``tests/test_planner_accuracy.py``),
each the value *at the moment of the peak*. Goal: |error| <= max(5%, 1 MiB) for each.

Hugging Face models from config (``hf-llama``, ``hf-gpt2``, `HF_MODELS`) run single, ddp, fsdp, tp, tp + SP
(``tp_sp``) and pp (gpipe, 1f1b).

Run: ``.venv/bin/python benchmarks/planner_accuracy_memory.py [--models gpt-nano,gpt-1m,hf-llama,...] [--worlds 1,2,4] [--runtime-cases | --only-runtime-cases]``
``--save FILE`` writes the measurements (JSON, per case); ``--measured FILE`` skips the runs and
re-predicts against a saved file (measurements are deterministic tensor bytes, so a model change can
be checked in seconds).
"""

from __future__ import annotations

import argparse
import json
import sys
import time

from modelpar.measure import launch
from modelpar.measure.memory import (BATCHES, HF_MODELS, PARTS, autocast_hf_cases,  # noqa: F401
                                     compare, format_table, make_cases, predict, profile_for, runtime_cases, summary)


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="gpt-nano,gpt-1m,gpt-3m,gpt-10m,mlp-large,hf-llama,hf-gpt2")
    ap.add_argument("--worlds", default="1,2,4")
    ap.add_argument("--timeout", type=float, default=1200)
    ap.add_argument("--save", metavar="FILE", help="write the measurements (JSON) to FILE")
    ap.add_argument("--runtime-cases", action="store_true",
                    help="also the 2-rank runtime cases the tests measure (bucket views, FSDP accumulation, "
                         "selective / every-k checkpointing, bf16 autocast with each checkpointing mode and a pipeline)")
    ap.add_argument("--only-runtime-cases", action="store_true", help="the runtime cases alone")
    ap.add_argument("--measured", metavar="FILE",
                    help="re-predict against measurements saved with --save (no runs)")
    args = ap.parse_args(argv)
    models = args.models.split(",")
    worlds = [int(w) for w in args.worlds.split(",")]
    rows = []
    t = time.perf_counter()
    saved = json.loads(open(args.measured).read()) if args.measured else None
    measured: dict[str, dict] = {}
    by_world = {} if args.only_runtime_cases else make_cases(models, worlds)
    if args.runtime_cases or args.only_runtime_cases:
        by_world.setdefault(2, []).extend(runtime_cases())
        import importlib.util
        if importlib.util.find_spec("transformers") is not None:
            by_world[2].extend(autocast_hf_cases())
    for world, cases in sorted(by_world.items()):
        res = ({c.name: saved[c.name] for c in cases if c.name in saved} if saved is not None
               else launch(cases, world, timeout=args.timeout))
        measured.update(res)
        rows += [compare(c, res.get(c.name, {"error": "no result"})) for c in cases]
    if args.save:
        with open(args.save, "w") as f:
            json.dump(measured, f, indent=1)
    print("measured MiB at the peak of step 3, and (predicted - measured) / measured; ! = outside max(5%, 1 MiB)")
    print(format_table(rows))
    ok = sum(r.get("ok", False) for r in rows)
    print(f"\n{ok}/{len(rows)} cases within max(5%, 1 MiB) on every part [{time.perf_counter() - t:.0f} s]")
    print(summary(rows))
    return 0 if ok == len(rows) else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
