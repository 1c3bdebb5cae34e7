"""Gradient memory of FSDP under gradient accumulation, on CPU without a pipeline.

Trains the same model under FSDP on 2 ranks (``--hsdp``: HSDP 2 x 2 on 4) with 1 and with
``--steps`` (4) accumulation steps of the same local batch, and measures, with torch's MemTracker
(the tool `modelpar.measure` uses), the gradient bytes a rank holds after each local
batch's backward of the third step: MemTracker's Gradient bytes (the ``.grad`` of the registered,
sharded parameters) plus its Temp bytes (tensors made in backward and still alive then: FSDP's
unsharded gradients while its sync is off). It prints the largest of these per run and the ratio.

With gradients kept sharded (reduce-scatter every micro-batch, FSDP2's default, modelpar's
``defer_grad_sync=False``) the ratio is about 1 (goal: within 10%); with the sync deferred
(``--defer``: unsharded fp32 gradients accumulate until the last micro-batch) the unsharded
gradients (dp_shard times the sharded ones) are held between local batches. Memory is tensor bytes, not timing, so it is meaningful on a loaded machine.

Run: ``PYTHONPATH=$PWD .venv/bin/python benchmarks/fsdp_accumulation_memory.py [--model gpt-1m]
[--defer] [--hsdp]``. Exit status 1 when the default (not deferred) ratio is outside 1 +- 10%.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile

MIB = 2 ** 20


def _worker(spec_path: str, out_path: str) -> int:
    import torch
    import torch.distributed as dist

    from modelpar.launch import exit_rank  # noqa: F401
    from modelpar.parallel.mesh import init_distributed  # noqa: F401
    from modelpar.measure.runs import Case, _snap, _tracker, build_case
    from modelpar.train.data import global_batch_slice
    from modelpar.train.grads import clip_grad_norm_

    torch.set_num_threads(1)
    init_distributed(timeout_s=300)
    out = {}
    for c in json.loads(open(spec_path).read()):
        case = Case(**c)
        mt = _tracker()
        held = []
        with mt:
            b = build_case(case)
            mt.track_external(*b.pm.modules, b.opt)
            for step in range(3):
                for a in range(b.accum):
                    sl = global_batch_slice(len(b.xg), accum_step=a, num_accum=b.accum,
                                            dp_rank=b.pm.mesh.dp_rank, dp_degree=b.pm.plan.dp)
                    b.pm.forward_backward(b.xg[sl], b.yg[sl], loss_scale=1.0 / b.accum,
                                          sync_grads=a == b.accum - 1)
                    if step == 2:
                        s = _snap(mt.get_tracker_snapshot("current"))
                        held.append({"Gradient": s["Gradient"], "Temp": s["Temp"]})
                clip_grad_norm_(b.pm.parameters(), b.grad_clip)
                b.opt.step()
                b.opt.zero_grad(set_to_none=True)
        per_rank = [None] * dist.get_world_size()
        dist.all_gather_object(per_rank, held)
        out[case.name] = per_rank
        del b
    if dist.get_rank() == 0:
        with open(out_path, "w") as f:
            json.dump(out, f)
    dist.destroy_process_group()
    return 0


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="gpt-1m")
    ap.add_argument("--local-batch-size", type=int, default=4)
    ap.add_argument("--steps", type=int, default=4, help="accumulation steps of the second run")
    ap.add_argument("--defer", action="store_true", help="plan option defer_grad_sync=True")
    ap.add_argument("--hsdp", action="store_true", help="HSDP 2 x 2 on 4 ranks instead of FSDP on 2")
    ap.add_argument("--timeout", type=float, default=900)
    args = ap.parse_args(argv)
    plan, world = ((dict(dp_replicate=2, dp_shard=2), 4) if args.hsdp else (dict(dp_shard=2), 2))
    if args.defer:
        plan["defer_grad_sync"] = True
    lb = args.local_batch_size
    cases = [dict(name=f"{args.model}/accum{a}", model=args.model, plan=plan, global_batch_size=lb * world * a,
                  local_batch_size=lb) for a in (1, args.steps)]
    d = tempfile.mkdtemp(prefix="modelpar-fsdp-accum-")
    sp, op = os.path.join(d, "cases.json"), os.path.join(d, "out.json")
    with open(sp, "w") as f:
        json.dump(cases, f)
    from modelpar.launch import run_workers

    run = run_workers([os.path.abspath(__file__), "--worker", sp, op], world, op, timeout_s=args.timeout)
    if run.result is None:
        print(run.output[-4000:])
        print(f"no result: {run.reason()}")
        return 2
    res = run.result
    largest = {}
    for c in cases:
        per_rank = res[c["name"]]
        largest[c["name"]] = max(h["Gradient"] + h["Temp"] for r in per_rank for h in r)
        rows = ", ".join(f"mb{i}: grad {h['Gradient'] / MIB:.3f} + temp {h['Temp'] / MIB:.3f}"
                         for i, h in enumerate(per_rank[0]))
        print(f"{c['name']:<16} largest gradient bytes held after a backward {largest[c['name']] / MIB:8.3f} MiB"
              f"  (rank 0 {rows})")
    ratio = largest[cases[1]["name"]] / largest[cases[0]["name"]]
    print(f"gradient memory ratio, {args.steps} accumulation steps / 1: {ratio:.3f} "
          f"({'defer_grad_sync' if args.defer else 'default'}, {'hsdp 2x2' if args.hsdp else 'fsdp 2'})")
    return 0 if (args.defer or abs(ratio - 1) <= 0.10) else 1


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        from modelpar.launch import exit_rank
        exit_rank(_worker(sys.argv[2], sys.argv[3]))
    sys.exit(main(sys.argv[1:]))
