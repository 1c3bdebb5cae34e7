"""GPU check (issue 14, item 7): measured vs predicted step time, peak memory and MFU of GPTs on one GPU.

Needs only torch and modelpar's library modules (models, plan, parallel, planner; not the CLI's
dependencies: no jsonargparse, yaml, tqdm, numpy, transformers). On a machine with a CUDA GPU it:

0. checks that every torch API modelpar uses exists in this torch (`modelpar.bench.gpu.TORCH_APIS`:
   FSDP2, replicate, DTensor / TP, pipelining schedules, DCP, MemTracker, ...), and lists any missing;
1. trains, for GPTs of about 125M, 1B and 3B parameters (`modelpar.bench.gpu.SWEEP_MODELS`: 124M,
   1.02B, 2.91B), in bf16 (autocast, fp32 master weights, fused-attention SDPA, fused AdamW), with
   and without full activation checkpointing, at two sequence lengths (1,024 and 4,096; the
   micro-batch keeps 16,384 tokens per step), ``--warmup`` steps (excluded) then ``--steps`` timed
   steps per row, and prints one table: measured median step time against the planner's
   (`planner.cost.estimate_step` on the built-in profile of the device), measured
   ``torch.cuda.max_memory_allocated`` over the timed steps against `planner.memory.estimate_memory`,
   and MFU = model FLOPs per step (the planner's profile; PaLM App. B) / (step time x 989 TFLOP/s dense
   bf16). The sweep stops starting rows when ``--budget-s`` would be passed (said in the table), and a
   row that runs out of memory is reported and skipped;
2. runs a placement check: gpt-3m split between ``cpu`` and ``cuda:0`` (fp32, TF32 off) against its
   one-device reference, loss by loss over a few SGD steps (tolerance 1e-4 relative).

Everything is printed and also written to ``--out`` (default: ``$OUT`` when set, else
``gpu-check-out``): ``gpu_check.json`` (every row with all its parts) and ``gpu_check.md`` (the table).

Without CUDA (and without ``--device cpu``) it says so and exits 0. ``--device cpu --tiny`` runs the
same code on a tiny GPT on the CPU in seconds (a dry run that catches Python errors before GPU time is
spent; its numbers mean nothing).

Exit status: 0 when every row ran, ran out of memory, or was skipped for the budget, and the placement
check matched; 1 when a row failed with another error or the placement check did not match.

Run: ``PYTHONPATH=. python benchmarks/gpu_check.py [--models gpt-125m,gpt-1b,gpt-3b] [--seqs 1024,4096]
[--tokens 16384] [--steps 4] [--warmup 2] [--budget-s 300] [--out DIR] [--device cpu --tiny]``.
Without a GPU, ``--replay FILE...`` re-predicts recorded runs (``benchmarks/results/``) with this
planner: the way to check a planner change against GPU measurements on a CPU machine.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch

from modelpar.bench.gpu import (DENSE_BF16_PEAK, GOAL_MFU, SWEEP_MODELS, SWEEP_SEQS, TINY_MODELS, TINY_SEQS,
                                TORCH_APIS, audit_torch_apis, hardware_for_device, matmul_flops, placement_check, replay,
                                run_sweep, sweep_rows, sweep_table)


def _ints(s: str) -> tuple[int, ...]:
    return tuple(int(v) for v in s.split(",") if v)


def parse(argv: list[str]) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    ap.add_argument("--tiny", action="store_true", help="a tiny GPT and short sequences (a CPU dry run)")
    ap.add_argument("--models", default=None, help=f"comma-separated, of {', '.join(SWEEP_MODELS)} (default: all)")
    ap.add_argument("--seqs", type=_ints, default=None, help="sequence lengths (default 1024,4096; --tiny: 32,64)")
    ap.add_argument("--ac", default="none,full", help="checkpointing modes (none, full, selective, every-k)")
    ap.add_argument("--tokens", type=int, default=None, help="tokens per step (default 16384; --tiny: 128)")
    ap.add_argument("--steps", type=int, default=4, help="timed steps per row")
    ap.add_argument("--warmup", type=int, default=2, help="untimed steps per row before them")
    ap.add_argument("--budget-s", type=float, default=300.0, help="wall-time budget of the sweep (seconds)")
    ap.add_argument("--out", default=None, help="output folder (default: $OUT, else gpu-check-out)")
    ap.add_argument("--no-placement", action="store_true", help="skip the cpu + cuda:0 placement check")
    ap.add_argument("--replay", nargs="+", metavar="JSON", default=None,
                    help="no GPU needed: re-predict the rows of recorded gpu_check.json files with this planner "
                         "(e.g. benchmarks/results/h100-2026-12-06/*gpu_check.json) and print measured vs predicted")
    args = ap.parse_args(argv)
    table = TINY_MODELS if args.tiny else SWEEP_MODELS
    names = args.models.split(",") if args.models else list(table)
    bad = [n for n in names if n not in table]
    if bad:
        ap.error(f"--models: unknown {bad}; valid: {', '.join(table)}")
    args.model_table = {n: table[n] for n in names}
    args.seqs = args.seqs or (TINY_SEQS if args.tiny else SWEEP_SEQS)
    args.tokens = args.tokens or (128 if args.tiny else 16384)
    args.acs = tuple(a for a in args.ac.split(",") if a)
    if args.steps < 1 or args.warmup < 0:
        ap.error(f"--steps must be >= 1 and --warmup >= 0, got {args.steps} and {args.warmup}")
    return args


def replay_files(paths: list[str]) -> int:
    """`--replay`: each file's rows re-predicted (`modelpar.bench.gpu.replay`), its table, and the median and
    largest |error| of step time and peak memory over its measured rows."""
    import statistics
    for path in paths:
        rec = json.loads(Path(path).read_text())
        print(f"{path}: {rec.get('where', '?')}, torch {rec.get('torch', '?')}; re-predicted by this planner")
        res = replay(rec)
        print("\n" + sweep_table(res) + "\n")
        for key, what in (("step_error", "step time"), ("memory_error", "peak memory")):
            errs = [abs(r[key]) for r in res["rows"] if key in r]
            if errs:
                print(f"{what}: median |error| {statistics.median(errs):.1%}, largest {max(errs):.1%} "
                      f"over {len(errs)} measured rows")
    return 0


def main(argv: list[str]) -> int:
    args = parse(argv)
    if args.replay:
        return replay_files(args.replay)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("gpu_check: no CUDA device is available (torch.cuda.is_available() is False); nothing to check. "
              "Run it on a machine with an NVIDIA GPU (or --device cpu --tiny for a dry run).")
        return 0
    out = Path(args.out or os.environ.get("OUT") or "gpu-check-out")
    out.mkdir(parents=True, exist_ok=True)
    if args.device == "cuda":
        name = torch.cuda.get_device_name(0)
        props = torch.cuda.get_device_properties(0)
        hw = hardware_for_device(name, props.total_memory)
        where = f"{name}, {props.total_memory / 2**30:.0f} GiB, CUDA {torch.version.cuda}"
        torch.backends.cuda.matmul.allow_tf32 = True        # bf16 rows: fp32 matmuls are few (none in blocks)
    else:
        hw = hardware_for_device("NVIDIA H200")             # the prediction path only; numbers mean nothing
        where = "CPU (dry run: the planner's numbers are an H200's, the measured ones this CPU's)"
    print(f"gpu_check: torch {torch.__version__} on {where}; planner profile {hw.name}", flush=True)
    missing = audit_torch_apis()
    print(f"torch API audit: {len(TORCH_APIS) - len(missing)} of {len(TORCH_APIS)} APIs modelpar uses are present"
          + "".join(f"\n  MISSING {n}: {why}" for n, why in missing), flush=True)
    dev = "cuda:0" if args.device == "cuda" else "cpu"
    mm = matmul_flops(dev, n=8192 if args.device == "cuda" else 256)
    print(f"bf16 matmul {'8192' if args.device == 'cuda' else '256'}^3: {mm / 1e12:.1f} TFLOP/s achieved "
          f"({mm / DENSE_BF16_PEAK:.0%} of the {DENSE_BF16_PEAK / 1e12:.0f} TFLOP/s datasheet peak MFU is taken against)",
          flush=True)
    rows = sweep_rows(args.model_table, args.seqs, args.acs, args.tokens)
    print(f"sweep: {len(rows)} rows, {args.warmup} warm-up + {args.steps} timed steps each, "
          f"budget {args.budget_s:.0f} s", flush=True)
    def save(partial: dict) -> None:           # after every row: a killed run still leaves its rows
        (out / "gpu_check.json").write_text(json.dumps({**partial, "partial": True}, indent=1, default=str) + "\n")

    result = run_sweep(rows, dev, hw, budget_s=args.budget_s,
                       steps=args.steps, warmup=args.warmup, models=args.model_table,
                       log=lambda s: print(s, flush=True), on_row=save)
    result["torch"], result["cuda"], result["where"] = torch.__version__, torch.version.cuda, where
    result["torch_api_missing"] = missing
    result["matmul_flops"] = mm
    table = sweep_table(result)
    print("\n" + table + "\n")
    for r in result["rows"]:
        if r["model"] == "gpt-1b" and "mfu" in r:
            print(f"gpt-1b seq {r['seq']} ac {r['ac']}: MFU {r['mfu']:.1%}, goal >= {GOAL_MFU:.0%} of "
                  f"{DENSE_BF16_PEAK / 1e12:.0f} TFLOP/s: {'met' if r['mfu'] >= GOAL_MFU else 'NOT met'}")
    errors = [r for r in result["rows"] if r["status"].startswith("error")]
    ok = not errors
    if not args.no_placement:
        devices = ("cpu", "cuda:0") if args.device == "cuda" else ("cpu", "cpu")
        model = "gpt-nano" if args.tiny else "gpt-3m"
        try:
            torch.cuda.empty_cache() if args.device == "cuda" else None
            pc = placement_check(devices, model_name=model)
            good = pc["max_rel_diff"] <= 1e-4
            print(f"placement {' + '.join(devices)} vs one device ({model}): losses {pc['placement']} vs "
                  f"{pc['reference']}, largest relative difference {pc['max_rel_diff']:.2e} "
                  f"({'matches' if good else 'DOES NOT match'}, tolerance 1e-4)")
        except Exception as e:       # noqa: BLE001 -- reported, and the JSON is still written
            pc, good = {"error": f"{type(e).__name__}: {e}"}, False
            print(f"placement {' + '.join(devices)}: FAILED: {pc['error']}")
        result["placement"] = {**pc, "ok": good}
        ok = ok and good
    (out / "gpu_check.json").write_text(json.dumps(result, indent=1, default=str) + "\n")
    (out / "gpu_check.md").write_text(table + "\n")
    print(f"written: {out / 'gpu_check.json'}, {out / 'gpu_check.md'}"
          + (f"; {len(errors)} row(s) failed with an error" if errors else ""))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
