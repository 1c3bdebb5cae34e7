"""``modelpar plan | estimate | calibrate``: each ``*_main(argv) -> exit code`` builds its own parser."""

from __future__ import annotations

import argparse
import os
import platform
import time

import torch

from modelpar.planner.hardware import BUILTIN, Hardware, cpu_profile, get_hardware, interpolate_sizes, save_profile
from modelpar.plan import AC_MODES

GIB = 2 ** 30


def _profile_builtin(name: str, precision: str):
    from modelpar.models import MLP_PRESETS, build_model
    from modelpar.planner.profile import profile_model
    model = build_model(name, device="meta")
    if name in MLP_PRESETS:
        x = torch.zeros(1, MLP_PRESETS[name][0], device="meta")
    elif name == "cnn":
        model = build_model(name)                    # tiny: profiled under FakeTensorMode
        x = torch.zeros(1, 1, 8, 8)
    else:
        x = torch.zeros(1, model.cfg.seq_len, dtype=torch.long, device="meta")
    return profile_model(model, x, dtype=torch.bfloat16 if precision == "bf16" else torch.float32)


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="gpt-3m", help="built-in model name (gpt-nano .. gpt-70b, mlp-*, cnn)")
    p.add_argument("--devices", "--nproc", type=int, default=2, help="number of devices (world size)")
    p.add_argument("--hardware", default="cpu",
                   help=f"one of {', '.join(BUILTIN)}, 'cpu', or a JSON profile from `modelpar calibrate`")
    p.add_argument("--global-batch-size", type=int, default=32, help="samples per optimizer step")
    p.add_argument("--precision", choices=("fp32", "bf16"), default=None,
                   help="default: fp32 on cpu, bf16 on GPUs")
    p.add_argument("--optimizer", choices=("sgd", "sgd_momentum", "adamw"), default="adamw")
    p.add_argument("--activation-checkpointing", choices=AC_MODES, default=None, help="search only this mode (default: all)")
    p.add_argument("--ac-every", type=int, default=None, metavar="K", help="k of every-k (default: the search tries 2 and 4)")


def _ac_kwargs(args) -> dict:
    """search_plans' checkpointing arguments from --activation-checkpointing / --ac-every."""
    kw = {"checkpointing": (args.activation_checkpointing,)} if args.activation_checkpointing else {}
    if args.ac_every is not None:
        kw["ac_every"] = (args.ac_every,)
    return kw


def _setup(args):
    hw = get_hardware(args.hardware, local_ranks=args.devices if args.hardware == "cpu" else 1)
    prec = args.precision or ("fp32" if hw.name == "cpu" else "bf16")
    return hw, prec, _profile_builtin(args.model, prec)


def _row(i, c, hw, prec) -> str:
    from modelpar.planner.cost import mfu
    st = c.step
    rate = f"{st.tokens_per_s:,.0f} tok/s" if st.tokens_per_sample > 1 else f"{st.samples_per_s:,.1f} smp/s"
    return (f"{i:>3} {c.plan.describe():<58} {c.micro_batch_size:>4} {c.memory.total / GIB:>8.2f} "
            f"{st.total * 1e3:>10.1f} {rate:>18} {mfu(st, hw, prec):>6.1%} {st.comm_share:>6.1%} "
            f"{st.bubble_share:>6.1%}")


def plan_main(argv: list[str]) -> int:
    """Print the top predicted plans for a model on N devices; ``--explain K`` breaks down plan K."""
    p = argparse.ArgumentParser(prog="modelpar plan", description=(
        "Predict memory per device and step time of every parallel layout (dp_replicate x dp_shard x "
        "tp x pp, schedules, micro-batches, checkpointing) and print the fastest that fit."))
    _common(p)
    p.add_argument("--top", type=int, default=10, help="how many plans to print")
    p.add_argument("--explain", type=int, default=None, metavar="K", help="print the breakdown of plan K (1-based)")
    args = p.parse_args(argv)
    from modelpar.planner.search import search_plans
    hw, prec, prof = _setup(args)
    t = time.perf_counter()
    rep = search_plans(prof, args.devices, hw, global_batch_size=args.global_batch_size,
                       optimizer=args.optimizer, precision=prec, **_ac_kwargs(args))
    print(f"{args.model} ({prof.num_params / 1e6:,.1f}M params) on {args.devices} x {hw.name}, "
          f"global batch {args.global_batch_size}, {prec}: {rep.summary()} [{time.perf_counter() - t:.2f} s]")
    if not rep.ranked:
        print("no plan fits; reasons above")
        return 1
    print(f"{'#':>3} {'plan':<58} {'mb':>4} {'GiB/dev':>8} {'step ms':>10} {'throughput':>18} "
          f"{'MFU':>6} {'comm':>6} {'bubble':>6}")
    for i, c in enumerate(rep.ranked[:args.top], 1):
        print(_row(i, c, hw, prec))
    if args.explain:
        if not 1 <= args.explain <= len(rep.ranked):
            p.error(f"--explain {args.explain}: only {len(rep.ranked)} plans are feasible")
        c = rep.ranked[args.explain - 1]
        print(f"\nplan {args.explain}: {c.plan.describe()}  local batch {c.batch.local_batch_size}, "
              f"micro-batch {c.micro_batch_size}\n  {c.plan.to_json()}")
        print(f"  memory per device (pipeline rank {c.memory.pp_rank}, peak at {c.memory.phase}):")
        for k, v in c.memory.parts().items():
            print(f"    {k:<14} {v / GIB:10.3f} GiB")
        print(f"    {'total':<14} {c.memory.total / GIB:10.3f} GiB of {hw.memory_bytes / GIB:.1f}")
        print("  step time:")
        for k, v in c.step.parts().items():
            print(f"    {k:<14} {v * 1e3:10.2f} ms {v / c.step.total:6.1%}")
        print(f"    {'total':<14} {c.step.total * 1e3:10.2f} ms")
    return 0


def estimate_main(argv: list[str]) -> int:
    """Answer "does model X fit on N devices of type Y, and how?"."""
    p = argparse.ArgumentParser(prog="modelpar estimate", description=(
        "Does the model fit on N devices of this type, and with which strategy? Prints the memory per "
        "device of each basic strategy and the planner's best plan."))
    _common(p)
    args = p.parse_args(argv)
    from modelpar.plan import plan_for_strategy
    from modelpar.planner.memory import Batch, estimate_memory
    from modelpar.planner.search import search_plans
    hw, prec, prof = _setup(args)
    n = args.devices
    print(f"{args.model}: {prof.num_params / 1e6:,.1f}M params; {n} x {hw.name} "
          f"({hw.memory_bytes / GIB:.1f} GiB each), {prec}, micro-batch 1")
    for s in (("single",) if n == 1 else ("ddp", "fsdp", "tp", "pp")):
        try:
            plan = plan_for_strategy(s, n, precision=prec)
            local = plan.n_microbatches if plan.pp > 1 else 1
            m = estimate_memory(prof, plan, Batch(local * plan.dp, local), optimizer=args.optimizer,
                                overhead_bytes=hw.framework_overhead_bytes)
            fits = "fits" if m.total <= hw.memory_bytes else "does NOT fit"
            print(f"  {s:<6} {m.total / GIB:10.2f} GiB/device  {fits}")
        except ValueError as e:
            print(f"  {s:<6} not applicable: {e}")
    rep = search_plans(prof, n, hw, global_batch_size=args.global_batch_size, optimizer=args.optimizer,
                       precision=prec, **_ac_kwargs(args))
    if not rep.ranked:
        print(f"no: nothing fits on {n} devices ({rep.summary()})")
        return 1
    c = rep.ranked[0]
    print(f"yes: best plan {c.plan.describe()} (micro-batch {c.micro_batch_size}), "
          f"{c.memory.total / GIB:.2f} GiB/device, {c.step.total * 1e3:.1f} ms/step")
    return 0


# ---- calibrate --------------------------------------------------------------------------------
MATMUL_SIZES = (32, 64, 128, 256, 512, 1024, 2048)
# bytes: from latency-bound (TP activations of tiny models) to a DDP bucket and past it
COLLECTIVE_SIZES = (4 * 2 ** 10, 64 * 2 ** 10, 1 * 2 ** 20, 4 * 2 ** 20, 16 * 2 ** 20, 64 * 2 ** 20)
# fresh-allocation sweep (MiB): straddles glibc's largest dynamic mmap threshold (32 MiB on 64-bit)
FRESH_SIZES_MIB = (8, 16, 31, 33, 64)
COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter", "send_recv")


def default_calibration_path() -> str:
    """``$MODELPAR_CALIBRATION``, else ``~/.cache/modelpar/calibration.json`` (what `--strategy auto` reads)."""
    return os.environ.get("MODELPAR_CALIBRATION",
                          os.path.join(os.path.expanduser("~"), ".cache", "modelpar", "calibration.json"))


def _time(fn, reps: int, *, best: bool = False) -> float:
    """Median (``best``: smallest) seconds of ``fn`` over ``reps`` calls after one warm-up. Compute
    rates take the best call, which a busy neighbour on a shared machine can only slow down;
    collectives take the median, as their spread (TCP on loopback) is part of what training sees."""
    import statistics
    fn()
    ts = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t)
    return min(ts) if best else statistics.median(ts)


def measure_compute(sizes=MATMUL_SIZES) -> dict:
    """Matmul FLOP/s of N x N x N fp32 products over ``sizes``: the peak (``matmul_peak``: the best
    rate of a product repeated on the same operands) and the curve the cost model interpolates
    (`_linear_matmul_rate`); per-op overhead (a tiny add), copy bandwidth. Units: FLOP/s, s, B/s."""
    peak = 0.0
    for n in (256, 512):
        a, b = torch.randn(n, n), torch.randn(n, n)
        peak = max(peak, 2 * n ** 3 / _time(lambda: a @ b, max(7, min(200, int(3e9 // n ** 3))), best=True))
    flops = {n: _linear_matmul_rate(n) for n in sizes}
    overhead = _time(_op_chain, 30, best=True) / (2 * _CHAIN)         # forward op + its backward op
    fresh = _fresh_alloc_costs()     # first: its warm-up leaves the allocator in its steady state
    attn = measure_attention()
    elementwise = measure_elementwise()
    zero_bubble = measure_zero_bubble_backward()
    a, b = torch.ones(32 * 2 ** 20), torch.ones(32 * 2 ** 20)   # 128 MiB each: past the caches
    c = torch.empty_like(a)
    bw = 3 * a.numel() * 4 / _time(lambda: torch.add(a, b, out=c), 5)     # read 2 + write 1
    return {"matmul_flops": flops, "matmul_peak": max(peak, *flops.values()), "op_overhead_s": overhead,
            "mem_bandwidth": bw, "attention_flops": attn, "fresh": fresh, "elementwise_bw": elementwise,
            "zero_bubble_backward_factor": zero_bubble}


def _linear_matmul_rate(n: int, pool_bytes: int = 64 * 2 ** 20) -> float:
    """FLOP/s of the three products a Linear layer runs on ``n x n`` operands -- forward ``x @ W.T``,
    input gradient ``dy @ W``, weight gradient ``dy.T @ x`` -- with operands that are not in cache:
    each call takes the next of as many operand sets as fill ``pool_bytes`` (past the last-level
    cache), as in a training step, where a product's inputs were written by earlier operators long
    evicted. Harmonic mean over the three layouts (equal FLOPs each); the median of 3 passes
    (one above n = 512).
    1 thread, this machine: n=128 75, n=256 94, n=512 101, n=1024 106 GFLOP/s vs 101-108 for the
    same products repeated on the same operands."""
    import statistics
    nbytes = 3 * n * n * 4
    sets = max(2, pool_bytes // nbytes)
    total = 0.0
    src = torch.randn(n, n)
    for layout in ("NT", "NN", "TN"):
        # copies of one random matrix: distinct memory is what matters, and copying is 10x faster
        # than drawing random numbers
        ops = [((src.clone().t() if layout == "TN" else src.clone()),
                (src.clone().t() if layout == "NT" else src.clone()), torch.empty(n, n))
               for _ in range(sets)]

        def run():
            for x, w, o in ops:
                torch.mm(x, w, out=o)
        big = n > 512                   # seconds per pass; cold and repeated rates agree there
        if not big:
            run()
        passes = []
        for _ in range(1 if big else 3):
            t = time.perf_counter()
            run()
            passes.append(time.perf_counter() - t)
        total += statistics.median(passes) / sets
    return 3 * 2 * n ** 3 / total


def measure_elementwise(tokens: int = 2048, width: int = 256) -> float:
    """Bytes/s that a transformer block's non-matmul operators reach, counted as `profile_model`
    counts them (inputs + outputs of each non-view, non-matmul operator), forward + backward, on
    activations of (tokens, width) fp32 and the MLP's (tokens, 4 x width): layer norm, GELU on the
    4x-wide hidden, the head reshapes' copies, two residual adds, cross-entropy. GELU's erf and the
    norms' reductions keep them well below the streaming bandwidth."""
    import torch.nn.functional as F

    from modelpar.planner.profile import count_elementwise_bytes
    x = torch.randn(tokens, width, requires_grad=True)
    hid = torch.randn(tokens, 4 * width, requires_grad=True)
    ln = torch.nn.LayerNorm(width)
    target = torch.randint(0, width, (tokens,))

    def run():
        h = ln(x)
        heads = h.view(tokens // 64, 64, 4, width // 4).transpose(1, 2).contiguous()   # split heads
        u = F.gelu(hid)
        y = x + heads.transpose(1, 2).reshape(tokens, width) + u[:, :width]
        F.cross_entropy(y, target).backward()

    nbytes = count_elementwise_bytes(run)
    return nbytes / _time(run, 9, best=True)


def measure_zero_bubble_backward(tokens: int = 1024, width: int = 256, blocks: int = 6) -> float:
    """How much longer a backward takes when split the zero-bubble way (Qi et al. ICLR'24): torch's
    ``stage_backward_input`` (activation gradients) then ``stage_backward_weight`` (weight gradients,
    from output gradients and activations kept for it), over the plain ``backward()``; on a chain of
    ``blocks`` pre-norm MLP blocks (LayerNorm, Linear width -> 4 width, GELU, Linear back, residual)
    on (tokens, width) fp32 activations. Ratio of backward seconds (medians; forward subtracted).
    1 thread here: 1.07-1.12 (gpt-3m's own blocks: 1.10-1.12, gpt-1m's 1.25: the weight pass reads
    what the input pass left, evicted; the more blocks per stage, the more)."""
    import statistics

    from torch.distributed.pipelining._backward import stage_backward_input, stage_backward_weight

    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.norm = torch.nn.LayerNorm(width)
            self.up, self.down = torch.nn.Linear(width, 4 * width), torch.nn.Linear(4 * width, width)

        def forward(self, x):
            return x + self.down(torch.nn.functional.gelu(self.up(self.norm(x))))
    torch.manual_seed(0)
    net = torch.nn.Sequential(*[Block() for _ in range(blocks)])
    src = torch.randn(tokens, width)

    def fwd():
        with torch.no_grad():
            net(src)

    def plain():
        x = src.clone().requires_grad_()
        y = net(x)
        y.backward(torch.ones_like(y))
        net.zero_grad(set_to_none=True)

    def split():
        x = src.clone().requires_grad_()
        y = net(x)
        _, groups = stage_backward_input([y], [torch.ones_like(y)], [x], net.parameters())
        stage_backward_weight(net.parameters(), groups)
        net.zero_grad(set_to_none=True)
    ratios = []
    for _ in range(2):
        t_f, t_p, t_s = (_time(f, 3) for f in (fwd, plain, split))
        ratios.append((t_s - t_f) / max(t_p - t_f, 1e-9))
    return max(1.0, statistics.median(ratios))


def measure_attention(batch: int = 8, heads: int = 4, seq: int = 256, head_dim: int = 64) -> float:
    """Counted FLOP/s of causal ``scaled_dot_product_attention`` forward + backward (fp32, the fused
    kernel torch picks): FLOPs as the profile counts them (torch's ``sdpa_flop_count``, full (seq x
    seq) products, backward twice the forward) over the measured time."""
    from torch.utils.flop_counter import sdpa_flop_count
    q, k, v = (torch.randn(batch, heads, seq, head_dim, requires_grad=True) for _ in range(3))

    def run():
        torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True).sum().backward()

    return 3 * sdpa_flop_count(q.shape, k.shape, v.shape) / _time(run, 7, best=True)


_CHAIN = 64


def _op_chain() -> None:
    """``_CHAIN`` tiny element-wise ops with autograd on, then their backward: the fixed cost of one
    eager operator (dispatch, autograd node, allocation) without arithmetic to speak of."""
    x = torch.ones(16, requires_grad=True)
    y = x
    for _ in range(_CHAIN):
        y = y * 1.0001
    y.sum().backward()


def _collective_calls(rank: int, world: int, nbytes: int) -> dict:
    """{op: call} issuing each of `COLLECTIVES` on ``nbytes`` (the full, gathered / reduced size) from
    this rank; send/recv runs from rank 0 to rank 1 (other ranks do nothing)."""
    import torch.distributed as dist
    full = torch.zeros(nbytes // 4)
    shard = torch.zeros(nbytes // 4 // world)
    return {"all_reduce": lambda: dist.all_reduce(full),
            "all_gather": lambda: dist.all_gather_into_tensor(full, shard),
            "reduce_scatter": lambda: dist.reduce_scatter_tensor(shard, full),
            "send_recv": (lambda: dist.send(full, 1)) if rank == 0 else
                         (lambda: dist.recv(full, 0)) if rank == 1 else (lambda: None)}


def _collective_worker(rank: int, world: int, port: int, sizes, out):
    import warnings

    import torch.distributed as dist
    warnings.simplefilter("ignore", FutureWarning)     # *_tensor collectives' rename notices
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    res = {op: {} for op in COLLECTIVES}
    # memory bandwidth per rank while every rank streams at once (ranks share the memory bus)
    a, b = torch.ones(16 * 2 ** 20), torch.ones(16 * 2 ** 20)     # 64 MiB each: past the caches
    c = torch.empty_like(a)
    res["mem_bandwidth"] = 3 * a.numel() * 4 / _synced_median(lambda: torch.add(a, b, out=c), 15)
    del a, b, c
    res["fresh"] = _fresh_alloc_costs()
    for nbytes in sizes:
        ops = _collective_calls(rank, world, nbytes)
        for op, fn in ops.items():
            dist.barrier()
            res[op][nbytes] = _time(fn, 7)
    res["in_context"] = _in_context_tables(rank, world, sizes)
    res["framework"] = _framework_overheads(world, res["in_context"]["all_reduce"])
    if rank == 0:
        out.put(res)        # a SimpleQueue writes through: delivered before this process exits
    # leave without destroying the gloo group: its teardown occasionally aborts a rank ("terminate
    # called without an active exception"), which would lose the whole calibration (`exit_rank`)
    from modelpar.parallel.mesh import exit_rank
    exit_rank(0)


def _synced_median(fn, reps: int) -> float:
    """Seconds of ``fn`` with every rank calling it at the same moment (a barrier before each call):
    the median per rank, averaged over the ranks. For rates that ranks share (the memory bus), which a
    rank measuring while the others lag behind would overstate (up to 1.7x here)."""
    import statistics

    import torch.distributed as dist
    fn()
    ts = []
    for _ in range(reps):
        dist.barrier()
        t = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t)
    out = torch.tensor([statistics.median(ts)], dtype=torch.float64)
    dist.all_reduce(out)
    return float(out) / dist.get_world_size()


def _trimmed_mean(ts: list[float]) -> float:
    """Mean of ``ts`` without its top and bottom eighth. The mean is what a step pays; a collective's
    cost between compute segments is bimodal per call (the other rank is already waiting, or not),
    so a median flips between the modes; the trim drops scheduler hiccups."""
    import statistics
    ts = sorted(ts)
    cut = len(ts) // 8
    return statistics.fmean(ts[cut:len(ts) - cut])


def _in_context_tables(rank: int, world: int, sizes, segment_s: float = 0.01) -> dict[str, dict[int, float]]:
    """Seconds of each collective issued the way training issues it: after ~``segment_s`` of matmul
    work on every rank (a block's forward or backward), not back to back. On a shared CPU this is
    what a blocking collective costs in a step: the wait for the slowest rank (the segments' spread)
    plus waking the backend's threads, which a tight loop of collectives never pays (gloo on 2 ranks
    of this machine: 1-5 ms per call between segments vs 0.3-4 ms back to back).
    Per call: the time from the end of the rank's segment to the collective's return; per rank the
    `_trimmed_mean` over the calls (up to 1 MiB, where the wait dominates, pooled over those sizes;
    non-decreasing in the size), averaged over the ranks (every rank reports the same number)."""
    import torch.distributed as dist
    a, w = torch.randn(2048, 128), torch.randn(128, 512)
    t = time.perf_counter()
    a @ w
    k = max(1, round(segment_s / max(time.perf_counter() - t, 1e-5)))

    def seg():
        for _ in range(k):
            a @ w
    out = {op: {} for op in COLLECTIVES}
    samples: dict[str, dict[int, list[float]]] = {}
    for nbytes in sizes:
        ops = _collective_calls(rank, world, nbytes)
        reps = 12 if nbytes <= 4 * 2 ** 20 else 5
        for op, fn in ops.items():
            dist.barrier()
            ts = []
            for _ in range(reps):
                seg()
                t = time.perf_counter()
                fn()
                ts.append(time.perf_counter() - t)
            samples.setdefault(op, {})[nbytes] = ts
    for op, by_size in samples.items():
        # up to 1 MiB the wait dominates and does not depend on the size: one pooled value
        small = sorted(t for nb, ts in by_size.items() if nb <= 2 ** 20 for t in ts)
        prev = 0.0
        for nbytes, ts in sorted(by_size.items()):
            # cumulative max: a larger message never costs less
            prev = out[op][nbytes] = max(prev, _trimmed_mean(small if nbytes <= 2 ** 20 else ts))
    flat = torch.tensor([out[op][nb] for op in COLLECTIVES for nb in sizes], dtype=torch.float64)
    dist.all_reduce(flat)
    if world > 2:       # send/recv runs between ranks 0 and 1 only
        per = len(sizes)
        i = COLLECTIVES.index("send_recv") * per
        flat[i:i + per] *= world / 2
    flat /= world
    vals = iter(flat.tolist())
    return {op: {nb: next(vals) for nb in sizes} for op in COLLECTIVES}


def _tp_linear_cost(mesh, world: int, tokens: int, width: int, all_reduce: dict[int, float],
                    n: int = 3) -> tuple[float, float]:
    """(input activation bytes, seconds per Linear) that tensor parallelism adds, forward + backward:
    ``2n`` Linears alternating width -> 4 width (colwise) and back (rowwise) on a (tokens, width) input,
    minus the same local shards as plain Linears (medians) and minus its ``2n - 1`` all-reduces at the
    in-context times ``all_reduce`` ({bytes: s}) that the cost model charges them, so that model and
    measurement agree on this chain whatever share of it one calls communication."""
    import torch.distributed as dist
    import torch.nn as nn
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    torch.manual_seed(0)
    x, act = torch.randn(tokens, width), torch.zeros(tokens, width)
    tp = nn.Sequential(*[nn.Linear(width, 4 * width) if i % 2 == 0 else nn.Linear(4 * width, width)
                         for i in range(2 * n)])
    parallelize_module(tp, mesh, {str(i): ColwiseParallel() if i % 2 == 0 else RowwiseParallel() for i in range(2 * n)})
    local = nn.Sequential(*[nn.Linear(width, 4 * width // world) if i % 2 == 0 else nn.Linear(4 * width // world, width)
                            for i in range(2 * n)])
    import statistics
    est = []
    for _ in range(5):                  # median of 5 estimates: each is a difference of jittery times
        dist.barrier()
        t_tp = _time(lambda: tp(x).sum().backward(), 9)
        t_local = _time(lambda: local(x).sum().backward(), 9)
        est.append((t_tp - t_local) / (2 * n))
    t_ar = (2 * n - 1) * interpolate_sizes(sorted(all_reduce.items()), act.numel() * 4)
    return 4.0 * tokens * width, statistics.median(est) - t_ar / (2 * n)


def _framework_overheads(world: int, all_reduce: dict[int, float], *, d: int = 16, n: int = 8) -> dict:
    """Seconds per call that torch's tensor-parallel Linear (DTensor) and FSDP2 unit add beyond the
    arithmetic and the collectives, forward + backward: a chain of ``2n`` tiny (d x d) Linears, plain,
    with alternating colwise / rowwise TP (`_tp_linear_cost`: its all-reduces subtracted at the
    in-context times ``all_reduce``, {bytes: s}, that the cost model charges), and with every Linear an
    FSDP2 unit (the same collectives issued alone subtracted). Every rank reports the ranks' mean."""
    import torch.distributed as dist
    import torch.nn as nn
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (world,))
    x = torch.randn(4, d)

    def chain():
        torch.manual_seed(0)
        return nn.Sequential(*[nn.Linear(d, d) for _ in range(2 * n)])

    def step(m):
        m(x).sum().backward()

    plain = chain()
    t_plain = _time(lambda: step(plain), 15, best=True)
    tp_costs = [_tp_linear_cost(mesh, world, tokens, width, all_reduce) for tokens, width in ((64, 16), (2048, 256))]
    fs = chain()
    for lin in fs:
        fully_shard(lin, mesh=mesh)
    fully_shard(fs, mesh=mesh)
    # the same 2n Linears as n/ 2 units of 4 Linears (8 tensors each instead of 2): FSDP2's cost
    # has a part per unit (hooks, one gather, one reduce-scatter) and a part per tensor (copy-in/out)
    fs4 = chain()
    for i in range(0, 2 * n, 4):
        fully_shard([fs4[j] for j in range(i, i + 4)], mesh=mesh)
    fully_shard(fs4, mesh=mesh)
    # the same chains' collectives alone (tiny messages: latency), subtracted:
    # FSDP2 (reshard after forward): per unit a gather in forward and in backward, one reduce-scatter
    w4, shard4 = torch.zeros(4 * (d * d + d)), torch.zeros(4 * (d * d + d) // world)
    w = torch.zeros(d * d + d)
    shard = torch.zeros((d * d + d) // world)
    c2s, c8s = [], []
    for _ in range(3):                  # median of 3 estimates, each a difference of best-of-15 times
        dist.barrier()
        t_fs = _time(lambda: step(fs), 15, best=True)
        t_fs4 = _time(lambda: step(fs4), 15, best=True)
        t_fc4 = _time(lambda: [(dist.all_gather_into_tensor(w4, shard4), dist.all_gather_into_tensor(w4, shard4),
                                dist.reduce_scatter_tensor(shard4, w4)) for _ in range(n // 2)], 15, best=True)
        t_fc = _time(lambda: [(dist.all_gather_into_tensor(w, shard), dist.all_gather_into_tensor(w, shard),
                               dist.reduce_scatter_tensor(shard, w)) for _ in range(2 * n)], 15, best=True)
        c2s.append((t_fs - t_plain - t_fc) / (2 * n))              # per unit of 2 tensors
        c8s.append((t_fs4 - t_plain - t_fc4) / (n // 2))           # per unit of 8 tensors
    # TP: a fixed part and a part per byte of the Linear's input activation (DTensor's conversions
    # and copies of the activation), from the two sizes
    (b0, c0), (b1, c1) = tp_costs
    tp_per_byte = max(0.0, (c1 - c0) / (b1 - b0))
    tp_each = max(0.0, c0 - tp_per_byte * b0)
    import statistics
    c2, c8 = statistics.median(c2s), statistics.median(c8s)
    per_tensor = max(0.0, (c8 - c2) / 6)
    per_unit = max(0.0, c2 - 2 * per_tensor)
    vals = torch.tensor([tp_each, tp_per_byte, per_unit, per_tensor], dtype=torch.float64)
    dist.all_reduce(vals)               # the ranks' mean: every rank reports the same numbers
    vals /= world
    return dict(zip(("tp_linear_overhead_s", "tp_linear_overhead_s_per_byte", "fsdp_unit_overhead_s",
                     "fsdp_tensor_overhead_s"), vals.tolist()))


def _fresh_alloc_costs(sizes_mib=FRESH_SIZES_MIB) -> dict[int, float]:
    """Seconds per byte that a *fresh* tensor costs beyond writing it, by size: ``torch.empty(n)``
    filled and freed, minus filling a reused buffer of the same size. On CPU, tensors above the C
    allocator's mmap threshold get new pages from the kernel on every allocation (page faults and
    zeroing on first touch, unmapping on free); smaller ones are recycled from the heap, so their cost
    is near 0. Called on every rank at once, as training allocates on every rank at once."""
    import statistics
    for mib in sorted(sizes_mib, reverse=True):     # warm-up pass: the allocator's steady state (the
        torch.empty(mib * 2 ** 20 // 4).fill_(1.0)   # dynamic threshold rises as large blocks are freed)
    passes: dict[int, list[float]] = {mib * 2 ** 20: [] for mib in sizes_mib}
    for _ in range(3):                               # the allocator's state drifts: median of 3 passes
        for mib in sizes_mib:
            n = mib * 2 ** 20 // 4
            buf = torch.empty(n)
            reuse = _time(lambda: buf.fill_(1.0), 5)
            fresh = _time(lambda: torch.empty(n).fill_(1.0), 5)
            passes[mib * 2 ** 20].append(max(0.0, fresh - reuse) / (4 * n))
            del buf
    return {k: statistics.median(v) for k, v in passes.items()}


def fresh_threshold(costs: dict[int, float]) -> tuple[float, float]:
    """(cost s/byte, smallest fresh size in bytes) from `_fresh_alloc_costs` output: the cost is the
    largest size's; the threshold is the smallest size of the unbroken run of sizes, from the largest
    down, that cost at least half of that (a lone costly small size is allocator noise)."""
    top = costs[max(costs)]
    if top <= 0:
        return 0.0, float("inf")
    thr = max(costs)
    for k in sorted(costs, reverse=True):       # the contiguous run of costly sizes from the top
        if costs[k] < 0.5 * top:
            break
        thr = k
    return top, float(thr)


def fit_alpha_beta(times: dict[int, float], *, steps: float, volume: float) -> tuple[float, float]:
    """Least-squares fit of ``t = steps * alpha + volume * B / beta`` over (bytes B, seconds t) pairs
    (Thakur et al. 2005 forms: all-reduce steps 2(n-1), volume 2(n-1)/n; all-gather and reduce-scatter
    n-1 and (n-1)/n; send/recv 1 and 1). Returns (alpha s, beta B/s); alpha >= 1e-7."""
    xs = [volume * b for b in times]
    ys = list(times.values())
    k = len(xs)
    mx, my = sum(xs) / k, sum(ys) / k
    sxx = sum((x - mx) ** 2 for x in xs)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx if sxx else 0.0
    slope = max(slope, 1e-12)
    alpha = max((my - slope * mx) / steps, 1e-7)
    return alpha, 1.0 / slope


def measure_collectives(world: int = 2, sizes=COLLECTIVE_SIZES) -> dict[str, tuple[float, float]]:
    """``{op: (latency s, bandwidth B/s)}`` of gloo all-reduce, all-gather, reduce-scatter and
    send/recv between ``world`` local ranks, each fitted by `fit_alpha_beta` over ``sizes``, and
    ``"mem_bandwidth"``: bytes/s one rank streams while all ``world`` ranks stream at once."""
    import socket
    import torch.multiprocessing as mp
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    q = ctx.SimpleQueue()
    mp.start_processes(_collective_worker, args=(world, port, sizes, q), nprocs=world, join=True,
                       start_method="spawn")
    res = q.get()
    from modelpar.planner.cost import alpha_beta_form
    fits = {}
    for op in COLLECTIVES:
        steps, volume = alpha_beta_form(op, world)
        fits[op] = fit_alpha_beta(res[op], steps=steps, volume=volume)
    fits["mem_bandwidth"] = res["mem_bandwidth"]
    fits["times"] = {op: res[op] for op in COLLECTIVES}
    fits["fresh"] = res["fresh"]
    fits["framework"] = res["framework"]
    fits["in_context"] = res["in_context"]
    return fits


def calibrate_main(argv: list[str]) -> int:
    """Measure this machine and save a hardware profile the planner then uses."""
    p = argparse.ArgumentParser(prog="modelpar calibrate", description=(
        "Measure matmul FLOP/s over a sweep of sizes, per-operation overhead, memory bandwidth, and gloo "
        "all-reduce / all-gather / reduce-scatter / send-recv latency and bandwidth between local ranks; "
        "save them as a JSON hardware profile (read by `modelpar train --strategy auto` and "
        "`modelpar plan --hardware FILE`). Only micro-benchmarks are timed, never a model."))
    p.add_argument("--out", default=None, help="where to write the profile (JSON; default "
                   "$MODELPAR_CALIBRATION or ~/.cache/modelpar/calibration.json)")
    p.add_argument("--ranks", type=int, default=2, help="local ranks sharing this machine (memory and cores are split)")
    p.add_argument("--no-collectives", action="store_true", help="skip the multi-process collective test")
    args = p.parse_args(argv)
    if args.ranks < 1:
        p.error(f"--ranks must be >= 1, got {args.ranks}")
    out = args.out or default_calibration_path()
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // args.ranks))
    c = measure_compute()
    # more local ranks than cores: each rank computes on its share of a core (compute is timed in
    # this one process); the rates that scale with a core scale by it
    share = min(1.0, (os.cpu_count() or 1) / args.ranks)
    if share < 1.0:
        c["matmul_flops"] = {n: f * share for n, f in c["matmul_flops"].items()}
        for k in ("matmul_peak", "attention_flops", "elementwise_bw"):
            c[k] *= share
        c["op_overhead_s"] /= share
        print(f"  {args.ranks} ranks on {os.cpu_count()} cores: compute rates x {share:.2f} per rank")
    best = c["matmul_peak"]
    base = cpu_profile(args.ranks)
    lat, bw = base.intra_latency, base.intra_bw
    extra = {f"matmul_flops_{n}": f for n, f in c["matmul_flops"].items()}
    extra["attention_flops"] = c["attention_flops"]
    extra["elementwise_bw"] = c["elementwise_bw"]
    extra["core_share"] = share
    extra["zero_bubble_backward_factor"] = c["zero_bubble_backward_factor"]
    coll = {}
    if not args.no_collectives and args.ranks > 1:
        coll = measure_collectives(args.ranks)
        # one rank alone (this process, the others not started) and every rank at once: ranks in
        # lockstep (data / tensor parallel) share the memory bus, pipeline stages mostly do not
        extra["mem_bandwidth_alone"] = c["mem_bandwidth"]
        extra["fresh_alloc_s_per_byte_alone"] = fresh_threshold(c["fresh"])[0]
        c["mem_bandwidth"] = coll.pop("mem_bandwidth")
        fresh = coll.pop("fresh")
        extra.update(coll.pop("framework"))
        times = coll.pop("times")
        in_ctx = coll.pop("in_context")
        lat, bw = coll["all_reduce"]
        for op, (a, b) in coll.items():
            extra[f"{op}_latency"], extra[f"{op}_bw"] = a, b
            for nbytes, t in times[op].items():      # the measured table; the cost model interpolates it
                extra[f"{op}_t_{nbytes}"] = t
            for nbytes, t in in_ctx[op].items():     # the same, issued between compute segments
                extra[f"{op}_ctx_{nbytes}"] = t
        extra["fresh_alloc_s_per_byte"], extra["fresh_alloc_min_bytes"] = fresh_threshold(fresh)
        if platform.libc_ver()[0] == "glibc" and extra["fresh_alloc_s_per_byte"] > 0:
            # glibc maps every block above its largest dynamic mmap threshold (32 MiB on 64-bit,
            # DEFAULT_MMAP_THRESHOLD_MAX) anew when no free heap chunk fits it; which free chunks
            # exist depends on the heap's history, so the sweep's boundary moves between runs
            extra["fresh_alloc_min_bytes"] = 32 * 2 ** 20
        extra["collective_ranks"] = args.ranks
    hw = Hardware("cpu", {"fp32": best, "bf16": best / 2}, base.memory_bytes, c["mem_bandwidth"], bw, lat,
                  bw, lat, args.ranks, 1.0, mem_bw_fraction=1.0, op_overhead_s=c["op_overhead_s"], comm_overlap=False,
                  source="calibrated by modelpar calibrate", extra=extra)
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    save_profile(hw, out)
    print(f"  matmul peak {best / 1e9:.1f} GFLOP/s (same operands repeated); a Linear's three products "
          "on operands from memory:")
    for n, f in c["matmul_flops"].items():
        print(f"  matmul {n:>5}: {f / 1e9:8.1f} GFLOP/s")
    print(f"  attention (causal, fused) {c['attention_flops'] / 1e9:.1f} GFLOP/s counted; "
          f"element-wise operators {c['elementwise_bw'] / 1e9:.1f} GB/s counted; a zero-bubble split backward "
          f"takes {c['zero_bubble_backward_factor']:.2f}x a plain one")
    print(f"  per-op overhead {c['op_overhead_s'] * 1e6:.1f} us, memory bandwidth per rank {c['mem_bandwidth'] / 1e9:.1f} GB/s")
    for op, (a, b) in coll.items():
        print(f"  {op:<15} latency {a * 1e6:8.1f} us, bandwidth {b / 1e9:6.2f} GB/s ({args.ranks} ranks); "
              + ", ".join(f"{k / 2 ** 20:g} MiB {v * 1e3:.2f} ms" for k, v in times[op].items()))
    if coll:
        print(f"  framework per call (fwd + bwd): TP Linear {extra['tp_linear_overhead_s'] * 1e6:.0f} us + "
              f"{extra['tp_linear_overhead_s_per_byte'] * 1e9:.2f} ns per input byte, "
              f"FSDP2 unit {extra['fsdp_unit_overhead_s'] * 1e6:.0f} us + {extra['fsdp_tensor_overhead_s'] * 1e6:.0f} us "
              f"per parameter tensor")
        for op in coll:
            print(f"  {op:<15} between compute segments: "
                  + ", ".join(f"{k / 2 ** 20:g} MiB {v * 1e3:.2f} ms" for k, v in in_ctx[op].items()))
        fb, fmin = extra["fresh_alloc_s_per_byte"], extra["fresh_alloc_min_bytes"]
        print(f"  alone (one rank): memory bandwidth {extra['mem_bandwidth_alone'] / 1e9:.1f} GB/s, fresh allocation "
              f"{extra['fresh_alloc_s_per_byte_alone'] * 1e9:.3f} ns/byte")
        print(f"  fresh allocation: {fb * 1e9:.3f} ns/byte from {fmin / 2 ** 20:g} MiB "
              f"({', '.join(f'{k / 2 ** 20:g} MiB {v * 1e9:.3f}' for k, v in fresh.items())} ns/byte)")
    print(f"saved {out}")
    return 0
