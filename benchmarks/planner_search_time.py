"""Time the planner's full search over 3,072 devices (goal: under 1 second).

Profiles gpt-70b on the meta device (bf16, not timed as search), then times `search_plans` over every
dp_replicate x dp_shard x tp x pp factorization of 3,072 H100s with all schedules, micro-batch counts,
virtual stages, checkpointing modes and micro-batch sizes, and prints the counts and the top layouts.

Run: ``.venv/bin/python benchmarks/planner_search_time.py [num_devices]``
"""

from __future__ import annotations

import sys
import time

import torch

from modelpar.models import build_model
from modelpar.planner.hardware import BUILTIN
from modelpar.planner.profile import profile_model
from modelpar.planner.search import search_plans


def main(argv: list[str]) -> int:
    n = int(argv[0]) if argv else 3072
    model = build_model("gpt-70b", device="meta")
    t0 = time.perf_counter()
    prof = profile_model(model, torch.zeros(1, model.cfg.seq_len, dtype=torch.long, device="meta"),
                         dtype=torch.bfloat16)
    t1 = time.perf_counter()
    rep = search_plans(prof, n, BUILTIN["H100-80GB-SXM"], global_batch_size=3072)
    t2 = time.perf_counter()
    print(f"profile gpt-70b: {t1 - t0:.2f} s")
    print(f"search {n} devices: {t2 - t1:.3f} s (goal < 1 s)")
    print(rep.summary())
    for c in rep.distinct_layouts(5):
        print(f"  {c.plan.describe():<60} b={c.micro_batch_size:<3} "
              f"{c.step.tokens_per_s:>12,.0f} tok/s  {c.memory.total / 2**30:6.1f} GiB")
    return 0 if t2 - t1 < 1.0 else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
