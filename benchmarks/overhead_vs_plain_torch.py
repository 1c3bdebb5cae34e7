"""modelpar's DDP and FSDP against a plain torch script of the same strategy.

Same model (GPT gpt-1m, seq 128), same global batch (8 per rank), same ranks (2 processes, one
thread each), same optimizer (AdamW). One timed step = forward + backward + optimizer step.
Per strategy three rows alternate in one run: plain torch (A), modelpar, plain torch again (B).
Overhead = modelpar median / plain-A median - 1, judged against max(3%, |B - A| / A), the noise
floor the two identical plain rows show on this machine. Medians of ``--repeats`` (>= 5)
alternating repeats; spread = min..max.

The plain scripts use the torch APIs directly: `DistributedDataParallel(model)`, and
`fully_shard` on every block then the root. modelpar's row is `train_step` as `modelpar train` runs
it between log steps: the gradient-use check (case C12, one all-gather of a few bytes) included, no
loss read on the host and no global gradient norm (nothing clips or logs it here);
`tests/test_step_overhead.py` counts that per-step work.

Regenerate the table in docs/parallelism.md:
    OMP_NUM_THREADS=1 python benchmarks/overhead_vs_plain_torch.py --out docs/overhead_vs_plain_torch.md
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time
from pathlib import Path

from _launch import benchmark_main  # noqa: E402  (benchmarks/_launch.py, beside this script)

CMD = "OMP_NUM_THREADS=1 python benchmarks/overhead_vs_plain_torch.py --out docs/overhead_vs_plain_torch.md"
SEQ, PER_RANK = 128, 8


def plain_step(strategy: str):
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F

    from modelpar.models import build_gpt

    model = build_gpt("gpt-1m", seq_len=SEQ, seed=0)
    if strategy == "ddp":
        from torch.nn.parallel import DistributedDataParallel as DDP
        run = DDP(model)
    else:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard
        mesh = init_device_mesh("cpu", (dist.get_world_size(),))
        for b in model.blocks:
            fully_shard(b, mesh=mesh)
        fully_shard(model, mesh=mesh, reshard_after_forward=False)
        run = model
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x, y = _batch(dist.get_rank())

    def step():
        F.cross_entropy(run(x).float().flatten(0, 1), y.flatten()).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return step


def modelpar_step(strategy: str):
    import torch
    import torch.distributed as dist

    from modelpar.models import build_gpt
    from modelpar.parallel.compose import parallelize
    from modelpar.parallel.mesh import build_mesh
    from modelpar.plan import plan_for_strategy
    from modelpar.train.step import train_step
    from modelpar.train.task import lm_loss

    world = dist.get_world_size()
    plan = plan_for_strategy(strategy, world)
    pm = parallelize(build_gpt("gpt-1m", seq_len=SEQ, seed=0), plan, build_mesh(plan, torch.device("cpu")),
                     loss_fn=lm_loss, device=torch.device("cpu"))
    opt = torch.optim.AdamW(list(pm.parameters()), lr=1e-3)
    xs, ys = zip(*(_batch(r) for r in range(world)))
    xg, yg = torch.cat(xs), torch.cat(ys)         # the global batch; each rank takes its own slice

    def step():
        train_step(pm, opt, xg, yg, accum_steps=1)
    return step


def _batch(rank: int):
    import torch

    g = torch.Generator().manual_seed(100 + rank)
    w = torch.randint(0, 256, (PER_RANK, SEQ + 1), generator=g)
    return w[:, :-1], w[:, 1:]


def worker(args) -> None:
    import torch
    import torch.distributed as dist

    from modelpar.parallel.mesh import init_distributed

    torch.set_num_threads(1)
    rank, world = init_distributed(timeout_s=900)
    res = {}
    for strategy in ("ddp", "fsdp"):
        rows = {"plain torch (A)": plain_step(strategy), "modelpar": modelpar_step(strategy),
                "plain torch (B)": plain_step(strategy)}
        for fn in rows.values():
            fn()                                   # warm-up
        times = {k: [] for k in rows}
        for _ in range(args.repeats):
            for k, fn in rows.items():
                dist.barrier()
                t0 = time.perf_counter()
                for _ in range(args.steps):
                    fn()
                dist.barrier()
                times[k].append((time.perf_counter() - t0) / args.steps)
        res[strategy] = {k: {"median_s": statistics.median(v), "min_s": min(v), "max_s": max(v)}
                         for k, v in times.items()}
    if rank == 0:
        Path(args.json).write_text(json.dumps(res, indent=1))
    dist.destroy_process_group()


def render(res: dict, load) -> str:
    lines = ["## modelpar vs plain torch (GPT gpt-1m, seq 128, 8 samples per rank, 2 processes, 1 thread each)", "",
             f"Load average before the run: {load[0]:.2f} {load[1]:.2f} {load[2]:.2f} on {os.cpu_count()} cores "
             f"(shared machine).", "",
             "| strategy | plain A median (ms) | modelpar median (ms) | plain B median (ms) | spread A / modelpar / B (ms) "
             "| overhead | noise floor max(3%, |B-A|/A) | within |", "|---|---|---|---|---|---|---|---|"]
    for s, r in res.items():
        a, m, b = (r[k] for k in ("plain torch (A)", "modelpar", "plain torch (B)"))
        over = m["median_s"] / a["median_s"] - 1
        floor = max(0.03, abs(b["median_s"] - a["median_s"]) / a["median_s"])
        spread = " / ".join(f"{x['min_s'] * 1e3:.0f}..{x['max_s'] * 1e3:.0f}" for x in (a, m, b))
        lines.append(f"| {s} | {a['median_s'] * 1e3:.0f} | {m['median_s'] * 1e3:.0f} | {b['median_s'] * 1e3:.0f} | "
                     f"{spread} | {over * 100:+.1f}% | {floor * 100:.1f}% | {'yes' if over <= floor else 'NO'} |")
    lines += ["", f"Regenerate: `{CMD}`"]
    return "\n".join(lines) + "\n"


def _add_args(ap) -> None:
    ap.add_argument("--steps", type=int, default=3)


def main() -> int:
    return benchmark_main(__file__, __doc__, json_default="/tmp/overhead_vs_plain_torch.json", add_args=_add_args, worker=worker,
                          render=lambda res, args, load: render(res, load), repeats_default=7)


if __name__ == "__main__":
    sys.exit(main())
