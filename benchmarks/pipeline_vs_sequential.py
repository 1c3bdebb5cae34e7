"""Pipeline parallel vs stage-after-stage model parallel, on 2 CPU processes.

Model: an MLP of 8 Linear layers of width 1024 (ReLU between), batch 1024, cross entropy over 1024
classes; one training step = forward + backward of the whole batch (no optimizer).

Rows (all through modelpar's `parallelize`, one thread per rank):
- baseline: the same 2-stage split through the same pipelining runtime with 1 micro-batch (GPipe),
  i.e. classic model parallel where one process idles while the other works;
- every schedule x micro-batches (4, 8, 16) (the sweep);
- one process with 2 threads running the whole model (no pipeline), on the same table, so one can
  see when a pipeline pays on CPU and when it does not.

Phase 1 (sweep) measures every row; phase 2 re-measures the fastest pipeline configuration, the
baseline and the one-process row in a fresh alternating run. Each number is the median of
``--repeats`` (>= 5) alternating repeats, each repeat the mean of ``--steps`` steps after one
warm-up step; the spread is min..max over repeats. The bubble column is per rank
1 - (time inside the schedule's own actions) / (step time), beside the formula (p-1)/(v m + p-1).

Regenerate the table in docs/parallelism.md:
    OMP_NUM_THREADS=1 python benchmarks/pipeline_vs_sequential.py --out docs/pipeline_vs_sequential.md
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time
from pathlib import Path

from _launch import benchmark_main  # noqa: E402  (benchmarks/_launch.py, beside this script)

WIDTH, LAYERS, BATCH = 1024, 8, 1024
CMD = "OMP_NUM_THREADS=1 python benchmarks/pipeline_vs_sequential.py --out docs/pipeline_vs_sequential.md"
SWEEP = [(s, m) for s in ("gpipe", "1f1b", "interleaved1f1b", "interleavedzerobubble") for m in (4, 8, 16)]


def build(schedule: str, m: int, mesh_cache: dict):
    """(step function, ActionTimer factory or None) for one row on this rank."""
    import torch
    import torch.nn.functional as F

    from modelpar.models import build_mlp
    from modelpar.parallel.compose import parallelize
    from modelpar.parallel.mesh import build_mesh
    from modelpar.plan import ParallelPlan

    model = build_mlp([WIDTH] * (LAYERS + 1), seed=0)
    v = 2 if schedule in ("interleaved1f1b", "interleavedzerobubble") else 1
    plan = ParallelPlan(pp=2, pp_schedule=schedule, n_microbatches=m, virtual_stages=v).validate(2)
    key = plan.mesh_axes()
    if key not in mesh_cache:
        mesh_cache[key] = build_mesh(plan, torch.device("cpu"))
    pm = parallelize(model, plan, mesh_cache[key], loss_fn=lambda o, y: F.cross_entropy(o, y),
                     device=torch.device("cpu"), example_input=torch.zeros(BATCH // m, WIDTH),
                     block_costs="params")
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(BATCH, WIDTH, generator=g), torch.randint(0, WIDTH, (BATCH,), generator=g)

    def step():
        pm.forward_backward(x, y)
        for p in pm.parameters():
            p.grad = None
    return step, pm.schedule, v


def single_process_step():
    import torch
    import torch.nn.functional as F

    from modelpar.models import build_mlp

    model = build_mlp([WIDTH] * (LAYERS + 1), seed=0)
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(BATCH, WIDTH, generator=g), torch.randint(0, WIDTH, (BATCH,), generator=g)

    def step():
        F.cross_entropy(model(x), y).backward()
        for p in model.parameters():
            p.grad = None
    return step


def time_row(row, steps: int, rank: int):
    """Mean step time (s) over ``steps`` after one warm-up, and this rank's busy time inside actions."""
    import torch
    import torch.distributed as dist

    from modelpar.parallel.pipeline import ActionTimer

    kind, fn, schedule = row
    if kind == "single":                 # rank 0 runs the whole model with 2 threads; rank 1 waits
        dist.barrier()
        dt = 0.0
        if rank == 0:
            torch.set_num_threads(2)
            fn()
            t0 = time.perf_counter()
            for _ in range(steps):
                fn()
            dt = (time.perf_counter() - t0) / steps
            torch.set_num_threads(1)
        dist.barrier()
        return dt, 0.0
    fn()
    dist.barrier()
    t0 = time.perf_counter()
    with ActionTimer(schedule) as timer:
        for _ in range(steps):
            fn()
    dist.barrier()
    dt = (time.perf_counter() - t0) / steps
    return dt, timer.busy_seconds() / steps


def measure(rows: dict, repeats: int, steps: int, rank: int) -> dict:
    """Alternating repeats: every row once per repeat, in the same order."""
    import torch
    import torch.distributed as dist

    times = {k: [] for k in rows}
    busy = {k: [] for k in rows}
    for _ in range(repeats):
        for k, row in rows.items():
            dt, b = time_row(row, steps, rank)
            t = torch.tensor([dt, b / max(dt, 1e-12)], dtype=torch.float64)
            all_t = [torch.zeros_like(t) for _ in range(dist.get_world_size())]
            dist.all_gather(all_t, t)
            times[k].append(max(float(a[0]) for a in all_t))
            busy[k].append([float(a[1]) for a in all_t])
    return {k: {"median_s": statistics.median(v), "min_s": min(v), "max_s": max(v), "all_s": v,
                "bubble_per_rank": [1 - statistics.median(r[i] for r in busy[k]) for i in range(2)]}
            for k, v in times.items()}


def worker(args) -> None:
    import torch
    import torch.distributed as dist

    from modelpar.parallel.mesh import init_distributed

    torch.set_num_threads(1)
    rank, _ = init_distributed(timeout_s=600)
    cache: dict = {}

    def pp_row(s, m):
        fn, sched, v = build(s, m, cache)
        return ("pp", fn, sched)
    rows = {"baseline (gpipe, m=1)": pp_row("gpipe", 1)}
    for s, m in SWEEP:
        rows[f"{s}, m={m}"] = pp_row(s, m)
    rows["1 process, 2 threads"] = ("single", single_process_step(), None)
    sweep = measure(rows, args.repeats, args.steps, rank)
    best = min((k for k in sweep if k.startswith(tuple(s for s, _ in SWEEP))), key=lambda k: sweep[k]["median_s"])
    fresh_rows = {k: rows[k] for k in ("baseline (gpipe, m=1)", best, "1 process, 2 threads")}
    fresh = measure(fresh_rows, max(args.repeats, 7), args.steps, rank)
    if rank == 0:
        Path(args.json).write_text(json.dumps({"sweep": sweep, "fresh": fresh, "best": best}, indent=1))
    dist.destroy_process_group()


def render(res: dict, load: tuple) -> str:
    from modelpar.planner.formulas import bubble_share_of_step

    base = res["sweep"]["baseline (gpipe, m=1)"]["median_s"]

    def line(k, r, base_s):
        m = int(k.split("m=")[1].rstrip(")")) if "m=" in k else 0
        v = 2 if "interleaved" in k else 1
        formula = f"{bubble_share_of_step('interleaved1f1b' if v > 1 else '1f1b', 2, m, v):.2f}" if m else "-"
        bub = "/".join(f"{b:.2f}" for b in r["bubble_per_rank"]) if "process" not in k else "-"
        return (f"| {k} | {r['median_s'] * 1e3:.0f} | {r['min_s'] * 1e3:.0f}..{r['max_s'] * 1e3:.0f} | "
                f"{base_s / r['median_s']:.2f}x | {bub} | {formula} |")
    head = ("| configuration | median step (ms) | spread min..max (ms) | speed-up vs baseline | "
            "bubble rank0/rank1 (measured) | bubble formula |\n|---|---|---|---|---|---|")
    out = ["## Pipeline vs stage-after-stage (MLP 8 x 1024, batch 1024, 2 processes, 1 thread each)", "",
           f"Load average before the run: {load[0]:.2f} {load[1]:.2f} {load[2]:.2f} on {os.cpu_count()} cores "
           f"(a shared machine: other jobs ran at the same time).", "",
           "### Sweep (alternating repeats)", "", head]
    out += [line(k, r, base) for k, r in res["sweep"].items()]
    fb = res["fresh"]["baseline (gpipe, m=1)"]["median_s"]
    out += ["", f"### Fresh run: chosen configuration `{res['best']}` against the baseline", "", head]
    out += [line(k, r, fb) for k, r in res["fresh"].items()]
    sp = fb / res["fresh"][res["best"]]["median_s"]
    out += ["", f"Fresh-run speed-up of `{res['best']}` over the baseline: **{sp:.2f}x** (target >= 1.45x; the "
            f"bubble formula allows 2m / (m + 1) over 2 stages: 1.78x at m = 8).", "",
            f"Regenerate: `{CMD}`"]
    return "\n".join(out) + "\n"


def _add_args(ap) -> None:
    ap.add_argument("--steps", type=int, default=2, help="timed steps per repeat (after 1 warm-up)")


def main() -> int:
    return benchmark_main(__file__, __doc__, json_default="/tmp/pipeline_vs_sequential.json", add_args=_add_args, worker=worker,
                          render=lambda res, args, load: render(res, load), repeats_default=5)


if __name__ == "__main__":
    sys.exit(main())
