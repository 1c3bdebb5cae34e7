"""Entry point run by torchrun (or plainly, for one process) for the checkpoint, fault and preflight
tests: runs a list of scenarios in one launch (the process group is shared) and writes their results;
rank 0's wall and CPU seconds per scenario go to OUT.json.times.json (the terminal summary lists the
slowest per launch, `helpers.workers.LAUNCHES`).

usage: torchrun --nproc-per-node N tests/helpers/ckpt_worker.py OUT.json SPEC.json
SPEC.json: a list of {"name": ..., "kind": "train" | "c1" | "c2" | "c9", "cfg": {TrainConfig fields},
"run_dir": ...}, or {"name": ..., "kind": "measure", "case": {`modelpar.measure.Case` fields}} (a
memory measurement, `modelpar.measure.runs.run_cases`: rank 0's result is ``{case name: row}``), or
{"name": ..., "kind": "call", "fn": "helpers.module:function", ...} (``function(spec)`` runs on every
rank and returns the result). Every rank's error message is kept (``errors``: rank -> message), so a test can
check that all ranks raised the same one.
"""

import json
import os
import sys
import time
import traceback
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))   # tests/: `helpers.*`

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from modelpar.parallel.mesh import init_distributed  # noqa: E402

BASE = dict(model="gpt-nano", seq_len=16, global_batch_size=8, steps=8, warmup_steps=2, eval_every=0,
            eval_samples=8, sample_bytes=0, track_memory=False, log_every=1, threads=1)


def data_dir() -> str:
    """A small, fixed corpus: the standard library's json package."""
    import json as _json
    return str(Path(_json.__file__).parent)


def base_cfg(**kw) -> dict:
    return {**BASE, "data": data_dir(), **kw}


def run_train(spec: dict) -> dict | None:
    from modelpar.train.config import TrainConfig
    from modelpar.train.runner import train

    s = train(TrainConfig(**spec["cfg"]), run_dir=Path(spec["run_dir"]), quiet=True)
    peaks = [s["peak_tensor_bytes"]]            # what each rank's summary says (rank order)
    if dist.is_initialized() and dist.get_world_size() > 1:
        peaks = [None] * dist.get_world_size()
        dist.all_gather_object(peaks, s["peak_tensor_bytes"])
    return {"losses": s["losses"], "start_step": s["start_step"], "val_loss_after": s["val_loss_after"],
            "plan": s["plan"], "world_size": s["world_size"], "peak_tensor_bytes": peaks}


def run_measure(spec: dict) -> dict:
    from modelpar.measure.runs import Case, run_cases

    return run_cases([Case(**spec["case"])], mode="memory")


def main() -> None:
    out, spec_file = sys.argv[1], sys.argv[2]
    specs = json.loads(Path(spec_file).read_text())
    torch.set_num_threads(1)
    rank, world = init_distributed(timeout_s=90)
    from helpers import preflight_cases

    results, times = {}, {}
    for spec in specs:
        err = None
        res = None
        t0, c0 = time.perf_counter(), time.process_time()
        try:
            if spec["kind"] == "call":       # {"fn": "helpers.module:function"}: function(spec) -> result
                import importlib
                mod, fn = spec["fn"].split(":")
                res = getattr(importlib.import_module(mod), fn)(spec)
            else:
                res = (run_train(spec) if spec["kind"] == "train" else run_measure(spec) if spec["kind"] == "measure"
                       else preflight_cases.run(spec))
        except Exception as e:  # noqa: BLE001 - reported per scenario
            err = f"{type(e).__name__}: {e}"
            print(f"[rank {rank}] {spec['name']}: {traceback.format_exc()}", file=sys.stderr, flush=True)
        errors = [err]
        if world > 1:
            errors = [None] * world
            dist.all_gather_object(errors, err)
        results[spec["name"]] = {"result": res, "errors": {str(r): e for r, e in enumerate(errors) if e}}
        if rank == 0:
            times[spec["name"]] = {"wall_s": round(time.perf_counter() - t0, 3), "cpu_s": round(time.process_time() - c0, 3)}
            Path(out).write_text(json.dumps(results, indent=1))
            Path(f"{out}.times.json").write_text(json.dumps(times, indent=1))
    from modelpar.launch import exit_rank

    exit_rank(0)        # every result is written: leave without gloo teardown (see exit_rank)


if __name__ == "__main__":
    main()
