"""Calibration: measure this machine once so the planner predicts it (`modelpar calibrate`; the
only place outside tests that times anything for the planner). Beside the planner, not inside it:
it starts processes (`modelpar.calibrate.collectives`).

- `default_calibration_path()`: where this machine's profile lives.
- `calibrate(out, ranks)`: run the micro-benchmarks and save the profile (JSON, `save_profile`; what
  was measured is a typed `modelpar.planner.calibration.Calibration`).
- `machine_hardware(local_ranks)`: the profile every command uses by default (``--hardware`` empty).
"""

from __future__ import annotations

import os
import platform
from pathlib import Path

import torch

from modelpar.planner.calibration import Calibration, CollectiveTable
from modelpar.planner.hardware import Hardware, cpu_profile, get_hardware, save_profile

AUTO_CALIBRATE_ENV = "MODELPAR_AUTO_CALIBRATE"   # "0": `train --strategy auto` never measures on the fly
NOISY_SPREAD = 0.25     # a term's spread over the rounds above which calibrate says the machine was busy
# terms whose spread is the host's own jitter, which training pays too, not a busy calibration: the
# wait for the slower rank (collectives between compute segments), differences of such times (the TP
# and FSDP2 per-call terms), the memory bandwidth sampled across the run (it follows the neighbours'
# traffic; `collectives.shared_bandwidth_sample`). Their spreads are printed, not warned about.
JITTER_TERMS = (".in_context[", "tp_linear_overhead", "fsdp_unit_overhead", "fsdp_tensor_overhead", "mem_bandwidth")


def default_calibration_path() -> Path:
    """``$MODELPAR_CALIBRATION``, else ``~/.cache/modelpar/calibration.json``."""
    return Path(os.environ.get("MODELPAR_CALIBRATION",
                               os.path.join(os.path.expanduser("~"), ".cache", "modelpar", "calibration.json")))


def machine_hardware(local_ranks: int, *, measure_if_missing: bool = False, say=print) -> tuple[Hardware, str]:
    """This machine's device profile and a one-line note on where it came from.

    CUDA: the built-in figures of the device's type. CPU: the calibration file
    (`default_calibration_path`) with its memory budget split over ``local_ranks``; without one, the
    uncalibrated CPU estimate -- or, with ``measure_if_missing`` (``train --strategy auto`` only) and
    ``$MODELPAR_AUTO_CALIBRATE`` not ``0``, a calibration measured now (~40 s, kept for next time).
    """
    import dataclasses

    from modelpar.planner.hardware import hardware_for_device, total_ram_bytes
    local = max(1, local_ranks)
    if torch.cuda.is_available():
        hw = hardware_for_device(torch.cuda.get_device_name(0), torch.cuda.get_device_properties(0).total_memory)
        return hw, f"hardware: {hw.name} (this machine's GPU type)"
    path = default_calibration_path()
    if not path.is_file() and measure_if_missing and os.environ.get(AUTO_CALIBRATE_ENV, "1") != "0":
        say(f"modelpar: this machine has no calibration yet; measuring it once with {local} local rank(s) "
            f"(`modelpar calibrate --out {path}`; set {AUTO_CALIBRATE_ENV}=0 to skip)")
        calibrate(path, local, say=say)
    if path.is_file():
        hw = get_hardware(str(path), local_ranks=local)
        # the memory budget follows this launch's local ranks, whatever the calibration used; so does the
        # share of a core each rank computes on, where ranks outnumber cores
        note, share = f"hardware: this machine's calibration {path}", min(1.0, (os.cpu_count() or 1) / local)
        if hw.calibration is not None and share < hw.calibration.core_share - 1e-9:
            note += (f"; {local} local ranks share {os.cpu_count()} cores: compute rates x "
                     f"{share / hw.calibration.core_share:.2f} (a core each when measured; ranks beyond the cores "
                     f"also wait on each other, which no term prices: `modelpar calibrate --nproc {local}` "
                     f"measures this layout)")
            hw = with_core_share(hw, share)
        return dataclasses.replace(hw, memory_bytes=total_ram_bytes() / local), note
    return (get_hardware("cpu", local_ranks=local),
            f"hardware: uncalibrated CPU estimate (no calibration at {path}; run `modelpar calibrate` once "
            f"for measured speeds)")


def with_core_share(hw: Hardware, share: float) -> Hardware:
    """``hw`` (a calibrated CPU profile) for ranks that each get ``share`` of a core (``min(1, cores /
    local ranks)``) where its calibration's ranks had ``calibration.core_share``: every rate that scales
    with a core (the matmul curve, shapes and thin products, the peak, attention, element-wise) times
    their ratio, the per-call overheads divided by it. Memory bandwidth and the collectives stay as
    measured. ``hw`` itself when the ratio is 1 or it has no calibration."""
    import dataclasses

    cal = hw.calibration
    if cal is None or abs(share - cal.core_share) < 1e-9:
        return hw
    f = share / cal.core_share
    cal = dataclasses.replace(
        cal, core_share=share, matmul_flops={n: v * f for n, v in cal.matmul_flops.items()},
        attention_flops=cal.attention_flops * f,
        elementwise_bw=None if cal.elementwise_bw is None else cal.elementwise_bw * f,
        matmul_shapes={lay: {k: v * f for k, v in g.items()} for lay, g in cal.matmul_shapes.items()},
        attention_shapes={k: v * f for k, v in cal.attention_shapes.items()},
        matmul_thin={lay: {k: v * f for k, v in g.items()} for lay, g in cal.matmul_thin.items()},
        dispatch_overhead_s=None if cal.dispatch_overhead_s is None else cal.dispatch_overhead_s / f)
    return dataclasses.replace(hw, peak_flops={k: v * f for k, v in hw.peak_flops.items()},
                               op_overhead_s=hw.op_overhead_s / f, calibration=cal)


def calibrate(out: str | os.PathLike | None = None, ranks: int = 2, *, collectives: bool = True, say=print,
              rounds: int | None = None, quick: bool = False) -> Path:
    """Measure this machine (`modelpar.calibrate.micro`, `modelpar.calibrate.collectives` on
    ``ranks`` local ranks) and save the hardware profile to ``out`` (default
    `default_calibration_path`); returns the path. Only micro-benchmarks are timed, never a model.
    ``rounds``: rounds of every compute term and in-context collective, the median over them kept
    (default `modelpar.calibrate.micro.ROUNDS`; 1 is fastest and records no spread). ``quick``: a
    smoke run of the whole command (``--quick``): every term measured and saved, the slowest on
    smaller grids and inputs (`micro.QUICK_SHAPE_DIMS`, `collectives.QUICK_TP_INPUTS`); the file's
    ``source`` says so, since its shape table and TP terms are coarser than a full calibration's.

    Raises:
        ValueError: ``ranks`` < 1 or ``rounds`` < 1.
        RuntimeError: the collective ranks failed.
    """
    from modelpar.calibrate.collectives import measure_collectives
    from modelpar.calibrate.micro import ROUNDS, fresh_threshold, measure_compute

    if ranks < 1:
        raise ValueError(f"--nproc must be >= 1, got {ranks}")
    rounds = ROUNDS if rounds is None else rounds
    if rounds < 1:
        raise ValueError(f"--rounds must be >= 1, got {rounds}")
    out = str(out or default_calibration_path())
    load0 = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // ranks))
    c = measure_compute(rounds=rounds, quick=quick)
    if c.get("rounds", rounds) > rounds:
        say(f"  compute: {c['rounds'] - rounds} extra round(s) after the first {rounds}: the rounds disagreed "
            f"(load from outside this process; the median of all {c['rounds']} is kept)")
    # more local ranks than cores: each rank computes on its share of a core (compute is timed in
    # this one process); the rates that scale with a core scale by it
    share = min(1.0, (os.cpu_count() or 1) / ranks)      # (`with_core_share` scales by it, below)
    if share < 1.0:
        say(f"  {ranks} ranks on {os.cpu_count()} cores: compute rates x {share:.2f} per rank")
    best = c["matmul_peak"]
    base = cpu_profile(ranks)
    lat, bw = base.intra_latency, base.intra_bw
    cal = dict(matmul_flops=dict(c["matmul_flops"]), attention_flops=c["attention_flops"],
               elementwise_bw=c["elementwise_bw"], core_share=1.0, dispatch_overhead_s=c["dispatch_overhead_s"],
               zero_bubble_backward_factor=c["zero_bubble_backward_factor"],
               rounds=int(c.get("rounds", 1)), spread=dict(c.get("spread", {})),
               matmul_shapes={lay: dict(g) for lay, g in c.get("matmul_shapes", {}).items()},
               attention_shapes=dict(c.get("attention_shapes", {})),
               matmul_thin={lay: dict(g) for lay, g in c.get("matmul_thin", {}).items()})
    coll = {}
    if collectives and ranks > 1:
        coll = measure_collectives(ranks, rounds=rounds, quick=quick)
        # one rank alone and every rank at once, sampled in pairs by the collective ranks: ranks in
        # lockstep (data / tensor parallel) share the memory bus, pipeline stages mostly do not
        cal["mem_bandwidth_alone"] = coll.pop("mem_bandwidth_alone")
        sp = coll.pop("spread", {})
        cal["spread"].pop("mem_bandwidth", None)     # this process's own rounds: superseded
        cal["spread"].update(sp)
        cal["fresh_alloc_s_per_byte_alone"] = fresh_threshold(c["fresh"])[0]
        c["mem_bandwidth"] = coll.pop("mem_bandwidth")
        fresh = coll.pop("fresh")
        terms, cal["compute_contention"], cal["spread"]["compute_contention"] = coll.pop("contention")
        cal["compute_contention_terms"] = dict(terms)
        cal.update(coll.pop("framework"))
        times = coll.pop("times")
        in_ctx = coll.pop("in_context")
        lat, bw = coll["all_reduce"]
        # the measured tables (the cost model interpolates them): back-to-back, and issued between
        # compute segments
        cal["collectives"] = {op: CollectiveTable(a, b, dict(times[op]), dict(in_ctx.get(op, {})))
                              for op, (a, b) in coll.items()}
        cal["fresh_alloc_s_per_byte"], cal["fresh_alloc_min_bytes"] = fresh_threshold(fresh)
        if platform.libc_ver()[0] == "glibc" and cal["fresh_alloc_s_per_byte"] > 0:
            # glibc maps every block above its largest dynamic mmap threshold (32 MiB on 64-bit,
            # DEFAULT_MMAP_THRESHOLD_MAX) anew when no free heap chunk fits it; which free chunks
            # exist depends on the heap's history, so the sweep's boundary moves between runs
            cal["fresh_alloc_min_bytes"] = 32 * 2 ** 20
        cal["collective_ranks"] = ranks
    calibration = Calibration(**cal)
    hw = Hardware("cpu", {"fp32": best, "bf16": best / 2}, base.memory_bytes, c["mem_bandwidth"], bw, lat,
                  bw, lat, ranks, 1.0, mem_bw_fraction=1.0, op_overhead_s=c["op_overhead_s"], comm_overlap=False,
                  source="calibrated by modelpar calibrate" + (" --quick (a smoke run: not for planning)" if quick else ""),
                  calibration=calibration, kind="cpu")
    hw = with_core_share(hw, share)
    calibration = hw.calibration
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    save_profile(hw, out)
    for line in summary_lines(hw, {op: times[op] for op in coll} if coll else {}, fresh if coll else {}):
        say(line)
    load1 = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    worst = max(((k, v) for k, v in calibration.spread.items() if not any(j in k for j in JITTER_TERMS)),
                key=lambda kv: kv[1], default=None)
    if worst is not None and worst[1] > NOISY_SPREAD:
        say(f"  note: the largest spread over {calibration.rounds} rounds is {worst[0]} {worst[1]:.0%} "
            f"(> {NOISY_SPREAD:.0%}; load average {load0:.1f} -> {load1:.1f} on {os.cpu_count()} cores): "
            "this machine was busy; re-run `modelpar calibrate` when it is quiet for predictions to trust")
    say(f"saved {out}")
    return Path(out)


def _sp(cal: Calibration, term: str) -> str:
    v = cal.spread.get(term)
    return "" if v is None else f"  spread {v:6.1%}"


def summary_lines(hw: Hardware, times: dict[str, dict[int, float]] | None = None,
                  fresh: dict[int, float] | None = None) -> list[str]:
    """What `calibrate` prints: one line per measured term with its value and, where the file has it
    (schema 3), its relative spread over the rounds (`Calibration.spread`). ``times``: the
    back-to-back collective tables ({op: {bytes: s}}); ``fresh``: the fresh-allocation sweep
    ({bytes: s/byte}); both optional (not kept in the file beyond the tables)."""
    cal = hw.calibration or Calibration()
    out = [f"  term{'':<34}{'value':>14}  spread over {cal.rounds} round(s): (max - min) / median",
           f"  matmul peak (same operands repeated){'':<2}{hw.peak_flops['fp32'] / 1e9:>9.1f} GFLOP/s{_sp(cal, 'matmul_peak')}"]
    for n, f in sorted(cal.matmul_flops.items()):
        out.append(f"  matmul {n:>5}^3 (a Linear's 3 products){'':<0}{f / 1e9:>9.1f} GFLOP/s{_sp(cal, f'matmul_flops[{n}]')}")
    for lay, g in sorted(cal.matmul_shapes.items()):
        lo, hi = min(g, key=g.get), max(g, key=g.get)
        out.append(f"  matmul shapes {lay} ({len(g)} M x K x N){'':<11}{g[lo] / 1e9:>5.1f}-{g[hi] / 1e9:.1f} GFLOP/s"
                   f"{_sp(cal, f'matmul_shapes[{lay}]')}  (slowest {'x'.join(map(str, lo))}, fastest "
                   f"{'x'.join(map(str, hi))})")
    for lay, g in sorted(cal.matmul_thin.items()):
        lo, hi = min(g, key=g.get), max(g, key=g.get)
        out.append(f"  matmul thin {lay} ({len(g)} rows x weight){'':<10}{g[lo] / 1e9:>5.1f}-{g[hi] / 1e9:.1f} GFLOP/s"
                   f"{_sp(cal, 'matmul_thin')}  (slowest {lo[0]} x {lo[1] / 2 ** 20:.0f} MiB)")
    out.append(f"  attention (causal, fused, counted){'':<4}{cal.attention_flops / 1e9:>9.1f} GFLOP/s{_sp(cal, 'attention_flops')}")
    if cal.attention_shapes:
        g = cal.attention_shapes
        lo, hi = min(g, key=g.get), max(g, key=g.get)
        out.append(f"  attention shapes ({len(g)} S x D){'':<15}{g[lo] / 1e9:>5.1f}-{g[hi] / 1e9:.1f} GFLOP/s"
                   f"{_sp(cal, 'attention_shapes')}  (slowest S {lo[1]} D {lo[2]}, fastest S {hi[1]} D {hi[2]})")
    out += [
            f"  element-wise operators (counted){'':<6}{(cal.elementwise_bw or 0) / 1e9:>9.1f} GB/s   {_sp(cal, 'elementwise_bw')}",
            f"  per-op overhead{'':<23}{hw.op_overhead_s * 1e6:>9.1f} us     {_sp(cal, 'op_overhead_s')}",
            f"  per aten call of tiny blocks{'':<10}{(cal.dispatch_overhead_s or 0) * 1e6:>9.1f} us     "
            f"{_sp(cal, 'dispatch_overhead_s')}",
            f"  memory bandwidth per rank (all ranks){'':<1}{hw.mem_bandwidth / 1e9:>9.1f} GB/s   {_sp(cal, 'mem_bandwidth')}"
            + ("  (median of samples between the collective phases)" if cal.collective_ranks else ""),
            f"  zero-bubble split backward / plain{'':<4}{cal.zero_bubble_backward_factor:>9.2f} x      "
            f"{_sp(cal, 'zero_bubble_backward_factor')}"]
    if cal.mem_bandwidth_alone is not None:
        out.append(f"  memory bandwidth, one rank alone{'':<6}{cal.mem_bandwidth_alone / 1e9:>9.1f} GB/s   "
                   f"{_sp(cal, 'mem_bandwidth_alone')}"
                   + ("  (paired with the samples above)" if cal.collective_ranks else ""))
    if cal.compute_contention_terms:
        out.append(f"  compute, every rank at once / alone{'':<3}{cal.compute_contention:>9.3f} x      "
                   f"{_sp(cal, 'compute_contention')}  ("
                   + ", ".join(f"{k} {v:.2f}" for k, v in cal.compute_contention_terms.items()) + ")")
    if cal.collective_ranks:
        out += [f"  TP Linear, per call (fwd + bwd){'':<7}{cal.tp_linear_overhead_s * 1e6:>9.0f} us     "
                f"{_sp(cal, 'tp_linear_overhead_s')}",
                f"  TP Linear, per input byte{'':<13}{cal.tp_linear_overhead_s_per_byte * 1e9:>9.2f} ns     "
                f"{_sp(cal, 'tp_linear_overhead_s_per_byte')}",
                f"  FSDP2 unit, per call{'':<18}{cal.fsdp_unit_overhead_s * 1e6:>9.0f} us     "
                f"{_sp(cal, 'fsdp_unit_overhead_s')}",
                f"  FSDP2 unit, per parameter tensor{'':<6}{cal.fsdp_tensor_overhead_s * 1e6:>9.1f} us     "
                f"{_sp(cal, 'fsdp_tensor_overhead_s')}"]
        for op, t in cal.collectives.items():
            small = min(t.in_context, default=None)
            if small is not None:
                big = max(t.in_context)
                out.append(f"  {op + ' between compute, <= 1 MiB':<38}{t.in_context[small] * 1e3:>9.2f} ms     "
                           f"{_sp(cal, f'{op}.in_context[small]')}")
                out.append(f"  {op + f' between compute, {big >> 20} MiB':<38}{t.in_context[big] * 1e3:>9.2f} ms     "
                           f"{_sp(cal, f'{op}.in_context[{big >> 10} KiB]')}")
            out.append(f"  {op:<15} back to back ({cal.collective_ranks} ranks): latency {t.latency_s * 1e6:.1f} us, "
                       f"bandwidth {t.bandwidth / 1e9:.2f} GB/s; "
                       + ", ".join(f"{k / 2 ** 20:g} MiB {v * 1e3:.2f} ms" for k, v in sorted((times or {}).get(op, t.seconds).items())))
        fb, fmin = cal.fresh_alloc_s_per_byte, cal.fresh_alloc_min_bytes
        out.append(f"  fresh allocation: {fb * 1e9:.3f} ns/byte from {fmin / 2 ** 20:g} MiB (every rank), "
                   f"{(cal.fresh_alloc_s_per_byte_alone or 0) * 1e9:.3f} alone"
                   + (f" ({', '.join(f'{k / 2 ** 20:g} MiB {v * 1e9:.3f}' for k, v in sorted(fresh.items()))} ns/byte)"
                      if fresh else ""))
    return out
