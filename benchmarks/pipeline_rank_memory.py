"""Per-rank peak memory of pipeline schedules: `modelpar train`'s measurement against the planner's.

Each configuration trains 3 steps with ``modelpar train --track-memory`` (the second step is measured
with `modelpar.train.metrics.StepMemory`, as every pipeline run is) and reads each rank's peak from
the run's ``summary.json`` (``peak_tensor_bytes_per_rank``); the prediction is
`modelpar.planner.memory.rank_memory` of every pipeline rank for the same layout (the planner's stage
split, which `train` runs too), gloo collectives, fused AdamW. The V schedules (zbvzerobubble,
dualpipev) and the interleaved ones (interleaved1f1b, interleavedzerobubble) are the subject
(docs/planner.md "Pipeline memory"); 1f1b is the
control.

    python benchmarks/pipeline_rank_memory.py --save /tmp/meas.json              # measure + predict
    python benchmarks/pipeline_rank_memory.py --measured /tmp/meas.json --label after --save /tmp/meas.json

``--label`` names the prediction column (several labels side by side: predict with one version of the
code, then another, into the same file). ``--only SUBSTR`` runs the configurations whose name holds it.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from modelpar.measure.rank_memory import MIB, configs, measure, predict


def table(data: dict, labels: list[str]) -> str:
    head = "| config | rank | measured MiB | " + " | ".join(f"{k} MiB (err)" for k in labels) + " |"
    lines = [head, "|" + "---|" * (3 + len(labels))]
    sums = {k: {} for k in labels}
    for name, d in data.items():
        fam = "V" if ("zbv" in name or "dualpipev" in name) else "interleaved" if "interleaved" in name else "1f1b"
        for r, meas in enumerate(d["measured"]):
            cells = []
            for k in labels:
                p = d["pred"].get(k)
                if p is None:
                    cells.append("")
                    continue
                e = (p[r] - meas) / meas
                sums[k].setdefault(fam, []).append(abs(e))
                cells.append(f"{p[r] / MIB:.2f} ({e:+.1%})")
            lines.append(f"| {name} | {r} | {meas / MIB:.2f} | " + " | ".join(cells) + " |")
    for k in labels:
        for fam, es in sorted(sums[k].items()):
            lines.append(f"\n{k}, {fam} schedules: mean |error| {sum(es) / len(es):.1%}, max {max(es):.1%} "
                         f"over {len(es)} ranks")
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--save", help="write measurements and predictions (JSON) here")
    ap.add_argument("--measured", help="re-predict against a saved file (no runs)")
    ap.add_argument("--label", default="before", help="name of this code's prediction column")
    ap.add_argument("--only", default="", help="only configurations whose name contains this")
    args = ap.parse_args(argv)
    data = json.loads(Path(args.measured).read_text()) if args.measured else {}
    for c in configs():
        if args.only not in c["name"]:
            continue
        d = data.setdefault(c["name"], {"config": c, "pred": {}})
        if "measured" not in d:
            d["measured"] = measure(c)
            print(f"{c['name']}: measured {[round(x / MIB, 2) for x in d['measured']]} MiB", flush=True)
        d["pred"][args.label] = predict(c)
        if args.save:
            Path(args.save).write_text(json.dumps(data, indent=1))
    labels = sorted({k for d in data.values() for k in d["pred"]}, key=lambda k: (k != "before", k))
    print(table({k: v for k, v in data.items() if "measured" in v}, labels))
    return 0


if __name__ == "__main__":
    os.environ.setdefault("PYTHONWARNINGS", "ignore")
    sys.exit(main(sys.argv[1:]))
