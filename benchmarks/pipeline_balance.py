"""Are the stage-cost estimates right? Measured per-stage compute time of FLOP-balanced splits.

For each model and stage count, modelpar splits the blocks by counted FLOPs (embedding and head
included, exact optimal contiguous split) and trains under a pipeline on 2 processes (2 stages:
1F1B; 4 stages: Interleaved1F1B with 2 stages per rank). The compute time of every stage is the
sum of the time inside its own actions (F and B) recorded from torch's schedule
(`modelpar.parallel.pipeline.ActionTimer`). Check: slowest stage <= 1.10 x mean stage,
where the granularity of the blocks allows it, i.e. where the estimated costs of the best split
are themselves within 1.10 (the "estimate bound" column); elsewhere the row is reported only.

Models: the MLP 10000-5000-2000-1000-500-10 (one block holds ~80% of the FLOPs, so it cannot be
balanced) and the GPT gpt-10m with 8 blocks (seq 128).
Medians over ``--repeats`` (>= 5) repeats.

Regenerate the table in docs/parallelism.md:
    OMP_NUM_THREADS=1 python benchmarks/pipeline_balance.py --out docs/pipeline_balance.md
"""

from __future__ import annotations

import json
import os
import statistics
import sys
from pathlib import Path

from _launch import benchmark_main  # noqa: E402  (benchmarks/_launch.py, beside this script)

CMD = "OMP_NUM_THREADS=1 python benchmarks/pipeline_balance.py --out docs/pipeline_balance.md"


def rows():
    import torch

    from modelpar.models import build_gpt, build_mlp

    return {
        "mlp-large": (lambda: build_mlp("mlp-large", seed=0), lambda b: torch.randn(b, 10000),
                      lambda b: torch.randint(0, 10, (b,)), 64),
        "gpt-10m (8 blocks)": (lambda: build_gpt("gpt-10m", n_layer=8, seq_len=128, seed=0),
                               lambda b: torch.randint(0, 256, (b, 128)), lambda b: torch.randint(0, 256, (b, 128)),
                               4),
    }


def worker(args) -> None:
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F

    from modelpar.parallel.compose import parallelize
    from modelpar.parallel.mesh import build_mesh, init_distributed
    from modelpar.parallel.parts import balanced_partition, block_costs, get_model_parts
    from modelpar.parallel.pipeline import ActionTimer
    from modelpar.plan import ParallelPlan

    torch.set_num_threads(1)
    rank, world = init_distributed(timeout_s=900)

    def loss(o, y):
        return F.cross_entropy(o.flatten(0, -2) if o.dim() > 2 else o, y.flatten())
    out = {}
    mesh = None
    for name, (make, xin, yin, batch) in rows().items():
        for stages in (2, 4):
            v = stages // 2
            plan = ParallelPlan(pp=2, virtual_stages=v, n_microbatches=4,
                                pp_schedule="1f1b" if v == 1 else "interleaved1f1b").validate(2)
            mesh = mesh or build_mesh(plan, torch.device("cpu"))
            model = make()
            ex = xin(batch // 4)
            parts = get_model_parts(model)
            est = block_costs(parts, "flops", ex)
            cuts = balanced_partition(est, stages)
            bounds = [0, *cuts, len(est)]
            est_stage = [sum(est[a:b]) for a, b in zip(bounds, bounds[1:])]
            pm = parallelize(model, plan, mesh, loss_fn=loss, device=torch.device("cpu"), example_input=ex,
                             block_costs="flops")
            x, y = xin(batch), yin(batch)
            pm.forward_backward(x, y)
            per_rep = []
            for _ in range(args.repeats):
                with ActionTimer(pm.schedule) as t:
                    pm.forward_backward(x, y)
                for p in pm.parameters():
                    p.grad = None
                per_rep.append(t.busy_by_stage())
            local = {s: statistics.median(r[s] for r in per_rep) for s in per_rep[0]}
            gathered = [None] * world
            dist.all_gather_object(gathered, local)
            if rank == 0:
                merged = {int(k): v for d in gathered for k, v in d.items()}
                meas = [merged[i] for i in range(stages)]
                out[f"{name}|{stages}"] = {
                    "ranges": pm.stage_ranges, "measured_s": meas,
                    "measured_ratio": max(meas) / statistics.mean(meas),
                    "estimate_ratio": max(est_stage) / statistics.mean(est_stage)}
            dist.barrier()
    if rank == 0:
        Path(args.json).write_text(json.dumps(out, indent=1))
    dist.destroy_process_group()


def render(res: dict, load) -> str:
    lines = ["## Stage balance: measured compute per stage of FLOP-balanced splits (2 processes)", "",
             f"Load average before the run: {load[0]:.2f} {load[1]:.2f} {load[2]:.2f} on {os.cpu_count()} cores "
             f"(shared machine).", "",
             "| model | stages | block ranges | measured stage compute (ms) | slowest / mean measured | "
             "estimate bound | check (<= 1.10 where the bound allows) |", "|---|---|---|---|---|---|---|"]
    for key, r in res.items():
        name, stages = key.split("|")
        allowed = r["estimate_ratio"] <= 1.10
        verdict = ("PASS" if r["measured_ratio"] <= 1.10 else "FAIL") if allowed else "n/a (granularity)"
        lines.append(f"| {name} | {stages} | {r['ranges']} | {' / '.join(f'{t * 1e3:.0f}' for t in r['measured_s'])}"
                     f" | {r['measured_ratio']:.2f} | {r['estimate_ratio']:.2f} | {verdict} |")
    lines += ["", f"Regenerate: `{CMD}`"]
    return "\n".join(lines) + "\n"


def _add_args(ap) -> None:
    pass


def main() -> int:
    return benchmark_main(__file__, __doc__, json_default="/tmp/pipeline_balance.json", add_args=_add_args, worker=worker,
                          render=lambda res, args, load: render(res, load), repeats_default=5)


if __name__ == "__main__":
    sys.exit(main())
