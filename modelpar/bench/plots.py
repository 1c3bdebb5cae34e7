"""Bench charts with matplotlib (Agg backend, small PNGs): throughput per strategy, memory per device
stacked by part, and one pipeline timeline per schedule from the recorded events of a real run."""

from __future__ import annotations

from pathlib import Path

MIB = 2 ** 20
DPI = 90
PART_COLORS = {"params": "#4c72b0", "grads": "#dd8452", "optimizer": "#55a868", "activations": "#c44e52"}
ACTION_COLORS = {"F": "#4c72b0", "B": "#dd8452", "I": "#e5ae38", "W": "#8172b2"}


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_throughput(rows: list[dict], path: Path, *, title: str) -> Path:
    """Horizontal bars of samples/s per row (``rows``: dicts with ``label``, ``samples_per_s`` and
    optionally ``pred_samples_per_s`` drawn as a marker)."""
    plt = _plt()
    rows = [r for r in rows if r.get("samples_per_s")]
    fig, ax = plt.subplots(figsize=(6.4, 0.45 * len(rows) + 1.2), dpi=DPI)
    y = list(range(len(rows)))
    ax.barh(y, [r["samples_per_s"] for r in rows], color="#4c72b0", label="measured")
    pred = [(i, r["pred_samples_per_s"]) for i, r in enumerate(rows) if r.get("pred_samples_per_s")]
    if pred:
        ax.plot([p for _, p in pred], [i for i, _ in pred], "k|", markersize=14, label="planner prediction")
    ax.set_yticks(y, [r["label"] for r in rows], fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel("samples / s")
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=7, loc="lower right")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path


def plot_memory(rows: list[dict], path: Path, *, title: str) -> Path:
    """Stacked bars of peak tensor memory per device (the most loaded rank), by part (MiB)."""
    plt = _plt()
    rows = [r for r in rows if r.get("memory")]
    fig, ax = plt.subplots(figsize=(6.4, 0.45 * len(rows) + 1.2), dpi=DPI)
    left = [0.0] * len(rows)
    y = list(range(len(rows)))
    for part, color in PART_COLORS.items():
        vals = [r["memory"].get(part, 0.0) / MIB for r in rows]
        ax.barh(y, vals, left=left, color=color, label=part)
        left = [a + b for a, b in zip(left, vals)]
    ax.set_yticks(y, [r["label"] for r in rows], fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel("peak tensor memory per device (MiB)")
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=7, loc="lower right", ncol=2)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path


def plot_pipeline_timeline(events: list[dict], path: Path, *, title: str) -> Path:
    """One row per pipeline stage; each micro-batch's forward (F), backward (B, or I + W for zero-bubble
    schedules) as a bar labelled with the micro-batch index. ``events``: dicts with ``stage``,
    ``action``, ``mb``, ``start_us``, ``dur_us`` (one clock for all ranks); times shown in ms from the
    first event.

    Raises:
        ValueError: no events.
    """
    if not events:
        raise ValueError("no pipeline events to draw")
    plt = _plt()
    t0 = min(e["start_us"] for e in events)
    stages = sorted({e["stage"] for e in events})
    fig, ax = plt.subplots(figsize=(7.5, 0.5 * len(stages) + 1.3), dpi=DPI)
    for e in events:
        y = stages.index(e["stage"])
        x, w = (e["start_us"] - t0) / 1e3, e["dur_us"] / 1e3
        ax.barh(y, w, left=x, height=0.7, color=ACTION_COLORS.get(e["action"], "gray"), edgecolor="white",
                linewidth=0.5)
        ax.text(x + w / 2, y, f"{e['action']}{e['mb']}", ha="center", va="center", fontsize=6, color="white")
    ax.set_yticks(range(len(stages)), [f"stage {s}" for s in stages], fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel("ms from the first micro-batch")
    ax.set_title(title, fontsize=9, loc="left")
    handles = [plt.Rectangle((0, 0), 1, 1, color=c) for a, c in ACTION_COLORS.items()
               if any(e["action"] == a for e in events)]
    names = {"F": "forward", "B": "backward", "I": "backward (input)", "W": "backward (weights)"}
    ax.legend(handles, [names[a] for a in ACTION_COLORS if any(e["action"] == a for e in events)], fontsize=7,
              loc="lower right", bbox_to_anchor=(1.0, 1.0), ncol=4, frameon=False)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path
