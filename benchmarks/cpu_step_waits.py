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
[--hardware CAL.json]`` (timings: only meaningful on a quiet host).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from planner_accuracy_time import cases_for, load_hardware  # noqa: E402

WAIT = "_c10d_functional::wait_tensor"
ISSUE = ("_c10d_functional::all_reduce", "c10d::allreduce_")


def _nbytes(shape) -> int:
    n = 4
    for d in shape:
        n *= d
    return n


def worker(args) -> None:
    import torch
    import torch.distributed as dist
    from torch.profiler import ProfilerActivity, profile

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
        rows = []
        for _ in range(args.steps):
            dist.barrier()
            w0, t0, p0 = time.perf_counter(), time.thread_time(), time.process_time()
            step(b)
            rows.append((time.perf_counter() - w0, time.thread_time() - t0, time.process_time() - p0))
        dist.barrier()
        with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
            step(b)
        calls: dict[int, dict[str, list[float]]] = {}
        pending: dict[str, list[int]] = {}
        for e in sorted(prof.events(), key=lambda e: e.time_range.start):
            if e.name == "_c10d_functional::all_reduce" and e.input_shapes:
                nb = _nbytes(e.input_shapes[0])
                calls.setdefault(nb, {"wait": []})
                pending.setdefault("f", []).append(nb)
            elif e.name == WAIT and pending.get("f"):
                calls[pending["f"].pop(0)]["wait"].append(e.cpu_time_total / 1e6)
        eager = sum(1 for e in prof.events() if e.name == "c10d::allreduce_")
        med = [statistics.median(x) for x in zip(*rows)]
        out[c.name] = {"wall": med[0], "thread": med[1], "process": med[2],
                       "funcol": {str(k): v["wait"] for k, v in calls.items()},
                       "eager_all_reduces": eager}
        del b
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, out)
    if dist.get_rank() == 0:
        with open(args.json, "w") as f:
            json.dump(gathered, f)
    dist.destroy_process_group()


def priced(case, hw) -> dict:
    """The planner's TP all-reduce count per step (forward + backward) and in-context seconds per call."""
    from modelpar.measure.memory import profile_for
    from modelpar.plan import ParallelPlan
    from modelpar.planner.comms import _coll
    from modelpar.planner.cost import tp_bytes_per_sample
    from modelpar.planner.memory import rank_loads

    plan = ParallelPlan.from_dict(case.plan)
    if plan.tp == 1:
        return {}
    prof = profile_for(case.model, case.model_config, case.seq_len)
    ld = rank_loads(prof, plan, act_bytes=4)[0]
    nb = tp_bytes_per_sample(prof, plan) * case.local_batch_size
    return {"bytes": nb, "count": 2 * ld.tp_collectives,
            "per_call": _coll(plan, "tp", hw, "all_reduce", nb, plan.tp, True)}


def render(ranks: list[dict], hw) -> str:
    by_name = {c.name: c for m in {n.split("/")[0] for n in ranks[0]} for c in cases_for(m)}
    lines = ["| case | rank | wall ms | main-thread CPU ms | process CPU ms | wall - process | all-reduces (bytes: n, "
             "median / mean wait ms) | priced |", "|---|---|---|---|---|---|---|---|"]
    for name in ranks[0]:
        pr = priced(by_name[name], hw) if hw is not None else {}
        for r, res in enumerate(ranks):
            x = res[name]
            ar = "; ".join(f"{int(k) / 2 ** 20:.3g} MiB: {len(w)}, {statistics.median(w) * 1e3:.2f} / "
                           f"{statistics.fmean(w) * 1e3:.2f}" for k, w in sorted(x["funcol"].items(), key=lambda kv: -int(kv[0])) if w)
            ar = ar or f"{x['eager_all_reduces']} eager"
            p = (f"{pr['count']} x {pr['bytes'] / 2 ** 20:.3g} MiB at {pr['per_call'] * 1e3:.2f} ms" if pr else "")
            lines.append(f"| {name} | {r} | {x['wall'] * 1e3:.1f} | {x['thread'] * 1e3:.1f} | {x['process'] * 1e3:.1f} | "
                         f"{(x['wall'] - x['process']) * 1e3:.1f} | {ar} | {p} |")
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="gpt-1m")
    ap.add_argument("--plans", default="ddp,fsdp,tp")
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--hardware", default=None, help="calibration JSON for the priced column (default: none)")
    ap.add_argument("--json", default="/tmp/cpu_step_waits.json")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.steps < 1:
        raise SystemExit(f"--steps must be >= 1, got {args.steps}")
    if args.worker:
        worker(args)
        return 0
    hw = load_hardware(args.hardware) if args.hardware else None
    from _launch import run_worker
    ranks = run_worker(os.path.abspath(__file__), ["--models", args.models, "--plans", args.plans,
                                                   "--steps", str(args.steps), "--json", args.json], args.json)
    print(render(ranks, hw))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
