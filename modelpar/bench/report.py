"""Bench results -> CSV rows and Markdown tables (one row dict per strategy run)."""

from __future__ import annotations

import csv
import os
import platform
import time
from pathlib import Path

from modelpar.bench.comm import KINDS, CommProfile, merge_ranks

MIB = 2 ** 20
GIB = 2 ** 30

BENCH_COLUMNS = ["model", "row", "label", "plan", "ranks", "note", "status", "reason", "samples_per_s",
                 "tokens_per_s", "step_ms", "mem_peak_mib", "mem_params_mib", "mem_grads_mib", "mem_optimizer_mib",
                 "mem_activations_mib", "memory_method", "rss_peak_mib", "comm_share", "comm_exposed_ms",
                 "comm_recorded_ms", "pred_samples_per_s", "pred_mem_mib", "pred_comm_share", "loss"]
COMM_COLUMNS = ["model", "row", "kind", "calls", "mb_per_step", "recorded_ms", "exposed_ms", "share_of_step"]


def summarize(model: str, spec, result: dict, pred: dict | None) -> dict:
    """One flat row (the CSV columns) from a run result (`runner.run_row`) or a skip/failure."""
    row = {c: "" for c in BENCH_COLUMNS}
    row.update(model=model, row=spec.key, label=spec.label, ranks=spec.nproc, note=spec.note,
               status=result.get("status", "failed"), reason=result.get("reason", ""))
    for k, v in (pred or {}).items():
        if k in row:
            row[k] = v
    if row["status"] != "ok":
        row["plan"] = result.get("plan_name", "")
        return row
    ranks = result["ranks"]
    heaviest = max((r for r in ranks if r.get("memory")), key=lambda r: r["memory"]["total"], default=None)
    row.update(plan=result["plan_name"], samples_per_s=result["samples_per_s"],
               tokens_per_s=result["tokens_per_s"] or "", step_ms=result["step_s"] * 1e3,
               rss_peak_mib=max(r["peak_rss_bytes"] for r in ranks) / MIB, loss=result.get("loss") or "")
    if heaviest:
        m = heaviest["memory"]
        row.update(mem_peak_mib=m["total"] / MIB, mem_params_mib=m["params"] / MIB, mem_grads_mib=m["grads"] / MIB,
                   mem_optimizer_mib=m["optimizer"] / MIB, mem_activations_mib=m["activations"] / MIB,
                   memory_method=m.get("method", ""))
    comm = job_comm(result)
    if comm is not None:
        row.update(comm_share=comm.share, comm_exposed_ms=comm.exposed_s * 1e3, comm_recorded_ms=comm.recorded_s * 1e3)
    return row


def job_comm(result: dict) -> CommProfile | None:
    profs = [CommProfile.from_dict(r["comm"]) for r in result.get("ranks", []) if r.get("comm")]
    return merge_ranks(profs) if profs else None


def comm_rows(model: str, key: str, result: dict) -> list[dict]:
    comm = job_comm(result) if result.get("status") == "ok" else None
    if comm is None:
        return []
    return [{"model": model, "row": key, "kind": k, "calls": s.calls, "mb_per_step": s.bytes / 1e6,
             "recorded_ms": s.recorded_s * 1e3, "exposed_ms": s.exposed_s * 1e3, "share_of_step": s.share}
            for k, s in comm.kinds.items()]


def append_csv(path: Path, columns: list[str], rows: list[dict]) -> None:
    """Append rows (header first if the file is new); flushed at once so an interrupted bench keeps them."""
    new = not path.exists()
    with open(path, "a", newline="") as f:
        w = csv.DictWriter(f, fieldnames=columns, extrasaction="ignore")
        if new:
            w.writeheader()
        w.writerows(rows)
        f.flush()
        os.fsync(f.fileno())


def read_csv(path: Path) -> list[dict]:
    if not path.exists():
        return []
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def _f(v, fmt: str, empty: str = "") -> str:
    try:
        return format(float(v), fmt)
    except (TypeError, ValueError):
        return empty


def bench_markdown(rows: list[dict]) -> str:
    """The strategy comparison of one model as a Markdown table."""
    lines = ["| strategy | plan | ranks | samples/s | tokens/s | step ms | peak MiB per device (params / grads / optim / activations) | comm % of step | predicted samples/s | predicted MiB | predicted comm % | note |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if r["status"] != "ok":
            why = "skipped" if r["status"] == "skipped" else "failed"
            lines.append(f"| {r['label']} | {r['plan'] or '-'} | {r['ranks']} | {why}: {r['reason']} | | | | | | | | {r['note']} |")
            continue
        mem = (f"{_f(r['mem_peak_mib'], '.1f')} ({_f(r['mem_params_mib'], '.1f')} / {_f(r['mem_grads_mib'], '.1f')} / "
               f"{_f(r['mem_optimizer_mib'], '.1f')} / {_f(r['mem_activations_mib'], '.1f')})")
        lines.append(
            f"| {r['label']} | {r['plan']} | {r['ranks']} | {_f(r['samples_per_s'], '.1f')} | "
            f"{_f(r['tokens_per_s'], ',.0f', '-')} | {_f(r['step_ms'], '.0f')} | {mem} | "
            f"{_f(100 * float(r['comm_share'] or 0), '.1f') if r['comm_share'] != '' else '-'} | "
            f"{_f(r['pred_samples_per_s'], '.1f', 'n/a')} | {_f(r['pred_mem_mib'], '.1f', 'n/a')} | "
            f"{_f(100 * float(r['pred_comm_share']), '.1f') if r['pred_comm_share'] not in ('', None) else 'n/a'} | "
            f"{r['note']} |")
    return "\n".join(lines)


def comm_markdown(rows: list[dict], labels: dict[str, str]) -> str:
    """Communication per strategy and kind: calls, MB per step (busiest rank), recorded and exposed ms
    (mean over ranks), exposed share of the step."""
    lines = ["| strategy | kind | calls | MB per step | recorded ms | exposed ms | % of step |",
             "|---|---|---|---|---|---|---|"]
    order = {k: i for i, k in enumerate(KINDS)}
    for r in sorted(rows, key=lambda r: (list(labels).index(r["row"]) if r["row"] in labels else 99,
                                         order.get(r["kind"], 99))):
        lines.append(f"| {labels.get(r['row'], r['row'])} | {r['kind']} | {r['calls']} | {_f(r['mb_per_step'], '.3f')} | "
                     f"{_f(r['recorded_ms'], '.1f')} | {_f(r['exposed_ms'], '.1f')} | "
                     f"{_f(100 * float(r['share_of_step']), '.1f')} |")
    return "\n".join(lines)


def machine_description() -> dict:
    """CPU model, cores, RAM, load average, torch version, date: the context of the numbers."""
    import torch

    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    from modelpar.bench.fit import machine_ram_bytes

    gpus = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())] if torch.cuda.is_available() else []
    return {"cpu": cpu, "cores": os.cpu_count(), "ram_gib": machine_ram_bytes() / GIB,
            "load_avg": os.getloadavg(), "torch": torch.__version__, "python": platform.python_version(),
            "gpus": gpus, "date": time.strftime("%Y-%m-%d %H:%M %Z")}


def machine_markdown(m: dict, load_end=None) -> str:
    dev = ", ".join(m["gpus"]) if m["gpus"] else "no GPU (CPU ranks over gloo)"
    load = " / ".join(f"{x:.2f}" for x in m["load_avg"])
    s = (f"- machine: {m['cpu']}, {m['cores']} cores, {m['ram_gib']:.1f} GiB RAM; {dev}\n"
         f"- software: torch {m['torch']}, Python {m['python']}\n"
         f"- date: {m['date']}\n"
         f"- load average (1/5/15 min) at the start: {load}")
    if load_end is not None:
        s += f"; at the end: {' / '.join(f'{x:.2f}' for x in load_end)}"
    return s
