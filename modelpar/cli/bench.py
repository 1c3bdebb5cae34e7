"""``modelpar bench``: measure strategies on built-in, Hugging Face or your own models; tables and charts.

Every row is its own launch (`modelpar.launch.run_workers`); its result is appended to ``bench.csv``
at once, so an interrupted bench keeps the rows already measured (``--resume`` continues in the same
folder). The last line printed is the output folder. The run itself: `modelpar.bench.suite`.
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass
from pathlib import Path

from modelpar.cli.args import add_fields, given_fields, make_parser, normalize_argv, parse
from modelpar.cli.options import BATCH_TERMS, BatchOptions, HardwareOptions, LayoutOptions, ModelOptions, PartsOptions

EXAMPLES = """examples:
  modelpar bench                                  # gpt-3m and mlp-large, 2 ranks (4 for the hybrid rows)
  modelpar bench --models gpt-3m --strategies ddp,fsdp,pp --steps 10
  modelpar bench --docs docs                      # also refresh docs/bench.md and docs/img/
  modelpar bench --models hf:llama --model-config '{"hidden_size": 256, "num_hidden_layers": 4,
      "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 256}' --seq-len 128 --strategies ddp,fsdp,tp,pp
"""


@dataclass
class BenchOptions:
    """The rows and how they are measured.

    Args:
        models: comma-separated models, one table each: built-in names, module:factory language models,
            or Hugging Face models (hf:<model_type>, a config.json path; docs/your-model.md).
        strategies: comma-separated rows (single, placement, ddp, fsdp, tp, pp, pp-gpipe, pp-interleaved,
            hybrid, hsdp, auto).
        hybrid_nproc: ranks of the hybrid rows (--nproc: ranks of the other multi-rank rows).
        warmup: untimed steps per row (the first step builds the pipeline and profiler state).
        steps: timed steps per row.
        threads: torch threads per rank.
        timeout: seconds per row before its launch is killed.
        out_dir: output folder (empty: bench-out/<date-time>).
        resume: skip rows already in OUT_DIR/bench.csv.
        fit: write the fit tables (which sizes fit on how many devices) and run their spot checks.
        spot_check: model:strategy:ranks runs checking the local fit table (empty: none).
        docs: also write DOCS/bench.md (its generated block) and DOCS/img/*.png.
    """

    models: str = "gpt-3m,mlp-large"
    strategies: str = ""
    hybrid_nproc: int = 4
    warmup: int = 1
    steps: int = 5
    threads: int = 1
    timeout: float = 240.0
    out_dir: str = ""
    resume: bool = False
    fit: bool = True
    spot_check: str = "gpt-100m:single:1,gpt-100m:fsdp:2"
    docs: str = ""


def build_parser():
    from modelpar.bench.runner import DEFAULT_ROWS

    p = make_parser("modelpar bench", __doc__.split("\n\n")[0].split(": ", 1)[1], epilog=EXAMPLES + "\n" + BATCH_TERMS)
    add_fields(p, BenchOptions, defaults={"strategies": ",".join(DEFAULT_ROWS)})
    add_fields(p, ModelOptions, defaults={"model": ""},
               docs={"model": "one model, the shared spelling of --models MODEL (empty: --models)."})
    add_fields(p, PartsOptions)
    add_fields(p, LayoutOptions, only=("nproc",))
    add_fields(p, BatchOptions, defaults={"global_batch_size": 0},
               docs={"global_batch_size": "samples per optimizer step (0: 8; 32 for the MLPs: the rows of "
                     "docs/bench.md)."})
    add_fields(p, HardwareOptions)
    return p


def main(argv: list[str]) -> int:
    """``modelpar bench`` entry point; returns the exit code (0 ok, 2 bad arguments, 130 interrupted)."""
    from modelpar.bench.runner import ROWS
    from modelpar.bench.suite import run_bench

    p = build_parser()
    argv = normalize_argv(argv, p, prog="modelpar bench")
    args = parse(p, argv)
    bad = [k for k in args.strategies.split(",") if k and k not in ROWS]
    if bad:
        raise ValueError(f"unknown strategies {bad}; valid: {', '.join(ROWS)}")
    from modelpar.models.spec import check_model

    if args.model:                              # the shared --model: one table
        if "models" in given_fields(p, argv):
            raise ValueError(f"give --model or --models, not both (--model {args.model}, --models {args.models})")
        args.models = args.model
    models = [m for m in args.models.split(",") if m]
    if args.model_config and len(models) != 1:
        raise ValueError(f"--model-config applies to one model; --models names {len(models)}: {models}")
    for m in models:                            # unknown names and bad --model-config fail here
        check_model(m, args.model_config or None)
    for name in ("nproc", "hybrid_nproc", "steps", "threads"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if not args.hardware:                       # this machine: its calibration, else the estimate (one line)
        from modelpar.calibrate import default_calibration_path, machine_hardware

        note = machine_hardware(args.nproc)[1]
        args.hardware = str(default_calibration_path()) if default_calibration_path().is_file() else "cpu"
        if "uncalibrated" in note:
            print(note, file=sys.stderr)
    out = Path(args.out_dir or f"bench-out/{time.strftime('%Y%m%d-%H%M%S')}")
    out.mkdir(parents=True, exist_ok=True)
    return run_bench(args, out, argv)


def bench_main(argv: list[str]) -> int:
    """``main`` with bad input reported as ``modelpar bench: error: ...`` and exit code 2."""
    from modelpar.cli.args import report_errors

    return report_errors(main, argv, "modelpar bench")
