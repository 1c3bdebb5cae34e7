"""Per-step cost of the rank-divergent parameter check (case C12, `modelpar.parallel.grad_use`).

2 ranks (one thread each), the GPT preset ``--model`` (default gpt-1m, seq 64, 4 samples per rank),
AdamW, under DDP and FSDP. Per strategy two ParallelModels are built from the same weights, one with
``check_unused_params=True`` (the default) and one without, and timed steps alternate between them
(``--steps`` steps per repeat, ``--repeats`` repeats; medians). Reported per strategy: the median
step time with and without the check, their ratio, and the median time of the check alone (one call
of ``ParallelModel.check_grad_use()`` after a backward: under FSDP packing the marks and one
all-reduce of a few int64 words; under DDP after the first step a local look at the marks).

    OMP_NUM_THREADS=1 python benchmarks/unused_param_check.py --out docs/unused_param_check.md

Numbers taken on a shared, loaded machine are indicative only (the load average is printed).
"""

from __future__ import annotations

import json
import statistics
import time
from pathlib import Path

from _launch import benchmark_main  # noqa: E402  (benchmarks/_launch.py, beside this script)

SEQ, PER_RANK = 64, 4


def add_args(ap) -> None:
    ap.add_argument("--model", default="gpt-1m", help="GPT preset")
    ap.add_argument("--steps", type=int, default=5, help="timed steps per repeat and variant")


def worker(args) -> None:
    import torch
    import torch.distributed as dist

    from modelpar.models import build_gpt
    from modelpar.parallel.compose import parallelize
    from modelpar.parallel.mesh import build_mesh, init_distributed
    from modelpar.plan import ParallelPlan
    from modelpar.train.step import adamw, train_step
    from modelpar.train.task import lm_loss

    torch.set_num_threads(1)
    rank, world = init_distributed(120)
    cpu = torch.device("cpu")
    g = torch.Generator().manual_seed(0)
    w = torch.randint(0, 256, (PER_RANK * world, SEQ + 1), generator=g)
    x, y = w[:, :-1], w[:, 1:]
    out = {}
    for name, plan in (("ddp", ParallelPlan(dp_replicate=world)), ("fsdp", ParallelPlan(dp_shard=world))):
        variants = {}
        for check in (True, False):
            pm = parallelize(build_gpt(args.model, seq_len=SEQ, seed=0), plan, build_mesh(plan, cpu),
                             loss_fn=lm_loss, device=cpu, check_unused_params=check)
            variants[check] = (pm, adamw(pm.parameters(), lr=1e-4))
            train_step(pm, variants[check][1], x, y, accum_steps=1)          # warm-up (optimizer state)
        times = {True: [], False: []}
        alone = []
        for _ in range(args.repeats):
            for check in (True, False):
                pm, opt = variants[check]
                dist.barrier()
                t = time.perf_counter()
                for _ in range(args.steps):
                    train_step(pm, opt, x, y, accum_steps=1)
                times[check].append((time.perf_counter() - t) / args.steps)
            pm, opt = variants[True]
            sl = slice(rank * PER_RANK, (rank + 1) * PER_RANK)
            pm.forward_backward(x[sl], y[sl])
            dist.barrier()
            t = time.perf_counter()
            pm.check_grad_use()
            alone.append(time.perf_counter() - t)
            opt.zero_grad(set_to_none=True)
        n_tensors = sum(1 for _ in pm.parameters())
        out[name] = {"on": statistics.median(times[True]), "off": statistics.median(times[False]),
                     "check": statistics.median(alone), "on_all": times[True], "off_all": times[False],
                     "tensors": n_tensors}
    if rank == 0:
        Path(args.json).write_text(json.dumps(out, indent=1))
    from modelpar.launch import exit_rank

    exit_rank(0)


def render(res: dict, args, load) -> str:
    lines = [f"Check of rank-divergent parameter use (C12): {args.model}, seq {SEQ}, {PER_RANK} samples per rank, "
             f"2 CPU ranks, medians of {args.repeats} repeats x {args.steps} steps; load average at start "
             f"{load[0]:.1f} (indicative numbers on a shared machine)", "",
             "| strategy | step, check on (ms) | step, check off (ms) | ratio on/off | check alone (ms) | "
             "parameter tensors |", "|---|---|---|---|---|---|"]
    for name, r in res.items():
        lines.append(f"| {name} | {1e3 * r['on']:.1f} | {1e3 * r['off']:.1f} | {r['on'] / r['off']:.3f} | "
                     f"{1e3 * r['check']:.2f} | {r['tensors']} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    raise SystemExit(benchmark_main(__file__, __doc__, json_default="/tmp/modelpar-unused-check.json",
                                    add_args=add_args, worker=worker, render=render))
