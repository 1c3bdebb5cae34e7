"""Entry point run by torchrun for the multi-process tests: runs the named cases in one launch.

usage: torchrun --nproc-per-node N tests/helpers/dist_worker.py OUT.json CASE [CASE ...]
Each case's result (or its error) is written to OUT.json by rank 0 after each case, so a failure or
a hang in one case still leaves the earlier results; rank 0's wall and CPU seconds per case go to
OUT.json.times.json (the terminal summary lists the slowest).
"""

import json
import os
import sys
import time
import traceback

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))   # tests/: `helpers.*`

import torch  # noqa: E402

from modelpar.parallel.mesh import init_distributed  # noqa: E402


def main() -> None:
    out, names = sys.argv[1], sys.argv[2:]
    torch.set_num_threads(1)
    rank, world = init_distributed(timeout_s=90)
    from helpers import parity_cases
    import torch.distributed as dist

    results, times = {}, {}
    for name in names:
        t0, c0 = time.perf_counter(), time.process_time()
        try:
            res = parity_cases.run_case(name)
            if rank == 0:
                results[name] = res
        except Exception as e:  # noqa: BLE001 - reported per case, the other cases go on
            results[name] = {"error": f"rank {rank}: {type(e).__name__}: {e}", "trace": traceback.format_exc()}
            print(results[name]["trace"], file=sys.stderr, flush=True)
            if rank != 0:
                with open(f"{out}.rank{rank}.err", "a") as f:
                    f.write(json.dumps({name: results[name]}) + "\n")
        if rank == 0:
            # rank 0's seconds per case (it also runs the one-process reference): where a launch's time goes
            times[name] = {"wall_s": round(time.perf_counter() - t0, 3), "cpu_s": round(time.process_time() - c0, 3)}
            with open(out, "w") as f:
                json.dump(results, f, indent=1)
            with open(f"{out}.times.json", "w") as f:
                json.dump(times, f, indent=1)
        dist.barrier()
    from modelpar.launch import exit_rank

    exit_rank(0)


if __name__ == "__main__":
    main()
