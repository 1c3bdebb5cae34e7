"""Where a 2-rank CPU step's wall time goes beyond its CPU work: per rank, wall vs main-thread CPU vs
process CPU (all threads: gloo's worker included), and, for one profiled step, every all-reduce by size
with the main thread's wait per call, beside what the planner prices (count and in-context seconds).

For each case (`planner_accuracy_time.cases_for`: the accuracy benchmark's plans, global batch 32, one
thread per rank, modelpar's own runtime) after 3 warm-up steps: ``--steps`` steps timed between
barriers on every rank (medians), then one step under ``torch.profiler`` (CPU), from which the
all-reduces (``_c10d_functional::all_reduce``: TP's DTensor collectives; ``c10d::allreduce_``: DDP's
buckets and other eager calls) are grouped by their input's byte size, with the duration of the
matching ``_c10d_functional::wait_tensor`` (the time the main thread blocks on the result).

What the columns separate: ``wall - process CPU`` is time no thread of the rank ran (waiting for the
peer, or for a core); ``process - main-thread CPU`` is the communication threads' own work. The slower
rank (larger process CPU) sets the step; the faster one waits for it at every blocking collective.

Run: ``python benchmarks/cpu_step_waits.py [--models gpt-1m] [--plans ddp,fsdp,tp] [--steps 6]
[--hardware CAL.json] [--from-json RUN.json]`` (timings: only meaningful on a quiet host).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from planner_accuracy_time import cases_for, load_hardware  # noqa: E402

from modelpar.bench.step_waits import priced, rank_waits, render  # noqa: E402


def worker(args) -> None:
    import torch
    import torch.distributed as dist

    from modelpar.measure.runs import build_case, step
    from modelpar.parallel.mesh import init_distributed

    init_distributed(timeout_s=300)
    torch.set_num_threads(1)
    cases = [c for m in args.models.split(",") for c in cases_for(m) if c.name.split("/")[1] in args.plans.split(",")]
    out = {}
    for c in cases:
        b = build_case(c)
        for _ in range(3):
            step(b)
        out[c.name] = rank_waits(b, args.steps, step, dist.barrier)
        del b
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, out)
    if dist.get_rank() == 0:
        with open(args.json, "w") as f:
            json.dump(gathered, f)
    dist.destroy_process_group()


def _render(ranks: list[dict], hw) -> str:
    by_name = {c.name: c for m in {n.split("/")[0] for n in ranks[0]} for c in cases_for(m)}
    prices = {n: priced(by_name[n], hw) for n in ranks[0]} if hw is not None else {}
    return render(ranks, prices)


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="gpt-1m")
    ap.add_argument("--plans", default="ddp,fsdp,tp")
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--hardware", default=None, help="calibration JSON for the priced column (default: none)")
    ap.add_argument("--json", default="/tmp/cpu_step_waits.json")
    ap.add_argument("--from-json", default=None,
                    help="render a --json file of an earlier run (e.g. with another --hardware), launching nothing")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.steps < 1:
        raise SystemExit(f"--steps must be >= 1, got {args.steps}")
    if args.worker:
        worker(args)
        return 0
    hw = load_hardware(args.hardware) if args.hardware else None
    if args.from_json:
        with open(args.from_json) as f:
            print(_render(json.load(f), hw))
        return 0
    from _launch import run_worker
    ranks = run_worker(os.path.abspath(__file__), ["--models", args.models, "--plans", args.plans,
                                                   "--steps", str(args.steps), "--json", args.json], args.json)
    print(_render(ranks, hw))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
