"""Per-step data cost on one rank: the whole global batch read on every rank (`TokenBatches.global_batch`,
what `train` did before) vs only the rank's own rows (`TokenBatches.global_rows`, sliced as `train_step`
slices it), for a few global batch sizes and data-parallel degrees at sequence length 4,096.

The data is an in-memory token stream of 2^27 uint16 tokens (a token file is read the same way, from
the page cache or the filesystem: then every row not read is also I/O saved). Times are medians of
``--repeat`` runs of one step's reads (process CPU seconds; the runs alternate).

Run: ``PYTHONPATH=. .venv/bin/python benchmarks/data_rows_per_rank.py [--repeat 5]``
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from modelpar.train.data import TokenBatches, global_batch_slice


def one_step(tb: TokenBatches, gbs: int, dp: int, accum: int, lazy: bool) -> float:
    t0 = time.process_time()
    xg, yg = (tb.global_rows if lazy else tb.global_batch)(0, 1, gbs)
    for a in range(accum):
        sl = global_batch_slice(gbs, accum_step=a, num_accum=accum, dp_rank=dp // 2, dp_degree=dp)
        x, y = xg[sl], yg[sl]
        assert x.shape[0] == gbs // (accum * dp)
    return time.process_time() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeat", type=int, default=5)
    args = ap.parse_args()
    torch.set_num_threads(1)
    data = torch.randint(0, 50_000, (2 ** 27,), dtype=torch.int32).to(torch.uint16)
    tb = TokenBatches(data, 4096)
    print(f"{'global batch':>12} {'dp':>5} {'accum':>5} {'whole batch (s)':>16} {'own rows (s)':>13} {'ratio':>7}")
    for gbs, dp, accum in ((512, 64, 2), (3072, 384, 1), (3072, 96, 4), (16384, 2048, 2)):
        whole, own = [], []
        for _ in range(args.repeat):
            whole.append(one_step(tb, gbs, dp, accum, lazy=False))
            own.append(one_step(tb, gbs, dp, accum, lazy=True))
        w, o = statistics.median(whole), statistics.median(own)
        print(f"{gbs:>12,} {dp:>5} {accum:>5} {w:>16.4f} {o:>13.5f} {w / o:>7.0f}x"
              f"   (spread {min(whole):.4f}-{max(whole):.4f} / {min(own):.5f}-{max(own):.5f})")


if __name__ == "__main__":
    main()
