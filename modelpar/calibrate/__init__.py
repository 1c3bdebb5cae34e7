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
        # the memory budget follows this launch's local ranks, whatever the calibration used
        return (dataclasses.replace(hw, memory_bytes=total_ram_bytes() / local),
                f"hardware: this machine's calibration {path}")
    return (get_hardware("cpu", local_ranks=local),
            f"hardware: uncalibrated CPU estimate (no calibration at {path}; run `modelpar calibrate` once "
            f"for measured speeds)")


def calibrate(out: str | os.PathLike | None = None, ranks: int = 2, *, collectives: bool = True, say=print) -> Path:
    """Measure this machine (`modelpar.calibrate.micro`, `modelpar.calibrate.collectives` on
    ``ranks`` local ranks) and save the hardware profile to ``out`` (default
    `default_calibration_path`); returns the path. Only micro-benchmarks are timed, never a model.

    Raises:
        ValueError: ``ranks`` < 1.
        RuntimeError: the collective ranks failed.
    """
    from modelpar.calibrate.collectives import measure_collectives
    from modelpar.calibrate.micro import fresh_threshold, measure_compute

    if ranks < 1:
        raise ValueError(f"--nproc must be >= 1, got {ranks}")
    out = str(out or default_calibration_path())
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // ranks))
    c = measure_compute()
    # more local ranks than cores: each rank computes on its share of a core (compute is timed in
    # this one process); the rates that scale with a core scale by it
    share = min(1.0, (os.cpu_count() or 1) / ranks)
    if share < 1.0:
        c["matmul_flops"] = {n: f * share for n, f in c["matmul_flops"].items()}
        for k in ("matmul_peak", "attention_flops", "elementwise_bw"):
            c[k] *= share
        c["op_overhead_s"] /= share
        say(f"  {ranks} ranks on {os.cpu_count()} cores: compute rates x {share:.2f} per rank")
    best = c["matmul_peak"]
    base = cpu_profile(ranks)
    lat, bw = base.intra_latency, base.intra_bw
    cal = dict(matmul_flops=dict(c["matmul_flops"]), attention_flops=c["attention_flops"],
               elementwise_bw=c["elementwise_bw"], core_share=share,
               zero_bubble_backward_factor=c["zero_bubble_backward_factor"])
    coll = {}
    if collectives and ranks > 1:
        coll = measure_collectives(ranks)
        # one rank alone (this process, the others not started) and every rank at once: ranks in
        # lockstep (data / tensor parallel) share the memory bus, pipeline stages mostly do not
        cal["mem_bandwidth_alone"] = c["mem_bandwidth"]
        cal["fresh_alloc_s_per_byte_alone"] = fresh_threshold(c["fresh"])[0]
        c["mem_bandwidth"] = coll.pop("mem_bandwidth")
        fresh = coll.pop("fresh")
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
                  source="calibrated by modelpar calibrate", calibration=calibration, kind="cpu")
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    save_profile(hw, out)
    say(f"  matmul peak {best / 1e9:.1f} GFLOP/s (same operands repeated); a Linear's three products "
          "on operands from memory:")
    for n, f in c["matmul_flops"].items():
        say(f"  matmul {n:>5}: {f / 1e9:8.1f} GFLOP/s")
    say(f"  attention (causal, fused) {c['attention_flops'] / 1e9:.1f} GFLOP/s counted; "
          f"element-wise operators {c['elementwise_bw'] / 1e9:.1f} GB/s counted; a zero-bubble split backward "
          f"takes {c['zero_bubble_backward_factor']:.2f}x a plain one")
    say(f"  per-op overhead {c['op_overhead_s'] * 1e6:.1f} us, memory bandwidth per rank {c['mem_bandwidth'] / 1e9:.1f} GB/s")
    for op, (a, b) in coll.items():
        say(f"  {op:<15} latency {a * 1e6:8.1f} us, bandwidth {b / 1e9:6.2f} GB/s ({ranks} ranks); "
              + ", ".join(f"{k / 2 ** 20:g} MiB {v * 1e3:.2f} ms" for k, v in times[op].items()))
    if coll:
        say(f"  framework per call (fwd + bwd): TP Linear {calibration.tp_linear_overhead_s * 1e6:.0f} us + "
              f"{calibration.tp_linear_overhead_s_per_byte * 1e9:.2f} ns per input byte, "
              f"FSDP2 unit {calibration.fsdp_unit_overhead_s * 1e6:.0f} us + "
              f"{calibration.fsdp_tensor_overhead_s * 1e6:.0f} us per parameter tensor")
        for op in coll:
            say(f"  {op:<15} between compute segments: "
                  + ", ".join(f"{k / 2 ** 20:g} MiB {v * 1e3:.2f} ms" for k, v in in_ctx[op].items()))
        fb, fmin = calibration.fresh_alloc_s_per_byte, calibration.fresh_alloc_min_bytes
        say(f"  alone (one rank): memory bandwidth {calibration.mem_bandwidth_alone / 1e9:.1f} GB/s, fresh "
              f"allocation {calibration.fresh_alloc_s_per_byte_alone * 1e9:.3f} ns/byte")
        say(f"  fresh allocation: {fb * 1e9:.3f} ns/byte from {fmin / 2 ** 20:g} MiB "
              f"({', '.join(f'{k / 2 ** 20:g} MiB {v * 1e9:.3f}' for k, v in fresh.items())} ns/byte)")
    say(f"saved {out}")
    return Path(out)
