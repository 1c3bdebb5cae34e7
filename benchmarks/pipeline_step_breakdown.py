"""One measured 2-stage pipeline step broken into its parts, beside the planner's terms.

For each case (default: mlp-large and hf-llama, GPipe and 1F1B, the step-time accuracy benchmark's
rows: global batch 32, 4 micro-batches of 8, AdamW, clipping 1.0, one thread per rank), every rank
times, per step: each compute action of torch's schedule (``F`` / ``B`` per micro-batch,
`modelpar.parallel.pipeline.ActionTimer`), the schedule's wall time (the rest of it is the
point-to-point sends / receives and the waiting for the other stage: its idle), the gradient
clipping (a norm all-reduced over the pipeline ranks, where the faster stage waits for the slower),
the optimizer step and ``zero_grad``. The planner's side is `StepForm` per rank: forward and
backward seconds of one micro-batch (`_times`), the optimizer, and `estimate_step`'s parts.

The cases are interleaved round by round in one launch, so a load change on the shared machine hits
them alike; parts are comparable as ratios within one run only. The load average is printed.

Run: ``python benchmarks/pipeline_step_breakdown.py --hardware CAL.json [--cases mlp-large/pp_gpipe,...]``
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

DEFAULT_CASES = "mlp-large/pp_gpipe,mlp-large/pp_1f1b,hf-llama/pp_gpipe,hf-llama/pp_1f1b"


def _cases(names: str):
    from planner_accuracy_time import cases_for
    by = {c.name: c for m in {n.split("/")[0] for n in names.split(",")} for c in cases_for(m)}
    return [by[n] for n in names.split(",")]


def _cpu_timer():
    """`ActionTimer` that also records each action's thread CPU time and minor page faults (this
    rank's thread: time it was descheduled by other processes does not count)."""
    import resource

    from modelpar.parallel.pipeline import ActionTimer

    class CpuActionTimer(ActionTimer):
        def _wrap(self, stage, attr, kind):
            orig = getattr(stage, attr)

            def timed(chunk_id, *a, **k):
                t0, c0 = time.perf_counter(), time.thread_time()
                f0 = resource.getrusage(resource.RUSAGE_THREAD).ru_minflt
                try:
                    return orig(chunk_id, *a, **k)
                finally:
                    f1 = resource.getrusage(resource.RUSAGE_THREAD).ru_minflt
                    self.records.append((stage.stage_index, kind(a, k), chunk_id, t0, time.perf_counter(),
                                         time.thread_time() - c0, f1 - f0))
            self._saved.append((stage, attr, orig))
            setattr(stage, attr, timed)
    return CpuActionTimer


def _timed_step(b, timer_cls):
    """One `train_step` of the built case with its parts timed (seconds, this rank's clock)."""
    import torch.distributed as dist

    from modelpar.train.grads import clip_grad_norm_

    pm, opt = b.pm, b.opt
    import resource
    t0 = time.perf_counter()
    c0 = time.thread_time()
    f0 = resource.getrusage(resource.RUSAGE_THREAD).ru_minflt
    with timer_cls(pm.schedule) as t:
        pm.forward_backward(b.xg, b.yg, loss_scale=1.0, sync_grads=True)
    t1 = time.perf_counter()
    c1 = time.thread_time()
    f1 = resource.getrusage(resource.RUSAGE_THREAD).ru_minflt
    params = list(pm.parameters())
    clip_grad_norm_(params, b.grad_clip, pp_group=pm.mesh.group("pp"), norm_params=pm.norm_parameters(params))
    t2 = time.perf_counter()
    c2 = time.thread_time()
    opt.step()
    t3 = time.perf_counter()
    c3 = time.thread_time()
    opt.zero_grad(set_to_none=True)
    t4 = time.perf_counter()
    dist.barrier()
    recs = [(s, k, mb, a - t0, e - t0, cpu, flt) for s, k, mb, a, e, cpu, flt in t.records]
    return {"schedule": t1 - t0, "schedule_cpu": c1 - c0, "schedule_faults": f1 - f0, "opt_cpu": c3 - c2,
            "clip": t2 - t1, "opt": t3 - t2, "zero": t4 - t3,
            "total": t4 - t0, "actions": recs}


def worker(args) -> None:
    import torch
    import torch.distributed as dist

    from modelpar.measure.runs import build_case, step
    from modelpar.parallel.mesh import init_distributed
    torch.set_num_threads(1)
    timer = _cpu_timer()
    rank, world = init_distributed(timeout_s=900)
    cases = _cases(args.cases)
    built = []
    for c in cases:
        b = build_case(c)
        assert b.accum == 1, "the breakdown times one local batch per step"
        for _ in range(3):
            step(b)
        built.append(b)
    res = {c.name: [] for c in cases}
    for _ in range(args.rounds):
        for c, b in zip(cases, built):
            step(b)                  # settle after the switch between cases
            for _ in range(2):
                dist.barrier()
                res[c.name].append(_timed_step(b, timer))
    gathered = [None] * world
    dist.all_gather_object(gathered, {"rank": rank, "res": res,
                                      "ranges": {c.name: b.pm.stage_ranges for c, b in zip(cases, built)}})
    if rank == 0:
        Path(args.json).write_text(json.dumps(gathered))
    dist.destroy_process_group()


def _med(xs):
    return statistics.median(xs) * 1e3 if xs else float("nan")


def summarize(gathered: list, hw_path: str | None) -> str:
    lines = []
    planner = _planner(list(gathered[0]["res"]), hw_path) if hw_path else {}
    for name in gathered[0]["res"]:
        steps = len(gathered[0]["res"][name])
        lines.append(f"\n== {name}: {steps} steps; stage block ranges {gathered[0]['ranges'][name]}")
        tot = [max(g["res"][name][i]["total"] for g in gathered) for i in range(steps)]
        lines.append(f"   step (slowest rank) median {_med(tot):.1f} ms")
        for g in sorted(gathered, key=lambda g: g["rank"]):
            rs = g["res"][name]

            def per_step(kinds, col):
                return [sum(x[col] for x in r["actions"] if x[1] in kinds) for r in rs]

            def per_action(kinds, col):
                return [x[col] for r in rs for x in r["actions"] if x[1] in kinds]
            f, bw = per_step("F", 4), per_step("BIW", 4)
            f = [fi - si for fi, si in zip(f, per_step("F", 3))]
            bw = [bi - si for bi, si in zip(bw, per_step("BIW", 3))]
            idle = [r["schedule"] - fi - bi for r, fi, bi in zip(rs, f, bw)]
            lines.append(
                f"   rank {g['rank']}: wall ms: schedule {_med([r['schedule'] for r in rs]):7.1f} = F {_med(f):6.1f} "
                f"+ B {_med(bw):6.1f} + outside actions (p2p, waiting) {_med(idle):6.1f}; clip "
                f"{_med([r['clip'] for r in rs]):6.1f}  opt {_med([r['opt'] for r in rs]):6.1f}  zero "
                f"{_med([r['zero'] for r in rs]):5.1f}")
            lines.append(
                f"      thread CPU ms: schedule {_med([r['schedule_cpu'] for r in rs]):7.1f}  F sum "
                f"{_med(per_step('F', 5)):6.1f}  B sum {_med(per_step('BIW', 5)):6.1f}  opt "
                f"{_med([r['opt_cpu'] for r in rs]):6.1f} | per micro-batch F {_med(per_action('F', 5)):6.1f} "
                f"B {_med(per_action('B', 5)):6.1f} | minor faults per step: schedule "
                f"{statistics.median(r['schedule_faults'] for r in rs):.0f}, F "
                f"{statistics.median(per_step('F', 6)):.0f}, B {statistics.median(per_step('BIW', 6)):.0f}")
            mid = rs[len(rs) // 2]["actions"]
            lines.append("      one step's actions (action+mb: start-end wall ms / cpu ms): " + " ".join(
                f"{x[1]}{x[2]}:{x[3] * 1e3:.0f}-{x[4] * 1e3:.0f}/{x[5] * 1e3:.0f}" for x in mid))
        if name in planner:
            lines.append("   planner: " + planner[name])
    return "\n".join(lines)


def _planner(names: list[str], hw_path: str) -> dict[str, str]:
    from planner_accuracy_time import load_hardware

    from modelpar.measure.memory import profile_for
    from modelpar.plan import ParallelPlan
    from modelpar.planner.cost import estimate_step, step_form
    from modelpar.planner.memo import PlannerCache
    from modelpar.planner.memory import Batch, rank_loads
    from modelpar.planner.step_estimate import tp_bytes_per_sample

    hw = load_hardware(hw_path)
    out = {}
    for c in _cases(",".join(names)):
        prof = profile_for(c.model, c.model_config, c.seq_len)
        plan = ParallelPlan.from_dict(c.plan)
        batch = Batch(c.global_batch_size, c.local_batch_size)
        est = estimate_step(prof, plan, batch, hw, optimizer=c.optimizer)
        cache = PlannerCache().bind(profile=prof, hw=hw)
        loads = rank_loads(prof, plan, act_bytes=4, cache=cache)
        form = step_form(loads, plan, hw, optimizer=c.optimizer, tp_bytes=tp_bytes_per_sample(prof, plan),
                         cache=cache)
        times, _, _ = form._times(plan, batch.micro_batch_size(plan))
        ranks = "; ".join(f"rank {i}: per mb F {tf * 1e3:.1f} B {tb * 1e3:.1f} opt {form.opt[i] * 1e3:.1f}"
                          for i, (_, tf, tb, _) in enumerate(times))
        parts = " ".join(f"{k} {getattr(est, k) * 1e3:.1f}" for k in ("compute", "bubble", "pp_comm", "optimizer"))
        out[c.name] = f"{ranks} | {parts} total {est.total * 1e3:.1f} ms"
    return out


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cases", default=DEFAULT_CASES)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--hardware", default=None, help="calibration JSON for the planner's side")
    ap.add_argument("--json", default="/tmp/pipeline_step_breakdown.json")
    ap.add_argument("--from-json", action="store_true", help="summarize an earlier --json, launching nothing")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        worker(args)
        return 0
    if not args.from_json:
        from _launch import run_worker
        load0 = os.getloadavg()
        run_worker(__file__, ["--cases", args.cases, "--rounds", str(args.rounds), "--json", args.json],
                   args.json, timeout_s=1800)
        print(f"[load average before {load0[0]:.2f}, after {os.getloadavg()[0]:.2f}; {os.cpu_count()} cores]")
    gathered = json.loads(Path(args.json).read_text())
    print(summarize(gathered, args.hardware))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
