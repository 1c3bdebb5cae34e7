"""Calibration of communication: gloo all-reduce / all-gather / reduce-scatter / send-recv between
local ranks started through `modelpar.launch` (``python -m modelpar.calibrate.collectives``), back
to back and between compute segments, the memory bandwidth every rank gets at once, compute kernels'
slowdown with every rank running them (`modelpar.calibrate.contention`), and the per-call
overheads of torch's TP Linear and FSDP2 units.
"""

from __future__ import annotations

import os
import sys
import time

import torch

from modelpar.calibrate.micro import (COLLECTIVE_SIZES, COLLECTIVES, EXTRA_ROUNDS, ROUNDS, _fresh_alloc_costs,
                                     _time, fit_alpha_beta, median_settled, robust)
from modelpar.planner.hardware import interpolate_sizes


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


def _collective_worker(sizes, rounds: int = ROUNDS, quick: bool = False) -> dict:
    """What each launched rank measures (the process group is up); rank 0's dict is the result
    (``quick``: see `_framework_overheads`)."""
    import torch.distributed as dist
    rank, world = dist.get_rank(), dist.get_world_size()
    res = {op: {} for op in COLLECTIVES}
    # memory bandwidth per rank while every rank streams at once (ranks share the memory bus) and
    # while one streams alone, sampled in pairs between the phases below (`shared_bandwidth_sample`)
    bws = [shared_bandwidth_sample()]
    # compute kernels with every rank running them at once vs one rank alone (`modelpar.calibrate.contention`)
    from modelpar.calibrate.contention import measure_contention
    res["contention"] = measure_contention(rank, world, dist.barrier, _mean_over_ranks, rounds=rounds)
    bws.append(shared_bandwidth_sample())
    res["fresh"] = _fresh_alloc_costs()
    for nbytes in sizes:
        bws.append(shared_bandwidth_sample())
        ops = _collective_calls(rank, world, nbytes)
        for op, fn in ops.items():
            dist.barrier()
            res[op][nbytes] = _time(fn, 7)
    res["in_context"], sp = _in_context_tables(rank, world, sizes, rounds=rounds,
                                               between_rounds=lambda: bws.append(shared_bandwidth_sample()))
    res["framework"], sp2 = _framework_overheads(world, res["in_context"]["all_reduce"], quick=quick)
    bws.append(shared_bandwidth_sample())
    res["mem_bandwidth"], spread = robust(b[0] for b in bws)
    res["mem_bandwidth_alone"], spread_alone = robust(b[1] for b in bws)
    res["spread"] = {"mem_bandwidth": spread, "mem_bandwidth_alone": spread_alone, **sp, **sp2}
    return res


def shared_bandwidth_sample(mib: int = 64, reps: int = 5) -> tuple[float, float]:
    """One paired sample of the memory bandwidth per rank (bytes/s): (every rank streaming at once,
    rank 0 streaming alone while the others wait in a barrier). The kernel is ``c = a + b`` on ``mib``
    MiB fp32 operands (past the caches; 3 x ``mib`` MiB of traffic), the median of ``reps`` calls
    (`_synced_median` for the shared rate). Every rank calls it at the same point and gets the same
    pair. The calibration takes samples between its phases, tens of seconds apart, and keeps each
    rate's median: on a shared host these rates move with the neighbours' memory traffic on a scale of
    seconds (2 ranks of the 2-core host kind, 4 samples 1 s apart in each of 6 launches: 12-23 GB/s
    per rank), so samples taken back to back agree with one another (1-4% spread) yet two
    calibrations minutes apart differed by 35%, enough to flip the plan `auto` picks; taking the two
    rates at the same moments keeps their ratio (pipeline stages vs ranks in lockstep) from carrying
    the load of two different moments (docs/planner.md, session 14)."""
    import torch.distributed as dist
    n = mib * 2 ** 20 // 4
    a, b = torch.ones(n), torch.ones(n)
    c = torch.empty_like(a)
    shared = 3 * n * 4 / _synced_median(lambda: torch.add(a, b, out=c), reps)
    dist.barrier()
    alone = torch.zeros(1, dtype=torch.float64)
    if dist.get_rank() == 0:
        alone += 3 * n * 4 / _time(lambda: torch.add(a, b, out=c), reps)
    dist.broadcast(alone, 0)
    return shared, float(alone)


def worker_main(argv: list[str]) -> int:
    """``torchrun ... -m modelpar.calibrate.collectives OUT.json [rounds=N] [quick=1] SIZE [SIZE ...]``:
    every rank measures (``rounds``: see `_in_context_tables`; ``quick``: `_framework_overheads`), rank 0
    writes the result (dict keys that are byte counts become strings in JSON)."""
    import warnings

    import torch.distributed as dist

    from modelpar.launch import write_json_atomic
    from modelpar.parallel.mesh import init_distributed
    warnings.simplefilter("ignore", FutureWarning)     # *_tensor collectives' rename notices
    torch.set_num_threads(1)
    init_distributed(timeout_s=300)
    rounds = [int(a.split("=", 1)[1]) for a in argv[1:] if a.startswith("rounds=")]
    quick = "quick=1" in argv[1:]
    res = _collective_worker([int(a) for a in argv[1:] if "=" not in a], *rounds[-1:], quick=quick)
    if dist.get_rank() == 0:
        write_json_atomic(argv[0], res)
    return 0


def _int_keys(d):
    """JSON's string keys back to byte counts, recursively where every key is a number."""
    if not isinstance(d, dict):
        return d
    if d and all(isinstance(k, str) and k.isdigit() for k in d):
        return {int(k): _int_keys(v) for k, v in d.items()}
    return {k: _int_keys(v) for k, v in d.items()}


def _mean_over_ranks(values: list[float]) -> list[float]:
    """Element-wise mean of ``values`` over the ranks (an all-reduce; every rank gets the same)."""
    import torch.distributed as dist
    out = torch.tensor(values, dtype=torch.float64)
    dist.all_reduce(out)
    return (out / dist.get_world_size()).tolist()


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


# the in-context tables' settling tolerance: looser than compute's (`micro.SETTLED`), since the wait
# for the slower rank is jitter that training pays too (2-core host kind: rounds of one calibration
# 15-67% apart at <= 1 MiB, 4-27% at 64 MiB); extra rounds still narrow the median of a bursty start
IN_CONTEXT_SETTLED = 0.25


def tables_unsettled(per_round: list[dict[str, dict[int, float]]], tolerance: float = IN_CONTEXT_SETTLED) -> bool:
    """Whether the median over ``per_round`` (one ``{op: {bytes: s}}`` table per round) of any
    measured (op, size) stands on disagreeing rounds (`micro.median_settled` at ``tolerance``);
    entries that are 0 in every round (a rank that takes no part in send/recv) are not measured."""
    keys = {(op, nb) for r in per_round for op, t in r.items() for nb in t}
    return any(not median_settled(vs, tolerance) for op, nb in sorted(keys)
               for vs in [[r[op][nb] for r in per_round]] if any(vs))


def _in_context_tables(rank: int, world: int, sizes, segment_s: float = 0.01, rounds: int = ROUNDS,
                       between_rounds=None) -> tuple[dict[str, dict[int, float]], dict[str, float]]:
    """Seconds of each collective issued the way training issues it: after ~``segment_s`` of matmul
    work on every rank (a block's forward or backward), not back to back. On a shared CPU this is
    what a blocking collective costs in a step: the wait for the slowest rank (the segments' spread)
    plus waking the backend's threads, which a tight loop of collectives never pays (gloo on 2 ranks
    of this machine: 1-5 ms per call between segments vs 0.3-4 ms back to back).
    Per call: the time from the end of the rank's segment to the collective's return. ``rounds``
    rounds, each over every size and op (4 calls per size up to 4 MiB, 2 above); per round and rank
    the `_trimmed_mean` over the calls (up to 1 MiB, where the wait dominates, pooled over those
    sizes); with ``rounds`` > 1, up to `micro.EXTRA_ROUNDS` more rounds while a median is not settled
    (`IN_CONTEXT_SETTLED`); per rank the median over the rounds (`robust`: outlying rounds are rejected); made
    non-decreasing in the size; averaged over the ranks (every rank reports the same number).
    Returns (``{op: {bytes: s}}``, ``{"<op>.in_context[small|<n> KiB]": relative spread}``: the
    rounds' spread at the pooled small sizes and at the largest, the ranks' mean). ``between_rounds``:
    called on every rank after each round (the caller's samples of other terms, spread in time)."""
    import torch.distributed as dist
    a, w = torch.randn(2048, 128), torch.randn(128, 512)
    t = time.perf_counter()
    a @ w
    k = max(1, round(segment_s / max(time.perf_counter() - t, 1e-5)))

    def seg():
        for _ in range(k):
            a @ w
    per_round: list[dict[str, dict[int, float]]] = []

    def unsettled() -> bool:        # any rank's `tables_unsettled`: the same answer on every rank
        f = torch.tensor([1.0 if tables_unsettled(per_round) else 0.0])
        dist.all_reduce(f, op=dist.ReduceOp.MAX)
        return bool(f.item())
    while len(per_round) < rounds or (rounds > 1 and len(per_round) < rounds + EXTRA_ROUNDS and unsettled()):
        samples: dict[str, dict[int, list[float]]] = {}
        for nbytes in sizes:
            ops = _collective_calls(rank, world, nbytes)
            reps = 4 if nbytes <= 4 * 2 ** 20 else 2
            for op, fn in ops.items():
                dist.barrier()
                ts = []
                for _ in range(reps):
                    seg()
                    t = time.perf_counter()
                    fn()
                    ts.append(time.perf_counter() - t)
                samples.setdefault(op, {})[nbytes] = ts
        tab: dict[str, dict[int, float]] = {}
        for op, by_size in samples.items():
            # up to 1 MiB the wait dominates and does not depend on the size: one pooled value
            small = sorted(t for nb, ts in by_size.items() if nb <= 2 ** 20 for t in ts)
            tab[op] = {nb: _trimmed_mean(small if nb <= 2 ** 20 else ts) for nb, ts in by_size.items()}
        per_round.append(tab)
        if between_rounds is not None:
            between_rounds()
    out = {op: {} for op in COLLECTIVES}
    spread: dict[str, float] = {}
    big = max(sizes)
    for op in COLLECTIVES:
        prev = 0.0
        for nbytes in sorted(sizes):
            med, sp = robust(r[op][nbytes] for r in per_round)
            # cumulative max: a larger message never costs less
            prev = out[op][nbytes] = max(prev, med)
            if nbytes == big or nbytes == min(sizes):
                spread[f"{op}.in_context[{'small' if nbytes <= 2 ** 20 else f'{nbytes >> 10} KiB'}]"] = sp
    flat = torch.tensor([out[op][nb] for op in COLLECTIVES for nb in sizes], dtype=torch.float64)
    dist.all_reduce(flat)
    if world > 2:       # send/recv runs between ranks 0 and 1 only
        per = len(sizes)
        i = COLLECTIVES.index("send_recv") * per
        flat[i:i + per] *= world / 2
    flat /= world
    vals = iter(flat.tolist())
    sp = torch.tensor(list(spread.values()), dtype=torch.float64)
    dist.all_reduce(sp)
    sp /= world
    return ({op: {nb: next(vals) for nb in sizes} for op in COLLECTIVES},
            dict(zip(spread, sp.tolist())))


def _alternated(fns, reps: int, *, best: bool = False) -> list[float]:
    """Seconds of each of ``fns`` over ``reps`` rounds that call them in turn (one warm-up call
    each first): the median (``best``: smallest) per function. Alternating puts every function
    under the same load at the same moments, so their difference does not carry a burst that hit
    only one of them."""
    import statistics
    for f in fns:
        f()
    ts: list[list[float]] = [[] for _ in fns]
    for _ in range(reps):
        for i, f in enumerate(fns):
            t = time.perf_counter()
            f()
            ts[i].append(time.perf_counter() - t)
    return [min(t) if best else statistics.median(t) for t in ts]


TP_ESTIMATES, FSDP_ESTIMATES = 7, 5     # estimates (medians kept) of the two difference terms
# the TP chain's (tokens, width) inputs: the fixed part and the per-byte part (`_framework_overheads`);
# `modelpar calibrate --quick` (a smoke run, not for planning) times the larger on a quarter of the
# tokens with 3 estimates (the chain at 2048 x 256 was ~19 s CPU per rank of a --rounds 1 calibration)
TP_INPUTS, QUICK_TP_INPUTS, QUICK_TP_ESTIMATES = ((64, 16), (2048, 256)), ((64, 16), (512, 256)), 3


def _tp_linear_cost(mesh, world: int, tokens: int, width: int, all_reduce: dict[int, float],
                    n: int = 3, estimates: int = TP_ESTIMATES) -> tuple[float, list[float]]:
    """(input activation bytes, estimates of the seconds per Linear) that tensor parallelism adds,
    forward + backward: ``2n`` Linears alternating width -> 4 width (colwise) and back (rowwise) on a
    (tokens, width) input, minus the same local shards as plain Linears and minus its ``2n - 1``
    all-reduces at the in-context times ``all_reduce`` ({bytes: s}) that the cost model charges them,
    so that model and measurement agree on this chain whatever share of it one calls communication.
    ``estimates`` estimates (`TP_ESTIMATES`), each from medians of 5 alternated calls of the two
    chains (a difference of jittery times: the term with the most repeats)."""
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
    t_ar = (2 * n - 1) * interpolate_sizes(sorted(all_reduce.items()), act.numel() * 4)
    est = []
    for _ in range(estimates):
        dist.barrier()
        t_tp, t_local = _alternated([lambda: tp(x).sum().backward(), lambda: local(x).sum().backward()], 5)
        est.append((t_tp - t_local - t_ar) / (2 * n))
    return 4.0 * tokens * width, est


def _framework_overheads(world: int, all_reduce: dict[int, float], *, d: int = 16,
                         n: int = 8, quick: bool = False) -> tuple[dict, dict]:
    """Seconds per call that torch's tensor-parallel Linear (DTensor) and FSDP2 unit add beyond the
    arithmetic and the collectives, forward + backward: a chain of ``2n`` tiny (d x d) Linears, plain,
    with alternating colwise / rowwise TP (`_tp_linear_cost`: its all-reduces subtracted at the
    in-context times ``all_reduce``, {bytes: s}, that the cost model charges), and with every Linear an
    FSDP2 unit (the same collectives issued alone subtracted), the chains timed alternately
    (`_alternated`). Each term is the median of its estimates (`TP_ESTIMATES`, `FSDP_ESTIMATES`);
    the second dict holds their relative spreads (`robust`). Every rank reports the ranks' mean.
    ``quick``: the TP chain on `QUICK_TP_INPUTS` with `QUICK_TP_ESTIMATES` estimates."""
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
    tp_costs = [_tp_linear_cost(mesh, world, tokens, width, all_reduce,
                                estimates=QUICK_TP_ESTIMATES if quick else TP_ESTIMATES)
                for tokens, width in (QUICK_TP_INPUTS if quick else TP_INPUTS)]
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
    for _ in range(FSDP_ESTIMATES):     # each a difference of best-of-15 alternated times
        dist.barrier()
        t_plain, t_fs, t_fs4, t_fc4, t_fc = _alternated([
            lambda: step(plain), lambda: step(fs), lambda: step(fs4),
            lambda: [(dist.all_gather_into_tensor(w4, shard4), dist.all_gather_into_tensor(w4, shard4),
                      dist.reduce_scatter_tensor(shard4, w4)) for _ in range(n // 2)],
            lambda: [(dist.all_gather_into_tensor(w, shard), dist.all_gather_into_tensor(w, shard),
                      dist.reduce_scatter_tensor(shard, w)) for _ in range(2 * n)]], 15, best=True)
        c2s.append((t_fs - t_plain - t_fc) / (2 * n))              # per unit of 2 tensors
        c8s.append((t_fs4 - t_plain - t_fc4) / (n // 2))           # per unit of 8 tensors
    # TP: a fixed part and a part per byte of the Linear's input activation (DTensor's conversions
    # and copies of the activation), from the two sizes' medians
    import statistics
    (b0, e0), (b1, e1) = tp_costs
    c0, c1 = statistics.median(e0), statistics.median(e1)
    tp_per_byte = max(0.0, (c1 - c0) / (b1 - b0))
    tp_each = max(0.0, c0 - tp_per_byte * b0)
    c2, c8 = statistics.median(c2s), statistics.median(c8s)
    per_tensor = max(0.0, (c8 - c2) / 6)
    per_unit = max(0.0, c2 - 2 * per_tensor)
    # spreads: of the estimates each term mostly rests on (the small chain's for the fixed parts,
    # the large TP chain's for the per-byte part, the 8-tensor units' for the per-tensor part)
    spreads = [min(robust(e)[1], 1e9) for e in (e0, e1, c2s, c8s)]
    names = ("tp_linear_overhead_s", "tp_linear_overhead_s_per_byte", "fsdp_unit_overhead_s", "fsdp_tensor_overhead_s")
    vals = torch.tensor([tp_each, tp_per_byte, per_unit, per_tensor] + spreads, dtype=torch.float64)
    dist.all_reduce(vals)               # the ranks' mean: every rank reports the same numbers
    vals /= world
    v = vals.tolist()
    return dict(zip(names, v[:4])), dict(zip(names, v[4:]))


def measure_collectives(world: int = 2, sizes=COLLECTIVE_SIZES, *, timeout_s: float = 600,
                        rounds: int = ROUNDS, quick: bool = False) -> dict:
    """``{op: (latency s, bandwidth B/s)}`` of gloo all-reduce, all-gather, reduce-scatter and
    send/recv between ``world`` local ranks (launched by `modelpar.launch.run_workers`), each fitted
    by `fit_alpha_beta` over ``sizes``, ``"mem_bandwidth"``: bytes/s one rank streams while all
    ``world`` ranks stream at once, and ``"mem_bandwidth_alone"``: while one streams alone (the
    medians of `shared_bandwidth_sample` pairs taken between the phases: ``len(sizes) + 3`` and one
    per in-context round), and ``"contention"``: `modelpar.calibrate.contention.measure_contention`'s
    (terms, factor, spread). ``rounds``: rounds of the in-context tables and of the contention terms
    (`_in_context_tables`); ``quick``: the framework terms' smaller TP chain (`_framework_overheads`).

    Raises:
        RuntimeError: the ranks failed or did not finish within ``timeout_s``.
    """
    import tempfile

    from modelpar.launch import run_workers
    out = os.path.join(tempfile.mkdtemp(prefix="modelpar-calibrate-"), "collectives.json")
    run = run_workers(["-m", "modelpar.calibrate.collectives", out, f"rounds={rounds}", *(["quick=1"] if quick else []),
                       *map(str, sizes)], world, out, timeout_s=timeout_s)
    if run.result is None:
        raise RuntimeError(f"calibration ranks failed ({run.reason()}):\n{run.output[-3000:]}")
    res = _int_keys(run.result)
    from modelpar.planner.cost import alpha_beta_form
    fits = {}
    for op in COLLECTIVES:
        steps, volume = alpha_beta_form(op, world)
        fits[op] = fit_alpha_beta(res[op], steps=steps, volume=volume)
    fits["mem_bandwidth"] = res["mem_bandwidth"]
    fits["mem_bandwidth_alone"] = res["mem_bandwidth_alone"]
    fits["times"] = {op: res[op] for op in COLLECTIVES}
    fits["fresh"] = res["fresh"]
    fits["contention"] = res["contention"]
    fits["framework"] = res["framework"]
    fits["in_context"] = res["in_context"]
    fits["spread"] = res["spread"]
    return fits


if __name__ == "__main__":
    from modelpar.launch import exit_rank

    exit_rank(worker_main(sys.argv[1:]))
