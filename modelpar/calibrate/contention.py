"""Compute contention between local ranks: how much slower a rank's compute kernels run while every
other local rank runs the same kernels at the same moment (they share the last-level cache and the
memory bus; on the 2-core AMD EPYC host kind: a private 1 MiB L2 per core, one 32 MiB L3) than
while the others idle. `modelpar.calibrate.micro` times every compute term in one process with the
other ranks not started; a data- or tensor-parallel step computes on every rank at once.

`measure_contention` runs inside the calibration's multi-rank worker
(`modelpar.calibrate.collectives._collective_worker`, the process group up): a small set of the
kernels the CPU step model prices most (`CONTENTION_KERNELS`), each timed in the main thread's CPU
time (``time.thread_time``: time a rank is descheduled by other load on a shared host is not
counted, the slowdown of the instructions it did run is) with a barrier before every call, once with
one rank running while the others wait at the barrier (each rank in turn) and once with every rank
running; rounds alternate the order. Per kernel the ratio concurrent / alone (median per rank, mean
over the ranks); the summary is the geometric mean of the kernels' ratios, kept per round and
reduced by `modelpar.calibrate.micro.robust` (median, spread over the rounds).
"""

from __future__ import annotations

import math
import statistics
import time

import torch

CONTENTION_REPS = 5     # timed calls per kernel and mode in each round (after one warm-up)


def _matmul_pool(lay: str, m: int, k: int, n: int, pool_bytes: int = 32 * 2 ** 20):
    """One pass over as many ``M x K @ K x N`` operand sets of layout ``lay`` as fill ``pool_bytes``
    (operands from memory, as `modelpar.calibrate.micro.measure_shapes` times the grid)."""
    a_src = torch.randn(k, m).t() if lay[0] == "T" else torch.randn(m, k)
    b_src = torch.randn(n, k).t() if lay[1] == "T" else torch.randn(k, n)
    sets = max(2, pool_bytes // (4 * (m * k + k * n + m * n)))
    ops = [(a_src.clone() if lay[0] == "N" else a_src.t().clone().t(),
            b_src.clone() if lay[1] == "N" else b_src.t().clone().t(), torch.empty(m, n)) for _ in range(sets)]

    def run():
        for a, b, o in ops:
            torch.mm(a, b, out=o)
    return run


def _elementwise():
    """`modelpar.calibrate.micro.measure_elementwise`'s block of non-matmul operators, fwd + bwd."""
    import torch.nn.functional as F
    tokens, width = 2048, 256
    x = torch.randn(tokens, width, requires_grad=True)
    hid = torch.randn(tokens, 4 * width, requires_grad=True)
    ln, target = torch.nn.LayerNorm(width), torch.randint(0, width, (tokens,))

    def run():
        h = ln(x)
        heads = h.view(tokens // 64, 64, 4, width // 4).transpose(1, 2).contiguous()
        y = x + heads.transpose(1, 2).reshape(tokens, width) + F.gelu(hid)[:, :width]
        F.cross_entropy(y, target).backward()
    return run


def _attention():
    """Causal fused attention forward + backward at `modelpar.calibrate.micro.measure_attention`'s
    shape (8 x 4 heads, S 256, D 64)."""
    q, k, v = (torch.randn(8, 4, 256, 64, requires_grad=True) for _ in range(3))
    return lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True).sum().backward()


def _dispatch():
    """`modelpar.calibrate.micro.measure_dispatch_overhead`'s tiny pre-norm MLP blocks, fwd + bwd."""
    from modelpar.calibrate.micro import _PreNormMLP
    torch.manual_seed(0)
    net = torch.nn.Sequential(*[_PreNormMLP(16) for _ in range(8)])
    src = torch.randn(1, 4, 16)

    def run():
        x = src.clone().requires_grad_()
        net(x).sum().backward()
        net.zero_grad(set_to_none=True)
    return run


# term -> builder of one call: three products of the shape grid (a Linear's forward, input and
# weight gradient at a GPT block's sizes), the element-wise block, fused attention, the framework chain
CONTENTION_KERNELS = {
    "matmul NT 1024x256x1024": lambda: _matmul_pool("NT", 1024, 256, 1024),
    "matmul NN 1024x1024x256": lambda: _matmul_pool("NN", 1024, 1024, 256),
    "matmul TN 256x1024x256": lambda: _matmul_pool("TN", 256, 1024, 256),
    "elementwise": _elementwise,
    "attention": _attention,
    "dispatch": _dispatch,
}


def _timed(fn, reps: int, run: bool, barrier) -> float | None:
    """Median thread-CPU seconds of ``fn`` over ``reps`` calls, a ``barrier()`` before each (``run``
    False: only the barriers, for a rank that waits while another times alone)."""
    ts = []
    for _ in range(reps):
        barrier()
        if run:
            t = time.thread_time()
            fn()
            ts.append(time.thread_time() - t)
    barrier()
    return statistics.median(ts) if ts else None


def measure_contention(rank: int, world: int, barrier, mean_over_ranks, *, rounds: int = 3,
                       reps: int = CONTENTION_REPS, kernels=None) -> tuple[dict[str, float], float, float]:
    """(``{term: concurrent / alone}``, summary factor, its relative spread over ``rounds``) on every
    rank (collective: every rank calls it with the same arguments). ``barrier()``: the process
    group's barrier; ``mean_over_ranks(list[float]) -> list[float]``: the element-wise mean over the
    ranks (an all-reduce), so every rank returns the same numbers. ``kernels``: ``{term: builder}``
    (default `CONTENTION_KERNELS`). One rank (``world`` 1): every ratio 1.

    Raises:
        ValueError: ``rounds`` or ``reps`` < 1.
    """
    from modelpar.calibrate.micro import robust
    if rounds < 1 or reps < 1:
        raise ValueError(f"contention rounds and reps must be >= 1, got rounds={rounds}, reps={reps}")
    kernels = CONTENTION_KERNELS if kernels is None else kernels
    if world < 2:
        return dict.fromkeys(kernels, 1.0), 1.0, 0.0
    fns = {name: build() for name, build in kernels.items()}
    for fn in fns.values():
        fn()                                         # warm-up, all ranks
    per_round = []
    for r in range(rounds):
        alone, together = {}, {}
        for mode in (("alone", "together") if r % 2 == 0 else ("together", "alone")):
            for name, fn in fns.items():
                if mode == "together":
                    together[name] = _timed(fn, reps, True, barrier)
                else:
                    for who in range(world):         # each rank in turn, the others at the barrier
                        t = _timed(fn, reps, who == rank, barrier)
                        alone[name] = t if t is not None else alone.get(name)
        per_round.append(mean_over_ranks([together[n] / alone[n] for n in fns]))
    terms = {n: statistics.median(rd[i] for rd in per_round) for i, n in enumerate(fns)}
    factor, spread = robust([math.exp(statistics.fmean(math.log(x) for x in rd)) for rd in per_round])
    return terms, factor, spread
