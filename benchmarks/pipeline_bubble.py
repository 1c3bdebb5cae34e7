"""Pipeline bubble per schedule, measured from the schedules' own recorded actions.

Per rank: bubble = 1 - (sum of the time inside each compute action F / B / I / W) / (step time),
with the actions timed by `modelpar.parallel.pipeline.ActionTimer` around torch's own schedule,
beside the formula (p - 1) / (m + p - 1), and (p - 1) / (v m + p - 1) for interleaved schedules
(Narayanan et al. 2021, Sec. 2.2). The zero-bubble schedules (InterleavedZeroBubble, ZBV,
DualPipeV) are reported, not judged: the formula is the 1F1B one and their point is to beat it.
Time outside actions includes the point-to-point sends and receives, so on a CPU with gloo the
measured bubble is above the formula.

Model: MLP 8 x 1024, batch ``--batch`` (default 512), 2 processes, one thread each, m = 8.
Medians of ``--repeats`` (>= 5) alternating repeats; spread = min..max of the step time.

Regenerate the table in docs/parallelism.md:
    OMP_NUM_THREADS=1 python benchmarks/pipeline_bubble.py --out docs/pipeline_bubble.md
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time
from pathlib import Path

from _launch import benchmark_main  # noqa: E402  (benchmarks/_launch.py, beside this script)

CMD = "OMP_NUM_THREADS=1 python benchmarks/pipeline_bubble.py --out docs/pipeline_bubble.md"
SCHEDULES = ("gpipe", "1f1b", "interleaved1f1b", "loopedbfs", "interleavedzerobubble", "zbvzerobubble",
             "dualpipev")
MULTI = SCHEDULES[2:]


def worker(args) -> None:
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F

    from modelpar.models import build_mlp
    from modelpar.parallel.compose import parallelize
    from modelpar.parallel.mesh import build_mesh, init_distributed
    from modelpar.parallel.pipeline import ActionTimer
    from modelpar.plan import ParallelPlan

    torch.set_num_threads(1)
    rank, world = init_distributed(timeout_s=600)
    m, batch = args.microbatches, args.batch
    mesh = None
    rows = {}
    for s in SCHEDULES:
        v = 2 if s in MULTI else 1
        plan = ParallelPlan(pp=2, pp_schedule=s, n_microbatches=m, virtual_stages=v).validate(2)
        mesh = mesh or build_mesh(plan, torch.device("cpu"))
        pm = parallelize(build_mlp([1024] * 9, seed=0), plan, mesh, loss_fn=lambda o, y: F.cross_entropy(o, y),
                         device=torch.device("cpu"), example_input=torch.zeros(batch // m, 1024),
                         block_costs="params")
        g = torch.Generator().manual_seed(0)
        rows[s] = (pm, torch.randn(batch, 1024, generator=g), torch.randint(0, 1024, (batch,), generator=g), v)
    res = {s: {"step_s": [], "busy": []} for s in SCHEDULES}
    for _ in range(args.repeats):
        for s, (pm, x, y, v) in rows.items():
            pm.forward_backward(x, y)          # warm-up
            dist.barrier()
            t0 = time.perf_counter()
            with ActionTimer(pm.schedule) as timer:
                for _ in range(args.steps):
                    pm.forward_backward(x, y)
                    for p in pm.parameters():
                        p.grad = None
            dt = (time.perf_counter() - t0) / args.steps
            t = torch.tensor([dt, timer.busy_seconds() / args.steps], dtype=torch.float64)
            parts = [torch.zeros_like(t) for _ in range(world)]
            dist.all_gather(parts, t)
            res[s]["step_s"].append(max(float(p[0]) for p in parts))
            res[s]["busy"].append([float(p[1] / p[0]) for p in parts])
    if rank == 0:
        out = {s: {"median_s": statistics.median(r["step_s"]), "min_s": min(r["step_s"]),
                   "max_s": max(r["step_s"]),
                   "bubble": [1 - statistics.median(b[i] for b in r["busy"]) for i in range(world)],
                   "v": rows[s][3]} for s, r in res.items()}
        Path(args.json).write_text(json.dumps(out, indent=1))
    dist.destroy_process_group()


def render(res: dict, m: int, batch: int, load) -> str:
    from modelpar.planner.formulas import bubble_share_of_step

    lines = [f"## Pipeline bubble per schedule (MLP 8 x 1024, batch {batch}, m = {m}, 2 processes, 1 thread each)",
             "", f"Load average before the run: {load[0]:.2f} {load[1]:.2f} {load[2]:.2f} on {os.cpu_count()} "
             f"cores (shared machine).", "",
             "| schedule | v | median step (ms) | spread (ms) | measured bubble rank0 / rank1 | formula |",
             "|---|---|---|---|---|---|"]
    for s, r in res.items():
        note = " (reported only)" if s in ("interleavedzerobubble", "zbvzerobubble", "dualpipev") else ""
        lines.append(f"| {s}{note} | {r['v']} | {r['median_s'] * 1e3:.0f} | {r['min_s'] * 1e3:.0f}..{r['max_s'] * 1e3:.0f}"
                     f" | {r['bubble'][0]:.2f} / {r['bubble'][1]:.2f} | {bubble_share_of_step(s, 2, m, r['v']):.2f} |")
    lines += ["", f"Regenerate: `{CMD}`"]
    return "\n".join(lines) + "\n"


def _add_args(ap) -> None:
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--microbatches", type=int, default=8)
    ap.add_argument("--batch", type=int, default=512)


def main() -> int:
    return benchmark_main(__file__, __doc__, json_default="/tmp/pipeline_bubble.json", add_args=_add_args, worker=worker,
                          render=lambda res, args, load: render(res, args.microbatches, args.batch, load), repeats_default=5)


if __name__ == "__main__":
    sys.exit(main())
