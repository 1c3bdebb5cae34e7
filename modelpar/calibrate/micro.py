"""Calibration micro-benchmarks: what `modelpar calibrate` times on this machine (never a model).

Compute (this process): matmul rates over sizes, per-operator overhead, streaming and element-wise
bandwidth, fused attention, the zero-bubble split backward, fresh-allocation costs. Collectives
are in `modelpar.calibrate.collectives`.
"""

from __future__ import annotations

import time

import torch

MATMUL_SIZES = (32, 64, 128, 256, 512, 1024, 2048)
# bytes: from latency-bound (TP activations of tiny models) to a DDP bucket and past it
COLLECTIVE_SIZES = (4 * 2 ** 10, 64 * 2 ** 10, 1 * 2 ** 20, 4 * 2 ** 20, 16 * 2 ** 20, 64 * 2 ** 20)
# fresh-allocation sweep (MiB): straddles glibc's largest dynamic mmap threshold (32 MiB on 64-bit)
FRESH_SIZES_MIB = (8, 16, 31, 33, 64)
COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter", "send_recv")


def _time(fn, reps: int, *, best: bool = False, timer=time.perf_counter) -> float:
    """Median (``best``: smallest) seconds of ``fn`` over ``reps`` calls after one warm-up. Compute
    rates take the best call, which a busy neighbour on a shared machine can only slow down;
    collectives take the median, as their spread (TCP on loopback) is part of what training sees.
    ``timer``: the clock (``time.thread_time`` for CPU-time diagnostics on a shared machine)."""
    import statistics
    fn()
    ts = []
    for _ in range(reps):
        t = timer()
        fn()
        ts.append(timer() - t)
    return min(ts) if best else statistics.median(ts)


ROUNDS = 3      # rounds of every compute term (`measure_compute`) and of the in-context collectives
# `measure_compute` adds up to EXTRA_ROUNDS rounds, each after a pause of ROUND_PAUSE_S, while the
# median of a settling term is not yet settled (`median_settled`): a burst of load from outside
# that spans the first rounds (2-core host kind, one calibration: matmul and attention rates 22-46%
# apart over 3 rounds, 15-25% below the next calibration's, step-time predictions off by +15-25%)
EXTRA_ROUNDS, ROUND_PAUSE_S, SETTLED = 4, 2.0, 0.10
# `modelpar calibrate --quick` (a smoke run of the whole command, not for planning): the shape grid on
# three sizes, one pass each, and the zero-bubble chain on a quarter of the tokens
QUICK_SHAPE_DIMS = (8, 64, 1024)
QUICK_ZERO_BUBBLE_TOKENS = 256


def robust(values) -> tuple[float, float]:
    """(kept value, relative spread) of one term's per-round measurements: the median (with 3 rounds
    one outlying round, e.g. a neighbour's burst, is rejected whichever way it lies) and the full
    range over the median's magnitude, ``(max - min) / |median|`` (0 for one round; inf for a median
    of 0 with a range)."""
    import statistics
    vs = list(values)
    med = statistics.median(vs)
    rng = max(vs) - min(vs)
    return med, (rng / abs(med) if med else (0.0 if not rng else float("inf")))


def median_settled(values, tolerance: float = SETTLED) -> bool:
    """Whether the median of one term's rounds stands on agreeing rounds: the middle values once
    sorted (three for an odd count, four for an even one; all of them up to 4 rounds) lie within
    ``tolerance`` of the median (relative range). The rounds outside the middle may be anything:
    outliers either way, which the median rejects. One round is settled (nothing to compare)."""
    import statistics
    vs = sorted(values)
    if len(vs) < 2:
        return True
    m = len(vs) // 2
    mid = vs[max(0, m - 1):m + 2] if len(vs) % 2 else vs[max(0, m - 2):m + 2]
    med = statistics.median(vs)
    return bool(med) and (mid[-1] - mid[0]) <= tolerance * abs(med)


def measure_compute(sizes=MATMUL_SIZES, rounds: int = ROUNDS, *, quick: bool = False) -> dict:
    """Matmul FLOP/s of N x N x N fp32 products over ``sizes``: the peak (``matmul_peak``: the best
    rate of a product repeated on the same operands) and the curve the cost model interpolates
    (`_linear_matmul_rate`); the shape grid (``matmul_shapes``, `measure_shapes`); the attention
    grid (``attention_shapes``, `measure_attention_shapes`); per-op overhead (a tiny add) and per
    dispatched call of tiny blocks (`measure_dispatch_overhead`), copy bandwidth, element-wise and fused
    attention rates; thin products with weights beyond the cache (``matmul_thin``,
    `modelpar.calibrate.thin.measure_thin_matmuls`). Each term is measured once per round, the rounds alternating over all terms
    (a burst of load on a shared machine spoils one round of several terms rather than every
    measurement of one) and kept by `robust` (median over rounds); ``spread`` holds each term's
    relative spread over the rounds. With ``rounds`` > 1, up to `EXTRA_ROUNDS` more rounds follow
    (each after a pause) while a settling term's median is not `median_settled` (the matmul curve
    from 128^3, attention, element-wise, per-call dispatch); ``rounds`` in the result is the count
    run, which the attention grid also gets. Units: FLOP/s, s, B/s. ``quick``: the shape grid on
    `QUICK_SHAPE_DIMS` with one pass per shape and the zero-bubble chain on
    `QUICK_ZERO_BUBBLE_TOKENS` tokens (every term still measured; for checking the command end to end).

    Raises:
        ValueError: ``rounds`` < 1.
    """
    if rounds < 1:
        raise ValueError(f"rounds must be >= 1, got {rounds}")
    per: dict[str, list[float]] = {}

    def add(name, v):
        per.setdefault(name, []).append(v)
    fresh = _fresh_alloc_costs()     # first: its warm-up leaves the allocator in its steady state
    a, b = torch.ones(32 * 2 ** 20), torch.ones(32 * 2 ** 20)   # 128 MiB each: past the caches
    c = torch.empty_like(a)
    settling = [f"matmul_flops[{n}]" for n in sizes if n >= 128] + ["attention_flops", "elementwise_bw",
                                                                     "dispatch_overhead_s"]
    done = 0
    while done < rounds or (rounds > 1 and done < rounds + EXTRA_ROUNDS
                            and not all(median_settled(per[k]) for k in settling)):
        if done >= rounds:
            time.sleep(ROUND_PAUSE_S)       # step out of the burst rather than measure inside it
        done += 1
        for n in (256, 512):
            x, w = torch.randn(n, n), torch.randn(n, n)
            add("matmul_peak", 2 * n ** 3 / _time(lambda: x @ w, max(7, min(200, int(3e9 // n ** 3))), best=True))
        for n in sizes:
            add(f"matmul_flops[{n}]", _linear_matmul_rate(n, passes=1))
        add("op_overhead_s", _time(_op_chain, 30, best=True) / (2 * _CHAIN))   # forward op + its backward op
        add("dispatch_overhead_s", measure_dispatch_overhead())
        add("attention_flops", measure_attention())
        add("elementwise_bw", measure_elementwise(reps=4))
        add("mem_bandwidth", 3 * a.numel() * 4 / _time(lambda: torch.add(a, b, out=c), 5))  # read 2 + write 1
    del a, b, c
    smaller_zb = {"tokens": QUICK_ZERO_BUBBLE_TOKENS} if quick else {}
    smaller_grid = {"dims": QUICK_SHAPE_DIMS, "passes": 1} if quick else {}
    zb, zb_spread = measure_zero_bubble_backward(with_spread=True, **smaller_zb)
    shapes, shape_spread = measure_shapes(**smaller_grid)
    attn_shapes, spread_attn = measure_attention_shapes(rounds=done)
    from modelpar.calibrate.thin import QUICK_THIN_ROWS, QUICK_THIN_WEIGHT_MIB, measure_thin_matmuls
    thin, thin_spread = measure_thin_matmuls(**({"rows": QUICK_THIN_ROWS, "weight_mib": QUICK_THIN_WEIGHT_MIB,
                                             "passes": 1} if quick else {}))
    kept = {k: robust(v) for k, v in per.items()}
    flops = {n: kept[f"matmul_flops[{n}]"][0] for n in sizes}
    spread = {k: s for k, (_, s) in kept.items()}
    spread["zero_bubble_backward_factor"] = zb_spread
    spread.update(shape_spread)
    spread["attention_shapes"] = spread_attn
    spread["matmul_thin"] = thin_spread
    return {"matmul_thin": thin, "matmul_shapes": shapes, "attention_shapes": attn_shapes, "matmul_flops": flops, "matmul_peak": max(kept["matmul_peak"][0], *flops.values()),
            "op_overhead_s": kept["op_overhead_s"][0], "mem_bandwidth": kept["mem_bandwidth"][0],
            "dispatch_overhead_s": kept["dispatch_overhead_s"][0],
            "attention_flops": kept["attention_flops"][0], "fresh": fresh,
            "elementwise_bw": kept["elementwise_bw"][0], "zero_bubble_backward_factor": zb,
            "spread": spread, "rounds": done}


def time_products(ops, passes: int, timer=time.perf_counter) -> tuple[float, float]:
    """Seconds per product of ``torch.mm(a, b, out=o)`` over ``ops`` (a list of ``(a, b, o)``): one
    warm-up pass, then ``passes`` timed passes over every set, kept by `robust` as (median, spread)."""
    def run():
        for a, b, o in ops:
            torch.mm(a, b, out=o)
    run()
    ts = []
    for _ in range(passes):
        t = timer()
        run()
        ts.append((timer() - t) / len(ops))
    return robust(ts)


def _linear_matmul_rate(n: int, pool_bytes: int = 64 * 2 ** 20, passes: int = 3, timer=time.perf_counter) -> float:
    """FLOP/s of the three products a Linear layer runs on ``n x n`` operands -- forward ``x @ W.T``,
    input gradient ``dy @ W``, weight gradient ``dy.T @ x`` -- with operands that are not in cache:
    each call takes the next of as many operand sets as fill ``pool_bytes`` (past the last-level
    cache), as in a training step, where a product's inputs were written by earlier operators long
    evicted. Harmonic mean over the three layouts (equal FLOPs each); the median of ``passes``
    passes (one above n = 512, after a warm-up pass at or below it). ``timer``: the clock
    (``time.thread_time`` for CPU-time replays on a shared machine, `benchmarks/step_time_ops.py`).
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
        ts = []
        for _ in range(1 if big else passes):
            t = timer()
            run()
            ts.append(timer() - t)
        total += statistics.median(ts) / sets
    return 3 * 2 * n ** 3 / total


# the shape grid (`measure_shapes`): every M, K, N from these, in each layout a Linear runs
# (8 and 16: a small MLP's local or micro-batch rows, e.g. mlp-large at 16 per DDP rank and 8 per
# pipeline micro-batch: weight-streaming products at a fraction of M = 64's rate, which a grid
# starting at 64 clamps to it)
SHAPE_DIMS = (8, 16, 64, 256, 1024)
MAX_SETS = 512
SHAPE_LAYOUTS = ("NT", "NN", "TN")


def measure_shapes(dims=SHAPE_DIMS, layouts=SHAPE_LAYOUTS, pool_bytes: int = 32 * 2 ** 20,
                   passes: int = 2, timer=time.perf_counter) -> tuple[dict[str, dict[tuple[int, int, int], float]],
                                                                      dict[str, float]]:
    """FLOP/s of fp32 ``M x K @ K x N`` products over the grid ``dims`` x ``dims`` x ``dims`` in each
    layout (``"NT"``: ``x @ W.T``, a Linear's forward; ``"NN"``: ``dy @ W``, its input gradient;
    ``"TN"``: ``dy.T @ x``, its weight gradient), with operands from memory as in
    `_linear_matmul_rate` (each call takes the next of as many operand sets as fill ``pool_bytes``).
    Per shape the median of ``passes`` passes after a warm-up. Thin products (one small dimension)
    run well below the square curve at equal FLOPs (36-65 GFLOP/s vs 67-72 for (2048 x 688) x
    (688 x 256) measured on the 2-core CPU host the tests run on), which a FLOPs-only curve cannot see.
    Returns ({layout: {(M, K, N): FLOP/s}}, {"matmul_shapes[<layout>]": the largest relative spread
    over the passes of any shape of that layout}). ``timer``: as in `_linear_matmul_rate`."""
    import statistics
    rates: dict[str, dict[tuple[int, int, int], float]] = {}
    spread: dict[str, float] = {}
    for lay in layouts:
        rates[lay], worst = {}, 0.0
        for m in dims:
            for k in dims:
                for n in dims:
                    a_src = torch.randn(k, m).t() if lay[0] == "T" else torch.randn(m, k)
                    b_src = torch.randn(n, k).t() if lay[1] == "T" else torch.randn(k, n)
                    # tiny products: at most MAX_SETS operand sets (call overhead dominates them;
                    # 40,000 sets of 8 x 8 x 8 would time the loop, not the product)
                    sets = max(2, min(MAX_SETS, pool_bytes // (4 * (m * k + k * n + m * n))))
                    ops = [(a_src.clone() if lay[0] == "N" else a_src.t().clone().t(),
                            b_src.clone() if lay[1] == "N" else b_src.t().clone().t(), torch.empty(m, n))
                           for _ in range(sets)]

                    med, sp = time_products(ops, passes, timer)
                    rates[lay][(m, k, n)] = 2.0 * m * k * n / med
                    worst = max(worst, sp)
        spread[f"matmul_shapes[{lay}]"] = worst
    return rates, spread


def measure_elementwise(tokens: int = 2048, width: int = 256, reps: int = 9, timer=time.perf_counter) -> float:
    """Bytes/s that a transformer block's non-matmul operators reach, counted as `profile_model`
    counts them (inputs + outputs of each non-view, non-matmul operator), forward + backward, on
    activations of (tokens, width) fp32 and the MLP's (tokens, 4 x width): layer norm, GELU on the
    4x-wide hidden, the head reshapes' copies, two residual adds, cross-entropy. GELU's erf and the
    norms' reductions keep them well below the streaming bandwidth. Best of ``reps`` runs.
    ``timer``: as in `_time`."""
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
    return nbytes / _time(run, reps, best=True, timer=timer)


def measure_zero_bubble_backward(tokens: int = 1024, width: int = 256, blocks: int = 6, *,
                                 with_spread: bool = False):
    """How much longer a backward takes when split the zero-bubble way (Qi et al. ICLR'24): torch's
    ``stage_backward_input`` (activation gradients) then ``stage_backward_weight`` (weight gradients,
    from output gradients and activations kept for it), over the plain ``backward()``; on a chain of
    ``blocks`` pre-norm MLP blocks (LayerNorm, Linear width -> 4 width, GELU, Linear back, residual)
    on (tokens, width) fp32 activations. Ratio of backward seconds (medians; forward subtracted).
    1 thread here: 1.07-1.12 (gpt-3m's own blocks: 1.10-1.12, gpt-1m's 1.25: the weight pass reads
    what the input pass left, evicted; the more blocks per stage, the more). ``with_spread``:
    (factor, relative spread of the two estimates, `robust`)."""
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
    factor = max(1.0, statistics.median(ratios))
    return (factor, robust(ratios)[1]) if with_spread else factor


def measure_attention(batch: int = 8, heads: int = 4, seq: int = 256, head_dim: int = 64,
                      timer=time.perf_counter) -> float:
    """Counted FLOP/s of causal ``scaled_dot_product_attention`` forward + backward (fp32, the fused
    kernel torch picks): FLOPs as the profile counts them (torch's ``sdpa_flop_count``, full (seq x
    seq) products, backward twice the forward) over the measured time."""
    from torch.utils.flop_counter import sdpa_flop_count
    q, k, v = (torch.randn(batch, heads, seq, head_dim, requires_grad=True) for _ in range(3))

    def run():
        torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True).sum().backward()

    return 3 * sdpa_flop_count(q.shape, k.shape, v.shape) / _time(run, 7, best=True, timer=timer)


# the attention grid (`measure_attention_shapes`): sequence lengths and head dimensions, at the
# batch x heads of `measure_attention` (8 x 4), which is one of its points
ATTENTION_SEQS = (64, 128, 256, 512)
ATTENTION_HEAD_DIMS = (32, 64, 128)
ATTENTION_BH = 32


def measure_attention_shapes(seqs=ATTENTION_SEQS, head_dims=ATTENTION_HEAD_DIMS, bh: int = ATTENTION_BH,
                             rounds: int = ROUNDS, timer=time.perf_counter) -> tuple[dict[tuple[int, int, int], float], float]:
    """Counted FLOP/s of causal fused attention forward + backward (as `measure_attention`) of
    ``bh`` sequences (batch x heads) over ``seqs`` x ``head_dims``: the CPU flash kernel works in
    query / key blocks, so short sequences (few blocks, the causal diagonal a large share) and small
    head dimensions (little work per block) run well below the reference shape's rate (1 thread,
    this host kind, loaded: 21 GFLOP/s at S 128, D 32 vs 36 at S 256, D 64). ``rounds`` rounds, each
    timing one call of every shape in turn (a burst of load spoils one round of several shapes, not
    every call of one); per shape the median over the rounds (`robust`), the rate a training step's
    call sees rather than the luckiest. Returns ({(bh, S, D): FLOP/s}, the largest relative spread
    of any shape). ``timer``: as in `_linear_matmul_rate`."""
    from torch.utils.flop_counter import sdpa_flop_count
    sdpa = torch.nn.functional.scaled_dot_product_attention
    data = {(bh, s, d): tuple(torch.randn(1, bh, s, d, requires_grad=True) for _ in range(3))
            for s in seqs for d in head_dims}
    per: dict[tuple[int, int, int], list[float]] = {k: [] for k in data}
    for q, k, v in data.values():       # warm-up
        sdpa(q, k, v, is_causal=True).sum().backward()
    for _ in range(rounds):
        for key, (q, k, v) in data.items():
            t = timer()
            sdpa(q, k, v, is_causal=True).sum().backward()
            per[key].append(3 * sdpa_flop_count(q.shape, k.shape, v.shape) / (timer() - t))
    kept = {k: robust(v) for k, v in per.items()}
    return {k: r for k, (r, _) in kept.items()}, max(sp for _, sp in kept.values())


_CHAIN = 64


class _PreNormMLP(torch.nn.Module):
    """x + down(gelu(up(norm(x)))): the module structure of a transformer block's MLP half."""

    def __init__(self, width: int):
        super().__init__()
        self.norm = torch.nn.LayerNorm(width)
        self.up, self.down = torch.nn.Linear(width, 4 * width), torch.nn.Linear(4 * width, width)

    def forward(self, x):
        return x + self.down(torch.nn.functional.gelu(self.up(self.norm(x))))


def count_calls(fn) -> int:
    """Aten calls ``fn()`` dispatches (views and matmuls included), counted as
    `modelpar.planner.profile_model` counts a model's (`BlockProfile.fwd_calls`: all but
    `profile_ops.UNCOUNTED_CALLS`)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from modelpar.planner.profile_ops import UNCOUNTED_CALLS

    class _Count(TorchDispatchMode):
        n = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            _Count.n += func.overloadpacket.__name__ not in UNCOUNTED_CALLS
            return func(*args, **(kwargs or {}))
    with _Count():
        fn()
    return _Count.n


def measure_dispatch_overhead(blocks: int = 8, tokens: int = 4, width: int = 16, reps: int = 30,
                              timer=time.perf_counter) -> float:
    """Seconds per dispatched aten call of ``blocks`` tiny pre-norm MLP blocks (LayerNorm, Linear
    width -> 4 width, GELU, Linear back, residual) on (1, tokens, width) fp32 inputs, forward +
    backward with autograd, over every call they dispatch (`count_calls`: views and matmuls
    included). The kernels are negligible at this size, so this is what a model's framework costs
    per call as a model pays it: the module calls, the views each Linear makes and their autograd
    nodes, the engine's walk over the graph, allocation and the tiny kernels' dispatch. The per-op
    chain (`_op_chain`: scalar multiplies, no modules, no views) reads 4.3 us per op on this host
    kind, loaded, where this reads 10.2 us per call and a built-in GPT at 1 x 4 tokens 9.8
    (`benchmarks/step_time_ops.py`'s fixed-cost part). Best of ``reps`` (``timer``: as in `_time`)."""
    torch.manual_seed(0)
    net = torch.nn.Sequential(*[_PreNormMLP(width) for _ in range(blocks)])
    src = torch.randn(1, tokens, width)

    def run():
        x = src.clone().requires_grad_()
        net(x).sum().backward()
        net.zero_grad(set_to_none=True)
    return _time(run, reps, best=True, timer=timer) / count_calls(run)


def _op_chain() -> None:
    """``_CHAIN`` tiny element-wise ops with autograd on, then their backward: the fixed cost of one
    eager operator (dispatch, autograd node, allocation) without arithmetic to speak of."""
    x = torch.ones(16, requires_grad=True)
    y = x
    for _ in range(_CHAIN):
        y = y * 1.0001
    y.sum().backward()


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
