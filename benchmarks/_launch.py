"""Shared by the benchmark scripts: launch a script's own 2-rank worker through torchrun, read its JSON."""

from __future__ import annotations

import os
from pathlib import Path


def run_worker(script: str, worker_args: list[str], out: str, *, nproc: int = 2, timeout_s: float = 3600) -> dict:
    """Run ``script --worker ...`` on ``nproc`` local ranks (one thread each, `modelpar.launch`) and
    return the JSON the worker wrote to ``out``. The results count once written, even if a rank then
    failed while shutting down.

    Raises:
        SystemExit: the worker ended (or was killed at ``timeout_s``) without writing ``out``.
    """
    from modelpar.launch import run_workers

    run = run_workers([script, "--worker", *worker_args], nproc, out, timeout_s=timeout_s)
    print(run.output, end="")
    if run.result is None:
        raise SystemExit(f"the benchmark worker failed ({run.reason()}) before writing {out}")
    return run.result


def benchmark_main(script: str, doc: str, *, json_default: str, add_args, worker, render,
                   repeats_default: int = 5) -> int:
    """The shared command line of the 2-rank benchmarks.

    ``add_args(ap)`` adds the script's own options; ``worker(args)`` is what each rank runs (with
    ``--worker``); ``render(result, args, load)`` turns the worker's JSON into the Markdown table, printed
    and written to ``--out``. Every option except ``--out`` is forwarded to the ranks.
    """
    import argparse

    ap = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=repeats_default, help="alternating repeats (>= 5)")
    add_args(ap)
    ap.add_argument("--json", default=json_default, help="where the ranks write their raw results")
    ap.add_argument("--out", default=None, help="write the markdown table here")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.repeats < 5:
        ap.error("--repeats must be >= 5")
    if args.worker:
        worker(args)
        return 0
    load = os.getloadavg()
    forward = [x for k, v in vars(args).items() if k not in ("out", "worker")
               for x in (f"--{k.replace('_', '-')}", str(v))]        # options are spelt with dashes
    text = render(run_worker(script, forward, args.json), args, load)
    print(text)
    if args.out:
        Path(args.out).write_text(text)
    return 0
