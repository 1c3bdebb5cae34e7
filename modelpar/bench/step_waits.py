"""The logic of `benchmarks/cpu_step_waits.py`: one rank's timed steps and profiled step of a measured
case, grouped into all-reduces by size with the main thread's wait per call (`rank_waits`), the
planner's priced TP count and in-context seconds (`priced`), and the Markdown table (`render`).

Units: seconds in the records, milliseconds in the table; all-reduce sizes in bytes of fp32 input."""

from __future__ import annotations

import statistics
import time

WAIT = "_c10d_functional::wait_tensor"       # the main thread blocking on a DTensor collective's result
FUNCOL_ALL_REDUCE = "_c10d_functional::all_reduce"
EAGER_ALL_REDUCE = "c10d::allreduce_"


def _nbytes(shape) -> int:
    n = 4
    for d in shape:
        n *= d
    return n


def group_waits(events) -> dict[str, list[float]]:
    """``{str(bytes): [wait seconds, ...]}`` from profiler events (objects with ``name``,
    ``input_shapes``, ``time_range.start`` and ``cpu_time_total`` in us): each DTensor all-reduce
    paired, in issue order, with the next `WAIT` event."""
    calls: dict[str, list[float]] = {}
    pending: list[str] = []
    for e in sorted(events, key=lambda e: e.time_range.start):
        if e.name == FUNCOL_ALL_REDUCE and e.input_shapes:
            nb = str(_nbytes(e.input_shapes[0]))
            calls.setdefault(nb, [])
            pending.append(nb)
        elif e.name == WAIT and pending:
            calls[pending.pop(0)].append(e.cpu_time_total / 1e6)
    return calls


def rank_waits(built, steps: int, step, barrier) -> dict:
    """This rank's record of one built case (`modelpar.measure.runs.build_case`; ``step(built)``
    runs one optimizer step, ``barrier()`` syncs the ranks): medians over ``steps`` timed steps of
    wall, main-thread CPU and process CPU (seconds), then one profiled step's `group_waits` and its
    count of eager all-reduces (DDP's buckets and other c10d calls)."""
    from torch.profiler import ProfilerActivity, profile

    rows = []
    for _ in range(steps):
        barrier()
        w0, t0, p0 = time.perf_counter(), time.thread_time(), time.process_time()
        step(built)
        rows.append((time.perf_counter() - w0, time.thread_time() - t0, time.process_time() - p0))
    barrier()
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        step(built)
    events = prof.events()
    med = [statistics.median(x) for x in zip(*rows)]
    return {"wall": med[0], "thread": med[1], "process": med[2], "funcol": group_waits(events),
            "eager_all_reduces": sum(1 for e in events if e.name == EAGER_ALL_REDUCE)}


def priced(case, hw) -> dict:
    """The planner's TP all-reduces of ``case`` (`modelpar.measure.Case`) per step on ``hw``:
    ``{"bytes": block output x local batch, "count": forward + backward calls, "per_call": in-context
    seconds (`comms._coll`)}`` as `cost.StepForm` charges them; ``{}`` without TP."""
    from modelpar.measure.memory import profile_for
    from modelpar.plan import ParallelPlan
    from modelpar.planner.comms import _coll
    from modelpar.planner.cost import tp_bytes_per_sample
    from modelpar.planner.memory import rank_loads

    plan = ParallelPlan.from_dict(case.plan)
    if plan.tp == 1:
        return {}
    prof = profile_for(case.model, case.model_config, case.seq_len)
    ld = rank_loads(prof, plan, act_bytes=4)[0]
    nb = tp_bytes_per_sample(prof, plan) * case.local_batch_size
    return {"bytes": nb, "count": 2 * ld.tp_collectives,
            "per_call": _coll(plan, "tp", hw, "all_reduce", nb, plan.tp, True)}


def render(ranks: list[dict], prices: dict[str, dict]) -> str:
    """The Markdown table of every rank's records (``ranks[r][case name]``, `rank_waits`) with the
    ``prices`` (`priced`, per case name; missing: blank)."""
    lines = ["| case | rank | wall ms | main-thread CPU ms | process CPU ms | wall - process | all-reduces (bytes: n, "
             "median / mean wait ms) | priced |", "|---|---|---|---|---|---|---|---|"]
    for name in ranks[0]:
        pr = prices.get(name) or {}
        for r, res in enumerate(ranks):
            x = res[name]
            ar = "; ".join(f"{int(k) / 2 ** 20:.3g} MiB: {len(w)}, {statistics.median(w) * 1e3:.2f} / "
                           f"{statistics.fmean(w) * 1e3:.2f}"
                           for k, w in sorted(x["funcol"].items(), key=lambda kv: -int(kv[0])) if w)
            ar = ar or f"{x['eager_all_reduces']} eager"
            p = f"{pr['count']} x {pr['bytes'] / 2 ** 20:.3g} MiB at {pr['per_call'] * 1e3:.2f} ms" if pr else ""
            lines.append(f"| {name} | {r} | {x['wall'] * 1e3:.1f} | {x['thread'] * 1e3:.1f} | {x['process'] * 1e3:.1f} | "
                         f"{(x['wall'] - x['process']) * 1e3:.1f} | {ar} | {p} |")
    return "\n".join(lines)
