"""Time the planner's full search (goal: under 1 second) at 3,072 and 16,384 devices.

Profiles gpt-70b on the meta device (bf16, not timed as search), then times `search_plans` over every
dp_replicate x dp_shard x tp x pp factorization of N H100s with all schedules, micro-batch counts,
virtual stages, checkpointing modes and micro-batch sizes, and prints the counts and the top layouts.
Default runs: 3,072 devices with a global batch of 3,072 sequences, and 16,384 devices with 16,384
(one per device; a fixed batch of 3,072 would prune most layouts at that size).

Hosts differ (the same search took 0.92 s on one machine and 1.6 s on another), so a fixed
pure-Python reference loop (`reference_loop`: float arithmetic, dict and tuple work of the kind the
search does) is timed beside it; compare ``search / reference`` between hosts, not seconds. Each
timing is the best of ``--repeat`` runs (default 3); the process's CPU time is printed too (on a
shared, loaded host it varies far less than wall time).

Run: ``PYTHONPATH=. .venv/bin/python benchmarks/planner_search_time.py [N:BATCH ...] [--repeat K]``
"""

from __future__ import annotations

import sys
import time

import torch

from modelpar.models import build_model
from modelpar.planner.hardware import BUILTIN
from modelpar.planner.profile import profile_model
from modelpar.planner.search import search_plans


def reference_loop(n: int = 400_000) -> float:
    """Seconds of a fixed pure-Python workload (the same on every host and commit)."""
    t0 = time.perf_counter()
    d: dict[tuple, float] = {}
    acc = 0.0
    for i in range(n):
        k = (i & 1023, i % 7)
        x = d.get(k, 0.5) * 1.000001 + i * 1e-9
        d[k] = x
        acc += max(x, acc * 1e-12) if i % 3 else min(x, 2.0)
    assert acc > 0
    return time.perf_counter() - t0


def main(argv: list[str]) -> int:
    repeat = 3
    if "--repeat" in argv:
        i = argv.index("--repeat")
        repeat = int(argv[i + 1])
        argv = argv[:i] + argv[i + 2:]
    runs = [tuple(int(x) for x in a.split(":")) for a in argv] or [(3072, 3072), (16384, 16384)]
    model = build_model("gpt-70b", device="meta")
    t0 = time.perf_counter()
    prof = profile_model(model, torch.zeros(1, model.cfg.seq_len, dtype=torch.long, device="meta"),
                         dtype=torch.bfloat16)
    print(f"profile gpt-70b: {time.perf_counter() - t0:.2f} s")
    ref = min(reference_loop() for _ in range(repeat))
    print(f"reference loop: {ref:.3f} s (best of {repeat})")
    ok = True
    for n, gbs in runs:
        best, cpu, rep = None, None, None
        for _ in range(repeat):
            t1, c1 = time.perf_counter(), time.process_time()
            rep = search_plans(prof, n, BUILTIN["H100-80GB-SXM"], global_batch_size=gbs)
            dt, dc = time.perf_counter() - t1, time.process_time() - c1
            best = dt if best is None else min(best, dt)
            cpu = dc if cpu is None else min(cpu, dc)
        ok &= best < 1.0
        print(f"search {n} devices, global batch {gbs}: {best:.3f} s wall, {cpu:.3f} s CPU (goal < 1 s; "
              f"best of {repeat}), {best / ref:.2f} x the reference loop")
        print("  " + rep.summary())
        for c in rep.distinct_layouts(3):
            print(f"    {c.plan.describe():<60} b={c.micro_batch_size:<3} "
                  f"{c.step.tokens_per_s:>12,.0f} tok/s  {c.memory.total / 2**30:6.1f} GiB")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
