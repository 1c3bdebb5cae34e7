"""Megatron-LM SC'21 Table 1 rows only: a view of `modelpar.planner.published` (see its docstring).

Each row is predicted for the layout and runtime of Megatron-LM's ``examples/sc21/run_table_1.sh``
(micro-batch, interleaving, torch DDP for PP = 1 and Megatron's DDP for PP > 1, vocabulary-parallel
embedding and head, fp16 reductions), on the built-in A100-80GB profile and its cited tables
(modelpar/planner/gpu.py). Achieved TFLOP/s per GPU uses the paper's FLOP count,
F = 96 B s l h^2 (1 + s/(6h) + V/(16 l h)), over the predicted iteration time x GPUs.

Run: ``PYTHONPATH=. .venv/bin/python benchmarks/planner_megatron.py``
"""

from __future__ import annotations

import sys

from modelpar.planner.published import megatron_rows, table


def main() -> int:
    rows = megatron_rows()
    print(table(rows, [1.0] * len(rows), "Megatron-LM SC'21 Table 1 (factor 1)"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
