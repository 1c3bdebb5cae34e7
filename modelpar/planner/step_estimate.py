"""The step-time model's result: `StepEstimate` (seconds of one optimizer step by part, FLOPs) and
MFU / HFU (Chowdhery et al., "PaLM" (2022), App. B: model FLOPs count each forward once, hardware
FLOPs include the recomputed forward); `_finish` wraps `cost.rank_step`'s parts into one, and
`tp_bytes_per_sample` sizes TP's all-reduces. Split out of `cost.py` unchanged; `cost` re-exports them."""

from __future__ import annotations

from dataclasses import dataclass, fields

from modelpar.plan import ParallelPlan
from modelpar.planner.hardware import Hardware
from modelpar.planner.memo import PlannerCache
from modelpar.planner.profile import ModelProfile
from modelpar.planner.recompute import recompute_flops_per_sample


@dataclass(slots=True)
class StepEstimate:
    """Predicted time of one optimizer step on the slowest rank, by part (seconds)."""

    compute: float          # forward + backward kernels (incl. memory-bound and per-op terms)
    recompute: float        # the extra forward of full checkpointing
    tp_comm: float
    pp_comm: float
    dp_comm: float          # exposed DDP/FSDP/HSDP communication
    bubble: float
    optimizer: float
    model_flops: float      # per step, whole job, each forward once (FLOPs)
    hardware_flops: float   # including recomputation
    num_devices: int
    samples: int            # global batch size
    tokens_per_sample: int

    @property
    def total(self) -> float:
        return (self.compute + self.recompute + self.tp_comm + self.pp_comm + self.dp_comm + self.bubble
                + self.optimizer)

    @property
    def comm_share(self) -> float:
        return (self.tp_comm + self.pp_comm + self.dp_comm) / self.total

    @property
    def bubble_share(self) -> float:
        return self.bubble / self.total

    @property
    def samples_per_s(self) -> float:
        return self.samples / self.total

    @property
    def tokens_per_s(self) -> float:
        return self.samples * self.tokens_per_sample / self.total

    def parts(self) -> dict[str, float]:
        keep = ("compute", "recompute", "tp_comm", "pp_comm", "dp_comm", "bubble", "optimizer")
        return {f.name: getattr(self, f.name) for f in fields(self) if f.name in keep}


def mfu(step: StepEstimate, hw: Hardware, precision: str) -> float:
    """Model FLOPs utilization: model FLOPs per second / (devices x dense peak) (PaLM App. B)."""
    return step.model_flops / (step.total * step.num_devices * hw.peak_flops[precision])


def hfu(step: StepEstimate, hw: Hardware, precision: str) -> float:
    """Hardware FLOPs utilization: as `mfu` but counting the recomputed forward."""
    return step.hardware_flops / (step.total * step.num_devices * hw.peak_flops[precision])


def tp_bytes_per_sample(profile: ModelProfile, plan: ParallelPlan) -> float:
    """Bytes of one TP all-reduce per sample: a middle block's output at the plan's precision."""
    mid = profile.blocks[len(profile.blocks) // 2]
    scale = (2 if plan.precision == "bf16" else 4) / (2 if profile.dtype == "bf16" else 4)
    return mid.output_bytes * scale / profile.batch_size


def _finish(parts: dict, profile: ModelProfile, plan: ParallelPlan, global_batch: int,
            flops: tuple[float, float] | None = None, cache: PlannerCache | None = None) -> StepEstimate:
    """Wrap step parts; ``flops`` = (forward, backward) FLOPs per sample, computed if None;
    ``cache``: memo tables of ``profile`` (`memo.PlannerCache`)."""
    if flops is None:
        flops = (profile.fwd_flops_per_sample, profile.train_flops_per_sample - profile.fwd_flops_per_sample)
    fwd, bwd = flops
    model = global_batch * (fwd + bwd)
    hw_flops = model + global_batch * recompute_flops_per_sample(profile, plan, cache)
    return StepEstimate(**parts, model_flops=model, hardware_flops=hw_flops,
                        num_devices=plan.world_size, samples=global_batch,
                        tokens_per_sample=profile.tokens_per_sample)
