"""Which model sizes fit on how many devices, and with which strategy.

Per cell (model size x device count x device memory) every candidate strategy's peak memory per device
is predicted, and the cell lists the strategies that fit. The prediction comes from the planner's
memory model (`modelpar.planner.memory.estimate_memory` over a `profile_model` of the preset on the
meta device) when the planner is importable; otherwise from `zero_model_state_bytes` plus
`recompute_activation_bytes` below, and the table says which model it used.

Assumptions of the GPU table (stated in the output): bf16 compute with full activation recomputation,
micro-batch of one sequence at the preset's sequence length, AdamW; a 1-GiB framework allowance.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

GIB = 2 ** 30
FIT_SIZES = ("gpt-100m", "gpt-500m", "gpt-1b", "gpt-2b", "gpt-10b", "gpt-70b")
FIT_DEVICES = (1, 2, 4, 8, 16, 64)
FIT_GPUS = {"80 GB": "H100-80GB-SXM", "141 GB": "H200"}       # label -> planner hardware name
FALLBACK_GPU_BYTES = {"80 GB": 80 * GIB, "141 GB": 141e9}
GPUS_PER_NODE = 8


def zero_model_state_bytes(num_params: float, *, dp: int = 1, zero_stage: int = 0, model_parallel: int = 1) -> float:
    """Model-state bytes per device for mixed-precision AdamW (ZeRO, Rajbhandari et al. SC'20, Sec. 3.1, 5).

    16 bytes per parameter: 2 (bf16 params) + 2 (bf16 grads) + 12 (fp32 master, momentum, variance).
    Over ``dp`` data-parallel ranks: stage 0 (DDP) 16P; stage 1 4P + 12P/N; stage 2 2P + 14P/N;
    stage 3 (FSDP) 16P/N. ``model_parallel`` (TP x PP) divides P first.

    Raises:
        ValueError: zero_stage not in 0..3 or a degree < 1.
    """
    if zero_stage not in (0, 1, 2, 3):
        raise ValueError(f"zero_stage must be 0, 1, 2 or 3, got {zero_stage}")
    if dp < 1 or model_parallel < 1:
        raise ValueError(f"dp and model_parallel must be >= 1, got dp={dp}, model_parallel={model_parallel}")
    p = num_params / model_parallel
    return (16 * p, 4 * p + 12 * p / dp, 2 * p + 14 * p / dp, 16 * p / dp)[zero_stage]


def recompute_activation_bytes(*, seq_len: int, d_model: int, n_head: int, n_layer: int, micro_batch: int = 1,
                               tp: int = 1, pp: int = 1, bytes_per_el: int = 2) -> float:
    """Activation bytes per device under full recomputation (Korthikanti et al. 2022, Sec. 4):
    each layer keeps its input, 2 s b h bytes (16-bit), for the first stage's L/p layers and p
    micro-batches in flight (1F1B), plus one layer's full activations s b h (34 + 5 a s / h) / t
    while it is recomputed."""
    s, b, h, a = seq_len, micro_batch, d_model, n_head
    scale = bytes_per_el / 2
    kept = 2 * s * b * h * math.ceil(n_layer / pp) * pp * scale
    one_layer = s * b * h * (34 + 5 * a * s / h) / tp * scale
    return kept + one_layer


def candidate_plans(num_devices: int, *, n_layer: int, n_head: int, precision: str = "bf16",
                    activation_checkpointing: str = "full"):
    """``[(strategy name, ParallelPlan), ...]`` worth trying on ``num_devices`` devices: single; ddp, fsdp;
    tp inside one node (heads divisible); pp up to one layer per stage; fsdp x tp and pp x tp."""
    from modelpar.plan import ParallelPlan

    n = num_devices
    kw = dict(precision=precision, activation_checkpointing=activation_checkpointing)
    out = []
    if n == 1:
        return [("single", ParallelPlan(**kw))]
    out.append(("ddp", ParallelPlan(dp_replicate=n, **kw)))
    out.append(("fsdp", ParallelPlan(dp_shard=n, **kw)))
    if n <= GPUS_PER_NODE and n_head % n == 0:
        out.append(("tp", ParallelPlan(tp=n, **kw)))
    if n <= n_layer:
        out.append(("pp", ParallelPlan(pp=n, n_microbatches=n, **kw)))
    tp = min(GPUS_PER_NODE, n // 2)
    if n >= 4 and tp > 1 and n_head % tp == 0:
        out.append((f"fsdp x tp{tp}", ParallelPlan(dp_shard=n // tp, tp=tp, **kw)))
    if n > GPUS_PER_NODE and n_head % GPUS_PER_NODE == 0 and n // GPUS_PER_NODE <= n_layer:
        p = n // GPUS_PER_NODE
        out.append((f"pp{p} x tp{GPUS_PER_NODE}", ParallelPlan(pp=p, tp=GPUS_PER_NODE, n_microbatches=p, **kw)))
    return out


def planner_memory_model():
    """``(profile_model, estimate_memory, Batch)`` from the planner (tests replace it with None to check
    the table without predictions)."""
    from modelpar.planner.memory import Batch, estimate_memory
    from modelpar.planner.profile import profile_model

    return profile_model, estimate_memory, Batch


@dataclass
class FitCell:
    size: str
    devices: int
    memory_label: str
    fits: list[str] = field(default_factory=list)
    best: str = ""                # the fitting strategy with the least memory per device
    best_bytes: float = 0.0


class MemoryModel:
    """Peak bytes per device of a preset under a plan, through the planner when available."""

    def __init__(self, *, seq_len: int | None = None, micro_batch: int = 1, optimizer: str = "adamw",
                 overhead_bytes: float = 1 * GIB):
        self.seq_len, self.micro_batch, self.optimizer, self.overhead = seq_len, micro_batch, optimizer, overhead_bytes
        self.planner = planner_memory_model()
        self.source = ("planner memory model (modelpar.planner.memory.estimate_memory)" if self.planner else
                       "fallback: zero_model_state_bytes + recompute_activation_bytes (planner not importable)")
        self._profiles: dict[tuple, object] = {}

    def _profile(self, preset: str, dtype):
        import torch

        from modelpar.models import PRESETS, build_gpt

        key = (preset, str(dtype))
        if key not in self._profiles:
            cfg = PRESETS[preset]
            seq = self.seq_len or cfg.seq_len
            model = build_gpt(preset, device="meta", seq_len=seq) if self.seq_len else build_gpt(preset, device="meta")
            self._profiles[key] = self.planner[0](model, torch.zeros(1, seq, dtype=torch.long), dtype=dtype)
        return self._profiles[key]

    def bytes(self, preset: str, plan) -> float:
        from modelpar.models import PRESETS

        cfg = PRESETS[preset]
        if self.planner is not None:
            import torch

            try:
                prof = self._profile(preset, torch.bfloat16 if plan.precision == "bf16" else torch.float32)
                m = plan.n_microbatches if plan.pp > 1 else 1
                batch = self.planner[2](global_batch_size=self.micro_batch * m * plan.dp,
                                        local_batch_size=self.micro_batch * m)
                return self.planner[1](prof, plan, batch, optimizer=self.optimizer,
                                       overhead_bytes=self.overhead).total
            except Exception as e:                # fall back per cell, and say so
                self.source = f"{self.source}; fallback where it raised ({type(e).__name__}: {e})"
        stage = 3 if plan.dp_shard > 1 else 0
        n = cfg.num_params() if callable(getattr(cfg, "num_params", None)) else cfg.num_params
        states = zero_model_state_bytes(n, dp=plan.dp, zero_stage=stage, model_parallel=plan.tp * plan.pp)
        if plan.precision == "fp32":
            states *= 1.0                         # fp32: 4 + 4 + 8 = 16 bytes as well
        acts = recompute_activation_bytes(seq_len=self.seq_len or cfg.seq_len, d_model=cfg.d_model, n_head=cfg.n_head,
                                          n_layer=cfg.n_layer, micro_batch=self.micro_batch, tp=plan.tp, pp=plan.pp,
                                          bytes_per_el=2 if plan.precision == "bf16" else 4)
        if plan.activation_checkpointing != "full":
            acts *= 1.0 + cfg.n_layer / 2          # rough: every layer's activations kept
        return states + acts + self.overhead


def fit_table(mm: MemoryModel, *, sizes=FIT_SIZES, devices=FIT_DEVICES, memories: dict[str, float],
              precision: str = "bf16", activation_checkpointing: str = "full",
              ranks_share_memory: bool = False) -> list[FitCell]:
    """One `FitCell` per (size, device count, memory label).

    Args:
        memories: label -> bytes per device (or, with ``ranks_share_memory``, the machine's total, split
            evenly between the ranks, as local CPU ranks share one machine's RAM).
    """
    from modelpar.models import PRESETS

    cells = []
    for size in sizes:
        cfg = PRESETS[size]
        for n in devices:
            for label, cap in memories.items():
                per_dev = cap / n if ranks_share_memory else cap
                cell = FitCell(size, n, label)
                for name, plan in candidate_plans(n, n_layer=cfg.n_layer, n_head=cfg.n_head, precision=precision,
                                                  activation_checkpointing=activation_checkpointing):
                    b = mm.bytes(size, plan)
                    if b <= per_dev:
                        cell.fits.append(name)
                        if not cell.best or b < cell.best_bytes:
                            cell.best, cell.best_bytes = name, b
                cells.append(cell)
    return cells


def gpu_memories() -> tuple[dict[str, float], float]:
    """(label -> usable bytes per GPU, framework overhead bytes) from the planner's hardware table."""
    try:
        from modelpar.planner.hardware import get_hardware

        hws = {label: get_hardware(name) for label, name in FIT_GPUS.items()}
        return ({k: float(h.memory_bytes) for k, h in hws.items()},
                max(float(h.framework_overhead_bytes) for h in hws.values()))
    except Exception:
        return dict(FALLBACK_GPU_BYTES), 1.0 * GIB


def machine_ram_bytes() -> float:
    """This machine's physical memory, bytes."""
    from modelpar.planner.hardware import total_ram_bytes

    return total_ram_bytes()


def fit_markdown(cells: list[FitCell], *, devices=FIT_DEVICES) -> str:
    """A Markdown table: rows = size x memory label, columns = device counts; each cell the strategies
    that fit (the least memory first) or ``-``."""
    labels = list(dict.fromkeys(c.memory_label for c in cells))
    sizes = list(dict.fromkeys(c.size for c in cells))
    devs = [d for d in devices if any(c.devices == d for c in cells)]
    lines = ["| model | device memory | " + " | ".join(f"{d} device{'s' if d > 1 else ''}" for d in devs) + " |",
             "|---|---|" + "---|" * len(devs)]
    by = {(c.size, c.devices, c.memory_label): c for c in cells}
    for size in sizes:
        for label in labels:
            row = []
            for d in devs:
                c = by.get((size, d, label))
                if c is None or not c.fits:
                    row.append("-")
                else:
                    rest = [f for f in c.fits if f != c.best]
                    row.append(f"**{c.best}** ({c.best_bytes / GIB:.1f} GiB)" + (f", {', '.join(rest)}" if rest else ""))
            lines.append(f"| {size} | {label} | " + " | ".join(row) + " |")
    return "\n".join(lines)
