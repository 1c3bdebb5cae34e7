"""Predict published GPU training runs with the planner, row by row, and print every row's error.

The rows, the runtime each ran on and their evaluation (leave-one-out framework factor, the table
printed with the factor and at 1, Korthikanti's activation formulas) are `modelpar.planner.published`
(its docstring gives the sources); this script only prints them.

Run: ``PYTHONPATH=. .venv/bin/python benchmarks/planner_published.py [--fast] [--mosaic-kernel fa1|fa2]``
"""

from __future__ import annotations

import sys
import time

from modelpar.planner.published import report


def main(argv: list[str]) -> int:
    fast = "--fast" in argv
    kernel = argv[argv.index("--mosaic-kernel") + 1] if "--mosaic-kernel" in argv else None
    t0 = time.perf_counter()
    print(report(fast, kernel))
    print(f"in {time.perf_counter() - t0:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
