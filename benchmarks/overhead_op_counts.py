"""What modelpar's step does that the plain torch loop does not: counted, not timed.

The loops of `benchmarks/overhead_vs_plain_torch.py` (plain torch, modelpar's `train_step`, gpt-1m,
seq 128, 8 samples per rank, 2 ranks), per strategy (ddp, fsdp), without clipping (as timed there) and
with clipping at 1.0 (`modelpar train`'s default; the plain loop then calls
`torch.nn.utils.clip_grad_norm_`). After
``--warmup`` steps of each loop (optimizer state built, DDP buckets rebuilt), one step of each is
run under four counters, and the counts are laid side by side (rank 0's; both ranks run the same
ops):

- torch.profiler (CPU, shapes recorded): every recorded op by name (``aten::*``, autograd nodes,
  FSDP's ``FSDP::*`` record functions, ``c10d::*`` / ``gloo:*`` collectives); collectives also with
  their bytes (numel x element size of the recorded inputs);
- allocations (``profile_memory=True``): how many recorded ops allocate CPU memory themselves (an
  op's own allocations, not its children's) and the bytes they allocate;
- garbage collections (``gc.callbacks``) by generation;
- host reads: calls of ``Tensor.item`` / ``tolist`` / ``cpu`` / ``numpy`` (patched while counting);
- cProfile: Python function calls in total, and those of modelpar's own files by function.

Counts do not depend on machine load, so this runs on a busy host (unlike the timing benchmark).
The table prints only the rows where modelpar and plain torch differ (``--all`` prints every row).

    python benchmarks/overhead_op_counts.py [--out FILE.md] [--all 1]
"""

from __future__ import annotations

import collections
import contextlib
import cProfile
import gc
import json
import pstats
import sys
from pathlib import Path

from _launch import benchmark_main  # noqa: E402  (benchmarks/_launch.py, beside this script)
from overhead_vs_plain_torch import modelpar_step, plain_step  # noqa: E402

_ELEM = {"float": 4, "double": 8, "long int": 8, "int": 4, "unsigned char": 1, "c10::BFloat16": 2,
         "c10::Half": 2, "bool": 1, "signed char": 1, "short int": 2}
_COLL = ("c10d::", "gloo:", "record_param_comms")


@contextlib.contextmanager
def _host_reads(counter: collections.Counter):
    import torch

    names = ("item", "tolist", "cpu", "numpy")
    orig = {n: getattr(torch.Tensor, n) for n in names}

    def wrap(n):
        def f(self, *a, **k):
            counter[f"Tensor.{n}"] += 1
            return orig[n](self, *a, **k)
        return f
    for n in names:
        setattr(torch.Tensor, n, wrap(n))
    try:
        yield
    finally:
        for n in names:
            setattr(torch.Tensor, n, orig[n])


def count_step(fn) -> dict:
    """The four counts of one call of ``fn`` (see the module docstring)."""
    from torch.profiler import ProfilerActivity, profile

    ops: collections.Counter = collections.Counter()
    coll: collections.Counter = collections.Counter()
    reads: collections.Counter = collections.Counter()
    prof_py = cProfile.Profile()
    gcs: collections.Counter = collections.Counter()

    def on_gc(phase, info):
        if phase == "start":
            gcs[f"gen{info['generation']}"] += 1
    gc.callbacks.append(on_gc)
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True, profile_memory=True) as prof:
        with _host_reads(reads):
            prof_py.enable()
            fn()
            prof_py.disable()
    gc.callbacks.remove(on_gc)
    n_alloc, alloc_bytes = 0, 0
    for ev in prof.events():
        own_bytes = ev.cpu_memory_usage if ev.name == "[memory]" else ev.self_cpu_memory_usage
        if own_bytes > 0:
            n_alloc += 1
            alloc_bytes += own_bytes
        if ev.name == "[memory]":
            continue
        ops[ev.name] += 1
        if ev.name.startswith(_COLL):
            nbytes = 0
            for shape, typ in zip(ev.input_shapes or [], ev.input_dtypes or []):
                if isinstance(shape, list) and shape and all(isinstance(d, int) for d in shape):
                    numel = 1
                    for d in shape:
                        numel *= d
                    nbytes += numel * _ELEM.get(typ, 0)
            coll[f"{ev.name} ({nbytes} B)"] += 1
    st = pstats.Stats(prof_py)
    total_calls = sum(v[1] for v in st.stats.values())
    own, calls = collections.Counter(), collections.Counter()
    for (file, line, func), v in st.stats.items():
        if "/modelpar/" in file:
            own[f"{file.split('/modelpar/', 1)[1]}:{func}"] += v[1]
        if " at 0x" not in func:            # (the host-read patches themselves)
            calls[f"{'/'.join(file.split('/')[-2:])}:{func}"] += v[1]
    return {"ops": dict(ops), "collectives": dict(coll), "host_reads": dict(reads),
            "allocations": {"count": n_alloc, "bytes": alloc_bytes},
            "python_calls": total_calls, "modelpar_calls": dict(own),
            "calls": dict(calls), "gc": dict(gcs)}


def worker(args) -> None:
    import torch
    import torch.distributed as dist

    from modelpar.parallel.mesh import init_distributed

    torch.set_num_threads(1)
    rank, _ = init_distributed(timeout_s=900)
    res = {}
    for strategy in ("ddp", "fsdp"):
        fns = {"plain": plain_step(strategy), "modelpar": modelpar_step(strategy),
               "plain, clip 1.0": plain_step(strategy, grad_clip=1.0),
               "modelpar, clip 1.0": modelpar_step(strategy, grad_clip=1.0)}
        for fn in fns.values():
            for _ in range(args.warmup):
                fn()
        res[strategy] = {}
        for name, fn in fns.items():
            dist.barrier()
            res[strategy][name] = count_step(fn)
    if rank == 0:
        Path(args.json).write_text(json.dumps(res, indent=1))
    dist.destroy_process_group()


def render(res: dict, show_all: bool = False) -> str:
    lines = ["## What one step does: modelpar's `train_step` vs the plain torch loop (counts, rank 0)", "",
             "gpt-1m, seq 128, 8 samples per rank, 2 ranks; one step after the warm-up steps. Rows: ops "
             "recorded by torch.profiler (nested ops counted too), collectives with their bytes, host "
             "reads, garbage collections, allocations, Python calls." + ("" if show_all else " Only rows that differ."), ""]
    for key, r in ((f"{s}{c}", r) for s, rs in res.items() for c in ("", ", clip 1.0")
                   for r in [{"plain": rs[f"plain{c}"], "modelpar": rs[f"modelpar{c}"]}]):
        p, m = r["plain"], r["modelpar"]
        lines += [f"### {key}", "", "| what | plain torch | modelpar | difference |", "|---|---|---|---|"]
        rows = [("python calls (all)", p["python_calls"], m["python_calls"]),
                ("allocating ops (count)", p["allocations"]["count"], m["allocations"]["count"]),
                ("allocated bytes", p["allocations"]["bytes"], m["allocations"]["bytes"])]
        for kind in ("gc", "host_reads", "collectives", "ops"):
            for k in sorted(set(p[kind]) | set(m[kind])):
                rows.append((f"{kind.replace('_', ' ')}: `{k}`", p[kind].get(k, 0), m[kind].get(k, 0)))
        rows.append(("ops (all)", sum(p["ops"].values()), sum(m["ops"].values())))
        for what, a, b in rows:
            if show_all or a != b or what.startswith(("python calls", "ops (all)", "alloc")):
                lines.append(f"| {what} | {a} | {b} | {b - a:+d} |")
        diff = {k: m["calls"].get(k, 0) - p["calls"].get(k, 0) for k in set(p["calls"]) | set(m["calls"])}
        top = sorted((kv for kv in diff.items() if kv[1]), key=lambda kv: (-abs(kv[1]), kv[0]))[:25]
        lines += ["", "Python functions whose call count differs most (modelpar minus plain): "
                  + ", ".join(f"`{k}` {v:+d}" for k, v in top)]
        own = sorted(m["modelpar_calls"].items(), key=lambda kv: (-kv[1], kv[0]))
        lines += ["", f"modelpar's own functions called in the step ({sum(m['modelpar_calls'].values())} calls): "
                  + ", ".join(f"`{k}` x{v}" for k, v in own), ""]
    lines.append("Regenerate: `python benchmarks/overhead_op_counts.py`")
    return "\n".join(lines) + "\n"


def _add_args(ap) -> None:
    ap.add_argument("--warmup", type=int, default=3, help="uncounted steps of each loop first")
    ap.add_argument("--all", type=int, default=0, help="1: print every row, not only the differences")


def main() -> int:
    return benchmark_main(__file__, __doc__, json_default="/tmp/overhead_op_counts.json", add_args=_add_args,
                          worker=worker, render=lambda res, args, load: render(res, bool(args.all)))


if __name__ == "__main__":
    sys.exit(main())
