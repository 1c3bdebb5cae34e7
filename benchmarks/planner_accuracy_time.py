"""Step-time accuracy: predicted against measured median step time of every 2-rank plan.

For the GPT presets and mlp-large at their default batch (global 32, AdamW, fp32, 1 thread per rank),
every 2-rank basic plan (ddp, fsdp, tp, pp gpipe and 1f1b with 4 micro-batches) is measured in one
launch per model, the plans interleaved round by round (`modelpar.measure.time_cases`) so
load changes on the shared machine hit all plans alike, and compared with
`modelpar.planner.cost.estimate_step` using the calibration file (`modelpar calibrate`, micro-benchmarks
only; never fitted to these runs). Only steps of 200 ms or more count towards the goal (median
|error| <= 10%, largest <= 20%); shorter ones are printed for information.

Hugging Face models from config (``hf-llama``: GQA, ``hf-gpt2``: tied head; `HF_TIME_MODELS`) have the
same rows (`HF_PLANS`); their pipelines split the layers where the planner does
(`modelpar.measure.planner_boundaries`).

Run: ``.venv/bin/python benchmarks/planner_accuracy_time.py [--models gpt-3m,gpt-10m,mlp-large,hf-llama] [--rounds 3]``
(run ``modelpar calibrate`` first; ``$MODELPAR_CALIBRATION`` or ``--hardware FILE`` picks the file).
``--save rows.json`` keeps the measured rows; ``--measured rows.json --hardware B.json`` predicts the
same measurements again with another, independent calibration without launching anything.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

from modelpar.plan import ParallelPlan
from modelpar.measure import Case, launch
from modelpar.measure.memory import STRATEGIES_2

PLANS = STRATEGIES_2       # the memory benchmark's 2-rank strategies (modelpar.measure.memory)
GLOBAL_BATCH = 32          # TrainConfig's default
# Hugging Face models from config: name -> (--model, --model-config, seq_len), sized for
# steps of 200 ms or more on one CPU thread per rank; dropout forced to 0.
HF_TIME_MODELS = {
    "hf-llama": ("hf:llama", {"hidden_size": 256, "intermediate_size": 688, "num_hidden_layers": 4,
                              "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 32,
                              "vocab_size": 512, "max_position_embeddings": 256}, 128),
    "hf-gpt2": ("hf:gpt2", {"n_embd": 256, "n_layer": 4, "n_head": 8, "vocab_size": 512, "n_positions": 256,
                            "bos_token_id": 0, "eos_token_id": 0}, 128),
}
HF_PLANS = tuple(PLANS)


def load_hardware(path: str | None = None):
    from modelpar.calibrate import default_calibration_path
    from modelpar.planner.hardware import load_profile
    p = path or default_calibration_path()
    if not os.path.isfile(p):
        raise SystemExit(f"no calibration at {p}: run `modelpar calibrate` (or set MODELPAR_CALIBRATION)")
    return load_profile(p)


def cases_for(model: str, plans=PLANS) -> list[Case]:
    out = []
    spec, cfg, seq = HF_TIME_MODELS.get(model, (model, {}, 0))
    for name, kw in plans.items():
        if model in HF_TIME_MODELS and name not in HF_PLANS:
            continue
        p = ParallelPlan(**kw)
        out.append(Case(f"{model}/{name}", spec, p.to_dict(), GLOBAL_BATCH, GLOBAL_BATCH // p.dp,
                        model_config=cfg, seq_len=seq))
    return out


def predict_seconds(case: Case, hw) -> float:
    from modelpar.measure.memory import profile_for
    from modelpar.planner.cost import estimate_step
    from modelpar.planner.memory import Batch
    return estimate_step(profile_for(case.model, case.model_config, case.seq_len), ParallelPlan.from_dict(case.plan),
                         Batch(case.global_batch_size, case.local_batch_size), hw, optimizer=case.optimizer).total


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="gpt-1m,gpt-3m,gpt-10m,mlp-large,hf-llama,hf-gpt2")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--hardware", default=None, help="calibration JSON (default: the calibrate default path)")
    ap.add_argument("--timeout", type=float, default=1500)
    ap.add_argument("--save", default=None, help="write the rows (measured and predicted) as JSON here")
    ap.add_argument("--measured", default=None,
                    help="a --save file of an earlier run: predict its measured rows again with --hardware "
                         "(a second, independent calibration against the same measurements), launching nothing")
    args = ap.parse_args(argv)
    hw = load_hardware(args.hardware)
    rows = []
    if args.measured:
        with open(args.measured) as f:
            old = json.load(f)
        by_name = {c.name: c for m in {r["case"].split("/")[0] for r in old} for c in cases_for(m)}
        for r in old:
            pred = predict_seconds(by_name[r["case"]], hw)
            rows.append({**r, "pred": pred, "err": pred / r["median"] - 1})
        print(f"[measured rows from {args.measured}; predicted with {args.hardware or 'the default calibration'}]")
    for model in ([] if args.measured else args.models.split(",")):
        cases = cases_for(model)
        load0 = os.getloadavg()[0]
        t = time.perf_counter()
        res = launch(cases, 2, mode="time", rounds=args.rounds, timeout=args.timeout)
        load1 = os.getloadavg()[0]
        for c in cases:
            r = res[c.name]
            pred = predict_seconds(c, hw)
            rows.append({"case": c.name, "pred": pred, **{k: r[k] for k in ("median", "q1", "q3", "n")},
                         "err": pred / r["median"] - 1, "load": (load0 + load1) / 2})
        print(f"[{model}: {time.perf_counter() - t:.0f} s, load average {load0:.1f} -> {load1:.1f}]", flush=True)
    print(f"\n{'case':<22} {'measured median ms':>18} {'IQR ms':>17} {'n':>3} {'predicted ms':>13} {'error':>8} {'load':>5}")
    for r in rows:
        flag = "" if r["median"] >= 0.2 else "  (< 200 ms: not counted)"
        print(f"{r['case']:<22} {r['median'] * 1e3:>18.1f} {r['q1'] * 1e3:>8.1f}-{r['q3'] * 1e3:<8.1f} {r['n']:>3} "
              f"{r['pred'] * 1e3:>13.1f} {r['err']:>+8.1%} {r['load']:>5.1f}{flag}")
    if args.save:
        with open(args.save, "w") as f:
            json.dump(rows, f, indent=1)
    counted = [abs(r["err"]) for r in rows if r["median"] >= 0.2]
    if not counted:
        print("no step of 200 ms or more")
        return 1
    med, worst = statistics.median(counted), max(counted)
    print(f"\n{len(counted)} plans with steps >= 200 ms: median |error| {med:.1%} (goal <= 10%), "
          f"largest {worst:.1%} (goal <= 20%)")
    return 0 if med <= 0.10 and worst <= 0.20 else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
