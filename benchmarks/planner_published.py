"""Predict published GPU training runs with the planner, row by row, and print every row's error.

The rows, the runtime each ran on and their evaluation (leave-one-out framework factor, the table
printed with the factor and at 1, Korthikanti's activation formulas) are `modelpar.planner.published`
(its docstring gives the sources); this script only prints them.

Run: ``PYTHONPATH=. .venv/bin/python benchmarks/planner_published.py [--fast] [--mosaic-kernel fa1|fa2]
[--gemm-split-k N]`` (``--gemm-split-k 16``: the split-K sensitivity check of the GEMMs' wave
quantization, docs/planner.md; not the model)
"""

from __future__ import annotations

import sys
import time

from modelpar.planner.published import report


def main(argv: list[str]) -> int:
    fast = "--fast" in argv
    kernel = argv[argv.index("--mosaic-kernel") + 1] if "--mosaic-kernel" in argv else None
    split = int(argv[argv.index("--gemm-split-k") + 1]) if "--gemm-split-k" in argv else 1
    if split < 1:
        raise SystemExit(f"--gemm-split-k must be >= 1, got {split}")
    t0 = time.perf_counter()
    print(report(fast, kernel, split))
    print(f"in {time.perf_counter() - t0:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
