"""Per-rank peak memory of pipeline schedules: `modelpar train`'s measurement against the planner's.

Each configuration trains 3 steps with ``modelpar train --track-memory`` (the second step is measured
with `modelpar.train.metrics.StepMemory`, as every pipeline run is) and reads each rank's peak from
the run's ``summary.json`` (``peak_tensor_bytes_per_rank``); the prediction is
`modelpar.planner.memory.rank_memory` of every pipeline rank for the same layout (the planner's stage
split, which `train` runs too), gloo collectives, fused AdamW. The V schedules (zbvzerobubble,
dualpipev) are the subject (docs/planner.md "Pipeline memory"); 1f1b and interleaved1f1b are the
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
import subprocess
import sys
import tempfile
from pathlib import Path

MIB = 2 ** 20
LLAMA = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 8, "num_attention_heads": 4,
         "num_key_value_heads": 2, "vocab_size": 256, "max_position_embeddings": 64}
GPT8 = {"n_layer": 8}
# (model, --model-config, seq_len, micro-batch size, label)
MODELS = {"gpt1m": ("gpt-1m", {}, 0, 4), "gpt1m-8l": ("gpt-1m", GPT8, 0, 4), "llama": ("hf:llama", LLAMA, 64, 4)}


def configs() -> list[dict]:
    out = []
    for key, pp in (("gpt1m", 2), ("gpt1m-8l", 4), ("llama", 2), ("llama", 4)):
        for sched, v in (("zbvzerobubble", 2), ("dualpipev", 2), ("1f1b", 1), ("interleaved1f1b", 2)):
            for k in (1, 2, 3):
                m = k * pp
                if sched == "dualpipev" and m < 2 * pp:
                    continue
                if key == "llama" and k == 3:
                    continue
                model, cfg, seq, b = MODELS[key]
                out.append({"name": f"{key}-pp{pp}-{sched}-m{m}", "model": model, "model_config": cfg,
                            "seq_len": seq, "pp": pp, "schedule": sched, "v": v, "m": m, "b": b})
    return out


def _layout(c: dict) -> list[str]:
    return ["--pp", str(c["pp"]), "--pp-schedule", c["schedule"], "--virtual-stages", str(c["v"]),
            "--n-microbatches", str(c["m"]), "--global-batch-size", str(c["m"] * c["b"]), "--nproc", str(c["pp"])]


def measure(c: dict) -> list[int]:
    """Each rank's peak tensor bytes of the measured step of ``modelpar train`` for configuration ``c``."""
    with tempfile.TemporaryDirectory() as d:
        cmd = [sys.executable, "-m", "modelpar", "train", "--model", c["model"], "--steps", "3", "--track-memory",
               "--out-dir", d, "--sample-bytes", "0", "--eval-samples", str(c["m"] * c["b"]), "--log-every", "1",
               *_layout(c)]
        if c["model_config"]:
            cmd += ["--model-config", json.dumps(c["model_config"])]
        if c["seq_len"]:
            cmd += ["--seq-len", str(c["seq_len"])]
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
        runs = list(Path(d).iterdir())
        if r.returncode or not runs:
            raise SystemExit(f"{c['name']}: train failed:\n{r.stdout[-2000:]}\n{r.stderr[-3000:]}")
        return json.loads((runs[0] / "summary.json").read_text())["peak_tensor_bytes_per_rank"]


def predict(c: dict) -> list[float]:
    """The planner's peak of every pipeline rank (bytes), as `estimate_memory` computes each."""
    from modelpar.cli.common import profile_for
    from modelpar.plan import ParallelPlan
    from modelpar.planner.loads import rank_loads
    from modelpar.planner.memory import Batch, in_flight, rank_memory

    plan = ParallelPlan(pp=c["pp"], pp_schedule=c["schedule"], virtual_stages=c["v"], n_microbatches=c["m"])
    prof = profile_for(c["model"], c["model_config"], c["seq_len"], "fp32")[0]     # as `estimate` profiles it
    batch = Batch(c["m"] * c["b"], c["m"] * c["b"])
    loads = rank_loads(prof, plan, act_bytes=4)
    assert in_flight is not None
    return [rank_memory(ld, plan, micro_batch_size=c["b"], optimizer="adamw", overhead_bytes=0.0, pp_rank=r,
                        global_batch_size=batch.global_batch_size, gloo=True).total for r, ld in enumerate(loads)]


def table(data: dict, labels: list[str]) -> str:
    head = "| config | rank | measured MiB | " + " | ".join(f"{k} MiB (err)" for k in labels) + " |"
    lines = [head, "|" + "---|" * (3 + len(labels))]
    sums = {k: {} for k in labels}
    for name, d in data.items():
        fam = "V" if ("zbv" in name or "dualpipev" in name) else "other"
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
