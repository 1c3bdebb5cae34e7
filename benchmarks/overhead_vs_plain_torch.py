"""modelpar's DDP and FSDP against a plain torch script of the same strategy.

Same model (GPT gpt-1m, seq 128, built by the same call), same data (8 contiguous samples per rank),
same ranks (2 processes, one thread each), same optimizer (`_optimizer`: AdamW, lr 1e-3, torch's
default implementation), same ``zero_grad(set_to_none=True)``, same wrapper options. One timed step =
forward + backward + optimizer step. Per strategy three loops alternate in one run: plain torch (A),
modelpar (M), plain torch again (B), two separately built copies of the same plain script.

The measurement:

- ``--warmup`` repeats first (default 3), timed but excluded;
- then up to ``--repeats`` repeats (default 200) of ``--steps`` steps per loop (default 2). A repeat
  runs both strategies (ddp then fsdp, or the reverse on odd repeats), and per strategy the three
  loops back to back, in an order that cycles through all six orders (shuffled by a fixed seed, the
  same on every rank), so no loop is always first or always after another;
- the repeats stop after ``--max-seconds`` (default 240 s, warm-up included), the same repeat on
  every rank (rank 0 decides, broadcast); stopping on the clock alone, never on the results, keeps
  the estimate unbiased. Both strategies get the same number of repeats (about 74 on this host,
  where a repeat takes ~1.2 s of ddp and ~2.0 s of fsdp). Why 240 s: last session's fsdp row had a
  95% interval of half-width 2.9% after 38 repeats; the half-width shrinks as 1/sqrt(repeats), so
  74 repeats give ~2.1%, enough to decide against the 3% floor for an overhead up to ~0.9%
  (150 s, split evenly, gave fsdp 38 repeats: a decision only for overheads near 0).

The verdict, per strategy, from the n kept repeats (times are rank 0's, between barriers):

- contrast per repeat: d_r = ln(M_r / sqrt(A_r B_r)), modelpar against both plain loops of the same
  repeat (pairing within a repeat cancels load that drifts between repeats);
- overhead = exp(median d_r) - 1, with a 95% percentile-bootstrap interval (2000 resamples of the
  repeats, seed 0);
- null contrast: e_r = ln(B_r / A_r) * sqrt(3)/2, two identical loops, scaled so that with
  independent per-loop noise of variance s^2 both contrasts have variance 1.5 s^2;
- noise floor = max(3%, exp(q) - 1), q = the 95th percentile of |median e_r| over the same
  bootstrap: the overhead two identical loops show in this run, at 95%;
- verdict: **within** if the interval's upper end is at or below the floor, **over** if its lower end
  is above it, else **inconclusive** (the run cannot tell; rerun quieter or with more repeats). A
  floor above 3% is flagged: the run was too noisy to judge the 3% goal itself.

The plain scripts use the torch APIs directly: `DistributedDataParallel(model, broadcast_buffers=False,
gradient_as_bucket_view=True)` (modelpar's `apply_ddp` options), and `fully_shard` on every block then
the root (`apply_fsdp`'s units and options). modelpar's row is `train_step` as `modelpar train` runs
it between log steps without clipping: the gradient-use check (case C12) included -- under FSDP one
all-reduce of a few int64 words per step, under DDP a hook per parameter and a local look at the marks
after the first step (no collective; it was an all-gather every step, 1-2 ms per step on a 2-core
host, measured session 12, the ddp row's whole excess on a fast host) -- no loss read
on the host and no global gradient norm (nothing clips or logs it
here); `tests/test_step_overhead.py` and `benchmarks/overhead_op_counts.py` count that per-step work.

Regenerate the table in docs/overhead_vs_plain_torch.md:
    OMP_NUM_THREADS=1 python benchmarks/overhead_vs_plain_torch.py --out docs/overhead_vs_plain_torch.md
A quick check that it runs (numbers meaningless): ``--repeats 5 --warmup 1 --steps 1``.
"""

from __future__ import annotations

import itertools
import json
import math
import os
import random
import statistics
import sys
import time
from pathlib import Path

from _launch import benchmark_main  # noqa: E402  (benchmarks/_launch.py, beside this script)

CMD = "OMP_NUM_THREADS=1 python benchmarks/overhead_vs_plain_torch.py --out docs/overhead_vs_plain_torch.md"
SEQ, PER_RANK = 128, 8


def _optimizer(params):
    """The one optimizer both kinds of loop use: AdamW, lr 1e-3, torch's default implementation for
    these parameters (on CPU the single-tensor loop; `train_step` is given whatever optimizer the
    caller built, so the optimizer is no part of modelpar's per-step cost)."""
    import torch

    return torch.optim.AdamW(list(params), lr=1e-3)


def plain_step(strategy: str, grad_clip: float = 0.0):
    """The plain torch loop: the same model, data, optimizer and wrapper options as modelpar's
    (DDP: ``broadcast_buffers=False, gradient_as_bucket_view=True`` as `apply_ddp`; FSDP: every
    block with ``reshard_after_forward=True``, then the root with False, fp32, as `apply_fsdp`).
    ``grad_clip > 0``: `torch.nn.utils.clip_grad_norm_` before the optimizer step (op counts only)."""
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F

    from modelpar.models import build_gpt

    model = build_gpt("gpt-1m", seq_len=SEQ, seed=0)
    if strategy == "ddp":
        from torch.nn.parallel import DistributedDataParallel as DDP
        run = DDP(model, broadcast_buffers=False, gradient_as_bucket_view=True)
    else:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard
        mesh = init_device_mesh("cpu", (dist.get_world_size(),))
        for b in model.blocks:
            fully_shard(b, mesh=mesh, reshard_after_forward=True)
        fully_shard(model, mesh=mesh, reshard_after_forward=False)
        run = model
    opt = _optimizer(model.parameters())
    x, y = _batch(dist.get_rank())

    def step():
        F.cross_entropy(run(x).float().flatten(0, 1), y.flatten()).backward()
        if grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
    return step


def modelpar_step(strategy: str, grad_clip: float = 0.0):
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
    opt = _optimizer(pm.parameters())
    xs, ys = zip(*(_batch(r) for r in range(world)))
    xg, yg = torch.cat(xs), torch.cat(ys)         # the global batch; each rank takes its own slice

    def step():
        train_step(pm, opt, xg, yg, accum_steps=1, grad_clip=grad_clip)
    return step


def _batch(rank: int):
    """This rank's (inputs, targets), each contiguous: the same memory layout as the slice of the
    concatenated global batch `train_step` takes (a strided view would cost the plain loop copies)."""
    import torch

    g = torch.Generator().manual_seed(100 + rank)
    w = torch.randint(0, 256, (PER_RANK, SEQ + 1), generator=g)
    return w[:, :-1].contiguous(), w[:, 1:].contiguous()


ROWS = ("plain torch (A)", "modelpar", "plain torch (B)")
ORDERS = tuple(itertools.permutations(range(3)))      # the six orders of the three loops
FLOOR_MIN, LEVEL, RESAMPLES = 0.03, 0.95, 2000


def _orders(n: int, seed: int = 0) -> list[tuple[int, ...]]:
    """``n`` orders of the three loops: each block of six holds every order once, shuffled."""
    rng = random.Random(seed)
    out: list[tuple[int, ...]] = []
    while len(out) < n:
        block = list(ORDERS)
        rng.shuffle(block)
        out += block
    return out[:n]


def worker(args) -> None:
    import torch
    import torch.distributed as dist

    from modelpar.parallel.mesh import init_distributed

    torch.set_num_threads(1)
    rank, world = init_distributed(timeout_s=900)
    strategies = ("ddp", "fsdp")
    fns = {s: (plain_step(s), modelpar_step(s), plain_step(s)) for s in strategies}
    times: dict[str, list[list[float]]] = {s: [] for s in strategies}    # per repeat: s/step of A, M, B
    spent = dict.fromkeys(strategies, 0.0)
    t_start = time.perf_counter()
    for r, order in enumerate(_orders(args.warmup + args.repeats)):
        for s in (strategies if r % 2 == 0 else strategies[::-1]):   # strategies interleaved per repeat
            row = [0.0, 0.0, 0.0]
            t_s = time.perf_counter()
            for k in order:
                dist.barrier()
                t0 = time.perf_counter()
                for _ in range(args.steps):
                    fns[s][k]()
                dist.barrier()
                row[k] = (time.perf_counter() - t0) / args.steps
            spent[s] += time.perf_counter() - t_s
            if r >= args.warmup:
                times[s].append(row)
        # stop on the clock only, the same repeat on every rank
        stop = torch.tensor([float(r >= args.warmup + 4 and time.perf_counter() - t_start > args.max_seconds)])
        dist.broadcast(stop, 0)
        if stop.item():
            break
    res = {s: {"times_s": times[s], "steps": args.steps, "warmup": args.warmup, "seconds": spent[s]}
           for s in strategies}
    if rank == 0:
        Path(args.json).write_text(json.dumps(res, indent=1))
    dist.destroy_process_group()


def _quantile(xs: list[float], q: float) -> float:
    s = sorted(xs)
    i = q * (len(s) - 1)
    lo = math.floor(i)
    return s[lo] + (s[min(lo + 1, len(s) - 1)] - s[lo]) * (i - lo)


def verdict(times: list[list[float]], *, seed: int = 0) -> dict:
    """The statistics of one strategy (rule in the module docstring) from ``times``: per kept repeat
    ``[A, M, B]`` seconds per step. Returns overhead, its 95% interval, the noise floor (fractions,
    0.03 = 3%) and the verdict ("within", "over" or "inconclusive").

    Raises:
        ValueError: fewer than 5 repeats, or a time that is not positive.
    """
    if len(times) < 5:
        raise ValueError(f"verdict needs at least 5 kept repeats, got {len(times)}")
    if any(t <= 0 for row in times for t in row):
        raise ValueError("verdict: every time must be positive")
    d = [math.log(m / math.sqrt(a * b)) for a, m, b in times]
    e = [math.log(b / a) * math.sqrt(3) / 2 for a, _, b in times]
    rng = random.Random(seed)
    n = len(times)
    boot_d, boot_e = [], []
    for _ in range(RESAMPLES):
        idx = [rng.randrange(n) for _ in range(n)]
        boot_d.append(statistics.median(d[i] for i in idx))
        boot_e.append(abs(statistics.median(e[i] for i in idx)))
    lo, hi = (math.exp(_quantile(boot_d, q)) - 1 for q in ((1 - LEVEL) / 2, (1 + LEVEL) / 2))
    floor = max(FLOOR_MIN, math.exp(_quantile(boot_e, LEVEL)) - 1)
    over = math.exp(statistics.median(d)) - 1
    word = "within" if hi <= floor else "over" if lo > floor else "inconclusive"
    return {"overhead": over, "low": lo, "high": hi, "floor": floor, "verdict": word, "repeats": n,
            "plain_vs_plain": math.exp(statistics.median(math.log(b / a) for a, _, b in times)) - 1}


def render(res: dict, load) -> str:
    lines = ["## modelpar vs plain torch (GPT gpt-1m, seq 128, 8 samples per rank, 2 processes, 1 thread each)", "",
             f"Load average before the run: {load[0]:.2f} {load[1]:.2f} {load[2]:.2f} on {os.cpu_count()} cores.", "",
             "Rule (benchmarks/overhead_vs_plain_torch.py): overhead = median over repeats of modelpar against "
             "both plain loops of the same repeat, with its 95% bootstrap interval; floor = max(3%, what two "
             "identical plain loops differ by at 95%); within = the interval's top at or below the floor.", "",
             "| strategy | repeats x steps | plain A median (ms) | modelpar median (ms) | plain B median (ms) "
             "| B vs A | overhead (95% interval) | noise floor | verdict |", "|---|---|---|---|---|---|---|---|---|"]
    verdicts = []
    for s, r in res.items():
        v = verdict(r["times_s"])
        med = [statistics.median(row[k] for row in r["times_s"]) * 1e3 for k in range(3)]
        lines.append(f"| {s} | {v['repeats']} x {r['steps']} | {med[0]:.0f} | {med[1]:.0f} | {med[2]:.0f} | "
                     f"{v['plain_vs_plain'] * 100:+.1f}% | {v['overhead'] * 100:+.1f}% "
                     f"({v['low'] * 100:+.1f}% .. {v['high'] * 100:+.1f}%) | {v['floor'] * 100:.1f}% | "
                     f"{v['verdict']} |")
        noisy = " (noisy run: the floor is above 3%, so this is no 3% verdict)" if v["floor"] > FLOOR_MIN else ""
        verdicts.append(f"{s}: {v['verdict']}{noisy} (overhead {v['overhead'] * 100:+.1f}%, 95% interval "
                        f"{v['low'] * 100:+.1f}%..{v['high'] * 100:+.1f}%, floor {v['floor'] * 100:.1f}%, "
                        f"{v['repeats']} repeats, {r['seconds']:.0f} s)")
    lines += ["", *[f"- {t}" for t in verdicts], "", f"Regenerate: `{CMD}`"]
    return "\n".join(lines) + "\n"


def _add_args(ap) -> None:
    ap.add_argument("--steps", type=int, default=2, help="steps per loop and repeat")
    ap.add_argument("--warmup", type=int, default=3, help="repeats timed first and excluded")
    ap.add_argument("--max-seconds", type=float, default=240.0,
                    help="bound on the timed repeats (both strategies, interleaved), warm-up included")


def main() -> int:
    return benchmark_main(__file__, __doc__, json_default="/tmp/overhead_vs_plain_torch.json", add_args=_add_args, worker=worker,
                          render=lambda res, args, load: render(res, load), repeats_default=200)


if __name__ == "__main__":
    sys.exit(main())
